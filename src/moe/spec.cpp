// Validation of a MoE problem: every rule of include/epmoe/moe_spec.h in one place, each
// failure naming the argument, what was expected and what was given.
#include <cmath>
#include <string>
#include <vector>

#include "epmoe/moe_spec.h"
#include "epmoe/quantize.h"

namespace epmoe {

namespace {

template <typename Enum, size_t N>
struct NameTable {
  std::pair<Enum, std::string_view> entries[N];

  std::string_view name(Enum value) const {
    for (const auto& [entry, text] : entries)
      if (entry == value) return text;
    return "unknown";
  }
  Result<Enum> parse(std::string_view text, std::string_view what) const {
    std::string choices;
    for (const auto& [entry, name] : entries) {
      if (name == text) return entry;
      if (!choices.empty()) choices += ", ";
      choices += name;
    }
    return bad_argument(what, "one of " + choices, in_quotes(text));
  }
};

constexpr NameTable<RoutingKind, 4> kRoutingKinds{{{RoutingKind::kSoftmaxTopk, "softmax_topk"},
                                                    {RoutingKind::kTopkSoftmax, "topk_softmax"},
                                                    {RoutingKind::kSigmoidTopk, "sigmoid_topk"},
                                                    {RoutingKind::kGroupedTopk, "grouped_topk"}}};
constexpr NameTable<ScoreFunc, 2> kScoreFuncs{
    {{ScoreFunc::kSoftmax, "softmax"}, {ScoreFunc::kSigmoid, "sigmoid"}}};
constexpr NameTable<QuantScheme, 4> kQuantSchemes{{{QuantScheme::kBf16, "bf16"},
                                                    {QuantScheme::kFp8Tensor, "fp8_tensor"},
                                                    {QuantScheme::kFp8Channel, "fp8_channel"},
                                                    {QuantScheme::kFp8Block, "fp8_block"}}};
constexpr NameTable<Activation, 2> kActivations{
    {{Activation::kSilu, "silu"}, {Activation::kGelu, "gelu"}}};

std::string shape_text(std::initializer_list<int64_t> shape) {
  std::string text = "[";
  for (int64_t extent : shape) text += (text.size() > 1 ? ", " : "") + std::to_string(extent);
  return text + "]";
}

std::string dtypes_text(const std::vector<DType>& dtypes) {
  std::string text;
  for (DType dtype : dtypes) text += (text.empty() ? "" : " or ") + std::string(dtype_name(dtype));
  return text;
}

// Checks one tensor's device, dtype, contiguity and (when given) exact shape.
Status check_tensor(std::string_view name, const Tensor& tensor, Device device,
                    const std::vector<DType>& dtypes, std::optional<std::initializer_list<int64_t>> shape) {
  if (tensor.device != device)
    return bad_argument(name, "a tensor on " + std::string(device_name(device)), tensor.describe());
  bool dtype_ok = false;
  for (DType dtype : dtypes) dtype_ok |= tensor.dtype == dtype;
  if (!dtype_ok) return bad_argument(name, "dtype " + dtypes_text(dtypes), tensor.describe());
  if (shape && !tensor.has_shape(*shape))
    return bad_argument(name, "shape " + shape_text(*shape), "shape " + tensor.shape_string());
  if (!tensor.is_contiguous()) return bad_argument(name, "a contiguous tensor", "strided " + tensor.describe());
  if (tensor.data == nullptr && tensor.numel() > 0)
    return bad_argument(name, "a tensor with data", "a null pointer");
  return {};
}

Status check_rank(std::string_view name, const Tensor& tensor, int rank, std::string_view layout) {
  if (tensor.rank != rank)
    return bad_argument(name, std::to_string(rank) + "-d tensor " + std::string(layout),
                        tensor.describe());
  return {};
}

// The fp8 scale tensor that goes with one weight matrix of shape [N, K] (per expert when
// `experts` is set).
Status check_weight_scale(std::string_view name, const std::optional<Tensor>& scale,
                          const QuantSpec& quant, std::optional<int64_t> experts, int64_t n,
                          int64_t k, Device device) {
  if (quant.scheme == QuantScheme::kBf16) {
    if (scale) return bad_argument(name, "no scale with the bf16 scheme", scale->describe());
    return {};
  }
  if (!scale)
    return bad_argument(name, "a scale tensor for " + std::string(quant_scheme_name(quant.scheme)),
                        "none");
  const std::vector<int64_t> expected = weight_scale_shape(quant, experts, n, k);
  const Tensor expected_view = Tensor::contiguous(nullptr, DType::kF32, expected);
  if (scale->shape_string() != expected_view.shape_string())
    return bad_argument(name, "shape " + expected_view.shape_string() + " for " +
                                  std::string(quant_scheme_name(quant.scheme)),
                        "shape " + scale->shape_string());
  return check_tensor(name, *scale, device, {DType::kF32}, std::nullopt);
}

Status check_fp8_blocks(std::string_view name, const QuantSpec& quant, int64_t n, int64_t k,
                        std::string_view n_name, std::string_view k_name) {
  if (quant.scheme != QuantScheme::kFp8Block) return {};
  if (n % quant.block_n != 0 || k % quant.block_k != 0)
    return bad_argument(name,
                        std::string(n_name) + " divisible by block_n=" + std::to_string(quant.block_n) +
                            " and " + std::string(k_name) + " divisible by block_k=" +
                            std::to_string(quant.block_k),
                        std::string(n_name) + "=" + std::to_string(n) + ", " + std::string(k_name) +
                            "=" + std::to_string(k));
  return {};
}

// Dense data: bf16 on the GPU; the CPU also takes f32.
std::vector<DType> dense_dtypes(Device device) {
  if (device == Device::kCpu) return {DType::kBF16, DType::kF32};
  return {DType::kBF16};
}

std::vector<DType> weight_dtypes(QuantScheme scheme, Device device) {
  if (is_fp8(scheme)) return {DType::kFP8E4M3};
  return dense_dtypes(device);
}

Status check_logits(const Tensor& logits, int64_t T, int64_t E, Device device) {
  return check_tensor("router_logits", logits, device, {DType::kF32, DType::kBF16}, {{T, E}});
}

Status check_correction_bias(const RoutingSpec& routing, const std::optional<Tensor>& bias, Device device) {
  if (!bias) return {};
  if (routing.kind != RoutingKind::kGroupedTopk)
    return bad_argument("correction_bias", "only with grouped_topk routing", std::string(routing_kind_name(routing.kind)));
  EPMOE_RETURN_IF_ERROR(check_tensor("correction_bias", *bias, device, {DType::kF32}, {{routing.num_experts}}));
  if (routing.num_experts / routing.n_group < 2)
    return bad_argument("correction_bias", "groups of at least 2 experts (a group scores its best two)",
                        std::to_string(routing.num_experts / routing.n_group) + " expert per group");
  return {};
}

Status check_routing(const MoeSpec& spec, const MoeInputs& inputs, const MoeShape& shape,
                     Device device) {
  const int64_t T = shape.tokens, E = shape.num_experts, k = shape.top_k;
  const bool precomputed = inputs.topk_ids || inputs.topk_weights;
  if (inputs.router_logits && precomputed)
    return bad_argument("routing", "either router_logits or topk_ids with topk_weights",
                        "both");
  if (!inputs.router_logits && !(inputs.topk_ids && inputs.topk_weights))
    return bad_argument("routing", "router_logits, or both topk_ids and topk_weights",
                        inputs.topk_ids ? "topk_ids alone" : inputs.topk_weights ? "topk_weights alone" : "neither");
  if (inputs.router_logits) {
    EPMOE_RETURN_IF_ERROR(check_logits(*inputs.router_logits, T, E, device));
  } else {
    EPMOE_RETURN_IF_ERROR(check_tensor("topk_ids", *inputs.topk_ids, device, {DType::kI32}, {{T, k}}));
    EPMOE_RETURN_IF_ERROR(
        check_tensor("topk_weights", *inputs.topk_weights, device, {DType::kF32}, {{T, k}}));
    if (device == Device::kCpu) {
      const int32_t* ids = inputs.topk_ids->data_as<int32_t>();
      for (int64_t i = 0; i < T * k; ++i)
        if (ids[i] < 0 || ids[i] >= E)
          return bad_argument("topk_ids[" + std::to_string(i / k) + ", " + std::to_string(i % k) + "]",
                              "an expert id in [0, " + std::to_string(E) + ")", std::to_string(ids[i]));
    }
  }
  if (inputs.correction_bias && !inputs.router_logits)
    return bad_argument("correction_bias", "only with routing from router_logits", "precomputed top-k");
  return check_correction_bias(spec.routing, inputs.correction_bias, device);
}

Status check_expert_map(const MoeInputs& inputs, const MoeShape& shape, Device device) {
  const int64_t E = shape.num_experts, E_local = shape.num_local_experts;
  if (!inputs.expert_map) {
    if (E_local != E)
      return bad_argument("w13", "all " + std::to_string(E) +
                                     " experts when no expert_map is given (E_local == E)",
                          std::to_string(E_local) + " local experts");
    return {};
  }
  EPMOE_RETURN_IF_ERROR(check_tensor("expert_map", *inputs.expert_map, device, {DType::kI32}, {{E}}));
  if (device != Device::kCpu) return {};
  const int32_t* map = inputs.expert_map->data_as<int32_t>();
  std::vector<int64_t> owner(E_local, -1);
  for (int64_t e = 0; e < E; ++e) {
    const int32_t local = map[e];
    if (local < -1 || local >= E_local)
      return bad_argument("expert_map[" + std::to_string(e) + "]",
                          "-1 or a local expert index in [0, " + std::to_string(E_local) + ")",
                          std::to_string(local));
    if (local >= 0 && owner[local] >= 0)
      return bad_argument("expert_map[" + std::to_string(e) + "]",
                          "a local index no other expert uses",
                          std::to_string(local) + ", already the local index of expert " +
                              std::to_string(owner[local]));
    if (local >= 0) owner[local] = e;
  }
  return {};
}

}  // namespace

std::string_view routing_kind_name(RoutingKind kind) { return kRoutingKinds.name(kind); }
std::string_view score_func_name(ScoreFunc func) { return kScoreFuncs.name(func); }
std::string_view quant_scheme_name(QuantScheme scheme) { return kQuantSchemes.name(scheme); }
std::string_view activation_name(Activation activation) { return kActivations.name(activation); }
Result<RoutingKind> parse_routing_kind(std::string_view name) {
  return kRoutingKinds.parse(name, "routing.kind");
}
Result<ScoreFunc> parse_score_func(std::string_view name) {
  return kScoreFuncs.parse(name, "routing.score_func");
}
Result<QuantScheme> parse_quant_scheme(std::string_view name) {
  return kQuantSchemes.parse(name, "quant.scheme");
}
Result<Activation> parse_activation(std::string_view name) {
  return kActivations.parse(name, "activation");
}
bool is_fp8(QuantScheme scheme) { return scheme != QuantScheme::kBf16; }

Status validate_spec(const MoeSpec& spec) {
  const RoutingSpec& routing = spec.routing;
  const std::string E = std::to_string(routing.num_experts);
  if (routing.num_experts <= 0)
    return bad_argument("routing.num_experts", "a positive number of experts", E);
  if (routing.top_k <= 0 || routing.top_k > routing.num_experts)
    return bad_argument("routing.top_k", "1 <= top_k <= num_experts (" + E + ")",
                        std::to_string(routing.top_k));
  if (routing.kind == RoutingKind::kGroupedTopk) {
    if (routing.n_group <= 0 || routing.num_experts % routing.n_group != 0)
      return bad_argument("routing.n_group", "a divisor of num_experts (" + E + ")",
                          std::to_string(routing.n_group));
    if (routing.topk_group <= 0 || routing.topk_group > routing.n_group)
      return bad_argument("routing.topk_group",
                          "1 <= topk_group <= n_group (" + std::to_string(routing.n_group) + ")",
                          std::to_string(routing.topk_group));
    const int selectable = routing.topk_group * (routing.num_experts / routing.n_group);
    if (routing.top_k > selectable)
      return bad_argument("routing.top_k",
                          "at most the " + std::to_string(selectable) +
                              " experts of the topk_group kept groups",
                          std::to_string(routing.top_k));
    if (!(routing.routed_scaling_factor > 0.0f) || !std::isfinite(routing.routed_scaling_factor))
      return bad_argument("routing.routed_scaling_factor", "a positive finite number",
                          std::to_string(routing.routed_scaling_factor));
  }
  if (spec.apply_router_weight_on_input && routing.top_k != 1)
    return bad_argument("apply_router_weight_on_input", "top_k == 1",
                        "top_k == " + std::to_string(routing.top_k));
  if (spec.quant.scheme == QuantScheme::kFp8Block &&
      (spec.quant.block_n <= 0 || spec.quant.block_k <= 0))
    return bad_argument("quant.block_n/block_k", "positive block sizes",
                        std::to_string(spec.quant.block_n) + "x" + std::to_string(spec.quant.block_k));
  return {};
}

Result<MoeShape> validate_moe(const MoeSpec& spec, const MoeWeights& weights,
                              const MoeInputs& inputs, const Tensor* out, Device device) {
  EPMOE_RETURN_IF_ERROR(validate_spec(spec));
  const QuantSpec& quant = spec.quant;
  MoeShape shape;
  shape.num_experts = spec.routing.num_experts;
  shape.top_k = spec.routing.top_k;

  EPMOE_RETURN_IF_ERROR(check_rank("x", inputs.x, 2, "[T, H]"));
  shape.tokens = inputs.x.size(0);
  shape.hidden = inputs.x.size(1);
  EPMOE_RETURN_IF_ERROR(check_tensor("x", inputs.x, device, dense_dtypes(device), std::nullopt));
  if (shape.hidden <= 0) return bad_argument("x", "a positive hidden size H", inputs.x.describe());
  const int64_t T = shape.tokens, H = shape.hidden;

  EPMOE_RETURN_IF_ERROR(check_rank("w13", weights.w13, 3, "[E_local, 2I, H]"));
  shape.num_local_experts = weights.w13.size(0);
  if (weights.w13.size(1) <= 0 || weights.w13.size(1) % 2 != 0)
    return bad_argument("w13", "an even, positive number of rows 2I in [E_local, 2I, H]",
                        "shape " + weights.w13.shape_string());
  shape.intermediate = weights.w13.size(1) / 2;
  const int64_t E_local = shape.num_local_experts, I = shape.intermediate;
  const std::vector<DType> expert_dtypes = weight_dtypes(quant.scheme, device);
  EPMOE_RETURN_IF_ERROR(check_tensor("w13", weights.w13, device, expert_dtypes, {{E_local, 2 * I, H}}));
  EPMOE_RETURN_IF_ERROR(check_tensor("w2", weights.w2, device, expert_dtypes, {{E_local, H, I}}));
  EPMOE_RETURN_IF_ERROR(check_fp8_blocks("w13", quant, I, H, "I", "H"));
  EPMOE_RETURN_IF_ERROR(check_fp8_blocks("w2", quant, H, I, "H", "I"));
  EPMOE_RETURN_IF_ERROR(check_weight_scale("w13_scale", weights.w13_scale, quant, E_local, 2 * I, H, device));
  EPMOE_RETURN_IF_ERROR(check_weight_scale("w2_scale", weights.w2_scale, quant, E_local, H, I, device));

  for (const auto& [name, scale] : {std::pair{"input_scale", &weights.input_scale},
                                    std::pair{"intermediate_scale", &weights.intermediate_scale}}) {
    if (!*scale) continue;
    if (quant.scheme != QuantScheme::kFp8Tensor)
      return bad_argument(name, "a static activation scale only with fp8_tensor",
                          std::string(quant_scheme_name(quant.scheme)));
    EPMOE_RETURN_IF_ERROR(check_tensor(name, **scale, device, {DType::kF32}, {{1}}));
  }

  if (weights.shared_w13.has_value() != weights.shared_w2.has_value())
    return bad_argument("shared_w13/shared_w2", "both or neither",
                        weights.shared_w13 ? "shared_w13 alone" : "shared_w2 alone");
  if (weights.shared_w13) {
    EPMOE_RETURN_IF_ERROR(check_rank("shared_w13", *weights.shared_w13, 2, "[2 I_s, H]"));
    const int64_t two_is = weights.shared_w13->size(0);
    if (two_is <= 0 || two_is % 2 != 0)
      return bad_argument("shared_w13", "an even, positive number of rows 2 I_s in [2 I_s, H]",
                          "shape " + weights.shared_w13->shape_string());
    shape.shared_intermediate = two_is / 2;
    const int64_t Is = shape.shared_intermediate;
    EPMOE_RETURN_IF_ERROR(check_tensor("shared_w13", *weights.shared_w13, device, expert_dtypes, {{2 * Is, H}}));
    EPMOE_RETURN_IF_ERROR(check_tensor("shared_w2", *weights.shared_w2, device, expert_dtypes, {{H, Is}}));
    EPMOE_RETURN_IF_ERROR(check_fp8_blocks("shared_w13", quant, Is, H, "I_s", "H"));
    EPMOE_RETURN_IF_ERROR(check_fp8_blocks("shared_w2", quant, H, Is, "H", "I_s"));
    EPMOE_RETURN_IF_ERROR(check_weight_scale("shared_w13_scale", weights.shared_w13_scale, quant,
                                             std::nullopt, 2 * Is, H, device));
    EPMOE_RETURN_IF_ERROR(check_weight_scale("shared_w2_scale", weights.shared_w2_scale, quant,
                                             std::nullopt, H, Is, device));
  } else if (weights.shared_w13_scale || weights.shared_w2_scale) {
    return bad_argument("shared_w13_scale/shared_w2_scale", "no shared-expert scales without shared experts",
                        "scales without shared_w13/shared_w2");
  }

  EPMOE_RETURN_IF_ERROR(check_routing(spec, inputs, shape, device));
  EPMOE_RETURN_IF_ERROR(check_expert_map(inputs, shape, device));
  if (out) EPMOE_RETURN_IF_ERROR(check_tensor("out", *out, device, {inputs.x.dtype}, {{T, H}}));
  return shape;
}

Status validate_route(const RoutingSpec& routing, const Tensor& router_logits,
                      const std::optional<Tensor>& correction_bias, const Tensor& topk_ids,
                      const Tensor& topk_weights, Device device) {
  MoeSpec spec;
  spec.routing = routing;
  EPMOE_RETURN_IF_ERROR(validate_spec(spec));
  EPMOE_RETURN_IF_ERROR(check_rank("router_logits", router_logits, 2, "[T, E]"));
  const int64_t T = router_logits.size(0);
  EPMOE_RETURN_IF_ERROR(check_logits(router_logits, T, routing.num_experts, device));
  EPMOE_RETURN_IF_ERROR(check_tensor("topk_ids", topk_ids, device, {DType::kI32}, {{T, routing.top_k}}));
  EPMOE_RETURN_IF_ERROR(check_tensor("topk_weights", topk_weights, device, {DType::kF32}, {{T, routing.top_k}}));
  return check_correction_bias(routing, correction_bias, device);
}

}  // namespace epmoe
