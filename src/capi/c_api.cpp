// The C ABI (include/epmoe/c_api.h): converts its plain structs into the C++ types, picks
// the CPU or the CUDA operator by where the tensors live, and turns a failed Status into
// an error code plus a per-thread message.
#include "epmoe/c_api.h"

#include <exception>
#include <string>

#include "epmoe/moe_cpu.h"
#ifdef EPMOE_WITH_CUDA
#include "epmoe/moe_cuda.h"
#endif

namespace epmoe {
namespace {

thread_local std::string last_error;

// Runs `body` (returning a Status) so that nothing, not even an exception, crosses the ABI.
template <typename Body>
int guarded(Body body) noexcept {
  try {
    const Status status = body();
    last_error = status.ok() ? "" : status.message();
    return static_cast<int>(status.code());
  } catch (const std::exception& error) {
    last_error = std::string("internal error: ") + error.what();
  } catch (...) {
    last_error = "internal error: an unknown exception";
  }
  return EPMOE_INTERNAL;
}

// A required tensor, or nullopt for an absent one (rank 0, no data).
Result<std::optional<Tensor>> from_c(const epmoe_tensor& c, std::string_view name) {
  if (c.rank == 0 && c.data == nullptr) return std::optional<Tensor>{};
  if (c.rank < 1 || c.rank > kMaxTensorRank)
    return bad_argument(name, "rank 1.." + std::to_string(kMaxTensorRank), std::to_string(c.rank));
  if (c.dtype < 0 || c.dtype > static_cast<int>(DType::kI64))
    return bad_argument(name, "a dtype code in 0..5 (EPMOE_F32..EPMOE_I64)", std::to_string(c.dtype));
  if (c.device != EPMOE_CPU && c.device != EPMOE_CUDA)
    return bad_argument(name, "device EPMOE_CPU (0) or EPMOE_CUDA (1)", std::to_string(c.device));
  Tensor tensor;
  tensor.data = c.data;
  tensor.dtype = static_cast<DType>(c.dtype);
  tensor.device = c.device == EPMOE_CUDA ? Device::kCuda : Device::kCpu;
  tensor.rank = c.rank;
  for (int d = 0; d < c.rank; ++d) {
    if (c.shape[d] < 0) return bad_argument(name, "non-negative sizes", "size " + std::to_string(c.shape[d]));
    tensor.shape[d] = c.shape[d];
    tensor.strides[d] = c.strides[d];
  }
  return std::optional<Tensor>(tensor);
}

Result<Tensor> required(const epmoe_tensor& c, std::string_view name) {
  Result<std::optional<Tensor>> tensor = from_c(c, name);
  if (!tensor.ok()) return tensor.status();
  if (!tensor.value()) return bad_argument(name, "a tensor", "none");
  return *tensor.value();
}

Result<RoutingSpec> from_c(const epmoe_routing& c) {
  RoutingSpec routing;
  if (c.kind == nullptr) return bad_argument("routing.kind", "a routing kind name", "NULL");
  Result<RoutingKind> kind = parse_routing_kind(c.kind);
  if (!kind.ok()) return kind.status();
  routing.kind = kind.value();
  if (c.score_func != nullptr) {
    Result<ScoreFunc> score_func = parse_score_func(c.score_func);
    if (!score_func.ok()) return score_func.status();
    routing.score_func = score_func.value();
  }
  routing.num_experts = c.num_experts;
  routing.top_k = c.top_k;
  routing.renormalize = c.renormalize != 0;
  routing.n_group = c.n_group;
  routing.topk_group = c.topk_group;
  routing.routed_scaling_factor = c.routed_scaling_factor;
  return routing;
}

Result<MoeSpec> from_c(const epmoe_spec& c) {
  MoeSpec spec;
  Result<RoutingSpec> routing = from_c(c.routing);
  if (!routing.ok()) return routing.status();
  spec.routing = routing.value();
  Result<QuantScheme> scheme = parse_quant_scheme(c.quant_scheme ? c.quant_scheme : "");
  if (!scheme.ok()) return scheme.status();
  spec.quant = {scheme.value(), c.block_n, c.block_k};
  Result<Activation> activation = parse_activation(c.activation ? c.activation : "");
  if (!activation.ok()) return activation.status();
  spec.activation = activation.value();
  spec.apply_router_weight_on_input = c.apply_router_weight_on_input != 0;
  return spec;
}

// One call's C++ arguments.
struct Call {
  MoeSpec spec;
  MoeWeights weights;
  MoeInputs inputs;
  Tensor out;
};

Result<Call> from_c(const epmoe_spec* spec, const epmoe_moe_tensors* tensors) {
  if (spec == nullptr || tensors == nullptr) return bad_argument("spec, tensors", "non-NULL pointers", "NULL");
  Call call;
  Result<MoeSpec> moe_spec = from_c(*spec);
  if (!moe_spec.ok()) return moe_spec.status();
  call.spec = moe_spec.value();
  const std::pair<Tensor*, std::pair<const epmoe_tensor*, const char*>> needed[] = {
      {&call.inputs.x, {&tensors->x, "x"}},
      {&call.weights.w13, {&tensors->w13, "w13"}},
      {&call.weights.w2, {&tensors->w2, "w2"}},
      {&call.out, {&tensors->out, "out"}}};
  for (const auto& [target, source] : needed) {
    Result<Tensor> tensor = required(*source.first, source.second);
    if (!tensor.ok()) return tensor.status();
    *target = tensor.value();
  }
  const std::pair<std::optional<Tensor>*, std::pair<const epmoe_tensor*, const char*>> optional[] = {
      {&call.weights.w13_scale, {&tensors->w13_scale, "w13_scale"}},
      {&call.weights.w2_scale, {&tensors->w2_scale, "w2_scale"}},
      {&call.weights.input_scale, {&tensors->input_scale, "input_scale"}},
      {&call.weights.intermediate_scale, {&tensors->intermediate_scale, "intermediate_scale"}},
      {&call.inputs.topk_ids, {&tensors->topk_ids, "topk_ids"}},
      {&call.inputs.topk_weights, {&tensors->topk_weights, "topk_weights"}},
      {&call.inputs.expert_map, {&tensors->expert_map, "expert_map"}}};
  for (const auto& [target, source] : optional) {
    Result<std::optional<Tensor>> tensor = from_c(*source.first, source.second);
    if (!tensor.ok()) return tensor.status();
    *target = tensor.value();
  }
  return call;
}

Status workspace_bytes(const Call& call, size_t& bytes) {
  const Device device = call.inputs.x.device;
  Result<MoeShape> shape = validate_moe(call.spec, call.weights, call.inputs, &call.out, device);
  if (!shape.ok()) return shape.status();
  bytes = 0;
#ifdef EPMOE_WITH_CUDA
  if (device == Device::kCuda) bytes = moe_workspace_bytes(call.spec, shape.value());
#endif
  return {};
}

Status fused_experts(const Call& call, void* workspace, size_t workspace_bytes, void* stream) {
  if (call.inputs.x.device == Device::kCpu) return moe_forward_cpu(call.spec, call.weights, call.inputs, call.out);
#ifdef EPMOE_WITH_CUDA
  return moe_forward_cuda(call.spec, call.weights, call.inputs, call.out, {workspace, workspace_bytes},
                          static_cast<CUstream_st*>(stream));
#else
  (void)workspace, (void)workspace_bytes, (void)stream;
  return Status::unsupported("x: CUDA tensors need a build with the CUDA backend (this one has none)");
#endif
}

Status route(const epmoe_routing* c_routing, const epmoe_tensor* c_logits, const epmoe_tensor* c_bias,
             const epmoe_tensor* c_ids, const epmoe_tensor* c_weights, void* stream) {
  if (!c_routing || !c_logits || !c_ids || !c_weights)
    return bad_argument("routing, router_logits, topk_ids, topk_weights", "non-NULL pointers", "NULL");
  Result<RoutingSpec> routing = from_c(*c_routing);
  if (!routing.ok()) return routing.status();
  Result<Tensor> logits = required(*c_logits, "router_logits");
  Result<Tensor> ids = required(*c_ids, "topk_ids");
  Result<Tensor> weights = required(*c_weights, "topk_weights");
  Result<std::optional<Tensor>> bias = c_bias ? from_c(*c_bias, "correction_bias") : std::optional<Tensor>{};
  for (const Status* status : {&logits.status(), &ids.status(), &weights.status(), &bias.status()})
    if (!status->ok()) return *status;
  const Device device = logits->device;
  if (device == Device::kCpu) {
    EPMOE_RETURN_IF_ERROR(validate_route(routing.value(), logits.value(), bias.value(), ids.value(), weights.value(), device));
    return route_cpu(routing.value(), logits.value(), bias.value(), ids.value(), weights.value());
  }
#ifdef EPMOE_WITH_CUDA
  return route_cuda(routing.value(), logits.value(), bias.value(), ids.value(), weights.value(),
                    static_cast<CUstream_st*>(stream));
#else
  (void)stream;
  return Status::unsupported("router_logits: CUDA tensors need a build with the CUDA backend (this one has none)");
#endif
}

}  // namespace
}  // namespace epmoe

extern "C" {

int epmoe_c_api_version(void) { return EPMOE_C_API_VERSION; }

const char* epmoe_last_error(void) { return epmoe::last_error.c_str(); }

int epmoe_fused_experts_workspace_bytes(const epmoe_spec* spec, const epmoe_moe_tensors* tensors, size_t* bytes) {
  return epmoe::guarded([&]() -> epmoe::Status {
    if (bytes == nullptr) return epmoe::bad_argument("bytes", "a non-NULL pointer", "NULL");
    epmoe::Result<epmoe::Call> call = epmoe::from_c(spec, tensors);
    if (!call.ok()) return call.status();
    return epmoe::workspace_bytes(call.value(), *bytes);
  });
}

int epmoe_fused_experts(const epmoe_spec* spec, const epmoe_moe_tensors* tensors, void* workspace,
                        size_t workspace_bytes, void* stream) {
  return epmoe::guarded([&]() -> epmoe::Status {
    epmoe::Result<epmoe::Call> call = epmoe::from_c(spec, tensors);
    if (!call.ok()) return call.status();
    return epmoe::fused_experts(call.value(), workspace, workspace_bytes, stream);
  });
}

int epmoe_route(const epmoe_routing* routing, const epmoe_tensor* router_logits, const epmoe_tensor* correction_bias,
                const epmoe_tensor* topk_ids, const epmoe_tensor* topk_weights, void* stream) {
  return epmoe::guarded(
      [&] { return epmoe::route(routing, router_logits, correction_bias, topk_ids, topk_weights, stream); });
}

}  // extern "C"
