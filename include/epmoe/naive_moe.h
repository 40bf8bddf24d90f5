// An independent, deliberately plain MoE: per token, route in double precision, run each
// chosen local expert's FFN in double on dequantised weights (code * scale), and sum. No
// sorting, no blocking: the yardstick for the operator's error (`epmoe check`, the tests).
//
// Activations are exact unless `quantize_activations` is set: then x * router weight is
// rounded to x's dtype and, for the fp8 schemes, GEMM1's and GEMM2's inputs are rounded to
// e4m3 with the scheme's scales (per tensor, per token, per token-group), as the operator
// does. e4m3 keeps 3 mantissa bits, so each
// such rounding alone costs about 2.6% relative error on random data: against exact
// activations an fp8 layer lands near 4e-2 whatever the kernel; against the quantised
// reference the operator's own error shows.
#pragma once

#include <vector>

#include "epmoe/moe_spec.h"

namespace epmoe {

// y [T, H] in double. Validates like the operator; honours expert_map (non-local experts
// are skipped), shared experts and the router weight on the input.
struct NaiveOptions {
  bool quantize_activations = false;
  int num_threads = 0;
};
Result<std::vector<double>> naive_moe(const MoeSpec& spec, const MoeWeights& weights,
                                      const MoeInputs& inputs, const NaiveOptions& options = {});

// ||a - b|| / ||b|| over all elements (Frobenius); NaN if either holds a NaN.
double relative_error(const std::vector<double>& a, const std::vector<double>& b);

// A tensor's values as doubles (f32, bf16, f16 or fp8 decoded).
std::vector<double> to_doubles(const Tensor& tensor);

}  // namespace epmoe
