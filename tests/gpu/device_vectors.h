// Host vectors to and from device memory, for the GPU tests that drive kernels directly.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "epmoe/device_case.h"

namespace epmoe {

// A device copy of `host`, owned by `storage`.
template <typename T>
T* upload_vector(const std::vector<T>& host, std::vector<DeviceBuffer>& storage) {
  storage.push_back(DeviceBuffer::allocate(std::max<size_t>(host.size(), 1) * sizeof(T)).value());
  EXPECT_EQ(cudaMemcpy(storage.back().data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return static_cast<T*>(storage.back().data());
}

template <typename T>
std::vector<T> download(const T* device, size_t count) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

}  // namespace epmoe
