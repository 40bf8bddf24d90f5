// FP8 (e4m3) quantisation of bf16 activations, code for code what the CPU quantiser
// produces (fp8_codes.cuh):
//   per group (fp8_block, group = block_k): a warp per kGroupsPerWarp groups of a row, held
//     in registers (one pass), or where they do not fit two passes (amax, then codes);
//   per row (fp8_channel, dynamic per token): a warp per row, two passes (amax, then codes);
//   per tensor (fp8_tensor): an amax (atomicMax on the bits of |x|, which order like the
//     floats, NaN above every number), then the codes; or a given static scale. Over rows
//     in expert groups (GEMM2's input), one amax and one scale per group.
// Rows in groups (RowGroups) may be narrower than the row stride (the shared experts' I_s
// beside the routed I), and rows past the last group hold nothing and are skipped; so are x's
// rows that no local pair reads, where the caller says which (Fp8Quantize::slot_of_pair).
// Bound by reading the values (the two-pass kernels read them twice, the second time from
// L1/L2). The kernels are chained launches (launch.cuh) like the rest of the pipeline.
#include <algorithm>
#include <utility>

#include "fp8_codes.cuh"
#include "launch.cuh"
#include "launchers.h"

namespace epmoe::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * 32;

// Where row `row` sits: its group (-1 when no RowGroups), width, and whether it holds data.
struct RowPlace {
  int group;
  int64_t width;
  bool used;
};

// (Rows a local pair reads: checked by the caller, place_of.)
__device__ RowPlace place_in_groups(const Fp8Quantize& q, int64_t row) {
  const RowGroups& g = q.row_groups;
  if (!g.offsets) return {-1, q.cols, true};
  if (row >= g.offsets[g.count]) return {0, 0, false};
  int low = 0, high = g.count - 1;  // the last group whose first row <= row
  while (low < high) {
    const int middle = (low + high + 1) / 2;
    if (g.offsets[middle] <= row)
      low = middle;
    else
      high = middle - 1;
  }
  if (row >= g.offsets[low] + g.counts[low]) return {0, 0, false};  // between the routed slots and the shared
  return {low, low == g.shared_group ? g.shared_cols : q.cols, true};
}

__device__ RowPlace place_of(const Fp8Quantize& q, int64_t row) {
  if (row >= q.rows) return {0, 0, false};  // (the last block's warps past the rows)
  if (q.slot_of_pair) {  // (every thread reads the same top_k slots: one line)
    bool read = false;
    for (int j = 0; j < q.top_k; ++j) read |= q.slot_of_pair[row * q.top_k + j] >= 0;
    if (!read) return {0, 0, false};
  }
  return place_in_groups(q, row);
}

// Per group: a warp takes kGroupsPerWarp groups of a row (a unit), and the warps of a grid
// that the GPU holds at once walk the units, a row's units on neighbouring warps. Where each
// group fits sixteen lanes at eight values apiece (groups of at most 128, widths and rows
// 8-aligned: every GPU fp8_block row) a half-warp loads its two groups at once, 16 bytes a
// lane, and quantises them from the registers; else the warp takes its groups one by one in
// two passes (quantize_span). (A warp a group with one load at a time left the kernel bound by
// latency: 329 us for deepseek-v3's x at 16k tokens, 352 MB, ~90 us of HBM. Four groups a
// warp at 8 bytes a lane: 193 us on an H100, ~60% of its copy rate; two a half-warp, with
// the division by the reciprocal: 170 us, 69%. docs/KERNELS.md, twenty-fourth and -fifth
// sessions. A block a row and 32 groups, each block's few loads between its launch and its
// exit, ran at ~200 blocks a microsecond whatever a block moved: 166 / 79 / 67 us for
// deepseek-v3 / qwen3-235b-a22b / qwen3-30b-a3b at 16k tokens on the H200, 2-4x the bytes'
// time; twenty-seventh session. On the resident grid, H100: qwen3-30b-a3b 68 -> 44 us,
// deepseek-v3 170 -> 164, about its bytes' time there; twenty-eighth session.)
constexpr int kGroupsPerHalfWarp = 2;
constexpr int kGroupsPerWarp = 2 * kGroupsPerHalfWarp;

// Fp8Quantize::zero, by the grid of the launch's first kernel, before any of its threads leaves.
__device__ void zero_counters(const Fp8Quantize& q) { zero_by_grid(q.zero, q.zero_count); }

__global__ void quantize_groups_kernel(Fp8Quantize q) {
  allow_successor();
  wait_for_predecessor();
  zero_counters(q);
  const int64_t threads = int64_t{gridDim.x} * kThreads;
  const int lane = threadIdx.x % 32;
  const int64_t scales_per_row = (q.stride + q.group - 1) / q.group;
  const int64_t units_per_row = (scales_per_row + kGroupsPerWarp - 1) / kGroupsPerWarp;
  const int64_t units = q.rows * units_per_row, warps = threads / 32;
  // Whether a local pair reads a unit's row: lane j < top_k holds pair j's slot, loaded a unit
  // ahead, so that the wait for it falls behind this unit's loads.
  auto pair_slot = [&](int64_t unit) {
    const bool held = q.slot_of_pair && unit < units && lane < q.top_k;
    return held ? q.slot_of_pair[unit / units_per_row * q.top_k + lane] : -1;
  };
  const int64_t first_unit = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32;
  int32_t slot = pair_slot(first_unit);
  for (int64_t unit = first_unit; unit < units; unit += warps) {
    const int64_t row = unit / units_per_row, first_group = unit % units_per_row * kGroupsPerWarp;
    const bool read = !q.slot_of_pair || __any_sync(0xffffffffu, slot >= 0);
    slot = pair_slot(unit + warps);
    if (!read) continue;
    const RowPlace place = place_in_groups(q, row);
    if (!place.used) continue;
    auto group_begin = [&](int j) { return row * q.stride + (first_group + j) * q.group; };
    auto group_width = [&](int j) { return min(q.group, place.width - (first_group + j) * q.group); };  // <= 0: none
    const bool held = q.group <= 128 && q.group % 8 == 0 && q.stride % 8 == 0 && place.width % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(q.values) % 16 == 0 && reinterpret_cast<uintptr_t>(q.codes) % 8 == 0;
    if (held) {
      const int half = lane / 16, half_lane = lane % 16;
      auto half_group = [&](int j) { return half * kGroupsPerHalfWarp + j; };  // of the warp's
      uint4 octets[kGroupsPerHalfWarp];
#pragma unroll
      for (int j = 0; j < kGroupsPerHalfWarp; ++j)
        octets[j] = 8 * half_lane < group_width(half_group(j))
                        ? __ldcg(reinterpret_cast<const uint4*>(q.values + group_begin(half_group(j))) + half_lane)
                        : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int j = 0; j < kGroupsPerHalfWarp; ++j) {
        // (every lane, for the shuffles; a group past the row stores nothing)
        const int g = half_group(j);
        const uint2 quads[2] = {make_uint2(octets[j].x, octets[j].y), make_uint2(octets[j].z, octets[j].w)};
        const float scale =
            quantize_held(quads, 8 * half_lane < group_width(g), nullptr, q.codes + group_begin(g), half_lane);
        if (half_lane == 0 && group_width(g) > 0) q.scales[row * scales_per_row + first_group + g] = scale;
      }
      continue;
    }
    for (int j = 0; j < kGroupsPerWarp && group_width(j) > 0; ++j) {
      const float scale = quantize_span(q.values + group_begin(j), q.codes + group_begin(j), group_width(j), lane);
      if (lane == 0) q.scales[row * scales_per_row + first_group + j] = scale;
    }
  }
}

// kRowThreads threads a row: a warp (kWarpsPerBlock rows a block), or where rows are few (decode
// sizes: a warp a row would leave most of the GPU idle, each warp's loads in turn) the whole
// block. The row's values in 8-byte loads, eight in flight a thread. (A block a row, 2-byte
// loads one at a time a thread: the median launch 122.6 us over x's and GEMM1's output's for
// qwen3-30b-a3b fp8_channel at 16k tokens on an H100, where x is 67 MB; docs/KERNELS.md,
// thirtieth session.)
template <int kRowThreads>
struct RowOfThreads {
  static_assert(kThreads % kRowThreads == 0, "whole rows a block");
  int64_t row = int64_t{blockIdx.x} * (kThreads / kRowThreads) + threadIdx.x / kRowThreads;
  int thread = static_cast<int>(threadIdx.x % kRowThreads);
};

// Per row: the scale of the row; per tensor over groups: the amax of the row into its group's.
// (Every exit is taken by all threads of a row: a block's span reduces through __syncthreads.)
template <int kRowThreads>
__global__ void quantize_rows_kernel(Fp8Quantize q) {
  allow_successor();
  wait_for_predecessor();
  zero_counters(q);
  const auto [row, thread] = RowOfThreads<kRowThreads>{};
  const RowPlace place = place_of(q, row);
  if (!place.used) return;
  const uint16_t* values = q.values + row * q.stride;
  uint8_t* codes = q.codes + row * q.stride;
  const bool quads = span_in_quads(values, codes, place.width);
  const uint32_t amax = span_amax_bits<kRowThreads>(values, place.width, quads, thread);
  if (q.granularity == Fp8Granularity::kPerTensor) {
    if (thread == 0) atomicMax(q.amax_bits + max(place.group, 0), amax);
    return;
  }
  const AmaxScale scale(amax);
  encode_span<kRowThreads>(values, codes, place.width, quads, thread, scale);
  if (thread == 0) q.scales[row] = scale.scale;
}

// Per tensor over rows (with or without groups): codes from the static scale or the amax.
template <int kRowThreads>
__global__ void tensor_codes_kernel(Fp8Quantize q) {
  allow_successor();
  wait_for_predecessor();
  if (q.static_scale) zero_counters(q);  // (else the amax kernel before it did)
  const auto [row, thread] = RowOfThreads<kRowThreads>{};
  const RowPlace place = place_of(q, row);
  if (!place.used) return;
  const int group = max(place.group, 0);
  const uint16_t* values = q.values + row * q.stride;
  uint8_t* codes = q.codes + row * q.stride;
  const bool quads = span_in_quads(values, codes, place.width);
  auto write = [&](const auto& scale) {
    encode_span<kRowThreads>(values, codes, place.width, quads, thread, scale);
    const bool first_of_group = q.row_groups.offsets ? row == q.row_groups.offsets[group] : row == 0;
    if (thread == 0 && first_of_group) q.scales[group] = scale.scale;
  };
  if (q.static_scale)
    write(StaticScale{*q.static_scale});
  else
    write(AmaxScale(q.amax_bits[group]));
}

// The row kernels' launches, a warp a row or a block a row (RowOfThreads).
template <int kRowThreads>
cudaError_t launch_row_kernels(const Fp8Quantize& q, cudaStream_t stream, Start start) {
  const dim3 blocks(static_cast<unsigned>((q.rows * kRowThreads + kThreads - 1) / kThreads));
  if (q.granularity == Fp8Granularity::kPerRow)
    return launch_kernel(start, quantize_rows_kernel<kRowThreads>, blocks, dim3(kThreads), 0, stream, q);
  if (q.static_scale)
    return launch_kernel(start, tensor_codes_kernel<kRowThreads>, blocks, dim3(kThreads), 0, stream, q);
  const int groups = q.row_groups.offsets ? q.row_groups.count : 1;
  if (const cudaError_t e = cudaMemsetAsync(q.amax_bits, 0, groups * sizeof(uint32_t), stream); e != cudaSuccess)
    return e;
  if (const cudaError_t e =
          launch_kernel(start, quantize_rows_kernel<kRowThreads>, blocks, dim3(kThreads), 0, stream, q);
      e != cudaSuccess)
    return e;
  return launch_chained(tensor_codes_kernel<kRowThreads>, blocks, dim3(kThreads), 0, stream, q);
}

}  // namespace

cudaError_t launch_quantize_fp8(const Fp8Quantize& q, cudaStream_t stream, Start start) {
  // Rows left alone would change a per-tensor amax; row groups have no tokens.
  if (q.slot_of_pair &&
      (q.granularity == Fp8Granularity::kPerTensor || q.top_k < 1 || q.top_k > kMaxTopK || q.row_groups.offsets))
    return cudaErrorInvalidValue;
  if (q.rows == 0) return cudaSuccess;
  static const cudaError_t carveout =
      prefer_max_shared_memory(quantize_groups_kernel, quantize_rows_kernel<32>, tensor_codes_kernel<32>,
                               quantize_rows_kernel<kThreads>, tensor_codes_kernel<kThreads>);
  if (carveout != cudaSuccess) return carveout;
  switch (q.granularity) {
    case Fp8Granularity::kPerGroup: {
      // As many blocks as the GPU holds at once, at most a warp a unit.
      static const std::pair<cudaError_t, int64_t> resident = resident_ctas(quantize_groups_kernel, kThreads, 0, 1);
      if (resident.first != cudaSuccess) return resident.first;
      const int64_t units_per_row = ((q.stride + q.group - 1) / q.group + kGroupsPerWarp - 1) / kGroupsPerWarp;
      const int64_t units = q.rows * units_per_row;
      const int64_t blocks = std::clamp<int64_t>((units + kWarpsPerBlock - 1) / kWarpsPerBlock, 1, resident.second);
      return launch_kernel(start, quantize_groups_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
                           stream, q);
    }
    case Fp8Granularity::kPerRow:
    case Fp8Granularity::kPerTensor:
      // A block a row where a warp a row would give the GPU fewer than 32 warps an SM.
      return q.rows < int64_t{32} * multiprocessor_count() ? launch_row_kernels<kThreads>(q, stream, start)
                                                           : launch_row_kernels<32>(q, stream, start);
  }
  return cudaErrorInvalidValue;
}

}  // namespace epmoe::cuda
