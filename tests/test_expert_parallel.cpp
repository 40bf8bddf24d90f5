// Expert placement and the EP invariant: the R ranks' outputs, each computing only its own
// experts, sum to the single-rank output, for every placement, scheme and size.
#include <gtest/gtest.h>

#include "epmoe/expert_map.h"
#include "moe_test_util.h"

namespace epmoe {
namespace {

using testing::fresh_seed;
using testing::random_case;
using testing::run_poisoned;

TEST(ExpertMap, LinearGivesTheRemainderToTheFirstRanks) {
  // 10 experts over 4 ranks: 3, 3, 2, 2.
  const std::vector<std::vector<int32_t>> expected = {{0, 1, 2}, {3, 4, 5}, {6, 7}, {8, 9}};
  for (int rank = 0; rank < 4; ++rank) {
    Result<ExpertMap> map = ExpertMap::build(Placement::kLinear, 10, 4, rank);
    ASSERT_TRUE(map.ok());
    EXPECT_EQ(std::vector<int32_t>(map->global_ids().begin(), map->global_ids().end()), expected[rank]);
    for (int local = 0; local < map->num_local(); ++local) EXPECT_EQ(map->local_index(expected[rank][local]), local);
  }
}

TEST(ExpertMap, RoundRobinDealsExpertsInTurn) {
  Result<ExpertMap> map = ExpertMap::build(Placement::kRoundRobin, 10, 3, 1);
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(std::vector<int32_t>(map->global_ids().begin(), map->global_ids().end()), (std::vector<int32_t>{1, 4, 7}));
  EXPECT_EQ(map->local_index(7), 2);
  EXPECT_EQ(map->local_index(2), -1);
}

TEST(ExpertMap, ExplicitListsAreChecked) {
  const std::vector<int32_t> good = {5, 0, 3};
  Result<ExpertMap> map = ExpertMap::from_list(8, good);
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(map->local_index(5), 0);
  EXPECT_EQ(map->local_index(3), 2);
  const std::vector<int32_t> repeated = {5, 0, 5};
  EXPECT_EQ(ExpertMap::from_list(8, repeated).status().message(),
            "expert list[2]: expected distinct expert ids, got 5 again (first at index 0)");
  const std::vector<int32_t> outside = {8};
  EXPECT_EQ(ExpertMap::from_list(8, outside).status().message(),
            "expert list[0]: expected a global expert id in [0, 8), got 8");
  EXPECT_EQ(ExpertMap::build(Placement::kLinear, 8, 9, 0).status().message(),
            "num_ranks: expected 1 <= ranks <= num_experts (8), got 9");
  EXPECT_EQ(ExpertMap::build(Placement::kLinear, 8, 2, 2).status().message(), "rank: expected 0 <= rank < 2, got 2");
}

TEST(ExpertMap, PlacementsPartitionTheExperts) {
  for (Placement placement : {Placement::kLinear, Placement::kRoundRobin})
    for (int ranks : {1, 2, 3, 8}) {
      std::vector<int> owners(64, 0);
      for (int rank = 0; rank < ranks; ++rank) {
        const ExpertMap map = ExpertMap::build(placement, 64, ranks, rank).value();
        for (int32_t e : map.global_ids()) ++owners[e];
      }
      for (int e = 0; e < 64; ++e) ASSERT_EQ(owners[e], 1) << placement_name(placement) << " R=" << ranks;
    }
}

struct EpCase {
  int experts, ranks;
  Placement placement;
  QuantScheme scheme;
};

class EpInvariant : public ::testing::TestWithParam<EpCase> {};

TEST_P(EpInvariant, RankOutputsSumToTheSingleRankOutput) {
  const EpCase c = GetParam();
  RandomCaseOptions options;
  const bool grouped = c.experts >= 64;
  options.spec.routing = {.kind = grouped ? RoutingKind::kGroupedTopk : RoutingKind::kSoftmaxTopk,
                          .num_experts = c.experts, .top_k = c.experts >= 16 ? 8 : 2, .renormalize = true,
                          .score_func = ScoreFunc::kSigmoid, .n_group = 8, .topk_group = 4,
                          .routed_scaling_factor = 2.5f};
  options.spec.quant = {c.scheme, 32, 32};
  options.correction_bias = grouped;
  options.tokens = 13;
  options.hidden = 64;
  options.intermediate = 32;
  options.shared_intermediate = 64;
  options.activation_dtype = DType::kF32;  // no bf16 rounding: the sums agree to f32 rounding
  options.dense_weight_dtype = DType::kF32;
  options.seed = fresh_seed();
  options.placement = c.placement;
  const std::vector<double> whole = run_poisoned(random_case(options));

  std::vector<double> sum(whole.size(), 0.0);
  for (int rank = 0; rank < c.ranks; ++rank) {
    options.num_ranks = c.ranks;
    options.rank = rank;
    const std::vector<double> part = run_poisoned(random_case(options));
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
  }
  EXPECT_LT(relative_error(sum, whole), 2e-6) << "seed " << options.seed;
}

std::vector<EpCase> ep_cases() {
  std::vector<EpCase> cases;
  for (int experts : {8, 16, 64, 256})
    for (int ranks : {1, 2, 4, 8})
      for (Placement placement : {Placement::kLinear, Placement::kRoundRobin})
        cases.push_back({experts, ranks, placement, experts == 16 ? QuantScheme::kFp8Block : QuantScheme::kBf16});
  for (QuantScheme scheme : {QuantScheme::kFp8Tensor, QuantScheme::kFp8Channel})
    cases.push_back({64, 4, Placement::kRoundRobin, scheme});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(EveryPlacement, EpInvariant, ::testing::ValuesIn(ep_cases()), [](const auto& info) {
  const EpCase& c = info.param;
  std::string name = "E";
  name += std::to_string(c.experts);
  name += "_R";
  name += std::to_string(c.ranks);
  name += "_";
  name += placement_name(c.placement);
  name += "_";
  name += quant_scheme_name(c.scheme);
  return name;
});

}  // namespace
}  // namespace epmoe
