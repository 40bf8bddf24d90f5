#include "ep/device_compute.h"

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
