// Combine: y[t] = sum_j w_tj * out[slot(t, j)] over j = 0..k-1 in order, then + the shared
// experts' row, in f32, rounded once to bf16. No atomics: each output element is written by
// one thread in a fixed order, so runs are bitwise identical. Also the row scaling of the
// router weight on the input (Llama-4), x * w rounded to bf16.
// A block takes tokens_per_block consecutive tokens x 1024 columns, 8 bf16 (16 bytes) per
// thread. It first lists the rows its tokens add, in order: each token's local pairs in j
// order, then the token's closing entry (its shared experts' row, or nothing), after which
// the token's sum is stored. Threads then walk the list kBatch entries at a time, a batch's
// loads all issued before its sums. Bound by reading the pair rows: at ep=8 a token has one
// or two local rows, and a block of one token (as before) kept one or two loads in flight a
// thread, after two dependent latencies (its slots, then its rows); several tokens a block
// keep a batch in flight. (One block per token looping over H took 25 us for 64 tokens of
// deepseek-v3: k dependent loads per 1024 columns, on half the SMs.)
#include <cuda_bf16.h>

#include <algorithm>

#include "launch.cuh"
#include "launchers.h"

namespace epmoe::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kVector = 8;  // bf16 per 16-byte access
constexpr int kColumnsPerBlock = kThreads * kVector;
constexpr int kBatch = 8;  // entries whose rows a thread loads before adding them up
constexpr int kMaxEntries = kMaxCombineTokensPerBlock * (kMaxTopK + 1);
constexpr uint8_t kCloses = 1;  // the token's last entry: store its sum after it
constexpr uint8_t kWhole = 2;   // a bf16 row even when GEMM2 split K (the shared experts' own tile list)

struct alignas(16) Bf16x8 {
  __nv_bfloat162 pairs[4];
};

__device__ void to_floats(float (&values)[kVector], uint4 bits) {
  const Bf16x8 row = *reinterpret_cast<const Bf16x8*>(&bits);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(row.pairs[i]);
    values[2 * i] = f.x;
    values[2 * i + 1] = f.y;
  }
}

// After a split-K GEMM2: the sum of a row's k_splits f32 partial rows in split order, rounded
// to bf16 as the whole row would have been.
__device__ void add_up_partials(float (&values)[kVector], const PairOutputs& out, int64_t slot, int64_t hidden,
                                int64_t h) {
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

// The rows a block's tokens add (above), in shared memory.
struct Entries {
  int32_t slot[kMaxEntries];  // -1: nothing to add
  float weight[kMaxEntries];
  uint8_t flags[kMaxEntries];
  int32_t warp_listed[kThreads / 32];
};

// Lists the entries of tokens [first_token, first_token + block_tokens); returns their count.
// Item i is choice i % (k + 1) of token i / (k + 1), choice k its closing entry; the listed
// ones keep that order (a warp ballot and the earlier warps' counts place each).
__device__ int list_entries(Entries& list, const CombineArgs& a, int64_t first_token, int block_tokens) {
  const int items = block_tokens * (a.top_k + 1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int count = 0;
  for (int first = 0; first < items; first += kThreads) {
    const int i = first + threadIdx.x;
    int32_t slot = -1;
    float weight = 1.0f;
    uint8_t flags = 0;
    bool listed = false;
    if (i < items) {
      const int choice = i % (a.top_k + 1);
      const int64_t t = first_token + i / (a.top_k + 1);
      if (choice < a.top_k) {
        slot = a.slot_of_pair[t * a.top_k + choice];
        if (!a.unit_weights) weight = a.topk_weights[t * a.top_k + choice];
        listed = slot >= 0;
      } else {
        slot = a.shared_group >= 0 ? a.group_offsets[a.shared_group] + static_cast<int32_t>(t) : -1;
        flags = kCloses | (a.pair_out.shared_rows_whole ? kWhole : 0);
        listed = true;
      }
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, listed);
    if (lane == 0) list.warp_listed[warp] = __popc(ballot);
    __syncthreads();
    int position = count + __popc(ballot & ((1u << lane) - 1u)), total = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      position += w < warp ? list.warp_listed[w] : 0;
      total += list.warp_listed[w];
    }
    if (listed) {
      list.slot[position] = slot;
      list.weight[position] = weight;
      list.flags[position] = flags;
    }
    count += total;
    __syncthreads();  // the list complete, warp_listed free for the next round
  }
  return count;
}

__global__ void __launch_bounds__(kThreads) combine_kernel(CombineArgs a) {
  __shared__ Entries list;
  allow_successor();
  wait_for_predecessor();
  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * a.tokens_per_block;
  const int count =
      list_entries(list, a, first_token, static_cast<int>(min(int64_t{a.tokens_per_block}, a.tokens - first_token)));
  const int64_t h = static_cast<int64_t>(blockIdx.y) * kColumnsPerBlock + threadIdx.x * kVector;
  if (h >= a.hidden) return;
  const PairOutputs& out = a.pair_out;
  auto whole = [&](int e) { return out.k_splits == 1 || (list.flags[e] & kWhole); };
  float acc[kVector] = {};
  int64_t t = first_token;
  for (int first = 0; first < count; first += kBatch) {
    uint4 rows[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int e = first + i;
      const bool load = e < count && list.slot[e] >= 0 && whole(e);
      rows[i] = load ? __ldg(reinterpret_cast<const uint4*>(out.rows + list.slot[e] * a.hidden + h)) : uint4{};
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int e = first + i;
      if (e >= count) break;
      if (list.slot[e] >= 0) {
        float values[kVector];
        if (whole(e)) {
          to_floats(values, rows[i]);
        } else {
          add_up_partials(values, out, list.slot[e], a.hidden, h);
        }
#pragma unroll
        for (int v = 0; v < kVector; ++v) acc[v] += list.weight[e] * values[v];
      }
      if (list.flags[e] & kCloses) {
        Bf16x8 result;
#pragma unroll
        for (int v = 0; v < 4; ++v) result.pairs[v] = __floats2bfloat162_rn(acc[2 * v], acc[2 * v + 1]);
        *reinterpret_cast<Bf16x8*>(a.y + t * a.hidden + h) = result;
#pragma unroll
        for (int v = 0; v < kVector; ++v) acc[v] = 0.0f;
        ++t;
      }
    }
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

int combine_tokens_per_block(int64_t tokens, int64_t hidden) {
  // Several tokens a block only where their blocks still fill every SM several times over
  // (8 blocks an SM); decode sizes keep a block a token, the shortest chain.
  const int64_t column_blocks = (hidden + kColumnsPerBlock - 1) / kColumnsPerBlock;
  return static_cast<int>(
      std::clamp<int64_t>(tokens * column_blocks / (8 * multiprocessor_count()), 1, kMaxCombineTokensPerBlock));
}

cudaError_t launch_combine(const CombineArgs& args, cudaStream_t stream) {
  if (args.tokens == 0) return cudaSuccess;
  if (args.tokens_per_block < 1 || args.tokens_per_block > kMaxCombineTokensPerBlock) return cudaErrorInvalidValue;
  static const cudaError_t carveout = prefer_max_shared_memory(combine_kernel);
  if (carveout != cudaSuccess) return carveout;
  const dim3 grid(static_cast<unsigned>((args.tokens + args.tokens_per_block - 1) / args.tokens_per_block),
                  static_cast<unsigned>((args.hidden + kColumnsPerBlock - 1) / kColumnsPerBlock));
  return launch_chained(combine_kernel, grid, dim3(kThreads), 0, stream, args);
}

cudaError_t launch_scale_rows(const uint16_t* x, const float* topk_weights, int64_t tokens, int64_t hidden,
                              uint16_t* x_scaled, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  static const cudaError_t carveout = prefer_max_shared_memory(scale_rows_kernel);
  if (carveout != cudaSuccess) return carveout;
  return launch_chained(scale_rows_kernel, dim3(static_cast<unsigned>(tokens)), dim3(kThreads), 0, stream, x,
                        topk_weights, hidden, x_scaled);
}

}  // namespace epmoe::cuda
