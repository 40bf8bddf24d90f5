#include "epmoe/moe_case.h"

#include <array>
#include <cmath>
#include <type_traits>
#include <nlohmann/json.hpp>
#include <span>

#include "core/parallel.h"
#include "core/random.h"
#include "epmoe/moe_cpu.h"
#include "epmoe/quantize.h"
#include "epmoe/safetensors.h"

namespace epmoe {

namespace {

using json = nlohmann::json;

constexpr const char* kSpecKey = "epmoe.spec";

// Reads a member of `object` into `value` if present, with a clear error on a wrong type.
template <typename T>
Status read_field(const json& object, const std::string& path, const char* key, T& value) {
  if (!object.contains(key)) return {};
  const json& field = object[key];
  const bool type_ok = std::is_same_v<T, bool> ? field.is_boolean()
                       : std::is_integral_v<T> ? field.is_number_integer()
                       : std::is_floating_point_v<T> ? field.is_number()
                                                     : field.is_string();
  if (!type_ok)
    return bad_argument(path + "." + key,
                        std::is_same_v<T, bool> ? "a boolean" : std::is_arithmetic_v<T> ? "a number" : "a string",
                        field.dump());
  value = field.get<T>();
  return {};
}

template <typename Enum>
Status read_enum(const json& object, const std::string& path, const char* key, Enum& value,
                 Result<Enum> (*parse)(std::string_view)) {
  std::string text;
  EPMOE_RETURN_IF_ERROR(read_field(object, path, key, text));
  if (text.empty()) return {};
  Result<Enum> parsed = parse(text);
  if (!parsed.ok()) return parsed.status();
  value = parsed.value();
  return {};
}

std::shared_ptr<Buffer> add_buffer(MoeCase& moe_case, DType dtype, std::span<const int64_t> shape) {
  auto buffer = std::make_shared<Buffer>(dtype, shape);
  moe_case.storage.push_back(buffer);
  return buffer;
}
std::shared_ptr<Buffer> add_buffer(MoeCase& moe_case, DType dtype, std::initializer_list<int64_t> shape) {
  return add_buffer(moe_case, dtype, std::span<const int64_t>(shape.begin(), shape.size()));
}

// The scale tensor of a weight under `quant`, or null for bf16.
std::shared_ptr<Buffer> add_scale_buffer(MoeCase& moe_case, const QuantSpec& quant, std::optional<int64_t> experts,
                                         int64_t n, int64_t k) {
  if (!is_fp8(quant.scheme)) return nullptr;
  return add_buffer(moe_case, DType::kF32, weight_scale_shape(quant, experts, n, k));
}

// Stores f32 values [n, k] (one matrix per expert) as the scheme's weight dtype, with the
// scales a checkpoint of that scheme carries.
void store_weight(const std::vector<float>& values, const QuantSpec& quant, DType dense_dtype, int64_t n,
                  int64_t k, void* out, float* scales) {
  if (!is_fp8(quant.scheme)) {
    for (int64_t i = 0; i < n * k; ++i) {
      if (dense_dtype == DType::kF32) {
        static_cast<float*>(out)[i] = values[i];
      } else {
        static_cast<uint16_t*>(out)[i] = f32_to_bf16(values[i]);
      }
    }
    return;
  }
  quantize_fp8_blocks(values.data(), weight_scale_blocks(quant, n, k), static_cast<uint8_t*>(out), scales);
}

// The optional tensors of the oracle format and where they live in a case.
template <typename Case>  // MoeCase or const MoeCase
auto optional_tensor_fields(Case& c) {
  using Slot = std::conditional_t<std::is_const_v<Case>, const std::optional<Tensor>*, std::optional<Tensor>*>;
  return std::array<std::pair<const char*, Slot>, 13>{{
      {"router_logits", &c.inputs.router_logits},
      {"e_score_correction_bias", &c.inputs.correction_bias},
      {"topk_ids", &c.inputs.topk_ids},
      {"topk_weights", &c.inputs.topk_weights},
      {"expert_map", &c.inputs.expert_map},
      {"w13_scale", &c.weights.w13_scale},
      {"w2_scale", &c.weights.w2_scale},
      {"input_scale", &c.weights.input_scale},
      {"intermediate_scale", &c.weights.intermediate_scale},
      {"shared_w13", &c.weights.shared_w13},
      {"shared_w2", &c.weights.shared_w2},
      {"shared_w13_scale", &c.weights.shared_w13_scale},
      {"shared_w2_scale", &c.weights.shared_w2_scale},
  }};
}

}  // namespace

std::string spec_to_json(const MoeSpec& spec) {
  const RoutingSpec& r = spec.routing;
  json routing = {{"kind", routing_kind_name(r.kind)}, {"num_experts", r.num_experts},
                  {"top_k", r.top_k}, {"renormalize", r.renormalize}};
  if (r.kind == RoutingKind::kGroupedTopk) {
    routing["score_func"] = score_func_name(r.score_func);
    routing["n_group"] = r.n_group;
    routing["topk_group"] = r.topk_group;
    routing["routed_scaling_factor"] = r.routed_scaling_factor;
  }
  json quant = {{"scheme", quant_scheme_name(spec.quant.scheme)}};
  if (spec.quant.scheme == QuantScheme::kFp8Block) {
    quant["block_n"] = spec.quant.block_n;
    quant["block_k"] = spec.quant.block_k;
  }
  return json{{"routing", routing},
              {"quant", quant},
              {"activation", activation_name(spec.activation)},
              {"apply_router_weight_on_input", spec.apply_router_weight_on_input}}
      .dump();
}

Result<MoeSpec> spec_from_json(const std::string& text) {
  const json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object())
    return bad_argument(kSpecKey, "a JSON object", in_quotes(text.substr(0, 80)));
  for (const char* section : {"routing", "quant"})
    if (!root.contains(section) || !root[section].is_object())
      return bad_argument(std::string(kSpecKey) + "." + section, "an object",
                          root.contains(section) ? root[section].dump() : "nothing");
  MoeSpec spec;
  const json& routing = root["routing"];
  const std::string r = std::string(kSpecKey) + ".routing", q = std::string(kSpecKey) + ".quant";
  EPMOE_RETURN_IF_ERROR(read_enum(routing, r, "kind", spec.routing.kind, parse_routing_kind));
  EPMOE_RETURN_IF_ERROR(read_field(routing, r, "num_experts", spec.routing.num_experts));
  EPMOE_RETURN_IF_ERROR(read_field(routing, r, "top_k", spec.routing.top_k));
  EPMOE_RETURN_IF_ERROR(read_field(routing, r, "renormalize", spec.routing.renormalize));
  EPMOE_RETURN_IF_ERROR(read_enum(routing, r, "score_func", spec.routing.score_func, parse_score_func));
  EPMOE_RETURN_IF_ERROR(read_field(routing, r, "n_group", spec.routing.n_group));
  EPMOE_RETURN_IF_ERROR(read_field(routing, r, "topk_group", spec.routing.topk_group));
  EPMOE_RETURN_IF_ERROR(read_field(routing, r, "routed_scaling_factor", spec.routing.routed_scaling_factor));
  const json& quant = root["quant"];
  EPMOE_RETURN_IF_ERROR(read_enum(quant, q, "scheme", spec.quant.scheme, parse_quant_scheme));
  EPMOE_RETURN_IF_ERROR(read_field(quant, q, "block_n", spec.quant.block_n));
  EPMOE_RETURN_IF_ERROR(read_field(quant, q, "block_k", spec.quant.block_k));
  EPMOE_RETURN_IF_ERROR(read_enum(root, kSpecKey, "activation", spec.activation, parse_activation));
  EPMOE_RETURN_IF_ERROR(
      read_field(root, kSpecKey, "apply_router_weight_on_input", spec.apply_router_weight_on_input));
  EPMOE_RETURN_IF_ERROR(validate_spec(spec));
  return spec;
}

Result<MoeCase> load_moe_case(const std::string& path) {
  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  if (!file.ok()) return file.status();
  const auto spec_text = file->metadata().find(kSpecKey);
  if (spec_text == file->metadata().end())
    return bad_argument(path + ": __metadata__", std::string("the key '") + kSpecKey + "'", "no such key");
  Result<MoeSpec> spec = spec_from_json(spec_text->second);
  if (!spec.ok()) return Status(spec.status().code(), path + ": " + spec.status().message());

  MoeCase moe_case;
  moe_case.spec = spec.value();
  const auto required = [&](const char* name) -> Result<Tensor> {
    std::optional<Tensor> tensor = file->tensor(name);
    if (!tensor) return bad_argument(path, std::string("a tensor named '") + name + "'", "none");
    return *tensor;
  };
  for (auto [name, slot] : {std::pair{"x", &moe_case.inputs.x}, std::pair{"w13", &moe_case.weights.w13},
                            std::pair{"w2", &moe_case.weights.w2}}) {
    Result<Tensor> tensor = required(name);
    if (!tensor.ok()) return tensor.status();
    *slot = tensor.value();
  }
  for (const auto& [name, slot] : optional_tensor_fields(moe_case)) *slot = file->tensor(name);
  moe_case.expected = file->tensor("y");
  const Tensor& x = moe_case.inputs.x;
  if (moe_case.expected && !moe_case.expected->has_shape({x.size(0), x.size(1)}))
    return bad_argument(path + ": y", "shape of x " + x.shape_string(), moe_case.expected->shape_string());
  Result<MoeShape> shape = validate_moe(moe_case.spec, moe_case.weights, moe_case.inputs, nullptr, Device::kCpu);
  if (!shape.ok()) return Status(shape.status().code(), path + ": " + shape.status().message());
  moe_case.storage.push_back(std::make_shared<SafetensorsFile>(std::move(file).value()));
  return moe_case;
}

Status save_moe_case(const std::string& path, const MoeCase& moe_case, const Tensor& y) {
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"x", moe_case.inputs.x}, {"w13", moe_case.weights.w13}, {"w2", moe_case.weights.w2}, {"y", y}};
  for (const auto& [name, tensor] : optional_tensor_fields(moe_case))
    if (*tensor) tensors.emplace_back(name, **tensor);
  return write_safetensors(path, tensors, {{kSpecKey, spec_to_json(moe_case.spec)}});
}

Result<MoeCase> make_random_case(const RandomCaseOptions& options) {
  const MoeSpec& spec = options.spec;
  EPMOE_RETURN_IF_ERROR(validate_spec(spec));
  const int E = spec.routing.num_experts, k = spec.routing.top_k;
  const int64_t T = options.tokens, H = options.hidden, I = options.intermediate, Is = options.shared_intermediate;
  if (T < 0 || H <= 0 || I <= 0 || Is < 0)
    return bad_argument("random case sizes", "T >= 0, H > 0, I > 0, I_s >= 0",
                        "T=" + std::to_string(T) + ", H=" + std::to_string(H) + ", I=" + std::to_string(I) +
                            ", I_s=" + std::to_string(Is));
  Result<ExpertMap> owned = ExpertMap::build(options.placement, E, options.num_ranks, options.rank);
  if (!owned.ok()) return owned.status();

  MoeCase moe_case;
  moe_case.spec = spec;
  Rng data_rng(options.seed, ~0ull);
  auto x = add_buffer(moe_case, options.activation_dtype, {T, H});
  for (int64_t i = 0; i < T * H; ++i) {
    const float value = data_rng.centered(1.0f);
    if (options.activation_dtype == DType::kF32) {
      x->data_as<float>()[i] = value;
    } else {
      x->data_as<uint16_t>()[i] = f32_to_bf16(value);
    }
  }
  moe_case.inputs.x = x->view();
  auto logits = add_buffer(moe_case, DType::kF32, {T, E});
  for (int64_t i = 0; i < T * E; ++i) logits->data_as<float>()[i] = data_rng.centered(1.5f);
  moe_case.inputs.router_logits = logits->view();
  if (options.correction_bias) {
    auto bias = add_buffer(moe_case, DType::kF32, {E});
    for (int e = 0; e < E; ++e) bias->data_as<float>()[e] = data_rng.centered(0.1f);
    moe_case.inputs.correction_bias = bias->view();
  }

  // The routing decides which experts are touched; the operator will route the same way.
  std::vector<int32_t> topk_ids(T * k);
  std::vector<float> topk_weights(T * k);
  EPMOE_RETURN_IF_ERROR(route_cpu(spec.routing, logits->view(), moe_case.inputs.correction_bias,
                                  Tensor::contiguous(topk_ids.data(), DType::kI32, {T, k}),
                                  Tensor::contiguous(topk_weights.data(), DType::kF32, {T, k})));
  auto map = std::make_shared<ExpertMap>(options.touched_experts_only
                                             ? ExpertMap::touched(E, topk_ids, &owned.value())
                                             : owned.value());
  moe_case.storage.push_back(map);
  if (options.num_ranks > 1 || options.touched_experts_only) moe_case.inputs.expert_map = map->view();

  const QuantSpec& quant = spec.quant;
  const bool fp8 = is_fp8(quant.scheme);
  const DType weight_dtype = fp8 ? DType::kFP8E4M3 : options.dense_weight_dtype;
  const int64_t E_local = map->num_local();
  auto w13 = add_buffer(moe_case, weight_dtype, {E_local, 2 * I, H});
  auto w2 = add_buffer(moe_case, weight_dtype, {E_local, H, I});
  std::shared_ptr<Buffer> w13_scale = add_scale_buffer(moe_case, quant, E_local, 2 * I, H);
  std::shared_ptr<Buffer> w2_scale = add_scale_buffer(moe_case, quant, E_local, H, I);
  const int64_t w13_scales = fp8 ? w13_scale->numel() / std::max<int64_t>(E_local, 1) : 0;
  const int64_t w2_scales = fp8 ? w2_scale->numel() / std::max<int64_t>(E_local, 1) : 0;
  if (fp8) {
    moe_case.weights.w13_scale = w13_scale->view();
    moe_case.weights.w2_scale = w2_scale->view();
  }
  const size_t element = dtype_size(weight_dtype);
  // One expert's matrices from the stream of its global id (E stands for the shared one).
  auto draw_expert = [&](uint64_t stream, int64_t inter, void* w13_out, float* w13_scale_out, void* w2_out,
                         float* w2_scale_out) {
    Rng rng(options.seed, stream);
    std::vector<float> values(2 * inter * H);
    for (float& v : values) v = rng.centered(1.0f / std::sqrt(static_cast<float>(H)));
    store_weight(values, quant, options.dense_weight_dtype, 2 * inter, H, w13_out, w13_scale_out);
    values.resize(H * inter);
    for (float& v : values) v = rng.centered(1.0f / std::sqrt(static_cast<float>(inter)));
    store_weight(values, quant, options.dense_weight_dtype, H, inter, w2_out, w2_scale_out);
  };
  parallel_for(E_local, 0, [&](int64_t local) {
    draw_expert(static_cast<uint64_t>(map->global_ids()[local]), I,
                w13->data_as<std::byte>() + local * 2 * I * H * element, fp8 ? w13_scale->data_as<float>() + local * w13_scales : nullptr,
                w2->data_as<std::byte>() + local * H * I * element, fp8 ? w2_scale->data_as<float>() + local * w2_scales : nullptr);
  });
  moe_case.weights.w13 = w13->view();
  moe_case.weights.w2 = w2->view();

  if (Is > 0 && options.rank == 0) {
    auto shared_w13 = add_buffer(moe_case, weight_dtype, {2 * Is, H});
    auto shared_w2 = add_buffer(moe_case, weight_dtype, {H, Is});
    std::shared_ptr<Buffer> s13 = add_scale_buffer(moe_case, quant, std::nullopt, 2 * Is, H);
    std::shared_ptr<Buffer> s2 = add_scale_buffer(moe_case, quant, std::nullopt, H, Is);
    if (fp8) {
      moe_case.weights.shared_w13_scale = s13->view();
      moe_case.weights.shared_w2_scale = s2->view();
    }
    draw_expert(static_cast<uint64_t>(E), Is, shared_w13->view().data, fp8 ? s13->data_as<float>() : nullptr,
                shared_w2->view().data, fp8 ? s2->data_as<float>() : nullptr);
    moe_case.weights.shared_w13 = shared_w13->view();
    moe_case.weights.shared_w2 = shared_w2->view();
  }

  if (options.static_activation_scales && quant.scheme == QuantScheme::kFp8Tensor) {
    // Calibration-style static scales: GEMM1's from x's range, GEMM2's a fixed guess that
    // covers activations of unit-variance weights (values beyond it saturate, as in real use).
    auto input_scale = add_buffer(moe_case, DType::kF32, {1});
    auto intermediate_scale = add_buffer(moe_case, DType::kF32, {1});
    *input_scale->data_as<float>() = fp8_scale_for_amax(1.7320508f);
    *intermediate_scale->data_as<float>() = fp8_scale_for_amax(4.0f);
    moe_case.weights.input_scale = input_scale->view();
    moe_case.weights.intermediate_scale = intermediate_scale->view();
  }
  return moe_case;
}

Result<BenchRouting> draw_bench_routing(const RandomCaseOptions& options, int64_t tokens, int sets) {
  const RoutingSpec& routing = options.spec.routing;
  const int64_t E = routing.num_experts, k = routing.top_k;
  BenchRouting drawn;
  Rng rng(options.seed, 0xb1a5);  // the bias first, then each set's logits
  drawn.bias.resize(E);
  for (float& v : drawn.bias) v = rng.centered(0.01f);
  std::optional<Tensor> bias;
  if (options.correction_bias) bias = Tensor::contiguous(drawn.bias.data(), DType::kF32, {E});
  std::vector<float> route_weights(tokens * k);
  for (int set = 0; set < sets; ++set) {
    std::vector<float>& logits = drawn.logits.emplace_back(tokens * E);
    for (float& v : logits) v = rng.centered(1.5f);
    std::vector<int32_t>& ids = drawn.ids.emplace_back(tokens * k);
    EPMOE_RETURN_IF_ERROR(route_cpu(routing, Tensor::contiguous(logits.data(), DType::kF32, {tokens, E}), bias,
                                    Tensor::contiguous(ids.data(), DType::kI32, {tokens, k}),
                                    Tensor::contiguous(route_weights.data(), DType::kF32, {tokens, k})));
  }
  return drawn;
}

int64_t weight_bytes(const MoeCase& moe_case) {
  int64_t bytes = 0;
  const MoeWeights& w = moe_case.weights;
  for (const std::optional<Tensor>& tensor : {std::optional<Tensor>(w.w13), std::optional<Tensor>(w.w2), w.w13_scale,
                                              w.w2_scale, w.shared_w13, w.shared_w2, w.shared_w13_scale,
                                              w.shared_w2_scale})
    if (tensor) bytes += static_cast<int64_t>(tensor->nbytes());
  return bytes;
}

}  // namespace epmoe
