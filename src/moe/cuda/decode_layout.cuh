// The pair layout of a decode step of a few tokens (launchers.h, routes_in_gemm1), made in
// shared memory by each CTA of the decode GEMM1 that routes for itself
// (GemmGroups::self_routing): the same layout sort_pairs makes (launchers.h, PairLayout),
// but with slots in a fixed order, since every CTA builds it on its own and all must agree:
// groups in ascending order, a group's pairs in pair order (token, then choice), the shared
// group at slots [T k, T k + T) and first in the tile list. A decode CTA has one thread per
// pair (at most kMaxSelfRoutedPairs), and with so few pairs each thread counts what it needs
// over all of them instead of a scan.
//
// The steps are functions of the pair index, so that the host can run them too
// (tests/test_decode_layout.cu); the kernel separates them by barriers.
#pragma once

#include <cstdint>

#include "launchers.h"
#include "route_token.cuh"

namespace epmoe::cuda {

// Experts, groups, slots and tiles all count below 2^15 (kMaxRoutedExperts, kMaxSelfRoutedPairs):
// 16-bit entries keep the struct small enough for five e4m3 decode CTAs an SM.
using PairIndex = int16_t;
static_assert(kMaxRoutedExperts < (1 << 15) && kMaxSelfRoutedPairs < (1 << 15));

struct DecodePairs {
  PairIndex expert[kMaxSelfRoutedPairs];  // routed from the logits (else unused)
  float weight[kMaxSelfRoutedPairs];
  PairIndex group[kMaxSelfRoutedPairs];  // -1: not local
  PairIndex slot[kMaxSelfRoutedPairs];   // -1: not local
  int32_t slot_token[kMaxSelfRoutedPairs];  // the token of each routed slot (GemmGroups::a_row_of_slot)
  // Each pair's group's first slot and pairs; a group's leader (its first pair) also holds
  // the group's row tiles, the other pairs 0.
  PairIndex group_first[kMaxSelfRoutedPairs];
  PairIndex group_count[kMaxSelfRoutedPairs];
  PairIndex lead_tiles[kMaxSelfRoutedPairs];
  // The routed row tiles in list order (each holds a pair at least): group, first slot, and
  // the group's end; then how many, and the routed pairs.
  PairIndex tile_group[kMaxSelfRoutedPairs], tile_first[kMaxSelfRoutedPairs], tile_end[kMaxSelfRoutedPairs];
  int32_t routed_tiles, local_pairs;
};

// Step 1, pair p of `pairs` (groups set): its slot and, for a leader, its group's extent.
__host__ __device__ inline void place_pair(DecodePairs& d, int p, int pairs, int top_k, int tile_rows) {
  const int group = d.group[p];
  int rank = 0, before = 0, count = 0;
  for (int q = 0; q < pairs; ++q) {
    const int other = d.group[q];
    if (other < 0) continue;
    before += other < group;
    count += other == group;
    rank += other == group && q < p;
  }
  d.slot[p] = static_cast<PairIndex>(group >= 0 ? before + rank : -1);
  if (group >= 0) d.slot_token[before + rank] = p / top_k;
  const bool leads = group >= 0 && rank == 0;
  d.group_first[p] = static_cast<PairIndex>(before);
  d.group_count[p] = static_cast<PairIndex>(count);
  d.lead_tiles[p] = static_cast<PairIndex>(leads ? (count + tile_rows - 1) / tile_rows : 0);
}

// Step 2, pair p (every pair placed): a leader lists its group's row tiles after those of
// the groups before it.
__host__ __device__ inline void list_tiles(DecodePairs& d, int p, int pairs, int tile_rows) {
  if (d.lead_tiles[p] == 0) return;
  int tiles_before = 0;
  for (int q = 0; q < pairs; ++q)
    if (d.group[q] >= 0 && d.group[q] < d.group[p]) tiles_before += d.lead_tiles[q];
  for (int i = 0; i < d.lead_tiles[p]; ++i) {
    d.tile_group[tiles_before + i] = d.group[p];
    d.tile_first[tiles_before + i] = static_cast<PairIndex>(d.group_first[p] + i * tile_rows);
    d.tile_end[tiles_before + i] = static_cast<PairIndex>(d.group_first[p] + d.group_count[p]);
  }
}

// Once per CTA after step 1 (thread 0): the routed pairs and row tiles.
__host__ __device__ inline void count_routed(DecodePairs& d, int pairs) {
  d.local_pairs = 0;
  d.routed_tiles = 0;
  for (int q = 0; q < pairs; ++q) {
    d.local_pairs += d.group[q] >= 0;
    d.routed_tiles += d.lead_tiles[q];
  }
}

// Group g's routed pairs and first slot (any g, with or without pairs).
struct GroupExtent {
  int32_t count, first;
};
__host__ __device__ inline GroupExtent group_extent(const DecodePairs& d, int pairs, int g) {
  GroupExtent extent{0, 0};
  for (int q = 0; q < pairs; ++q) {
    if (d.group[q] < 0) continue;
    extent.count += d.group[q] == g;
    extent.first += d.group[q] < g;
  }
  return extent;
}

// The most tokens a warp of a CTA of kMaxSelfRoutedPairs threads or more routes.
inline constexpr int kMaxSelfRoutedTokensPerWarp =
    (kMaxSelfRoutedTokens * 32 + kMaxSelfRoutedPairs - 1) / kMaxSelfRoutedPairs;

// The calling warp's tokens (warp w: w, w + warps, ...) routed in turn, into d's choices;
// every token's logits are loaded first, so the loads' latency comes once, not per token.
template <int kPerLane>
__device__ void route_warp_tokens(const SelfRouting& r, float* scratch, DecodePairs& d) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = static_cast<int>(blockDim.x) / 32;
  float logits[kMaxSelfRoutedTokensPerWarp][kPerLane];
#pragma unroll
  for (int i = 0; i < kMaxSelfRoutedTokensPerWarp; ++i)
    if (warp + i * warps < r.tokens)
      routing::load_logits<kPerLane>(r.logits, r.logits_bf16, r.num_experts, warp + i * warps, logits[i]);
#pragma unroll
  for (int i = 0; i < kMaxSelfRoutedTokensPerWarp; ++i) {
    const int token = warp + i * warps;
    if (token >= r.tokens) break;
    __syncwarp();  // the lanes have read the last token's scores from the scratch
    const routing::Choice choice = routing::rank_token<kPerLane>(r.spec, logits[i], r.correction_bias, scratch);
    if (lane < r.top_k) {
      d.expert[token * r.top_k + lane] = static_cast<PairIndex>(choice.expert);
      d.weight[token * r.top_k + lane] = choice.weight;
    }
  }
}

// The steps on the CTA (every thread calls it; a thread per pair, blockDim.x at least
// kMaxSelfRoutedPairs): the choices, routed from the logits (route_warp_tokens, in each
// warp's route_scratch_floats(E) of `route_scratch`) or read; their groups; their slots;
// the routed row tiles. Ends on a barrier.
__device__ inline void build_decode_pairs(const SelfRouting& r, int tile_rows, float* route_scratch, DecodePairs& d) {
  const int p = threadIdx.x, warp = p / 32;
  const int pairs = r.tokens * r.top_k;
  if (r.logits) {
    float* scratch = route_scratch + warp * routing::route_scratch_floats(r.num_experts);
    static_assert(kMaxSelfRoutedExperts == 8 * 32, "4 or 8 experts a lane");
    if (r.num_experts <= 4 * 32)
      route_warp_tokens<4>(r, scratch, d);
    else
      route_warp_tokens<8>(r, scratch, d);
    __syncthreads();
  }
  if (p < pairs) {
    const int32_t expert = r.logits ? d.expert[p] : r.topk_ids[p];
    d.group[p] = static_cast<PairIndex>(local_group(expert, r.expert_map, r.num_experts));
  }
  __syncthreads();
  if (p < pairs) place_pair(d, p, pairs, r.top_k, tile_rows);
  __syncthreads();
  if (p == 0) count_routed(d, pairs);
  if (p < pairs) list_tiles(d, p, pairs, tile_rows);
  __syncthreads();
}

// What the route and the sort would have written, by one CTA (every thread) once
// build_decode_pairs is done: the choices from the logits, and `layout` for GEMM2 and the
// combine; then r.published, if any (after the counters' zeroing: the caller waits for it).
// The shared group (shared_tiles > 0 of them, first in the list) is group local_experts.
__device__ inline void publish_decode_layout(const SelfRouting& r, const DecodePairs& d, const PairLayout& layout,
                                             int local_experts, int shared_tiles, int tile_rows) {
  const int pairs = r.tokens * r.top_k, t = threadIdx.x;
  const bool shared = shared_tiles > 0;
  const int groups = local_experts + (shared ? 1 : 0);
  if (t < pairs) {
    if (r.logits) {
      r.topk_ids_out[t] = d.expert[t];
      r.topk_weights_out[t] = d.weight[t];
    }
    layout.slot_of_pair[t] = d.slot[t];
    if (d.slot[t] >= 0) layout.slot_token[d.slot[t]] = d.slot_token[d.slot[t]];
  }
  for (int i = t; i < d.routed_tiles; i += blockDim.x) {
    layout.tile_group[shared_tiles + i] = d.tile_group[i];
    layout.tile_row[shared_tiles + i] = d.tile_first[i];
  }
  if (shared) {
    for (int token = t; token < r.tokens; token += blockDim.x) layout.slot_token[pairs + token] = token;
    for (int i = t; i < shared_tiles; i += blockDim.x) {
      layout.tile_group[i] = local_experts;
      layout.tile_row[i] = pairs + i * tile_rows;
    }
  }
  for (int g = t; g < groups; g += blockDim.x) {
    const GroupExtent extent = shared && g == local_experts ? GroupExtent{r.tokens, pairs} : group_extent(d, pairs, g);
    layout.group_counts[g] = extent.count;
    layout.group_offsets[g] = extent.first;
  }
  if (t == 0) {
    layout.group_offsets[groups] = shared ? pairs + r.tokens : d.local_pairs;
    layout.tile_count[0] = shared_tiles + d.routed_tiles;
    layout.tile_count[1] = 0;
  }
  if (r.published) {  // every thread's stores, then the flag (release at GPU scope)
    __syncthreads();
    if (t == 0) {
      __threadfence();
      atomicExch(r.published, 1);
    }
  }
}

// The CTA's DecodePairs (one per CTA of a kernel that calls this).
__device__ inline DecodePairs& decode_pairs() {
  __shared__ DecodePairs pairs;
  return pairs;
}

}  // namespace epmoe::cuda
