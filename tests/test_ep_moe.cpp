// EpMoe over the thread backend: for R in {1, 2, 3, 4, 8}, every strategy and placement,
// tokens per rank unequal and sometimes zero, and routing that sends every token to one
// rank, every rank's output equals the single-rank operator's output (f32 data: to f32
// rounding). Bad input (a rank with another spec, experts not partitioned, a rank that
// fails mid-layer) is a clear error on every rank, not a hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <functional>
#include <random>
#include <thread>

#include "epmoe/ep_moe.h"
#include "epmoe/moe_case.h"
#include "epmoe/moe_cpu.h"
#include "epmoe/naive_moe.h"

namespace epmoe {
namespace {

using namespace std::chrono_literals;

void on_ranks(int R, const std::function<void(int)>& body) {
  std::vector<std::jthread> threads;
  for (int r = 0; r < R; ++r) threads.emplace_back(body, r);
}

// The whole layer on one rank, f32 throughout.
MoeCase whole_layer(QuantScheme scheme, uint64_t seed, int64_t tokens) {
  RandomCaseOptions options;
  options.spec.routing = {.kind = RoutingKind::kGroupedTopk, .num_experts = 16, .top_k = 4, .renormalize = true,
                          .score_func = ScoreFunc::kSigmoid, .n_group = 4, .topk_group = 2,
                          .routed_scaling_factor = 2.5f};
  options.spec.quant = {scheme, 32, 32};
  options.correction_bias = true;
  options.tokens = tokens;
  options.hidden = 64;
  options.intermediate = 32;
  options.shared_intermediate = 64;
  options.activation_dtype = DType::kF32;
  options.dense_weight_dtype = DType::kF32;
  options.seed = seed;
  return make_random_case(options).value();
}

ExpertMap placement(const std::string& kind, int E, int R, int r, uint64_t seed) {
  if (kind == "linear") return ExpertMap::build(Placement::kLinear, E, R, r).value();
  if (kind == "round_robin") return ExpertMap::build(Placement::kRoundRobin, E, R, r).value();
  // explicit: a random permutation dealt out in uneven runs
  std::vector<int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  const int begin = r * E / R, end = (r + 1) * E / R;
  return ExpertMap::from_list(E, std::span<const int32_t>(order).subspan(begin, end - begin)).value();
}

std::vector<float> single_rank_output(const MoeCase& whole) {
  Buffer out(DType::kF32, {whole.inputs.x.size(0), whole.inputs.x.size(1)});
  EXPECT_TRUE(moe_forward_cpu(whole.spec, whole.weights, whole.inputs, out.view()).ok());
  return std::vector<float>(out.data_as<float>(), out.data_as<float>() + out.numel());
}

struct EpCase {
  int ranks;
  EpStrategy strategy;
  std::string placement;
  bool one_rank_hot;  // every token's experts on rank 0
};

class EpMoeMatchesSingleRank : public ::testing::TestWithParam<EpCase> {};

TEST_P(EpMoeMatchesSingleRank, OnEveryRank) {
  const EpCase c = GetParam();
  const int R = c.ranks, E = 16, H = 64;
  const uint64_t seed = std::random_device{}();
  std::mt19937 rng(static_cast<uint32_t>(seed));
  // Tokens per rank: unequal, some ranks none (replicate: every rank holds all of them).
  std::vector<int64_t> counts(R);
  for (int r = 0; r < R; ++r) counts[r] = (r % 3 == 1) ? 0 : 1 + static_cast<int64_t>(rng() % 9);
  const int64_t T = c.strategy == EpStrategy::kReplicateAllReduce ? 11 : std::accumulate(counts.begin(), counts.end(), int64_t{0});
  MoeCase whole = whole_layer(QuantScheme::kBf16, seed, T);
  std::vector<ExpertMap> maps;
  for (int r = 0; r < R; ++r) maps.push_back(placement(c.placement, E, R, r, seed));
  if (c.one_rank_hot) {  // push rank 0's experts far above the rest: the worst imbalance
    float* logits = whole.inputs.router_logits->data_as<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int32_t e : maps[0].global_ids()) logits[t * E + e] += 20.0f;
    std::fill_n(whole.inputs.correction_bias->data_as<float>(), E, 0.0f);
  }
  const std::vector<float> expected = single_rank_output(whole);

  auto comms = make_thread_group(R, 5000ms);
  std::vector<EpLayer> layers;
  for (int r = 0; r < R; ++r) layers.push_back(slice_layer(whole, maps[r]));
  std::vector<std::vector<float>> outputs(R);
  std::vector<EpStats> stats(R);
  std::vector<Status> statuses(R);
  on_ranks(R, [&](int r) {
    Result<EpMoe> layer = EpMoe::create(*comms[r], layers[r], c.strategy);
    if (!layer.ok()) {
      statuses[r] = layer.status();
      return;
    }
    const bool replicate = c.strategy == EpStrategy::kReplicateAllReduce;
    const int64_t first = replicate ? 0 : std::accumulate(counts.begin(), counts.begin() + r, int64_t{0});
    const int64_t rows = replicate ? T : counts[r];
    const Tensor x = Tensor::contiguous(whole.inputs.x.data_as<float>() + first * H, DType::kF32, {rows, H});
    const Tensor logits = Tensor::contiguous(whole.inputs.router_logits->data_as<float>() + first * E, DType::kF32, {rows, E});
    outputs[r].assign(rows * H, NAN);
    statuses[r] = layer->forward(x, logits, Tensor::contiguous(outputs[r].data(), DType::kF32, {rows, H}), &stats[r]);
  });
  int64_t first = 0;
  for (int r = 0; r < R; ++r) {
    ASSERT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].message();
    const int64_t start = c.strategy == EpStrategy::kReplicateAllReduce ? 0 : first;
    std::vector<double> got(outputs[r].begin(), outputs[r].end());
    std::vector<double> want(expected.begin() + start * H, expected.begin() + start * H + static_cast<int64_t>(got.size()));
    if (!want.empty()) {
      EXPECT_LT(relative_error(got, want), 2e-6) << "rank " << r << " seed " << seed;
    }
    first += counts[r];
  }
  if (c.one_rank_hot && c.strategy == EpStrategy::kAllToAll) {
    // Every token's experts live on rank 0: the others send their tokens there and nowhere else.
    for (int r = 1; r < R; ++r) {
      EXPECT_EQ(stats[r].rows_sent[0], counts[r]);
      for (int d = 1; d < R; ++d) EXPECT_EQ(stats[r].rows_sent[d], 0);
    }
  }
  int64_t pairs = 0;
  for (const EpStats& s : stats) pairs += std::accumulate(s.pairs_per_local_expert.begin(), s.pairs_per_local_expert.end(), int64_t{0});
  if (c.strategy == EpStrategy::kAllToAll) {
    EXPECT_EQ(pairs, T * 4);  // each pair computed exactly once, somewhere
  }
}

std::vector<EpCase> ep_cases() {
  std::vector<EpCase> cases;
  for (int R : {1, 2, 3, 4, 8})
    for (EpStrategy strategy : {EpStrategy::kReplicateAllReduce, EpStrategy::kAllGatherReduceScatter, EpStrategy::kAllToAll})
      for (const char* kind : {"linear", "round_robin", "explicit"}) cases.push_back({R, strategy, kind, false});
  for (EpStrategy strategy : {EpStrategy::kReplicateAllReduce, EpStrategy::kAllGatherReduceScatter, EpStrategy::kAllToAll})
    cases.push_back({4, strategy, "linear", true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(EveryStrategy, EpMoeMatchesSingleRank, ::testing::ValuesIn(ep_cases()), [](const auto& info) {
  std::string name = "R";
  name += std::to_string(info.param.ranks);
  name += "_";
  name += ep_strategy_name(info.param.strategy);
  name += "_";
  name += info.param.placement;
  if (info.param.one_rank_hot) name += "_all_to_rank0";
  return name;
});

TEST(EpMoe, FpBlockWeightsAcrossRanks) {
  const uint64_t seed = std::random_device{}();
  MoeCase whole = whole_layer(QuantScheme::kFp8Block, seed, 9);
  const std::vector<float> expected = single_rank_output(whole);
  auto comms = make_thread_group(4, 5000ms);
  std::vector<EpLayer> layers;
  for (int r = 0; r < 4; ++r) layers.push_back(slice_layer(whole, placement("round_robin", 16, 4, r, seed)));
  std::vector<std::vector<float>> outputs(4, std::vector<float>(9 * 64, NAN));
  on_ranks(4, [&](int r) {
    Result<EpMoe> layer = EpMoe::create(*comms[r], layers[r], EpStrategy::kAllToAll);
    ASSERT_TRUE(layer.ok()) << layer.status().message();
    ASSERT_TRUE(layer->forward(whole.inputs.x, *whole.inputs.router_logits,
                               Tensor::contiguous(outputs[r].data(), DType::kF32, {9, 64}))
                    .ok());
  });
  for (int r = 0; r < 4; ++r)
    EXPECT_LT(relative_error(std::vector<double>(outputs[r].begin(), outputs[r].end()),
                             std::vector<double>(expected.begin(), expected.end())),
              2e-6);
}

TEST(EpMoe, DifferentSpecOnOneRankIsAnErrorOnEveryRank) {
  MoeCase whole = whole_layer(QuantScheme::kBf16, 5, 4);
  auto comms = make_thread_group(3, 2000ms);
  std::vector<EpLayer> layers;
  for (int r = 0; r < 3; ++r) layers.push_back(slice_layer(whole, placement("linear", 16, 3, r, 0)));
  layers[2].spec.routing.routed_scaling_factor = 1.0f;
  std::vector<Status> statuses(3);
  on_ranks(3, [&](int r) { statuses[r] = EpMoe::create(*comms[r], layers[r], EpStrategy::kAllToAll).status(); });
  for (const Status& status : statuses) {
    EXPECT_FALSE(status.ok());
    EXPECT_NE(status.message().find("EpMoe on rank 2: expected the spec, sizes and strategy of rank 0"), std::string::npos)
        << status.message();
    EXPECT_NE(status.message().find("a different spec"), std::string::npos);
  }
}

TEST(EpMoe, ExpertsNotPartitionedIsAnErrorOnEveryRank) {
  MoeCase whole = whole_layer(QuantScheme::kBf16, 6, 4);
  auto comms = make_thread_group(2, 2000ms);
  // Rank 1 claims expert 3 too (rank 0 owns 0..7); expert 15 is nobody's.
  const std::vector<int32_t> mine0 = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int32_t> mine1 = {3, 8, 9, 10, 11, 12, 13, 14};
  std::vector<EpLayer> layers = {slice_layer(whole, ExpertMap::from_list(16, mine0).value()),
                                  slice_layer(whole, ExpertMap::from_list(16, mine1).value())};
  std::vector<Status> statuses(2);
  on_ranks(2, [&](int r) { statuses[r] = EpMoe::create(*comms[r], layers[r], EpStrategy::kReplicateAllReduce).status(); });
  for (const Status& status : statuses)
    EXPECT_EQ(status.message(), "expert placement: expected every expert on exactly one rank, got expert 3 on ranks 0, 1");
}

TEST(EpMoe, ARankFailingMidLayerFailsTheOthersWithinTheTimeout) {
  MoeCase whole = whole_layer(QuantScheme::kBf16, 7, 6);
  auto comms = make_thread_group(3, 300ms);
  std::vector<EpLayer> layers;
  for (int r = 0; r < 3; ++r) layers.push_back(slice_layer(whole, placement("linear", 16, 3, r, 0)));
  std::vector<Status> statuses(3);
  const auto start = std::chrono::steady_clock::now();
  on_ranks(3, [&](int r) {
    Result<EpMoe> layer = EpMoe::create(*comms[r], layers[r], EpStrategy::kAllGatherReduceScatter);
    ASSERT_TRUE(layer.ok());
    if (r == 1) return;  // dies before the forward: never joins its collectives
    std::vector<float> out(6 * 64);
    statuses[r] = layer->forward(whole.inputs.x, *whole.inputs.router_logits,
                                 Tensor::contiguous(out.data(), DType::kF32, {6, 64}));
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  for (int r : {0, 2}) {
    EXPECT_FALSE(statuses[r].ok());
    EXPECT_NE(statuses[r].message().find("for rank(s) 1 (timeout)"), std::string::npos) << statuses[r].message();
  }
}

}  // namespace
}  // namespace epmoe
