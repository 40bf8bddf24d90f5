// The MoE operator on the CPU: the reference every GPU kernel is tested against. It runs
// the pipeline of DESIGN.md (route, map and sort, GEMM1 + activation, GEMM2, combine) in
// f32 and rounds where the GPU path rounds:
//   - x * router weight (apply_router_weight_on_input) is rounded to x's dtype;
//   - bf16 inputs: the activation output and each pair's GEMM2 output are rounded to bf16;
//   - fp8 schemes quantise GEMM1's input per the scheme and GEMM2's input from the
//     activation output (after that bf16 rounding); a GEMM applies the product of its two
//     scales per K block (per 128-block for fp8_block, once per row for the others);
//   - combine sums w_tj * out_pair over j = 0..k-1 in order, then the shared experts, in
//     f32, and rounds once to the output dtype.
#pragma once

#include "epmoe/moe_spec.h"

namespace epmoe {

struct CpuOptions {
  int num_threads = 0;  // 0: one per hardware thread
};

// topk_ids [T, k] i32, topk_weights [T, k] f32, written in order of decreasing score.
Status route_cpu(const RoutingSpec& spec, const Tensor& router_logits,
                 const std::optional<Tensor>& correction_bias, const Tensor& topk_ids,
                 const Tensor& topk_weights);

// out [T, H], same dtype as x. Pairs whose expert maps to -1 are skipped, so summing the
// outputs of ranks that partition the experts gives the single-rank output.
Status moe_forward_cpu(const MoeSpec& spec, const MoeWeights& weights, const MoeInputs& inputs,
                       const Tensor& out, const CpuOptions& options = {});

}  // namespace epmoe
