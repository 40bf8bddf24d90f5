// Map and sort: pairs (token, j) -> local expert through expert_map -> slots grouped by
// expert, plus the row-tile schedule of the GEMMs, in three phases:
//   1. count: each pair's group (ids outside [0, E) and experts mapped to -1 get none),
//      counted per block with shared-memory atomics, which give each pair its rank among
//      the block's pairs of its group (kept in registers on one block; on several, parked
//      in slot_of_pair for the second launch);
//   2. scan: group totals and offsets, and each group's ceil(count / tile_rows) row tiles
//      (TilePlan: the shared group's in a list of its own when its tiles are taller);
//   3. place: a pair's slot = its group's offset + the group's pairs in earlier blocks +
//      its rank.
// Up to kPairsInOneSortBlock pairs (decode and T k <= 8192) one block does all three in one
// launch, which keeps the decode chain short; more pairs take one block per kPairsPerSortBlock
// (2048: a quarter of the one block's pairs, so four times the blocks on the loads), in two
// launches: count_pairs_kernel (phase 1, block counts into PairLayout::block_counts)
// and sort_pairs_kernel (phases 2 and 3; every block scans the block counts itself). One
// block walking all 131k pairs of 16k tokens took 66-74 us, latency-bound.
// The first launch also zeroes the arrival counters of GEMM1's fused quantisation.
// The order of slots inside a group depends on the atomics, but nothing downstream depends
// on it: a GEMM row's result does not depend on which rows share its tile, and the combine
// reads each pair's slot in the fixed order j = 0..k-1, so the output is bitwise the same.
// The shared experts, when present, are the last group, at a place that does not depend on
// the routing: slots [pairs, pairs + T) (slot pairs + t for token t, after the routed
// groups' slots and the unused ones) and, in the main list, its first ceil(T / tile_rows)
// tiles, so GEMM1 can start them before this kernel ends (grouped_gemm.cu).
#include <algorithm>
#include <limits>

#include "launch.cuh"
#include "launchers.h"

namespace epmoe::cuda {

namespace {

constexpr int kThreads = 1024;
// Pairs a thread loads before it visits any: the one-block launch's, and each block's where
// several share the pairs (smaller blocks: more SMs on the loads' latency).
constexpr int kOneBlockBatch = kPairsInOneSortBlock / kThreads, kManyBlocksBatch = kPairsPerSortBlock / kThreads;
static_assert(kOneBlockBatch * kThreads == kPairsInOneSortBlock && kManyBlocksBatch * kThreads == kPairsPerSortBlock);

struct SortArgs {
  const int32_t* topk_ids;
  const int32_t* expert_map;
  int64_t pairs, tokens;
  int top_k, num_experts;
  int groups, shared_group;  // shared_group: the shared experts' group, or -1
  TilePlan plan;
  PairLayout layout;
};

// This thread's pairs of its block's chunk (pair first + i kThreads for i < kBatch, first =
// the block's first pair + threadIdx.x): their groups, and their ranks among the block's
// pairs of the same group (-1 for no group or past the pairs).
template <int kBatch>
struct ThreadPairs {
  int group[kBatch];
  int32_t rank[kBatch];
};

template <int kBatch>
__device__ int64_t pair_index(int i) { return (int64_t{blockIdx.x} * kBatch + i) * kThreads + threadIdx.x; }

// The groups of this thread's pairs, through the block's copy of the expert map. All ids
// are loaded before any is mapped: the loads' latency, not bandwidth, bounds a block.
template <int kBatch>
__device__ void load_groups(const SortArgs& a, const int32_t* map, ThreadPairs<kBatch>& mine) {
  int32_t ids[kBatch];
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {
    const int64_t p = pair_index<kBatch>(i);
    ids[i] = p < a.pairs ? a.topk_ids[p] : -1;
  }
#pragma unroll
  for (int i = 0; i < kBatch; ++i) mine.group[i] = local_group(ids[i], map, a.num_experts);
}

// Phase 1 for this block's pairs into `counts` (zeroed shared memory), after the
// predecessor; the grid also zeroes the arrival counters.
template <int kBatch>
__device__ ThreadPairs<kBatch> count_block_pairs(const SortArgs& a, const int32_t* map, int32_t* counts) {
  zero_by_grid(a.layout.arrivals, a.layout.arrival_count);  // after the wait: the previous call's GEMM1 is done
  ThreadPairs<kBatch> mine;
  load_groups(a, map, mine);
#pragma unroll
  for (int i = 0; i < kBatch; ++i) mine.rank[i] = mine.group[i] >= 0 ? atomicAdd(&counts[mine.group[i]], 1) : -1;
  return mine;
}

// Phases 2 and 3. `totals` holds each routed group's pairs (the shared group takes T) and
// `before` each group's pairs in earlier blocks, in shared memory, as is `scratch` (3 x
// groups). Block 0 writes the counts, offsets and tile lists.
template <int kBatch>
__device__ void schedule_and_place(const SortArgs& a, const ThreadPairs<kBatch>& mine, const int32_t* totals,
                                   const int32_t* before, int32_t* scratch) {
  const PairLayout& layout = a.layout;
  const TilePlan& plan = a.plan;
  int32_t* base = scratch;  // the first slot of each group, then of this block's pairs of it
  int32_t* tile_first = scratch + a.groups;
  int32_t* tile_end = tile_first + a.groups;
  const bool shared_apart = a.shared_group >= 0 && plan.shared_tile_rows > 0;
  const bool writes_schedule = blockIdx.x == 0;
  auto apart = [&](int g) { return shared_apart && g == a.shared_group; };  // on the shared group's own list
  auto tile_rows_of = [&](int g) { return apart(g) ? plan.shared_tile_rows : plan.tile_rows; };
  // Each group's first slot and first row tile, by warp 0: lane l takes a run of
  // ceil(groups / 32) consecutive groups and sums its routed groups' (pairs << 32 | row
  // tiles); a warp scan of the runs' sums gives each run its start. (Thread 0 walking all
  // groups made ep=1 T=1 6-20% slower, docs/KERNELS.md.) The shared group's slots follow all
  // routed pairs; its tiles lead the main list or fill a list of their own.
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, per_lane = (a.groups + 31) / 32;
    const int first_group = min(lane * per_lane, a.groups), end_group = min(first_group + per_lane, a.groups);
    auto packed = [&](int g) -> uint64_t {
      if (g == a.shared_group) return 0;
      const int32_t count = totals[g];
      return uint64_t(count) << 32 | uint32_t((count + plan.tile_rows - 1) / plan.tile_rows);
    };
    uint64_t run = 0;
    for (int g = first_group; g < end_group; ++g) run += packed(g);
    uint64_t prefix = run;  // inclusive over the runs, then exclusive
    for (int offset = 1; offset < 32; offset *= 2) {
      const uint64_t earlier = __shfl_up_sync(0xffffffffu, prefix, offset);
      if (lane >= offset) prefix += earlier;
    }
    const uint64_t all_routed = __shfl_sync(0xffffffffu, prefix, 31);
    prefix -= run;
    const auto main_first = static_cast<int32_t>(a.shared_group >= 0 ? plan.shared_main_tiles : 0);
    for (int g = first_group; g < end_group; ++g) {
      const bool shared = g == a.shared_group;
      const int32_t count = shared ? static_cast<int32_t>(a.tokens) : totals[g];
      const int32_t first = apart(g) ? static_cast<int32_t>(plan.max_tiles)
                            : shared ? 0
                                     : main_first + static_cast<int32_t>(prefix & 0xffffffffu);
      const int32_t capacity = static_cast<int32_t>(apart(g) ? plan.max_tiles + plan.shared_tiles : plan.max_tiles);
      tile_first[g] = first;
      // (The plan's bounds make min a no-op.)
      tile_end[g] = min(first + (count + tile_rows_of(g) - 1) / tile_rows_of(g), capacity);
      base[g] = shared ? static_cast<int32_t>(a.pairs) : static_cast<int32_t>(prefix >> 32);
      if (writes_schedule) layout.group_counts[g] = count, layout.group_offsets[g] = base[g];
      prefix += packed(g);
    }
    if (writes_schedule && lane == 0) {
      const auto routed_slots = static_cast<int32_t>(all_routed >> 32);
      layout.group_offsets[a.groups] = a.shared_group >= 0 ? static_cast<int32_t>(a.pairs + a.tokens) : routed_slots;
      layout.tile_count[0] =
          min(main_first + static_cast<int32_t>(all_routed & 0xffffffffu), static_cast<int32_t>(plan.max_tiles));
      layout.tile_count[1] =
          shared_apart ? min(static_cast<int32_t>((a.tokens + plan.shared_tile_rows - 1) / plan.shared_tile_rows),
                             static_cast<int32_t>(plan.shared_tiles))
                       : 0;
    }
  }
  __syncthreads();
  if (writes_schedule)
    for (int g = threadIdx.x; g < a.groups; g += kThreads) {
      const int rows = tile_rows_of(g);
      for (int32_t tile = tile_first[g], row = 0; tile < tile_end[g]; ++tile, row += rows) {
        layout.tile_group[tile] = g;
        layout.tile_row[tile] = base[g] + row;
      }
    }
  if (a.shared_group >= 0) {  // this block's share of the shared group's tokens
    const int64_t per_block = (a.tokens + gridDim.x - 1) / gridDim.x;
    const int64_t end = min(a.tokens, (blockIdx.x + 1) * per_block);
    for (int64_t t = blockIdx.x * per_block + threadIdx.x; t < end; t += kThreads)
      layout.slot_token[base[a.shared_group] + t] = static_cast<int32_t>(t);
  }
  __syncthreads();
  for (int g = threadIdx.x; g < a.groups; g += kThreads) base[g] += before[g];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {
    const int64_t p = pair_index<kBatch>(i);
    if (p >= a.pairs) break;
    const int group = mine.group[i];
    const int32_t slot = group >= 0 ? base[group] + mine.rank[i] : -1;
    layout.slot_of_pair[p] = slot;
    if (group >= 0) layout.slot_token[slot] = static_cast<int32_t>(p / a.top_k);
  }
}

// Zeroes `count` ints of shared memory and copies the expert map into `map` (returned; null
// for the identity), then waits for the predecessor. The map is the operator's input, complete
// before its first kernel started (which waited for everything before the call): read before
// the wait, it takes a dependent global load off each pair's way to its group.
__device__ const int32_t* start(int32_t* shared, int count, const SortArgs& a, int32_t* map) {
  allow_successor();
  for (int i = threadIdx.x; i < count; i += kThreads) shared[i] = 0;
  if (a.expert_map)
    for (int e = threadIdx.x; e < a.num_experts; e += kThreads) map[e] = a.expert_map[e];
  __syncthreads();
  wait_for_predecessor();
  return a.expert_map ? map : nullptr;
}

// Phase 1 on several blocks: block b's counts to block_counts[b, groups].
__global__ void __launch_bounds__(kThreads, 1) count_pairs_kernel(SortArgs a) {
  constexpr int kBatch = kManyBlocksBatch;
  extern __shared__ int32_t counts[];  // [groups], then the expert map [num_experts]
  const int32_t* map = start(counts, a.groups, a, counts + a.groups);
  const ThreadPairs<kBatch> mine = count_block_pairs<kBatch>(a, map, counts);
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {  // the ranks wait in slot_of_pair for sort_pairs_kernel
    const int64_t p = pair_index<kBatch>(i);
    if (p < a.pairs) a.layout.slot_of_pair[p] = mine.rank[i];
  }
  __syncthreads();
  for (int g = threadIdx.x; g < a.groups; g += kThreads) a.layout.block_counts[blockIdx.x * a.groups + g] = counts[g];
}

// Phases 2 and 3 (and phase 1, on one block: block_counts null, kBatch kOneBlockBatch).
template <int kBatch>
__global__ void __launch_bounds__(kThreads, 1) sort_pairs_kernel(SortArgs a) {
  // totals, before, schedule_and_place's scratch: [groups] each, then the expert map
  extern __shared__ int32_t memory[];
  int32_t* totals = memory;
  int32_t* before = memory + a.groups;
  const int32_t* map = start(memory, 2 * a.groups, a, memory + 5 * a.groups);
  ThreadPairs<kBatch> mine;
  if (a.layout.block_counts == nullptr) {
    mine = count_block_pairs<kBatch>(a, map, totals);
  } else {
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t p = pair_index<kBatch>(i);
      mine.rank[i] = p < a.pairs ? a.layout.slot_of_pair[p] : -1;
    }
    load_groups(a, map, mine);
    for (int g = threadIdx.x; g < a.groups; g += kThreads)
      for (int b = 0; b < static_cast<int>(gridDim.x); ++b) {
        const int32_t count = a.layout.block_counts[b * a.groups + g];
        totals[g] += count;
        if (b < static_cast<int>(blockIdx.x)) before[g] += count;
      }
  }
  __syncthreads();
  schedule_and_place(a, mine, totals, before, memory + 2 * a.groups);
}

}  // namespace
int64_t max_row_tiles(int64_t slots, int64_t groups, int tile_rows) {
  // Every tile holds at least one slot, and at most one tile per group is partial.
  return std::max<int64_t>(1, std::min(slots, slots / tile_rows + groups));
}

int64_t sort_blocks(int64_t pairs) {
  return pairs <= kPairsInOneSortBlock ? 1 : (pairs + kPairsPerSortBlock - 1) / kPairsPerSortBlock;
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
  static const cudaError_t carveout = prefer_max_shared_memory(count_pairs_kernel, sort_pairs_kernel<kOneBlockBatch>,
                                                               sort_pairs_kernel<kManyBlocksBatch>);
  if (carveout != cudaSuccess) return carveout;
  const int groups = local_experts + (shared_group ? 1 : 0);
  SortArgs args{topk_ids, expert_map, tokens * top_k, tokens, top_k, num_experts,
                groups,   shared_group ? local_experts : -1, plan, layout};
  const int64_t blocks = sort_blocks(args.pairs);
  if (blocks > std::numeric_limits<int32_t>::max()) return cudaErrorInvalidConfiguration;
  const size_t group_bytes = static_cast<size_t>(groups) * sizeof(int32_t);
  const size_t map_bytes = expert_map ? static_cast<size_t>(num_experts) * sizeof(int32_t) : 0;
  if (blocks == 1) {
    args.layout.block_counts = nullptr;
    return launch_kernel(start, sort_pairs_kernel<kOneBlockBatch>, dim3(1), dim3(kThreads), 5 * group_bytes + map_bytes,
                         stream, args);
  }
  if (layout.block_counts == nullptr) return cudaErrorInvalidValue;  // the workspace holds them (sort_blocks)
  const dim3 grid(static_cast<unsigned>(blocks));
  if (const cudaError_t e = launch_kernel(start, count_pairs_kernel, grid, dim3(kThreads), group_bytes + map_bytes, stream, args);
      e != cudaSuccess)
    return e;
  return launch_chained(sort_pairs_kernel<kManyBlocksBatch>, grid, dim3(kThreads), 5 * group_bytes + map_bytes, stream,
                        args);
}

}  // namespace epmoe::cuda
