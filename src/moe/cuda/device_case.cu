#include "cuda_check.h"
#include "epmoe/device_case.h"

namespace epmoe {

Result<DeviceBuffer> DeviceBuffer::allocate(size_t bytes) {
  void* memory = nullptr;
  if (bytes > 0) {
    const cudaError_t error = cudaMalloc(&memory, bytes);
    if (error != cudaSuccess)
      return Status(StatusCode::kOutOfMemory,
                    "cudaMalloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(error));
  }
  DeviceBuffer buffer;
  buffer.memory_ = std::shared_ptr<void>(memory, [](void* pointer) { cudaFree(pointer); });
  buffer.bytes_ = bytes;
  return buffer;
}

Status copy_to_device(const Tensor& host, void* device) {
  if (host.nbytes() == 0) return {};
  CUDA_CHECK(cudaMemcpy(device, host.data, host.nbytes(), cudaMemcpyHostToDevice));
  return {};
}

Status copy_to_host(const void* device, const Tensor& host) {
  if (host.nbytes() == 0) return {};
  CUDA_CHECK(cudaMemcpy(host.data, device, host.nbytes(), cudaMemcpyDeviceToHost));
  return {};
}

Result<DeviceCase> upload(const MoeCase& host) {
  DeviceCase device;
  device.spec = host.spec;
  device.weights = host.weights;
  device.inputs = host.inputs;
  auto move = [&](Tensor& tensor) -> Status {
    Result<DeviceBuffer> buffer = DeviceBuffer::allocate(tensor.nbytes());
    if (!buffer.ok()) return buffer.status();
    EPMOE_RETURN_IF_ERROR(copy_to_device(tensor, buffer->data()));
    tensor.data = buffer->data();
    tensor.device = Device::kCuda;
    device.storage.push_back(std::move(buffer).value());
    return {};
  };
  MoeWeights& w = device.weights;
  MoeInputs& in = device.inputs;
  EPMOE_RETURN_IF_ERROR(move(in.x));
  EPMOE_RETURN_IF_ERROR(move(w.w13));
  EPMOE_RETURN_IF_ERROR(move(w.w2));
  for (std::optional<Tensor>* tensor :
       {&in.router_logits, &in.correction_bias, &in.topk_ids, &in.topk_weights, &in.expert_map, &w.w13_scale,
        &w.w2_scale, &w.input_scale, &w.intermediate_scale, &w.shared_w13, &w.shared_w2, &w.shared_w13_scale,
        &w.shared_w2_scale})
    if (*tensor) EPMOE_RETURN_IF_ERROR(move(**tensor));
  return device;
}

}  // namespace epmoe
