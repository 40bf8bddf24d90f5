// Combine: y[t] = sum_j w_tj * out[slot(t, j)] over j = 0..k-1 in order, then + the shared
// experts' row, in f32, rounded once to bf16. No atomics: each output element is written by
// one thread in a fixed order, so runs are bitwise identical. Also the row scaling of the
// router weight on the input (Llama-4), x * w rounded to bf16.
// A block per (token, 1024 columns), 8 bf16 (16 bytes) per thread: the token's slots and
// weights are read once into shared memory, and a thread's k row loads are all issued before
// it adds them up (in j order), so it waits about one memory latency, not k of them. Bound by
// reading the k pair rows. (One block per token, looping over H, took 25 us for 64 tokens of
// deepseek-v3: k dependent loads per 1024 columns, on half the SMs.)
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

// acc += weight * (8 values of a pair's output row starting at column h).
// `whole`: the row is bf16 even when GEMM2 split K (the shared experts' own tile list).
__device__ void accumulate(float (&acc)[kVector], const PairOutputs& out, int64_t slot, int64_t hidden, int64_t h,
                           float weight, bool whole = false) {
  float values[kVector];
  if (out.k_splits == 1 || whole) {
    const uint4 bits = __ldg(reinterpret_cast<const uint4*>(out.rows + slot * hidden + h));
    const Bf16x8 row = *reinterpret_cast<const Bf16x8*>(&bits);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(row.pairs[i]);
      values[2 * i] = f.x;
      values[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kVector; ++i) values[i] = 0.0f;
    for (int split = 0; split < out.k_splits; ++split) {
      const float4* partial = reinterpret_cast<const float4*>(out.partials + split * out.partial_stride + slot * hidden + h);
      const float4 first = partial[0], second = partial[1];
      values[0] += first.x, values[1] += first.y, values[2] += first.z, values[3] += first.w;
      values[4] += second.x, values[5] += second.y, values[6] += second.z, values[7] += second.w;
    }
#pragma unroll
    for (int i = 0; i < kVector; ++i) values[i] = __bfloat162float(__float2bfloat16_rn(values[i]));
  }
#pragma unroll
  for (int i = 0; i < kVector; ++i) acc[i] += weight * values[i];
}

__global__ void __launch_bounds__(kThreads) combine_kernel(PairOutputs pair_out, const int32_t* slot_of_pair,
                                                           const float* topk_weights, const int32_t* group_offsets,
                                                           int shared_group, bool unit_weights, int top_k,
                                                           int64_t hidden, uint16_t* y) {
  __shared__ int32_t slots[kMaxTopK];
  __shared__ float weights[kMaxTopK];
  allow_successor();
  wait_for_predecessor();
  const int64_t t = blockIdx.x;
  if (threadIdx.x < top_k) {
    slots[threadIdx.x] = slot_of_pair[t * top_k + threadIdx.x];
    weights[threadIdx.x] = unit_weights ? 1.0f : topk_weights[t * top_k + threadIdx.x];
  }
  __syncthreads();
  const int64_t h = (static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x) * kVector;
  if (h >= hidden) return;
  float acc[kVector] = {};
#pragma unroll 8
  for (int j = 0; j < top_k; ++j)
    if (slots[j] >= 0) accumulate(acc, pair_out, slots[j], hidden, h, weights[j]);
  if (shared_group >= 0)
    accumulate(acc, pair_out, group_offsets[shared_group] + t, hidden, h, 1.0f, pair_out.shared_rows_whole);
  Bf16x8 result;
#pragma unroll
  for (int i = 0; i < 4; ++i) result.pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  *reinterpret_cast<Bf16x8*>(y + t * hidden + h) = result;
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

cudaError_t launch_combine(const PairOutputs& pair_out, const int32_t* slot_of_pair, const float* topk_weights,
                           const int32_t* group_offsets, int shared_group, bool unit_weights, int64_t tokens,
                           int top_k, int64_t hidden, uint16_t* y, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  static const cudaError_t carveout = prefer_max_shared_memory(reinterpret_cast<const void*>(combine_kernel));
  if (carveout != cudaSuccess) return carveout;
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>((hidden + kThreads * kVector - 1) / (kThreads * kVector)));
  return launch_chained(combine_kernel, grid, dim3(kThreads), 0, stream, pair_out, slot_of_pair, topk_weights,
                        group_offsets, shared_group, unit_weights, top_k, hidden, y);
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
