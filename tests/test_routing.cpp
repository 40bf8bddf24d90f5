// Routing on the CPU: each kind against hand-computed cases, ties to the lower index, the
// DeepSeek-V3 bias, and invariants on fresh random logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "epmoe/moe_case.h"
#include "epmoe/moe_cpu.h"
#include "epmoe/presets.h"

namespace epmoe {
namespace {

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routed route(const RoutingSpec& spec, std::vector<float> logits, std::vector<float> bias = {}) {
  const int64_t T = static_cast<int64_t>(logits.size()) / spec.num_experts;
  Routed routed{std::vector<int32_t>(T * spec.top_k, -7), std::vector<float>(T * spec.top_k, NAN)};
  std::optional<Tensor> bias_tensor;
  if (!bias.empty()) bias_tensor = Tensor::contiguous(bias.data(), DType::kF32, {spec.num_experts});
  const Status status = route_cpu(spec, Tensor::contiguous(logits.data(), DType::kF32, {T, spec.num_experts}),
                                  bias_tensor, Tensor::contiguous(routed.ids.data(), DType::kI32, {T, spec.top_k}),
                                  Tensor::contiguous(routed.weights.data(), DType::kF32, {T, spec.top_k}));
  EXPECT_TRUE(status.ok()) << status.message();
  return routed;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(Routing, SoftmaxTopkHandComputed) {
  const RoutingSpec spec{.kind = RoutingKind::kSoftmaxTopk, .num_experts = 4, .top_k = 2};
  const Routed r = route(spec, {1, 2, 3, 0});
  const double sum = std::exp(0) + std::exp(1) + std::exp(2) + std::exp(3);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(r.weights[0], std::exp(3) / sum, 1e-6);
  EXPECT_NEAR(r.weights[1], std::exp(2) / sum, 1e-6);
}

TEST(Routing, SoftmaxTopkRenormalisedWeightsSumToOne) {
  const RoutingSpec spec{.kind = RoutingKind::kSoftmaxTopk, .num_experts = 4, .top_k = 2, .renormalize = true};
  const Routed r = route(spec, {1, 2, 3, 0});
  EXPECT_NEAR(r.weights[0], std::exp(3) / (std::exp(3) + std::exp(2)), 1e-6);
  EXPECT_NEAR(r.weights[1], std::exp(2) / (std::exp(3) + std::exp(2)), 1e-6);
}

TEST(Routing, TiesGoToTheLowerIndex) {
  for (RoutingKind kind : {RoutingKind::kSoftmaxTopk, RoutingKind::kTopkSoftmax, RoutingKind::kSigmoidTopk}) {
    const RoutingSpec spec{.kind = kind, .num_experts = 6, .top_k = 3};
    const Routed r = route(spec, {0.5f, 2, 2, 0.5f, 2, 2});
    EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2, 4})) << routing_kind_name(kind);
  }
  const RoutingSpec grouped{.kind = RoutingKind::kGroupedTopk, .num_experts = 8, .top_k = 2, .n_group = 4, .topk_group = 2};
  EXPECT_EQ(route(grouped, {1, 1, 1, 1, 1, 1, 1, 1}).ids, (std::vector<int32_t>{0, 1}));
}

TEST(Routing, TopkSoftmaxHandComputed) {
  const RoutingSpec spec{.kind = RoutingKind::kTopkSoftmax, .num_experts = 4, .top_k = 2};
  const Routed r = route(spec, {0.5f, 2, -1, 1});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3}));
  EXPECT_NEAR(r.weights[0], 1 / (1 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(r.weights[1], std::exp(-1.0) / (1 + std::exp(-1.0)), 1e-6);
}

TEST(Routing, SigmoidTopkHandComputed) {
  const RoutingSpec spec{.kind = RoutingKind::kSigmoidTopk, .num_experts = 3, .top_k = 1};
  const Routed r = route(spec, {0.3f, -2, 1.5f, /*token 2*/ -3, -1, -2});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(r.weights[0], sigmoid(1.5), 1e-6);
  EXPECT_NEAR(r.weights[1], sigmoid(-1), 1e-6);
}

TEST(Routing, GroupedTopkWithoutBiasScoresGroupsByTheirBest) {
  const RoutingSpec spec{.kind = RoutingKind::kGroupedTopk, .num_experts = 8, .top_k = 2,
                         .score_func = ScoreFunc::kSigmoid, .n_group = 4, .topk_group = 2};
  const Routed r = route(spec, {2, 1.9f, 0, 0, 0, 0, 0, 0});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(r.weights[0], sigmoid(2), 1e-6);
  EXPECT_NEAR(r.weights[1], sigmoid(1.9), 1e-6);
}

TEST(Routing, GroupedTopk_BiasChangesChoiceNotWeight) {
  const RoutingSpec spec{.kind = RoutingKind::kGroupedTopk, .num_experts = 8, .top_k = 2, .renormalize = true,
                         .score_func = ScoreFunc::kSigmoid, .n_group = 4, .topk_group = 2,
                         .routed_scaling_factor = 2.5f};
  // Group scores (sum of the best two biased scores): g0 = s(2) + s(1.9) = 1.75, g1 = g2 = 1,
  // g3 = 3. Experts 6 and 7 win on their bias; their weights are the unbiased s(0) = 0.5,
  // renormalised to 0.5 each, times 2.5.
  const Routed r = route(spec, {2, 1.9f, 0, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 1, 1});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{6, 7}));
  EXPECT_NEAR(r.weights[0], 1.25, 1e-6);
  EXPECT_NEAR(r.weights[1], 1.25, 1e-6);
}

TEST(Routing, GroupedTopkCountsNanAsMinusInfinityInGroupScores) {
  const RoutingSpec spec{.kind = RoutingKind::kGroupedTopk, .num_experts = 8, .top_k = 2,
                         .score_func = ScoreFunc::kSigmoid, .n_group = 4, .topk_group = 2};
  // NaN logits count as -inf, in group scores too (GPU routing does the same).
  // With a bias the groups score the sum of their best two: g0 = -inf + s(1) = -inf, g1 =
  // 2 s(0.5), g2 = s(2) + -inf = -inf, g3 = 2 s(-1). g1 and g3 stay; experts 2 and 3 tie,
  // the lower index first.
  const Routed r = route(spec, {NAN, 1, 0.5f, 0.5f, 2, NAN, -1, -1}, std::vector<float>(8, 0.0f));
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(r.weights[0], sigmoid(0.5), 1e-6);
  EXPECT_NEAR(r.weights[1], sigmoid(0.5), 1e-6);
  // Without a bias a group scores its best: g0's is s(3) beside its NaN, the best of all.
  const Routed v2 = route(spec, {NAN, 3, 0.5f, 0.5f, 0, 0, -1, -1});
  EXPECT_EQ(v2.ids, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(v2.weights[0], sigmoid(3), 1e-6);
  EXPECT_NEAR(v2.weights[1], sigmoid(0.5), 1e-6);
}

TEST(Routing, GroupedTopkSoftmaxScoresHandComputed) {
  const RoutingSpec spec{.kind = RoutingKind::kGroupedTopk, .num_experts = 4, .top_k = 1,
                         .score_func = ScoreFunc::kSoftmax, .n_group = 2, .topk_group = 1};
  const Routed r = route(spec, {0, 3, 1, 2});
  const double sum = std::exp(0) + std::exp(3) + std::exp(1) + std::exp(2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1}));
  EXPECT_NEAR(r.weights[0], std::exp(3) / sum, 1e-6);
}

// Fresh random logits: chosen experts are distinct, in kept groups, best first, and
// renormalised weights sum to 1 (times the scaling factor).
TEST(Routing, RandomLogitsInvariants) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int T = 300, E = 64;
  for (RoutingKind kind : {RoutingKind::kSoftmaxTopk, RoutingKind::kTopkSoftmax, RoutingKind::kSigmoidTopk,
                           RoutingKind::kGroupedTopk}) {
    const RoutingSpec spec{.kind = kind, .num_experts = E, .top_k = 6, .renormalize = true,
                           .score_func = ScoreFunc::kSigmoid, .n_group = 8, .topk_group = 3,
                           .routed_scaling_factor = 2.0f};
    std::vector<float> logits(T * E), bias(E);
    for (float& v : logits) v = normal(rng);
    for (float& v : bias) v = normal(rng) * 0.1f;
    const bool grouped = kind == RoutingKind::kGroupedTopk;
    const Routed r = route(spec, logits, grouped ? bias : std::vector<float>{});
    for (int t = 0; t < T; ++t) {
      const float* row = &logits[t * E];
      std::vector<float> selection(E);
      for (int e = 0; e < E; ++e) selection[e] = grouped ? static_cast<float>(sigmoid(row[e])) + bias[e] : row[e];
      // The kept groups, computed here independently: sum of the best two biased scores.
      std::vector<std::pair<float, int>> groups;
      for (int g = 0; g < 8; ++g) {
        std::vector<float> members(selection.begin() + g * 8, selection.begin() + g * 8 + 8);
        std::sort(members.rbegin(), members.rend());
        groups.emplace_back(-(members[0] + members[1]), g);
      }
      std::sort(groups.begin(), groups.end());
      double sum = 0;
      for (int j = 0; j < 6; ++j) {
        const int id = r.ids[t * 6 + j];
        ASSERT_GE(id, 0);
        ASSERT_LT(id, E);
        for (int i = 0; i < j; ++i) ASSERT_NE(id, r.ids[t * 6 + i]);
        if (j > 0) {
          ASSERT_GE(selection[r.ids[t * 6 + j - 1]], selection[id]) << "best first";
        }
        if (grouped) {
          const int g = id / 8;
          ASSERT_TRUE(g == groups[0].second || g == groups[1].second || g == groups[2].second)
              << "expert " << id << " of a dropped group";
        }
        sum += r.weights[t * 6 + j];
      }
      ASSERT_NEAR(sum, grouped ? 2.0 : 1.0, 1e-5) << routing_kind_name(kind);
    }
  }
}

// The bench's routing inputs (draw_bench_routing): each set's ids are route_cpu's of its
// logits, with the drawn bias only where the case has a correction bias; the sets differ,
// and the same seed draws the same routings.
TEST(Routing, BenchRoutingIsRouteCpuOfItsLogits) {
  for (const char* name : {"deepseek-v3", "qwen3-30b-a3b"}) {
    const ModelPreset& preset = *find_preset(name);
    RandomCaseOptions options;
    options.spec = preset.spec;
    options.correction_bias = preset.correction_bias;
    options.seed = std::random_device{}();
    const int64_t T = 37, E = preset.spec.routing.num_experts;
    const Result<BenchRouting> drawn = draw_bench_routing(options, T, 3);
    ASSERT_TRUE(drawn.ok()) << drawn.status().message();
    ASSERT_EQ(drawn->bias.size(), static_cast<size_t>(E));
    ASSERT_EQ(drawn->logits.size(), 3u);
    ASSERT_EQ(drawn->ids.size(), 3u);
    for (int set = 0; set < 3; ++set) {
      ASSERT_EQ(drawn->logits[set].size(), static_cast<size_t>(T * E));
      const Routed expected = route(preset.spec.routing, drawn->logits[set],
                                    preset.correction_bias ? drawn->bias : std::vector<float>{});
      EXPECT_EQ(drawn->ids[set], expected.ids) << name << " set " << set;
    }
    EXPECT_NE(drawn->logits[0], drawn->logits[1]) << name;
    EXPECT_NE(drawn->ids[0], drawn->ids[1]) << name;
    const Result<BenchRouting> again = draw_bench_routing(options, T, 3);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->ids, drawn->ids) << name << ": the same seed";
  }
}

}  // namespace
}  // namespace epmoe
