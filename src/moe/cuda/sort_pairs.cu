// Map and sort: pairs (token, j) -> local expert through expert_map -> slots grouped by
// expert, plus the row-tile schedule of the GEMMs. One block does all of it:
//   1. count: each pair's group (ids outside [0, E) and experts mapped to -1 get none),
//      counted with shared-memory atomics;
//   2. scan: group offsets, and each group's ceil(count / tile_rows) row tiles (TilePlan:
//      the shared group's in a list of its own when its tiles are taller);
//   3. place: each pair takes the next slot of its group (a shared-memory cursor);
// and it zeroes the arrival counters of GEMM1's fused quantisation.
// The order of slots inside a group depends on the atomics, but nothing downstream depends
// on it: a GEMM row's result does not depend on which rows share its tile, and the combine
// reads each pair's slot in the fixed order j = 0..k-1, so the output is bitwise the same.
// The shared experts, when present, are the last group: slot offset + t for token t.
// One block reads the T*k ids twice: ~3 us at decode, ~100 us at 16k tokens before the
// loads were batched (for_each_pair); one launch instead of four keeps the decode chain short.
#include <algorithm>

#include "launch.cuh"
#include "launchers.h"

namespace epmoe::cuda {

namespace {

constexpr int kThreads = 1024;

__device__ int local_group(int32_t id, const int32_t* expert_map, int num_experts) {
  if (id < 0 || id >= num_experts) return -1;
  return expert_map ? expert_map[id] : id;
}

// Calls visit(p, group of pair p) for this thread's pairs. Each thread loads kBatch ids (and
// then their map entries) before it visits any: one block walks all T k pairs, so the loads'
// latency, not bandwidth, bounds it (a load at a time: ~100 us for 131k pairs).
constexpr int kBatch = 8;
template <typename Visit>
__device__ void for_each_pair(const int32_t* topk_ids, const int32_t* expert_map, int64_t pairs, int num_experts,
                              Visit visit) {
  for (int64_t base = threadIdx.x; base < pairs; base += int64_t{kThreads} * kBatch) {
    int32_t ids[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) ids[i] = base + i * kThreads < pairs ? topk_ids[base + i * kThreads] : -1;
    int groups[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) groups[i] = local_group(ids[i], expert_map, num_experts);
#pragma unroll
    for (int i = 0; i < kBatch; ++i)
      if (base + i * kThreads < pairs) visit(base + i * kThreads, groups[i]);
  }
}

__global__ void __launch_bounds__(kThreads)
    sort_pairs_kernel(const int32_t* topk_ids, const int32_t* expert_map, int64_t pairs, int top_k, int num_experts,
                      int64_t tokens, int groups, int shared_group, TilePlan plan, PairLayout layout) {
  extern __shared__ int32_t counters[];  // [groups] counts, then cursors; [groups] first tiles, [groups] ends
  int32_t* cursor = counters;
  int32_t* tile_first = counters + groups;
  int32_t* tile_end = tile_first + groups;
  const bool shared_apart = shared_group >= 0 && plan.shared_tile_rows > 0;
  allow_successor();
  for (int g = threadIdx.x; g < groups; g += kThreads) cursor[g] = 0;
  __syncthreads();
  wait_for_predecessor();
  // After the wait: the previous call's GEMM1 has finished with the counters.
  for (int64_t i = threadIdx.x; i < layout.arrival_count; i += kThreads) layout.arrivals[i] = 0;
  for_each_pair(topk_ids, expert_map, pairs, num_experts, [&](int64_t, int group) {
    if (group >= 0) atomicAdd(&cursor[group], 1);
  });
  if (threadIdx.x == 0 && shared_group >= 0) cursor[shared_group] = static_cast<int32_t>(tokens);
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t slot = 0, tile = 0;
    for (int g = 0; g < groups; ++g) {
      const int32_t count = cursor[g];
      const bool apart = shared_apart && g == shared_group;
      const int rows = apart ? plan.shared_tile_rows : plan.tile_rows;
      const int32_t first = apart ? static_cast<int32_t>(plan.max_tiles) : tile;
      const int32_t capacity = apart ? static_cast<int32_t>(plan.max_tiles + plan.shared_tiles)
                                     : static_cast<int32_t>(plan.max_tiles);
      layout.group_counts[g] = count;
      layout.group_offsets[g] = slot;
      tile_first[g] = first;
      tile_end[g] = min(first + (count + rows - 1) / rows, capacity);  // the plan's bounds make min a no-op
      if (!apart) tile = tile_end[g];
      cursor[g] = slot;  // from here on: the next free slot of group g
      slot += count;
    }
    layout.group_offsets[groups] = slot;
    layout.tile_count[0] = tile;
    layout.tile_count[1] = shared_apart ? tile_end[shared_group] - tile_first[shared_group] : 0;
  }
  __syncthreads();
  for (int g = threadIdx.x; g < groups; g += kThreads) {
    const int32_t first_slot = cursor[g];
    const int rows = shared_apart && g == shared_group ? plan.shared_tile_rows : plan.tile_rows;
    for (int32_t tile = tile_first[g], row = 0; tile < tile_end[g]; ++tile, row += rows) {
      layout.tile_group[tile] = g;
      layout.tile_row[tile] = first_slot + row;
    }
  }
  if (shared_group >= 0)
    for (int64_t t = threadIdx.x; t < tokens; t += kThreads)
      layout.slot_token[cursor[shared_group] + t] = static_cast<int32_t>(t);
  for_each_pair(topk_ids, expert_map, pairs, num_experts, [&](int64_t p, int group) {
    int32_t slot = -1;
    if (group >= 0) {
      slot = atomicAdd(&cursor[group], 1);
      layout.slot_token[slot] = static_cast<int32_t>(p / top_k);
    }
    layout.slot_of_pair[p] = slot;
  });
}

}  // namespace

int64_t max_row_tiles(int64_t slots, int64_t groups, int tile_rows) {
  // Every tile holds at least one slot, and at most one tile per group is partial.
  return std::max<int64_t>(1, std::min(slots, slots / tile_rows + groups));
}

PairLayout shared_tile_list(const PairLayout& layout, const TilePlan& plan, int64_t arrival_scopes) {
  PairLayout view = layout;
  view.tile_group += plan.max_tiles;
  view.tile_row += plan.max_tiles;
  view.tile_count += 1;
  if (view.arrivals) view.arrivals += plan.max_tiles * arrival_scopes;
  return view;
}

cudaError_t launch_sort_pairs(const int32_t* topk_ids, const int32_t* expert_map, int64_t tokens, int top_k,
                              int num_experts, int local_experts, bool shared_group, const TilePlan& plan,
                              const PairLayout& layout, cudaStream_t stream, Start start) {
  static const cudaError_t carveout = prefer_max_shared_memory(reinterpret_cast<const void*>(sort_pairs_kernel));
  if (carveout != cudaSuccess) return carveout;
  const int groups = local_experts + (shared_group ? 1 : 0);
  const size_t shared_bytes = 3 * static_cast<size_t>(groups) * sizeof(int32_t);
  return launch_kernel(start, sort_pairs_kernel, dim3(1), dim3(kThreads), shared_bytes, stream, topk_ids, expert_map,
                        tokens * top_k, top_k, num_experts, tokens, groups, shared_group ? local_experts : -1, plan,
                        layout);
}

}  // namespace epmoe::cuda
