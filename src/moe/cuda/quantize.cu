// FP8 (e4m3) quantisation of bf16 activations, code for code what the CPU quantiser
// (include/epmoe/quantize.h) produces: scale = max(amax, 1e-10) / 448 per block, codes =
// e4m3(value / scale) saturating (IEEE division, as on the CPU), and a NaN anywhere in a
// block makes its scale and codes NaN.
//   per group (fp8_block: group = block_k; fp8_channel: group = cols, one per token):
//     one warp per (row, group), two passes over the group's values (amax, then codes);
//   per tensor: an amax kernel (atomicMax on the bits of |x|, which order like the floats,
//     NaN above every number), then a codes kernel; or a given static scale.
// Bound by reading the values (twice per group, the second time from L1/L2).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "launchers.h"

namespace epmoe::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr float kMaxCode = 448.0f;
constexpr float kMinAmax = 1e-10f;
constexpr uint32_t kNanBits = 0x7fc00000u;  // above +inf (0x7f800000) as an unsigned number

__device__ float load(const uint16_t* values, int64_t i) { return __bfloat162float(__ushort_as_bfloat16(values[i])); }

__device__ float scale_for_amax(float amax) { return isnan(amax) ? __int_as_float(kNanBits) : fmaxf(amax, kMinAmax) / kMaxCode; }

__device__ uint8_t encode(float value, float scale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(value / scale, __NV_SATFINITE, __NV_E4M3));
}

// |value| as ordered bits; NaN maps above every number.
__device__ uint32_t magnitude_bits(float value) {
  return isnan(value) ? kNanBits : __float_as_uint(fabsf(value));
}

__device__ uint32_t warp_max(uint32_t bits) {
  for (int offset = 16; offset > 0; offset /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  return bits;
}

__global__ void quantize_groups_kernel(Fp8Quantize q) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t groups_per_row = (q.cols + q.group - 1) / q.group;
  const int64_t group = blockIdx.y * static_cast<int64_t>(kWarpsPerBlock) + warp;
  if (group >= groups_per_row) return;
  const int64_t row = blockIdx.x;
  const int64_t begin = row * q.cols + group * q.group;
  const int64_t width = min(q.group, q.cols - group * q.group);
  uint32_t amax = 0;
  for (int64_t i = lane; i < width; i += 32) amax = max(amax, magnitude_bits(load(q.values, begin + i)));
  const float scale = scale_for_amax(__uint_as_float(warp_max(amax)));
  for (int64_t i = lane; i < width; i += 32) q.codes[begin + i] = encode(load(q.values, begin + i), scale);
  if (lane == 0) q.scales[row * groups_per_row + group] = scale;
}

__global__ void tensor_amax_kernel(Fp8Quantize q) {
  const int64_t count = q.rows * q.cols;
  uint32_t amax = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    amax = max(amax, magnitude_bits(load(q.values, i)));
  amax = warp_max(amax);
  if (threadIdx.x % 32 == 0) atomicMax(q.amax_bits, amax);
}

__global__ void tensor_codes_kernel(Fp8Quantize q) {
  const float scale = q.static_scale ? *q.static_scale : scale_for_amax(__uint_as_float(*q.amax_bits));
  const int64_t count = q.rows * q.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    q.codes[i] = encode(load(q.values, i), scale);
  if (blockIdx.x == 0 && threadIdx.x == 0) q.scales[0] = scale;
}

}  // namespace

cudaError_t launch_quantize_fp8(const Fp8Quantize& q, cudaStream_t stream) {
  if (q.rows == 0 || q.cols == 0) return cudaSuccess;
  if (q.group > 0) {
    const int64_t groups_per_row = (q.cols + q.group - 1) / q.group;
    const dim3 grid(static_cast<unsigned>(q.rows), static_cast<unsigned>((groups_per_row + kWarpsPerBlock - 1) / kWarpsPerBlock));
    quantize_groups_kernel<<<grid, kWarpsPerBlock * 32, 0, stream>>>(q);
    return cudaGetLastError();
  }
  int device = 0, sms = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) return e;
  const int64_t count = q.rows * q.cols;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(4 * sms, (count + 255) / 256));
  if (!q.static_scale) {
    if (const cudaError_t e = cudaMemsetAsync(q.amax_bits, 0, sizeof(uint32_t), stream); e != cudaSuccess) return e;
    tensor_amax_kernel<<<blocks, 256, 0, stream>>>(q);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  tensor_codes_kernel<<<blocks, 256, 0, stream>>>(q);
  return cudaGetLastError();
}

}  // namespace epmoe::cuda
