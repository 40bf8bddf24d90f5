// Tensor: a non-owning view (pointer, dtype, device, shape, strides in elements).
// Buffer: owns host memory and hands out contiguous views of it.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epmoe/dtype.h"
#include "epmoe/status.h"

namespace epmoe {

enum class Device : uint8_t { kCpu, kCuda };
std::string_view device_name(Device device);

inline constexpr int kMaxTensorRank = 4;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device = Device::kCpu;
  int rank = 0;
  std::array<int64_t, kMaxTensorRank> shape{};
  std::array<int64_t, kMaxTensorRank> strides{};  // in elements

  // A contiguous (row-major) view of `data`.
  static Tensor contiguous(void* data, DType dtype, std::span<const int64_t> shape,
                           Device device = Device::kCpu);
  static Tensor contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                           Device device = Device::kCpu) {
    return contiguous(data, dtype, std::span<const int64_t>(shape.begin(), shape.size()), device);
  }

  int64_t size(int dim) const { return shape[dim]; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  bool has_shape(std::initializer_list<int64_t> expected) const;
  std::string shape_string() const;  // "[8, 192, 64]"
  std::string describe() const;      // "bf16 [8, 192, 64] on cpu"

  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data);
  }
};

// Fills a host tensor of f32, bf16 or f16 with NaN: outputs are poisoned before a kernel
// runs, so an element it leaves unwritten shows up as NaN.
Status fill_with_nan(const Tensor& host);

// Owns zero-initialised host memory, aligned for vector loads.
class Buffer {
 public:
  Buffer() = default;
  Buffer(DType dtype, std::span<const int64_t> shape);
  Buffer(DType dtype, std::initializer_list<int64_t> shape)
      : Buffer(dtype, std::span<const int64_t>(shape.begin(), shape.size())) {}

  const Tensor& view() const { return view_; }
  template <typename T>
  T* data_as() const {
    return view_.data_as<T>();
  }
  int64_t numel() const { return view_.numel(); }

 private:
  struct AlignedFree {
    void operator()(std::byte* pointer) const;
  };
  std::unique_ptr<std::byte[], AlignedFree> storage_;
  Tensor view_;
};

}  // namespace epmoe
