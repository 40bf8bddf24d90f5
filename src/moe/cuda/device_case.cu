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
  // From pageable memory the call may return before the DMA lands; work on other streams
  // (an NCCL stream) must see the data.
  CUDA_CHECK(cudaStreamSynchronize(nullptr));
  return {};
}

Status copy_to_host(const void* device, const Tensor& host) {
  if (host.nbytes() == 0) return {};
  CUDA_CHECK(cudaMemcpy(host.data, device, host.nbytes(), cudaMemcpyDeviceToHost));
  return {};
}

Status move_to_device(Tensor& tensor, std::vector<DeviceBuffer>& storage) {
  Result<DeviceBuffer> buffer = DeviceBuffer::allocate(tensor.nbytes());
  if (!buffer.ok()) return buffer.status();
  EPMOE_RETURN_IF_ERROR(copy_to_device(tensor, buffer->data()));
  tensor.data = buffer->data();
  tensor.device = Device::kCuda;
  storage.push_back(std::move(buffer).value());
  return {};
}

namespace {

Status move_optional(std::initializer_list<std::optional<Tensor>*> tensors, std::vector<DeviceBuffer>& storage) {
  for (std::optional<Tensor>* tensor : tensors)
    if (*tensor) EPMOE_RETURN_IF_ERROR(move_to_device(**tensor, storage));
  return {};
}

}  // namespace

Status upload_weights(MoeWeights& weights, std::vector<DeviceBuffer>& storage) {
  EPMOE_RETURN_IF_ERROR(move_to_device(weights.w13, storage));
  EPMOE_RETURN_IF_ERROR(move_to_device(weights.w2, storage));
  return move_optional({&weights.w13_scale, &weights.w2_scale, &weights.input_scale, &weights.intermediate_scale,
                        &weights.shared_w13, &weights.shared_w2, &weights.shared_w13_scale, &weights.shared_w2_scale},
                       storage);
}

Result<DeviceCase> upload(const MoeCase& host) {
  DeviceCase device;
  device.spec = host.spec;
  device.weights = host.weights;
  device.inputs = host.inputs;
  MoeInputs& in = device.inputs;
  EPMOE_RETURN_IF_ERROR(move_to_device(in.x, device.storage));
  EPMOE_RETURN_IF_ERROR(upload_weights(device.weights, device.storage));
  EPMOE_RETURN_IF_ERROR(
      move_optional({&in.router_logits, &in.correction_bias, &in.topk_ids, &in.topk_weights, &in.expert_map}, device.storage));
  return device;
}

}  // namespace epmoe
