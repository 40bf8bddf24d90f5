#include "epmoe/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <cstring>
#include <new>

namespace epmoe {

std::string_view device_name(Device device) { return device == Device::kCpu ? "cpu" : "cuda"; }

Tensor Tensor::contiguous(void* data, DType dtype, std::span<const int64_t> shape, Device device) {
  Tensor tensor;
  tensor.data = data;
  tensor.dtype = dtype;
  tensor.device = device;
  tensor.rank = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int dim = tensor.rank - 1; dim >= 0; --dim) {
    tensor.shape[dim] = shape[dim];
    tensor.strides[dim] = stride;
    stride *= shape[dim];
  }
  return tensor;
}

int64_t Tensor::numel() const {
  int64_t count = 1;
  for (int dim = 0; dim < rank; ++dim) count *= shape[dim];
  return count;
}

bool Tensor::is_contiguous() const {
  int64_t stride = 1;
  for (int dim = rank - 1; dim >= 0; --dim) {
    if (shape[dim] != 1 && strides[dim] != stride) return false;
    stride *= shape[dim];
  }
  return true;
}

bool Tensor::has_shape(std::initializer_list<int64_t> expected) const {
  if (static_cast<int>(expected.size()) != rank) return false;
  int dim = 0;
  for (int64_t extent : expected) {
    if (shape[dim++] != extent) return false;
  }
  return true;
}

std::string Tensor::shape_string() const {
  std::string text = "[";
  for (int dim = 0; dim < rank; ++dim) {
    if (dim) text += ", ";
    text += std::to_string(shape[dim]);
  }
  return text + "]";
}

std::string Tensor::describe() const {
  return std::string(dtype_name(dtype)) + " " + shape_string() + " on " +
         std::string(device_name(device));
}

Status fill_with_nan(const Tensor& host) {
  if (host.device != Device::kCpu || !host.is_contiguous())
    return bad_argument("fill_with_nan", "a contiguous host tensor", host.describe());
  const int64_t count = host.numel();
  switch (host.dtype) {
    case DType::kF32:
      std::fill_n(host.data_as<float>(), count, std::numeric_limits<float>::quiet_NaN());
      return {};
    case DType::kBF16:
      std::fill_n(host.data_as<uint16_t>(), count, uint16_t{0x7fc0});
      return {};
    case DType::kF16:
      std::fill_n(host.data_as<uint16_t>(), count, uint16_t{0x7e00});
      return {};
    default:
      return bad_argument("fill_with_nan", "an f32, bf16 or f16 tensor", host.describe());
  }
}

void Buffer::AlignedFree::operator()(std::byte* pointer) const { std::free(pointer); }

Buffer::Buffer(DType dtype, std::span<const int64_t> shape) {
  view_ = Tensor::contiguous(nullptr, dtype, shape);
  constexpr size_t kAlignment = 64;
  const size_t bytes = (view_.nbytes() + kAlignment - 1) / kAlignment * kAlignment;
  auto* memory = static_cast<std::byte*>(std::aligned_alloc(kAlignment, bytes ? bytes : kAlignment));
  if (!memory) throw std::bad_alloc();
  std::memset(memory, 0, bytes);
  storage_.reset(memory);
  view_.data = memory;
}

}  // namespace epmoe
