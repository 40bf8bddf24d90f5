// Routing alone (route_cuda) against the CPU router (route_cpu) on fresh random logits:
// the same experts in the same order and the same weights, for every routing kind at
// expert counts from 8 to 1024 (each lane layout of the kernel), f32 and bf16 logits. The
// logits lie on a coarse grid, so ties are common and near-ties absent: a tie goes to the
// lower index on both, and no ulp of difference in a score can reorder two experts. Some
// tokens carry NaN logits (ordered as -inf on both). Outputs are poisoned.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "epmoe/device_case.h"
#include "epmoe/dtype.h"
#include "epmoe/moe_cpu.h"
#include "epmoe/moe_cuda.h"

namespace epmoe {
namespace {

struct RouteCase {
  const char* name;
  RoutingSpec spec;
  bool bias;         // grouped_topk: a correction bias
  bool bf16_logits;
};

class GpuRoute : public ::testing::TestWithParam<RouteCase> {};

TEST_P(GpuRoute, MatchesCpuRouterExactly) {
  const RouteCase c = GetParam();
  constexpr int64_t kTokens = 300;
  const int64_t E = c.spec.num_experts, k = c.spec.top_k;
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_int_distribution<int> grid(-24, 24);
  Buffer logits(c.bf16_logits ? DType::kBF16 : DType::kF32, {kTokens, E});
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t e = 0; e < E; ++e) {
      // Eighths: exact in bf16, ties frequent; every 17th token gets a NaN or two, and every
      // 13th has -0.0 beside +0.0 (equal scores: the lower index wins either way round).
      float value = static_cast<float>(grid(rng)) / 8.0f;
      if (t % 17 == 5 && (e == 3 || e == E - 1)) value = NAN;
      if (t % 13 == 2 && e % 5 < 2) value = e % 2 ? -0.0f : 0.0f;
      if (c.bf16_logits)
        logits.data_as<uint16_t>()[t * E + e] = f32_to_bf16(value);
      else
        logits.data_as<float>()[t * E + e] = value;
    }
  std::optional<Buffer> bias;
  if (c.bias) {
    bias.emplace(DType::kF32, std::vector<int64_t>{E});
    for (int64_t e = 0; e < E; ++e) bias->data_as<float>()[e] = static_cast<float>(grid(rng)) / 64.0f;
  }

  Buffer cpu_ids(DType::kI32, {kTokens, k}), cpu_weights(DType::kF32, {kTokens, k});
  const std::optional<Tensor> host_bias = bias ? std::optional<Tensor>(bias->view()) : std::nullopt;
  ASSERT_TRUE(route_cpu(c.spec, logits.view(), host_bias, cpu_ids.view(), cpu_weights.view()).ok());

  std::vector<DeviceBuffer> storage;
  Tensor device_logits = logits.view();
  ASSERT_TRUE(move_to_device(device_logits, storage).ok());
  std::optional<Tensor> device_bias = host_bias;
  if (device_bias) ASSERT_TRUE(move_to_device(*device_bias, storage).ok());
  Buffer poison_ids(DType::kI32, {kTokens, k}), poison_weights(DType::kF32, {kTokens, k});
  for (int64_t i = 0; i < kTokens * k; ++i) {
    poison_ids.data_as<int32_t>()[i] = -7;
    poison_weights.data_as<float>()[i] = NAN;
  }
  Tensor ids = poison_ids.view(), weights = poison_weights.view();
  ASSERT_TRUE(move_to_device(ids, storage).ok());
  ASSERT_TRUE(move_to_device(weights, storage).ok());
  const Status routed = route_cuda(c.spec, device_logits, device_bias, ids, weights, nullptr);
  ASSERT_TRUE(routed.ok()) << routed.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Buffer gpu_ids(DType::kI32, {kTokens, k}), gpu_weights(DType::kF32, {kTokens, k});
  ASSERT_TRUE(copy_to_host(ids.data, gpu_ids.view()).ok());
  ASSERT_TRUE(copy_to_host(weights.data, gpu_weights.view()).ok());

  int64_t id_mismatches = 0, weight_mismatches = 0;
  for (int64_t i = 0; i < kTokens * k; ++i) {
    const int32_t expected_id = cpu_ids.data_as<int32_t>()[i], id = gpu_ids.data_as<int32_t>()[i];
    const float expected = cpu_weights.data_as<float>()[i], weight = gpu_weights.data_as<float>()[i];
    if (id != expected_id) {
      if (++id_mismatches <= 5) ADD_FAILURE() << "token " << i / k << " choice " << i % k << ": " << id << " vs " << expected_id;
    }
    const bool both_nan = std::isnan(weight) && std::isnan(expected);
    if (!both_nan && !(std::fabs(weight - expected) <= 1e-5f * std::fabs(expected) + 1e-7f)) {
      if (++weight_mismatches <= 5)
        ADD_FAILURE() << "token " << i / k << " choice " << i % k << ": weight " << weight << " vs " << expected;
    }
  }
  EXPECT_EQ(id_mismatches, 0);
  EXPECT_EQ(weight_mismatches, 0);
}

RoutingSpec routing(RoutingKind kind, int experts, int k, bool renormalize = false) {
  RoutingSpec spec;
  spec.kind = kind;
  spec.num_experts = experts;
  spec.top_k = k;
  spec.renormalize = renormalize;
  return spec;
}

RoutingSpec grouped(int experts, int k, ScoreFunc score, int groups, int kept, bool renormalize, float scale) {
  RoutingSpec spec = routing(RoutingKind::kGroupedTopk, experts, k, renormalize);
  spec.score_func = score;
  spec.n_group = groups;
  spec.topk_group = kept;
  spec.routed_scaling_factor = scale;
  return spec;
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, GpuRoute,
    ::testing::Values(RouteCase{"softmax_topk_mixtral", routing(RoutingKind::kSoftmaxTopk, 8, 2, true), false, false},
                      RouteCase{"softmax_topk_qwen3", routing(RoutingKind::kSoftmaxTopk, 128, 8, true), false, true},
                      RouteCase{"softmax_topk_not_renormalised", routing(RoutingKind::kSoftmaxTopk, 60, 4), false, false},
                      RouteCase{"topk_softmax_gpt_oss", routing(RoutingKind::kTopkSoftmax, 32, 4), false, false},
                      RouteCase{"sigmoid_topk_llama4", routing(RoutingKind::kSigmoidTopk, 128, 1), false, true},
                      RouteCase{"grouped_v3_bias", grouped(256, 8, ScoreFunc::kSigmoid, 8, 4, true, 2.5f), true, false},
                      RouteCase{"grouped_v3_bias_bf16", grouped(256, 8, ScoreFunc::kSigmoid, 8, 4, true, 2.5f), true,
                                true},
                      RouteCase{"grouped_v2_softmax", grouped(160, 6, ScoreFunc::kSoftmax, 8, 3, false, 16.0f), false,
                                false},
                      RouteCase{"grouped_64_experts", grouped(64, 6, ScoreFunc::kSigmoid, 8, 3, true, 1.5f), true, false},
                      RouteCase{"grouped_3_groups", grouped(96, 4, ScoreFunc::kSigmoid, 3, 2, true, 1.0f), true,
                                false},
                      RouteCase{"grouped_32_experts", grouped(32, 4, ScoreFunc::kSoftmax, 4, 2, false, 1.0f), false,
                                false},
                      RouteCase{"softmax_topk_1024_experts", routing(RoutingKind::kSoftmaxTopk, 1024, 32, true), false,
                                false}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace epmoe
