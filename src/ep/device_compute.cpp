#include "ep/device_compute.h"

#include <algorithm>

#include "epmoe/device_case.h"
#include "epmoe/moe_cuda.h"

namespace epmoe {

Result<Buffer> moe_on_device(const MoeSpec& spec, const MoeWeights& device_weights, const ExpertMap& experts,
                             const Tensor& x, const std::vector<int32_t>& ids, const std::vector<float>& weights) {
  const int64_t rows = x.size(0), H = x.size(1), k = spec.routing.top_k;
  Buffer out(x.dtype, {rows, H});
  if (rows == 0) return out;
  std::vector<DeviceBuffer> keep;
  auto upload = [&](const Tensor& host) -> Result<Tensor> {
    Result<DeviceBuffer> buffer = DeviceBuffer::allocate(host.nbytes());
    if (!buffer.ok()) return buffer.status();
    EPMOE_RETURN_IF_ERROR(copy_to_device(host, buffer->data()));
    Tensor device = host;
    device.data = buffer->data();
    device.device = Device::kCuda;
    keep.push_back(std::move(buffer).value());
    return device;
  };
  MoeInputs inputs;
  Result<Tensor> d_x = upload(x);
  Result<Tensor> d_ids = upload(Tensor::contiguous(const_cast<int32_t*>(ids.data()), DType::kI32, {rows, k}));
  Result<Tensor> d_weights = upload(Tensor::contiguous(const_cast<float*>(weights.data()), DType::kF32, {rows, k}));
  Result<Tensor> d_map = upload(experts.view());
  for (const auto* r : {&d_x, &d_ids, &d_weights, &d_map})
    if (!r->ok()) return r->status();
  inputs.x = d_x.value();
  inputs.topk_ids = d_ids.value();
  inputs.topk_weights = d_weights.value();
  inputs.expert_map = d_map.value();
  Result<DeviceBuffer> d_out = DeviceBuffer::allocate(out.view().nbytes());
  if (!d_out.ok()) return d_out.status();
  Tensor out_view = out.view();
  out_view.data = d_out->data();
  out_view.device = Device::kCuda;
  Result<MoeShape> shape = validate_moe(spec, device_weights, inputs, &out_view, Device::kCuda);
  if (!shape.ok()) return shape.status();
  Result<DeviceBuffer> workspace = DeviceBuffer::allocate(moe_workspace_bytes(spec, shape.value()));
  if (!workspace.ok()) return workspace.status();
  EPMOE_RETURN_IF_ERROR(
      moe_forward_cuda(spec, device_weights, inputs, out_view, {workspace->data(), workspace->bytes()}, nullptr));
  EPMOE_RETURN_IF_ERROR(copy_to_host(d_out->data(), out.view()));
  return out;
}

}  // namespace epmoe

namespace epmoe {

Result<DeviceExperts> DeviceExperts::create(const MoeSpec& spec, const MoeWeights& device_weights,
                                            const ExpertMap& experts, std::optional<Tensor> device_correction_bias) {
  DeviceExperts result;
  result.spec_ = spec;
  result.layer_weights_ = device_weights;
  result.correction_bias_ = device_correction_bias;
  Result<DeviceBuffer> map = DeviceBuffer::allocate(experts.view().nbytes());
  if (!map.ok()) return map.status();
  EPMOE_RETURN_IF_ERROR(copy_to_device(experts.view(), map->data()));
  result.expert_map_ = std::move(map).value();
  result.expert_map_view_ = experts.view();
  result.expert_map_view_.data = result.expert_map_.data();
  result.expert_map_view_.device = Device::kCuda;
  return result;
}

Status DeviceExperts::reserve(DeviceBuffer& buffer, size_t bytes) {
  if (buffer.bytes() >= bytes && buffer.data()) return {};
  Result<DeviceBuffer> grown = DeviceBuffer::allocate(std::max<size_t>(bytes, 256));
  if (!grown.ok()) return grown.status();
  buffer = std::move(grown).value();
  return {};
}

Status DeviceExperts::forward(const Tensor& x, const Tensor& router_logits, bool with_shared, const Tensor& out,
                              std::vector<int32_t>& topk_ids) {
  const int64_t rows = x.size(0), k = spec_.routing.top_k;
  topk_ids.assign(rows * k, 0);
  if (rows == 0) return {};
  EPMOE_RETURN_IF_ERROR(reserve(ids_, rows * k * sizeof(int32_t)));
  EPMOE_RETURN_IF_ERROR(reserve(weights_buffer_, rows * k * sizeof(float)));
  const Tensor ids = Tensor::contiguous(ids_.data(), DType::kI32, {rows, k}, Device::kCuda);
  const Tensor weights = Tensor::contiguous(weights_buffer_.data(), DType::kF32, {rows, k}, Device::kCuda);
  EPMOE_RETURN_IF_ERROR(route_cuda(spec_.routing, router_logits, correction_bias_, ids, weights, nullptr));
  MoeWeights layer = layer_weights_;
  if (!with_shared) {
    layer.shared_w13.reset();
    layer.shared_w2.reset();
    layer.shared_w13_scale.reset();
    layer.shared_w2_scale.reset();
  }
  MoeInputs inputs;
  inputs.x = x;
  inputs.topk_ids = ids;
  inputs.topk_weights = weights;
  inputs.expert_map = expert_map_view_;
  Result<MoeShape> shape = validate_moe(spec_, layer, inputs, &out, Device::kCuda);
  if (!shape.ok()) return shape.status();
  EPMOE_RETURN_IF_ERROR(reserve(workspace_, moe_workspace_bytes(spec_, shape.value())));
  EPMOE_RETURN_IF_ERROR(
      moe_forward_cuda(spec_, layer, inputs, out, {workspace_.data(), workspace_.bytes()}, nullptr));
  return copy_to_host(ids_.data(), Tensor::contiguous(topk_ids.data(), DType::kI32, {rows, k}));
}

}  // namespace epmoe
