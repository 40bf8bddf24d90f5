// The options that pick a problem (model preset, quantisation, EP share, data), shared by
// `check` and `bench`, and the random case they describe.
#pragma once

#include <span>
#include <vector>

#include "args.h"
#include "epmoe/moe_case.h"
#include "epmoe/presets.h"
#include "median.h"

namespace epmoe::cli {

void declare_problem_options(Args& args, const std::string& default_tokens);

struct Problem {
  const ModelPreset* preset = nullptr;
  RandomCaseOptions options;  // tokens is filled per run
  int threads = 0;
};

Result<Problem> read_problem(const Args& args);

// One line: "deepseek-v3: E=256 k=8 H=7168 I=2048 shared I=2048, grouped_topk, fp8_block, ep 1/8"
std::string describe(const Problem& problem);

// The tolerance of the relative error for a scheme (bf16 1e-2, fp8 3e-2).
double tolerance_for(QuantScheme scheme);

}  // namespace epmoe::cli

namespace epmoe::cli {

// What one rank's share of a layer must at least move and compute (DESIGN.md,
// Performance model): each local expert's weights once if a pair touches it, plus x, the
// logits and y; flops 2 * 3 * H * (local pairs * I + T * I_s).
struct Workload {
  int64_t local_pairs = 0, experts_touched = 0;
  double bytes = 0, flops = 0;
};

// `topk_ids` [T, k] global ids; `owned` the rank's experts; shared experts on this rank.
Workload count_workload(const RandomCaseOptions& options, std::span<const int32_t> topk_ids, const ExpertMap& owned,
                        bool with_shared);

}  // namespace epmoe::cli
