// A MoeCase copied to the GPU: device buffers for every tensor, and the MoeWeights /
// MoeInputs views of them that moe_forward_cuda takes. For tests, check and bench.
#pragma once

#include <memory>
#include <vector>

#include "epmoe/moe_case.h"

namespace epmoe {

// Owns device memory (cudaMalloc); freed when the last copy of the handle goes.
class DeviceBuffer {
 public:
  static Result<DeviceBuffer> allocate(size_t bytes);
  void* data() const { return memory_.get(); }
  size_t bytes() const { return bytes_; }

 private:
  std::shared_ptr<void> memory_;
  size_t bytes_ = 0;
};

Status copy_to_device(const Tensor& host, void* device);
Status copy_to_host(const void* device, const Tensor& host);

struct DeviceCase {
  MoeSpec spec;
  MoeWeights weights;
  MoeInputs inputs;
  std::vector<DeviceBuffer> storage;
};

// Copies every tensor of `host` to the device (same shapes and dtypes).
Result<DeviceCase> upload(const MoeCase& host);

// Replaces `tensor` by a device copy that `storage` owns.
Status move_to_device(Tensor& tensor, std::vector<DeviceBuffer>& storage);

// Replaces every tensor of `weights` by a device copy that `storage` owns.
Status upload_weights(MoeWeights& weights, std::vector<DeviceBuffer>& storage);

}  // namespace epmoe
