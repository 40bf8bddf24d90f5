// The CPU operator against the naive double-precision loop, every scheme and routing kind,
// with shared experts, router weight on the input, skewed and empty routing; and its
// determinism. Fresh random data each run.
#include <gtest/gtest.h>

#include "epmoe/quantize.h"
#include "moe_test_util.h"

namespace epmoe {
namespace {

using testing::fresh_seed;
using testing::random_case;
using testing::run_poisoned;

struct Case {
  QuantScheme scheme;
  RoutingKind kind;
  int64_t tokens;
  bool shared;
};

std::string name_of(const Case& c) {
  return std::string(quant_scheme_name(c.scheme)) + "_" + std::string(routing_kind_name(c.kind)) + "_T" +
         std::to_string(c.tokens) + (c.shared ? "_shared" : "");
}

RandomCaseOptions options_for(const Case& c) {
  RandomCaseOptions options;
  const bool llama = c.kind == RoutingKind::kSigmoidTopk;
  options.spec.routing = {.kind = c.kind, .num_experts = 16, .top_k = llama ? 1 : 4, .renormalize = !llama,
                          .score_func = ScoreFunc::kSigmoid, .n_group = 4, .topk_group = 2,
                          .routed_scaling_factor = 2.5f};
  options.spec.quant.scheme = c.scheme;
  options.spec.apply_router_weight_on_input = llama;
  options.correction_bias = c.kind == RoutingKind::kGroupedTopk;
  options.tokens = c.tokens;
  options.hidden = 256;
  options.intermediate = 128;
  options.shared_intermediate = c.shared ? 256 : 0;
  options.seed = fresh_seed();
  return options;
}

class FusedMoeVsNaive : public ::testing::TestWithParam<Case> {};

TEST_P(FusedMoeVsNaive, WithinToleranceAndEveryElementWritten) {
  const Case c = GetParam();
  const RandomCaseOptions options = options_for(c);
  const MoeCase moe_case = random_case(options);
  const std::vector<double> out = run_poisoned(moe_case);
  const bool fp8 = is_fp8(c.scheme);
  Result<std::vector<double>> reference =
      naive_moe(moe_case.spec, moe_case.weights, moe_case.inputs, {.quantize_activations = true});
  ASSERT_TRUE(reference.ok()) << reference.status().message();
  ASSERT_GT(testing::norm(reference.value()), 0.0);
  const double error = relative_error(out, reference.value());
  EXPECT_LT(error, fp8 ? 3e-2 : 1e-2) << "seed " << options.seed;
  if (fp8) {
    // Against exact activations the e4m3 roundings cost a few percent, no more.
    Result<std::vector<double>> exact = naive_moe(moe_case.spec, moe_case.weights, moe_case.inputs);
    EXPECT_LT(relative_error(out, exact.value()), 8e-2) << "seed " << options.seed;
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (QuantScheme scheme : {QuantScheme::kBf16, QuantScheme::kFp8Tensor, QuantScheme::kFp8Channel, QuantScheme::kFp8Block})
    for (RoutingKind kind : {RoutingKind::kSoftmaxTopk, RoutingKind::kTopkSoftmax, RoutingKind::kSigmoidTopk,
                             RoutingKind::kGroupedTopk})
      for (int64_t tokens : {1, 7, 40}) cases.push_back({scheme, kind, tokens, tokens == 7});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllSchemesAndRoutings, FusedMoeVsNaive, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return name_of(info.param); });

TEST(FusedMoe, Fp8TensorWithStaticActivationScales) {
  RandomCaseOptions options = options_for({QuantScheme::kFp8Tensor, RoutingKind::kSoftmaxTopk, 29, true});
  options.static_activation_scales = true;
  const MoeCase moe_case = random_case(options);
  ASSERT_TRUE(moe_case.weights.input_scale.has_value());
  ASSERT_TRUE(moe_case.weights.intermediate_scale.has_value());
  const std::vector<double> out = run_poisoned(moe_case);
  const std::vector<double> reference =
      naive_moe(moe_case.spec, moe_case.weights, moe_case.inputs, {.quantize_activations = true}).value();
  EXPECT_LT(relative_error(out, reference), 3e-2) << "seed " << options.seed;
  // The static scales are what is used: another scale (not a power of two, which would
  // only shift exponents exactly) moves the e4m3 grid and so the result.
  MoeCase rescaled = random_case(options);
  *rescaled.weights.input_scale->data_as<float>() *= 1.37f;
  EXPECT_NE(run_poisoned(rescaled), out);
}

TEST(FusedMoe, F32PathMatchesNaiveToF32Rounding) {
  RandomCaseOptions options = options_for({QuantScheme::kBf16, RoutingKind::kGroupedTopk, 20, true});
  options.activation_dtype = DType::kF32;
  options.dense_weight_dtype = DType::kF32;
  const MoeCase moe_case = random_case(options);
  const double error = relative_error(run_poisoned(moe_case), naive_moe(moe_case.spec, moe_case.weights, moe_case.inputs).value());
  EXPECT_LT(error, 1e-5) << "seed " << options.seed;
}

TEST(FusedMoe, RunsAreBitwiseIdenticalAcrossThreadCounts) {
  const MoeCase moe_case = random_case(options_for({QuantScheme::kFp8Block, RoutingKind::kSoftmaxTopk, 37, true}));
  const std::vector<double> one = run_poisoned(moe_case, 1);
  EXPECT_EQ(one, run_poisoned(moe_case, 1));
  EXPECT_EQ(one, run_poisoned(moe_case, 3));
  EXPECT_EQ(one, run_poisoned(moe_case, 8));
}

// Precomputed routing that sends every token to expert 3 (and leaves the others empty).
TEST(FusedMoe, AllTokensToOneExpertAndEmptyExperts) {
  for (QuantScheme scheme : {QuantScheme::kBf16, QuantScheme::kFp8Tensor, QuantScheme::kFp8Block}) {
    MoeCase moe_case = random_case(options_for({scheme, RoutingKind::kSoftmaxTopk, 9, false}));
    moe_case.spec.routing.top_k = 1;
    std::vector<int32_t> ids(9, 3);
    std::vector<float> weights(9);
    for (int t = 0; t < 9; ++t) weights[t] = 0.25f + 0.05f * t;
    moe_case.inputs.router_logits.reset();
    moe_case.inputs.topk_ids = Tensor::contiguous(ids.data(), DType::kI32, {9, 1});
    moe_case.inputs.topk_weights = Tensor::contiguous(weights.data(), DType::kF32, {9, 1});
    const std::vector<double> out = run_poisoned(moe_case);
    const std::vector<double> reference =
        naive_moe(moe_case.spec, moe_case.weights, moe_case.inputs, {.quantize_activations = true}).value();
    EXPECT_LT(relative_error(out, reference), is_fp8(scheme) ? 3e-2 : 1e-2) << quant_scheme_name(scheme);
  }
}

TEST(FusedMoe, TokensOnNoLocalExpertGiveZeros) {
  MoeCase moe_case = random_case(options_for({QuantScheme::kBf16, RoutingKind::kSoftmaxTopk, 6, false}));
  std::vector<int32_t> map(16, -1);
  moe_case.inputs.expert_map = Tensor::contiguous(map.data(), DType::kI32, {16});
  for (double v : run_poisoned(moe_case)) ASSERT_EQ(v, 0.0);
}

TEST(FusedMoe, NaNInTheInputComesOutAsNaN) {
  MoeCase moe_case = random_case(options_for({QuantScheme::kFp8Channel, RoutingKind::kSoftmaxTopk, 4, false}));
  moe_case.inputs.x.data_as<uint16_t>()[2 * 256 + 17] = 0x7fc0;  // token 2
  const Tensor& x = moe_case.inputs.x;
  Buffer out(x.dtype, {4, 256});
  ASSERT_TRUE(moe_forward_cpu(moe_case.spec, moe_case.weights, moe_case.inputs, out.view()).ok());
  const std::vector<double> values = to_doubles(out.view());
  EXPECT_TRUE(std::isnan(values[2 * 256]));
  EXPECT_FALSE(std::isnan(values[0]));
}

TEST(Quantize, PerTokenGroupScalesAndCodes) {
  // Row 0: amax 3.5 in group 0, 0.0 in group 1 (a row of zeros); row 1 saturates.
  std::vector<float> values = {3.5f, -1.0f, 0.0f, 0.0f, 1e6f, 1.0f, -2.0f, 0.5f};
  std::vector<uint8_t> codes(8);
  std::vector<float> scales(4);
  quantize_fp8_blocks(values.data(), {2, 4, 1, 2}, codes.data(), scales.data());
  EXPECT_EQ(scales[0], 3.5f / 448.0f);
  EXPECT_EQ(scales[1], 1e-10f / 448.0f);
  EXPECT_EQ(scales[2], 1e6f / 448.0f);
  EXPECT_EQ(scales[3], 2.0f / 448.0f);
  EXPECT_EQ(fp8e4m3_to_f32(codes[0]), 448.0f);
  EXPECT_EQ(fp8e4m3_to_f32(codes[1]), -128.0f);  // -1 / 2^-7
  EXPECT_EQ(codes[5], 0);  // 1 / (1e6 / 448) is below half the smallest subnormal
  EXPECT_EQ(codes[2], 0);
  EXPECT_EQ(fp8e4m3_to_f32(codes[4]), 448.0f);
  EXPECT_EQ(fp8e4m3_to_f32(codes[6]), -448.0f);
}

TEST(Quantize, NaNPoisonsItsBlockOnly) {
  std::vector<float> values = {1.0f, NAN, 2.0f, 3.0f};
  std::vector<uint8_t> codes(4);
  std::vector<float> scales(2);
  quantize_fp8_blocks(values.data(), {1, 4, 1, 2}, codes.data(), scales.data());
  EXPECT_TRUE(std::isnan(scales[0]));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(codes[0])));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(codes[1])));
  EXPECT_EQ(scales[1], 3.0f / 448.0f);
  EXPECT_EQ(fp8e4m3_to_f32(codes[3]), 448.0f);
}

}  // namespace
}  // namespace epmoe
