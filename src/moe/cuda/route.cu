// The routing kernel: router logits -> top-k expert ids and weights, one warp per token
// (route_token.cuh has the four kinds of DESIGN.md and how a warp ranks the experts).
#include "launch.cuh"
#include "launchers.h"
#include "route_token.cuh"

namespace epmoe::cuda {

namespace {

constexpr int kWarpsPerBlock = 4;

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
  const int k = spec.top_k;
  float* scratch = shared_scores + warp * routing::route_scratch_floats(spec.num_experts);
  const routing::Choice choice = routing::route_token<kPerLane>(spec, logits, logits_bf16, bias, t, scratch);
  if (lane < k) {
    topk_ids[t * k + lane] = choice.expert;
    topk_weights[t * k + lane] = choice.weight;
  }
}

}  // namespace

cudaError_t launch_route(const RoutingSpec& spec, const void* logits, bool logits_bf16, const float* correction_bias,
                         int64_t tokens, int32_t* topk_ids, float* topk_weights, cudaStream_t stream, Start start) {
  if (tokens == 0) return cudaSuccess;
  const size_t shared_bytes = kWarpsPerBlock * routing::route_scratch_floats(spec.num_experts) * sizeof(float);
  const unsigned blocks = static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  auto launch = [&]<int kPerLane>() {
    static const cudaError_t carveout = prefer_max_shared_memory(route_kernel<kPerLane>);
    if (carveout != cudaSuccess) return carveout;
    return launch_kernel(start, route_kernel<kPerLane>, dim3(blocks), dim3(kWarpsPerBlock * 32), shared_bytes, stream,
                         spec, logits, logits_bf16, correction_bias, tokens, topk_ids, topk_weights);
  };
  static_assert(kMaxRoutedExperts <= 32 * 32, "32 experts a lane at most");
  switch (routing::experts_per_lane(spec.num_experts)) {
    case 4: return launch.template operator()<4>();
    case 8: return launch.template operator()<8>();
    default: return launch.template operator()<32>();
  }
}

}  // namespace epmoe::cuda
