// What one MoE layer computes: routing, quantisation scheme, activation, options, and the
// tensors that carry it. validate_moe() checks all of it before any kernel runs.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "epmoe/status.h"
#include "epmoe/tensor.h"

namespace epmoe {

enum class RoutingKind {
  kSoftmaxTopk,  // Mixtral, Qwen2/3-MoE: softmax over E in f32, top k, optional renormalise
  kTopkSoftmax,  // gpt-oss: top k of the logits, softmax over those k
  kSigmoidTopk,  // Llama-4: top k of the logits, weight = sigmoid(logit)
  kGroupedTopk,  // DeepSeek-V2/V3: group-limited top k (see RoutingSpec)
};

enum class ScoreFunc { kSoftmax, kSigmoid };

// Ties between equal scores go to the lower expert (and group) index.
struct RoutingSpec {
  RoutingKind kind = RoutingKind::kSoftmaxTopk;
  int num_experts = 0;  // E, global
  int top_k = 0;
  bool renormalize = false;  // the k weights are divided by their sum
  // kGroupedTopk: scores = score_func(logits); selection = scores + correction bias (when
  // the bias tensor is given); E experts in n_group groups; a group scores its best expert
  // (no bias, V2) or the sum of its best two (bias, V3); the best topk_group groups stay;
  // top k inside them by selection score; weights are the unbiased scores, optionally
  // renormalised, times routed_scaling_factor.
  ScoreFunc score_func = ScoreFunc::kSoftmax;
  int n_group = 1;
  int topk_group = 1;
  float routed_scaling_factor = 1.0f;
};

enum class QuantScheme {
  kBf16,       // no quantisation (bf16 weights; the CPU also takes f32)
  kFp8Tensor,  // e4m3 weights, one scale per expert matrix; activations per tensor
  kFp8Channel,  // e4m3 weights, one scale per output channel; activations per token, dynamic
  kFp8Block,   // e4m3 weights, one scale per block_n x block_k block; activations per token
               // and group of block_k, dynamic
};

struct QuantSpec {
  QuantScheme scheme = QuantScheme::kBf16;
  int block_n = 128;  // kFp8Block: weight block rows (output channels)
  int block_k = 128;  // kFp8Block: weight block columns and activation group size
};

enum class Activation { kSilu, kGelu };

struct MoeSpec {
  RoutingSpec routing;
  QuantSpec quant;
  Activation activation = Activation::kSilu;
  // Llama-4: the router weight scales the expert's input instead of its output (k = 1 only).
  bool apply_router_weight_on_input = false;
};

// Weights of the local experts. Matrices are K-major: each output row holds its K inputs.
struct MoeWeights {
  Tensor w13;  // [E_local, 2I, H]: gate rows, then up rows
  Tensor w2;   // [E_local, H, I]
  // Scales that dequantise the fp8 codes (value = code * scale):
  //   fp8_tensor:  [E_local]                      fp8_channel: [E_local, N]
  //   fp8_block:   [E_local, N / block_n, K / block_k]   (checkpoint: weight_scale_inv)
  std::optional<Tensor> w13_scale;
  std::optional<Tensor> w2_scale;
  // fp8_tensor only: static activation scales [1] for GEMM1's and GEMM2's inputs; absent
  // means dynamic (the amax of all tokens for GEMM1, of each expert's rows for GEMM2).
  std::optional<Tensor> input_scale;
  std::optional<Tensor> intermediate_scale;
  // Shared experts, every token through them with weight 1, as one expert of width I_s.
  std::optional<Tensor> shared_w13;  // [2 I_s, H]
  std::optional<Tensor> shared_w2;   // [H, I_s]
  std::optional<Tensor> shared_w13_scale;  // as w13_scale without the expert dimension
  std::optional<Tensor> shared_w2_scale;
};

// The routing comes either from router logits or as precomputed top-k ids and weights.
struct MoeInputs {
  Tensor x;                                   // [T, H] activations
  std::optional<Tensor> router_logits;        // [T, E] f32 or bf16
  std::optional<Tensor> correction_bias;      // [E] f32, kGroupedTopk only
  std::optional<Tensor> topk_ids;             // [T, k] i32, global expert ids
  std::optional<Tensor> topk_weights;         // [T, k] f32
  std::optional<Tensor> expert_map;           // [E] i32: local index or -1; absent = all local
};

// The sizes of a validated problem.
struct MoeShape {
  int64_t tokens = 0;             // T
  int64_t hidden = 0;             // H
  int64_t intermediate = 0;       // I
  int64_t num_experts = 0;        // E, global
  int64_t num_local_experts = 0;  // E_local
  int64_t top_k = 0;              // k
  int64_t shared_intermediate = 0;  // I_s; 0 without shared experts
};

std::string_view routing_kind_name(RoutingKind kind);  // "softmax_topk", ...
std::string_view score_func_name(ScoreFunc func);      // "softmax", "sigmoid"
std::string_view quant_scheme_name(QuantScheme scheme);  // "bf16", "fp8_tensor", ...
std::string_view activation_name(Activation activation);  // "silu", "gelu"
Result<RoutingKind> parse_routing_kind(std::string_view name);
Result<ScoreFunc> parse_score_func(std::string_view name);
Result<QuantScheme> parse_quant_scheme(std::string_view name);
Result<Activation> parse_activation(std::string_view name);
bool is_fp8(QuantScheme scheme);

// The spec alone: k <= E, groups divide E, topk_group <= n_group, k = 1 with weights on
// the input, block sizes positive.
Status validate_spec(const MoeSpec& spec);

// Everything: the spec, every tensor's dtype, shape and device against the spec and the
// other tensors, expert-map entries, scale shapes, and that fp8 blocks divide the matrices.
// `device` is where the computation runs; every tensor must live there. `out` may be null
// where no output exists yet (loading a case).
Result<MoeShape> validate_moe(const MoeSpec& spec, const MoeWeights& weights,
                              const MoeInputs& inputs, const Tensor* out, Device device);

// Routing alone (route_cpu / route_cuda): router_logits [T, E] f32 or bf16, topk_ids [T, k]
// i32, topk_weights [T, k] f32, correction_bias [E] f32 (grouped_topk only), all on `device`.
Status validate_route(const RoutingSpec& routing, const Tensor& router_logits,
                      const std::optional<Tensor>& correction_bias, const Tensor& topk_ids,
                      const Tensor& topk_weights, Device device);

}  // namespace epmoe
