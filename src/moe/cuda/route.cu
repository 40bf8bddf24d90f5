// Routing: router logits -> top-k expert ids and weights, the four kinds of DESIGN.md.
//
// One warp per token. The token's E scores live in shared memory (f32); lane l handles
// experts l, l + 32, ... Top-k takes k rounds of a warp-wide arg-max over the experts not
// yet taken, ordered by (score descending, index ascending) so ties go to the lower index;
// NaN scores order as -inf, as on the CPU. For the rounds each lane holds its experts'
// values in registers and its own best among those not taken, so a round is one warp
// arg-max and a rescan by the winning lane only (rescanning shared memory in every lane
// each round made the kernel ~12 us at decode sizes). Grouped top-k first scores the groups
// (lane g scores group g), keeps topk_group of them by the same arg-max, and masks the rest.
#include <cuda_bf16.h>

#include <cfloat>

#include "launch.cuh"
#include "launchers.h"

namespace epmoe::cuda {

namespace {

constexpr int kWarpsPerBlock = 4;

struct Candidate {
  float score;
  int index;
};

__device__ bool better(Candidate a, Candidate b) {
  return a.score > b.score || (a.score == b.score && a.index < b.index);
}

__device__ float order_value(float score) { return isnan(score) ? -FLT_MAX * 2.0f : score; }  // NaN as -inf

__device__ Candidate warp_best(Candidate c) {
  for (int offset = 16; offset > 0; offset /= 2) {
    Candidate other{__shfl_xor_sync(0xffffffffu, c.score, offset), __shfl_xor_sync(0xffffffffu, c.index, offset)};
    if (better(other, c)) c = other;
  }
  return c;
}

__device__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ float warp_max(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// A lane's best expert not yet taken among its kPerLane (lane + 32 i), with its score.
template <int kPerLane>
struct LaneExperts {
  float order[kPerLane];  // what the top-k orders by (NaN as -inf)
  float score[kPerLane];  // what the weight comes from
  unsigned long long taken = 0;  // bit i: expert lane + 32 i taken (or past E)
  Candidate best;
  float best_score = 0.0f;

  __device__ void find_best(int lane) {
    best = {-INFINITY, 0x7fffffff};
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const Candidate c{order[i], lane + 32 * i};
      if (!(taken >> i & 1ull) && (best.index == 0x7fffffff || better(c, best))) {
        best = c;
        best_score = score[i];
      }
    }
  }
};

__device__ float softmax_in_place(float* values, int count, int lane) {
  float local_max = -INFINITY;
  for (int i = lane; i < count; i += 32) local_max = fmaxf(local_max, values[i]);
  const float max_value = warp_max(local_max);
  float local_sum = 0.0f;
  for (int i = lane; i < count; i += 32) local_sum += (values[i] = expf(values[i] - max_value));
  const float sum = warp_sum(local_sum);
  for (int i = lane; i < count; i += 32) values[i] /= sum;
  __syncwarp();
  return sum;
}

__device__ float sigmoid(float value) { return 1.0f / (1.0f + expf(-value)); }

template <int kPerLane>
__global__ void route_kernel(RoutingSpec spec, const void* logits, bool logits_bf16, const float* bias, int64_t tokens,
                             int32_t* topk_ids, float* topk_weights) {
  extern __shared__ float shared_scores[];
  // In this order, the sort (and GEMM1 after it) can start only once what precedes the route
  // has finished: GEMM1's early shared tiles read the x codes of a quantisation launched
  // before the route (moe_forward.cu) without waiting themselves.
  wait_for_predecessor();
  allow_successor();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= tokens) return;
  const int E = spec.num_experts, k = spec.top_k;
  float* scores = shared_scores + warp * 2 * E;  // the weights' source
  float* selection = scores + E;                 // what the top-k orders by
  for (int e = lane; e < E; e += 32) {
    const int64_t index = t * E + e;
    scores[e] = logits_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(logits)[index])
                            : static_cast<const float*>(logits)[index];
  }
  __syncwarp();
  switch (spec.kind) {
    case RoutingKind::kSoftmaxTopk:
      softmax_in_place(scores, E, lane);
      break;
    case RoutingKind::kGroupedTopk:
      if (spec.score_func == ScoreFunc::kSoftmax) {
        softmax_in_place(scores, E, lane);
      } else {
        for (int e = lane; e < E; e += 32) scores[e] = sigmoid(scores[e]);
      }
      break;
    default:
      break;
  }
  for (int e = lane; e < E; e += 32) selection[e] = scores[e] + (bias ? bias[e] : 0.0f);
  __syncwarp();

  if (spec.kind == RoutingKind::kGroupedTopk) {
    // Lane g scores group g: its best (no bias) or the sum of its best two (bias).
    const int group_size = E / spec.n_group;
    float group_score = -INFINITY;
    if (lane < spec.n_group) {
      float first = -INFINITY, second = -INFINITY;
      for (int e = lane * group_size; e < (lane + 1) * group_size; ++e) {
        const float v = selection[e];
        if (v > first) {
          second = first;
          first = v;
        } else if (v > second) {
          second = v;
        }
      }
      group_score = bias ? first + second : first;
    }
    // Keep topk_group groups; lane g learns whether its group stays.
    bool kept = false;
    unsigned long long taken = 0;
    for (int round = 0; round < spec.topk_group; ++round) {
      Candidate mine{lane < spec.n_group && !(taken & 1ull) ? order_value(group_score) : -INFINITY,
                     lane < spec.n_group && !(taken & 1ull) ? lane : 0x7fffffff};
      const Candidate best = warp_best(mine);
      if (best.index == lane) {
        kept = true;
        taken = 1;
      }
    }
    const unsigned kept_groups = __ballot_sync(0xffffffffu, kept);
    for (int e = lane; e < E; e += 32)
      if (!(kept_groups >> (e / group_size) & 1u)) selection[e] = -INFINITY;
    __syncwarp();
  }

  // k rounds of arg-max; lane j keeps the j-th choice.
  LaneExperts<kPerLane> experts;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    experts.order[i] = e < E ? order_value(selection[e]) : -INFINITY;
    experts.score[i] = e < E ? scores[e] : 0.0f;
    if (e >= E) experts.taken |= 1ull << i;
  }
  experts.find_best(lane);
  int my_id = 0;
  float my_weight = 0.0f, top_logit = 0.0f;
  for (int j = 0; j < k; ++j) {
    const Candidate best = warp_best(experts.best);
    const float score = __shfl_sync(0xffffffffu, experts.best_score, best.index % 32);
    if (best.index % 32 == lane) {
      experts.taken |= 1ull << (best.index / 32);
      experts.find_best(lane);
    }
    if (j == 0) top_logit = score;
    float weight = score;
    if (spec.kind == RoutingKind::kSigmoidTopk) weight = sigmoid(score);
    if (spec.kind == RoutingKind::kTopkSoftmax) weight = expf(score - top_logit);
    if (lane == j) {
      my_id = best.index;
      my_weight = weight;
    }
  }
  float total = warp_sum(lane < k ? my_weight : 0.0f);
  if (spec.kind == RoutingKind::kTopkSoftmax || spec.renormalize) my_weight /= total;
  if (spec.kind == RoutingKind::kGroupedTopk) my_weight *= spec.routed_scaling_factor;
  if (lane < k) {
    topk_ids[t * k + lane] = my_id;
    topk_weights[t * k + lane] = my_weight;
  }
}

}  // namespace

cudaError_t launch_route(const RoutingSpec& spec, const void* logits, bool logits_bf16, const float* correction_bias,
                         int64_t tokens, int32_t* topk_ids, float* topk_weights, cudaStream_t stream, Start start) {
  if (tokens == 0) return cudaSuccess;
  const size_t shared_bytes = kWarpsPerBlock * 2 * spec.num_experts * sizeof(float);
  const unsigned blocks = static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  // Experts per lane held in registers: the fewest of 4, 8, 32 that cover E.
  auto launch = [&]<int kPerLane>() {
    static const cudaError_t carveout = prefer_max_shared_memory(route_kernel<kPerLane>);
    if (carveout != cudaSuccess) return carveout;
    return launch_kernel(start, route_kernel<kPerLane>, dim3(blocks), dim3(kWarpsPerBlock * 32), shared_bytes, stream,
                         spec, logits, logits_bf16, correction_bias, tokens, topk_ids, topk_weights);
  };
  static_assert(kMaxRoutedExperts <= 32 * 32, "32 experts a lane at most");
  if (spec.num_experts <= 4 * 32) return launch.template operator()<4>();
  if (spec.num_experts <= 8 * 32) return launch.template operator()<8>();
  return launch.template operator()<32>();
}

}  // namespace epmoe::cuda
