// The host conversions of core/dtype against the GPU's own: every bf16, f16 and fp8 code
// decoded, and f32 values around every bf16/f16 pattern (each pattern, the midpoints to its
// neighbours, and random bit patterns) encoded, by CUDA intrinsics on the device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "epmoe/dtype.h"

namespace epmoe {
namespace {

// out[i] = the device's encodings of in[i]: bf16 bits, f16 bits, fp8 code (sat-finite).
__global__ void encode_kernel(const float* in, int n, uint16_t* bf16, uint16_t* f16, uint8_t* fp8) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
  f16[i] = __half_as_ushort(__float2half_rn(in[i]));
  fp8[i] = __nv_cvt_float_to_fp8(in[i], __NV_SATFINITE, __NV_E4M3);
}

// out[i] = the device's decodings of code i: bf16, f16 (i < 65536) and fp8 (i < 256).
__global__ void decode_kernel(float* bf16, float* f16, float* fp8) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536) return;
  bf16[i] = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(i)));
  f16[i] = __half2float(__ushort_as_half(static_cast<unsigned short>(i)));
  if (i < 256) {
    __nv_fp8_e4m3 code;
    code.__x = static_cast<__nv_fp8_storage_t>(i);
    fp8[i] = static_cast<float>(code);
  }
}

template <typename T>
struct DeviceArray {
  T* data = nullptr;
  explicit DeviceArray(size_t n) { EXPECT_EQ(cudaMalloc(&data, n * sizeof(T)), cudaSuccess); }
  ~DeviceArray() { cudaFree(data); }
  std::vector<T> read(size_t n) const {
    std::vector<T> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), data, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
};

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

TEST(DTypeGpu, DecodingMatchesDeviceForEveryCode) {
  DeviceArray<float> bf16(65536), f16(65536), fp8(256);
  cudaMemset(bf16.data, 0xff, 65536 * sizeof(float));  // poison: NaN everywhere
  decode_kernel<<<256, 256>>>(bf16.data, f16.data, fp8.data);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto bf16_host = bf16.read(65536), f16_host = f16.read(65536), fp8_host = fp8.read(256);
  for (uint32_t code = 0; code < 65536; ++code) {
    ASSERT_TRUE(same_float(bf16_to_f32(static_cast<uint16_t>(code)), bf16_host[code])) << "bf16 " << code;
    ASSERT_TRUE(same_float(f16_to_f32(static_cast<uint16_t>(code)), f16_host[code])) << "f16 " << code;
    if (code < 256) ASSERT_TRUE(same_float(fp8e4m3_to_f32(static_cast<uint8_t>(code)), fp8_host[code])) << "fp8 " << code;
  }
}

TEST(DTypeGpu, EncodingMatchesDeviceAroundEveryPattern) {
  std::vector<float> values;
  for (uint32_t code = 0; code < 65536; ++code) {
    const uint32_t bits = code << 16;
    values.push_back(std::bit_cast<float>(bits));
    values.push_back(std::bit_cast<float>(bits | 0x8000u));  // the midpoint to the next bf16
    values.push_back(std::bit_cast<float>(bits | 0x7fffu));
    values.push_back(std::bit_cast<float>(bits | 0x8001u));
    values.push_back(f16_to_f32(static_cast<uint16_t>(code)));
    values.push_back(std::nextafter(f16_to_f32(static_cast<uint16_t>(code)), 0.0f));
  }
  std::mt19937 rng(std::random_device{}());
  for (int i = 0; i < (1 << 22); ++i) values.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  const int n = static_cast<int>(values.size());
  DeviceArray<float> in(n);
  DeviceArray<uint16_t> bf16(n), f16(n);
  DeviceArray<uint8_t> fp8(n);
  ASSERT_EQ(cudaMemcpy(in.data, values.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  encode_kernel<<<(n + 255) / 256, 256>>>(in.data, n, bf16.data, f16.data, fp8.data);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto bf16_host = bf16.read(n), f16_host = f16.read(n);
  const auto fp8_host = fp8.read(n);
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(f32_to_bf16(values[i]), bf16_host[i]) << "bf16 of bits " << std::bit_cast<uint32_t>(values[i]);
    ASSERT_EQ(f32_to_f16(values[i]), f16_host[i]) << "f16 of bits " << std::bit_cast<uint32_t>(values[i]);
    ASSERT_EQ(f32_to_fp8e4m3(values[i]), fp8_host[i]) << "fp8 of bits " << std::bit_cast<uint32_t>(values[i]);
  }
}

}  // namespace
}  // namespace epmoe
