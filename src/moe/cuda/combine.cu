// Combine: y[t] = sum_j w_tj * out[slot(t, j)] over j = 0..k-1 in order, then + the shared
// experts' row, in f32, rounded once to bf16. No atomics: each output element is written by
// one thread in a fixed order, so runs are bitwise identical. Also the row scaling of the
// router weight on the input (Llama-4), x * w rounded to bf16.
// One block per token, 8 bf16 (16 bytes) per thread: bound by reading the k pair rows.
#include <cuda_bf16.h>

#include "launch.cuh"
#include "launchers.h"

namespace epmoe::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kVector = 8;  // bf16 per 16-byte access

struct alignas(16) Bf16x8 {
  __nv_bfloat162 pairs[4];
};

__device__ void accumulate(float (&acc)[kVector], const uint16_t* row, float weight) {
  const Bf16x8 values = *reinterpret_cast<const Bf16x8*>(row);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(values.pairs[i]);
    acc[2 * i] += weight * f.x;
    acc[2 * i + 1] += weight * f.y;
  }
}

__global__ void combine_kernel(const uint16_t* pair_out, const int32_t* slot_of_pair, const float* topk_weights,
                               const int32_t* group_offsets, int shared_group, bool unit_weights, int top_k,
                               int64_t hidden, uint16_t* y) {
  allow_successor();
  wait_for_predecessor();
  const int64_t t = blockIdx.x;
  for (int64_t h = static_cast<int64_t>(threadIdx.x) * kVector; h < hidden; h += kThreads * kVector) {
    float acc[kVector] = {};
    for (int j = 0; j < top_k; ++j) {
      const int32_t slot = slot_of_pair[t * top_k + j];
      if (slot < 0) continue;
      accumulate(acc, pair_out + static_cast<int64_t>(slot) * hidden + h, unit_weights ? 1.0f : topk_weights[t * top_k + j]);
    }
    if (shared_group >= 0) accumulate(acc, pair_out + (group_offsets[shared_group] + t) * hidden + h, 1.0f);
    Bf16x8 result;
#pragma unroll
    for (int i = 0; i < 4; ++i) result.pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    *reinterpret_cast<Bf16x8*>(y + t * hidden + h) = result;
  }
}

__global__ void scale_rows_kernel(const uint16_t* x, const float* weights, int64_t hidden, uint16_t* x_scaled) {
  allow_successor();
  wait_for_predecessor();
  const int64_t t = blockIdx.x;
  const float weight = weights[t];
  for (int64_t h = static_cast<int64_t>(threadIdx.x) * kVector; h < hidden; h += kThreads * kVector) {
    const Bf16x8 values = *reinterpret_cast<const Bf16x8*>(x + t * hidden + h);
    Bf16x8 result;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(values.pairs[i]);
      result.pairs[i] = __floats2bfloat162_rn(f.x * weight, f.y * weight);
    }
    *reinterpret_cast<Bf16x8*>(x_scaled + t * hidden + h) = result;
  }
}

}  // namespace

cudaError_t launch_combine(const uint16_t* pair_out, const int32_t* slot_of_pair, const float* topk_weights,
                           const int32_t* group_offsets, int shared_group, bool unit_weights, int64_t tokens,
                           int top_k, int64_t hidden, uint16_t* y, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  static const cudaError_t carveout = prefer_max_shared_memory(reinterpret_cast<const void*>(combine_kernel));
  if (carveout != cudaSuccess) return carveout;
  return launch_chained(combine_kernel, dim3(static_cast<unsigned>(tokens)), dim3(kThreads), 0, stream, pair_out,
                        slot_of_pair, topk_weights, group_offsets, shared_group, unit_weights, top_k, hidden, y);
}

cudaError_t launch_scale_rows(const uint16_t* x, const float* topk_weights, int64_t tokens, int64_t hidden,
                              uint16_t* x_scaled, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  static const cudaError_t carveout = prefer_max_shared_memory(reinterpret_cast<const void*>(scale_rows_kernel));
  if (carveout != cudaSuccess) return carveout;
  return launch_chained(scale_rows_kernel, dim3(static_cast<unsigned>(tokens)), dim3(kThreads), 0, stream, x,
                        topk_weights, hidden, x_scaled);
}

}  // namespace epmoe::cuda
