// epmoe check --strategy: the expert-parallel layer (EpMoe) against the whole layer.
#pragma once

#include <string>

#include "epmoe/ep_moe.h"
#include "problem.h"

namespace epmoe::cli {

// Exit code as run_check's. backend: "threads" (in-process ranks) or "nccl" (one GPU a rank).
int check_ep_layer(const Problem& problem, int64_t tokens, EpStrategy strategy, const std::string& backend);

}  // namespace epmoe::cli
