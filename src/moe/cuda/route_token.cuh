// Routing of one token on one warp, the four kinds of DESIGN.md: what the routing kernel
// (route.cu) runs for each of its tokens, and what the decode GEMM1 runs where it routes its
// few tokens itself (grouped_gemm.cu, GemmGroups::self_routing).
//
// Lane l holds experts l, l + 32, ... in registers (kPerLane of them). Top-k takes k rounds
// of a warp-wide arg-max over the experts not yet taken, ordered by (score descending, index
// ascending) so ties go to the lower index; NaN scores order as -inf, as on the CPU. A score
// becomes an unsigned key that orders like the score, so a round is two redux.sync over each
// lane's best (the highest key, then the lowest index holding it; a lane sorts its experts
// once), and the winning lane drops its best. Grouped top-k first scores the groups (each
// group's experts split over a few lanes, their best two merged by shuffles), keeps
// topk_group of them the same way, and orders the experts of the other groups as -inf.
#pragma once

#include <cuda_bf16.h>

#include "epmoe/moe_spec.h"

namespace epmoe::cuda::routing {

inline constexpr unsigned kFullWarp = 0xffffffffu;

// Keys: larger score, larger key. NaN orders as -inf, and -0.0 as +0.0 (they compare equal,
// so the index decides). kNoCandidate is below every score's key (-inf's is 0x007fffff).
inline constexpr unsigned kNoCandidate = 0;
__device__ inline unsigned order_key(float score) {
  if (isnan(score)) score = -INFINITY;
  if (score == 0.0f) score = 0.0f;
  const unsigned bits = __float_as_uint(score);
  return bits >> 31 ? ~bits : bits | 0x80000000u;
}

// The index of the warp's best candidate: the highest key, the lowest index among equal keys.
__device__ inline int warp_best_index(unsigned key, int index) {
  const unsigned best = __reduce_max_sync(kFullWarp, key);
  return static_cast<int>(__reduce_min_sync(kFullWarp, key == best ? static_cast<unsigned>(index) : ~0u));
}

__device__ inline float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(kFullWarp, value, offset);
  return value;
}

__device__ inline float warp_max(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(kFullWarp, value, offset));
  return value;
}

__device__ inline float sigmoid(float value) { return 1.0f / (1.0f + expf(-value)); }

// A lane's experts (lane + 32 i) as keys, sorted best first once (a bitonic network in
// registers: no lane waits on another), so a round's winning lane only shifts its list by
// one, where a rescan of its unsorted experts would put kPerLane dependent compares in every
// round. Order: the higher key, then the lower index. kNoCandidate past E and at the end.
template <int kPerLane>
struct LaneExperts {
  static_assert((kPerLane & (kPerLane - 1)) == 0, "a bitonic network sorts a power of two");
  unsigned key[kPerLane];
  int index[kPerLane];

  __device__ static bool before(unsigned key_a, int index_a, unsigned key_b, int index_b) {
    return key_a > key_b || (key_a == key_b && index_a < index_b);
  }
  __device__ void sort() {
#pragma unroll
    for (int size = 2; size <= kPerLane; size *= 2)
#pragma unroll
      for (int stride = size / 2; stride > 0; stride /= 2)
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int j = i ^ stride;
          if (j <= i) continue;
          // Best first in runs whose `size` bit is clear, best last in the others (bitonic).
          const bool swap = (i & size) == 0 ? before(key[j], index[j], key[i], index[i])
                                            : before(key[i], index[i], key[j], index[j]);
          if (swap) {
            const unsigned k = key[i];
            key[i] = key[j], key[j] = k;
            const int x = index[i];
            index[i] = index[j], index[j] = x;
          }
        }
  }
  // Drops the best (this lane won the round).
  __device__ void pop() {
#pragma unroll
    for (int i = 0; i + 1 < kPerLane; ++i) key[i] = key[i + 1], index[i] = index[i + 1];
    key[kPerLane - 1] = kNoCandidate;
  }
};

// Grouped top-k's group choice: which of the n_group groups (bit g) stay. A group scores its
// best selection value (no bias) or the sum of its best two (bias), from `selection` in
// shared memory; each group's experts are split over lanes_per_group lanes.
__device__ inline unsigned kept_groups(const RoutingSpec& spec, const float* selection, bool bias, int lane) {
  const int group_size = spec.num_experts / spec.n_group;
  int lanes_per_group = 1;
  while (lanes_per_group * 2 * spec.n_group <= 32) lanes_per_group *= 2;
  const int group = lane / lanes_per_group, part = lane % lanes_per_group;
  float first = -INFINITY, second = -INFINITY;
  if (group < spec.n_group) {
    for (int e = group * group_size + part; e < (group + 1) * group_size; e += lanes_per_group) {
      const float v = selection[e];
      if (v > first) {
        second = first;
        first = v;
      } else if (v > second) {
        second = v;
      }
    }
  }
  // The best two of the segment's lanes (aligned, so xor stays inside it).
  for (int offset = lanes_per_group / 2; offset > 0; offset /= 2) {
    const float other_first = __shfl_xor_sync(kFullWarp, first, offset);
    const float other_second = __shfl_xor_sync(kFullWarp, second, offset);
    second = fmaxf(fminf(first, other_first), fmaxf(second, other_second));
    first = fmaxf(first, other_first);
  }
  const bool candidate = group < spec.n_group && part == 0;
  unsigned key = candidate ? order_key(bias ? first + second : first) : kNoCandidate;
  unsigned kept = 0;
  for (int round = 0; round < spec.topk_group; ++round) {
    const int winner = warp_best_index(key, group);
    kept |= 1u << winner;
    if (candidate && group == winner) key = kNoCandidate;
  }
  return kept;
}


// The shared floats route_token needs per warp: the scores and the selection scores, E each.
__host__ __device__ constexpr int route_scratch_floats(int num_experts) { return 2 * num_experts; }

// The experts a lane holds for E experts: the fewest of 4, 8 and 32 that cover them.
__host__ __device__ constexpr int experts_per_lane(int num_experts) {
  return num_experts <= 4 * 32 ? 4 : num_experts <= 8 * 32 ? 8 : 32;
}

// One of a token's k choices: lane j < k of the warp holds choice j.
struct Choice {
  int32_t expert;
  float weight;
};

// This lane's logits (experts lane + 32 i, -inf past E) of token t of the router logits
// [T, E] (f32 or bf16).
template <int kPerLane>
__device__ __forceinline__ void load_logits(const void* logits, bool logits_bf16, int num_experts, int64_t t,
                                            float (&score)[kPerLane]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    const int64_t index = t * num_experts + e;
    score[i] = e >= num_experts ? -INFINITY
               : logits_bf16    ? __bfloat162float(static_cast<const __nv_bfloat16*>(logits)[index])
                                : static_cast<const float*>(logits)[index];
  }
}

// Ranks one token on the calling warp (every lane calls it) from its logits (load_logits);
// `scratch` is route_scratch_floats(E) of shared memory for this warp alone.
template <int kPerLane>
__device__ __forceinline__ Choice rank_token(const RoutingSpec& spec, float (&score)[kPerLane], const float* bias,
                                             float* scratch) {
  const int lane = threadIdx.x % 32;
  const int E = spec.num_experts, k = spec.top_k;
  float* scores = scratch;        // the weights' source
  float* selection = scratch + E;  // what grouped top-k scores its groups by

  const bool softmax = spec.kind == RoutingKind::kSoftmaxTopk ||
                       (spec.kind == RoutingKind::kGroupedTopk && spec.score_func == ScoreFunc::kSoftmax);
  if (softmax) {
    float local_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) local_max = fmaxf(local_max, score[i]);
    const float max_value = warp_max(local_max);
    float local_sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i < E) local_sum += (score[i] = expf(score[i] - max_value));
    const float sum = warp_sum(local_sum);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) score[i] /= sum;
  } else if (spec.kind == RoutingKind::kGroupedTopk) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) score[i] = sigmoid(score[i]);
  }
  const bool grouped = spec.kind == RoutingKind::kGroupedTopk;
  float order[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    order[i] = e < E && bias ? score[i] + bias[e] : score[i];
    if (e < E) {
      scores[e] = score[i];
      if (grouped) selection[e] = order[i];
    }
  }
  __syncwarp();
  const unsigned kept = grouped ? kept_groups(spec, selection, bias, lane) : ~0u;
  const int group_size = grouped ? E / spec.n_group : E;

  // k rounds of arg-max; lane j keeps the j-th choice.
  LaneExperts<kPerLane> experts;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    experts.key[i] = e >= E ? kNoCandidate : order_key(kept >> (e / group_size) & 1u ? order[i] : -INFINITY);
    experts.index[i] = e;
  }
  experts.sort();
  int my_id = 0;
  for (int j = 0; j < k; ++j) {
    const int winner = warp_best_index(experts.key[0], experts.index[0]);
    if (experts.index[0] == winner) experts.pop();
    if (lane == j) my_id = winner;
  }
  const float my_score = lane < k ? scores[my_id] : 0.0f;
  const float top_score = __shfl_sync(kFullWarp, my_score, 0);
  float my_weight = my_score;
  if (spec.kind == RoutingKind::kSigmoidTopk) my_weight = sigmoid(my_score);
  if (spec.kind == RoutingKind::kTopkSoftmax) my_weight = expf(my_score - top_score);
  const float total = warp_sum(lane < k ? my_weight : 0.0f);
  if (spec.kind == RoutingKind::kTopkSoftmax || spec.renormalize) my_weight /= total;
  if (spec.kind == RoutingKind::kGroupedTopk) my_weight *= spec.routed_scaling_factor;
  return {my_id, my_weight};
}

// Routes token t: load_logits, then rank_token.
template <int kPerLane>
__device__ __forceinline__ Choice route_token(const RoutingSpec& spec, const void* logits, bool logits_bf16,
                                              const float* bias, int64_t t, float* scratch) {
  float score[kPerLane];
  load_logits<kPerLane>(logits, logits_bf16, spec.num_experts, t, score);
  return rank_token<kPerLane>(spec, score, bias, scratch);
}

}  // namespace epmoe::cuda::routing
