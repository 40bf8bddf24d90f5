// Runs the expert-parallel layer (EpMoe) of a preset over R ranks, for `check --strategy`
// (outputs against the whole layer) and `bench --strategy` (time and traffic per rank):
// threads in this process, or one NCCL rank per GPU. Data: the whole layer drawn once on
// the host, each rank's experts sliced from it.
#pragma once

#include <string>
#include <vector>

#include "epmoe/ep_moe.h"
#include "problem.h"

namespace epmoe::cli {

struct EpRank {
  EpLayer layer;
  int64_t first_row = 0, rows = 0;  // this rank's tokens in the whole layer's x
  std::vector<double> out;          // its output, after a run
  EpStats stats;
  std::vector<double> seconds;      // one per forward
  Status status;
};

struct EpSetup {
  MoeCase whole;  // all experts, all tokens
  EpStrategy strategy = EpStrategy::kAllToAll;
  bool nccl = false;
  std::vector<EpRank> ranks;
};

// The whole layer and each rank's part; refuses layers too large to hold in this process.
Result<EpSetup> prepare_ep(const Problem& problem, int64_t tokens, EpStrategy strategy, const std::string& backend);

// `forwards` forward passes on every rank (the first `warmup` not timed).
Status run_ep(EpSetup& setup, int forwards, int warmup);

}  // namespace epmoe::cli
