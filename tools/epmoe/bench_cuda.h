// epmoe bench on the GPU: one rank's share of a preset's layer through moe_forward_cuda.
#pragma once

#include <string>
#include <vector>

#include "problem.h"

namespace epmoe::cli {

// Whether a CUDA device is usable here.
bool cuda_device_present();

// Returns the exit code; prints the table and writes `json_path` when not empty.
// `graph_calls`: calls per CUDA graph (0: the whole rotation of inputs in one graph).
int bench_cuda(const Problem& problem, const std::vector<int64_t>& token_counts, int iterations, int graph_calls,
               const std::string& json_path);

}  // namespace epmoe::cli
