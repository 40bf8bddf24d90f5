// MoeSpec / validate_moe: each rule rejects bad input with a message naming the argument,
// the expected and the given value, before any kernel runs.
#include <gtest/gtest.h>

#include "epmoe/moe_case.h"
#include "epmoe/moe_cpu.h"

namespace epmoe {
namespace {

// A small valid case of the given scheme: E=8, k=2, H=256, I=128, T=5.
MoeCase valid_case(QuantScheme scheme = QuantScheme::kBf16, RoutingKind kind = RoutingKind::kSoftmaxTopk) {
  RandomCaseOptions options;
  options.spec.routing = {.kind = kind, .num_experts = 8, .top_k = 2, .renormalize = true, .n_group = 4, .topk_group = 2};
  options.spec.quant.scheme = scheme;
  options.tokens = 5;
  options.hidden = 256;
  options.intermediate = 128;
  options.seed = 42;
  Result<MoeCase> moe_case = make_random_case(options);
  EXPECT_TRUE(moe_case.ok()) << moe_case.status().message();
  return std::move(moe_case).value();
}

std::string error_of(const MoeCase& c) {
  Buffer out(c.inputs.x.dtype, {c.inputs.x.size(0), c.inputs.x.size(1)});
  const Tensor view = out.view();
  Result<MoeShape> shape = validate_moe(c.spec, c.weights, c.inputs, &view, Device::kCpu);
  EXPECT_FALSE(shape.ok()) << "expected a validation error";
  // The operator itself must refuse the same input with the same message.
  const Status run = moe_forward_cpu(c.spec, c.weights, c.inputs, view);
  EXPECT_EQ(run.message(), shape.status().message());
  return shape.status().message();
}

TEST(SpecValidation, ValidCaseShapesAreDerivedFromTheTensors) {
  const MoeCase c = valid_case(QuantScheme::kFp8Block);
  Buffer out(DType::kBF16, {5, 256});
  const Tensor view = out.view();
  Result<MoeShape> shape = validate_moe(c.spec, c.weights, c.inputs, &view, Device::kCpu);
  ASSERT_TRUE(shape.ok()) << shape.status().message();
  EXPECT_EQ(shape->tokens, 5);
  EXPECT_EQ(shape->hidden, 256);
  EXPECT_EQ(shape->intermediate, 128);
  EXPECT_EQ(shape->num_local_experts, 8);
  EXPECT_EQ(shape->top_k, 2);
}

TEST(SpecValidation, TopKLargerThanExperts) {
  MoeCase c = valid_case();
  c.spec.routing.top_k = 9;
  EXPECT_EQ(error_of(c), "routing.top_k: expected 1 <= top_k <= num_experts (8), got 9");
}

TEST(SpecValidation, GroupsMustDivideExperts) {
  MoeCase c = valid_case(QuantScheme::kBf16, RoutingKind::kGroupedTopk);
  c.spec.routing.n_group = 3;
  EXPECT_EQ(error_of(c), "routing.n_group: expected a divisor of num_experts (8), got 3");
}

TEST(SpecValidation, TopkGroupAtMostNGroup) {
  MoeCase c = valid_case(QuantScheme::kBf16, RoutingKind::kGroupedTopk);
  c.spec.routing.topk_group = 5;
  EXPECT_EQ(error_of(c), "routing.topk_group: expected 1 <= topk_group <= n_group (4), got 5");
}

TEST(SpecValidation, KeptGroupsMustHoldTopK) {
  MoeCase c = valid_case(QuantScheme::kBf16, RoutingKind::kGroupedTopk);
  c.spec.routing.topk_group = 1;
  c.spec.routing.top_k = 3;
  EXPECT_EQ(error_of(c), "routing.top_k: expected at most the 2 experts of the topk_group kept groups, got 3");
}

TEST(SpecValidation, RouterWeightOnInputNeedsTopOne) {
  MoeCase c = valid_case();
  c.spec.apply_router_weight_on_input = true;
  EXPECT_EQ(error_of(c), "apply_router_weight_on_input: expected top_k == 1, got top_k == 2");
}

TEST(SpecValidation, WeightShapeMismatch) {
  MoeCase c = valid_case();
  Buffer w2(DType::kBF16, {8, 128, 128});
  c.weights.w2 = w2.view();
  EXPECT_EQ(error_of(c), "w2: expected shape [8, 256, 128], got shape [8, 128, 128]");
}

TEST(SpecValidation, HiddenSizeMismatchBetweenXAndW13) {
  MoeCase c = valid_case();
  Buffer x(DType::kBF16, {5, 128});
  c.inputs.x = x.view();
  EXPECT_EQ(error_of(c), "w13: expected shape [8, 256, 128], got shape [8, 256, 256]");
}

TEST(SpecValidation, WrongWeightDtypeForScheme) {
  MoeCase c = valid_case();
  c.spec.quant.scheme = QuantScheme::kFp8Channel;
  EXPECT_EQ(error_of(c), "w13: expected dtype fp8_e4m3, got bf16 [8, 256, 256] on cpu");
}

TEST(SpecValidation, TensorOnTheWrongDevice) {
  MoeCase c = valid_case();
  c.inputs.x.device = Device::kCuda;
  EXPECT_EQ(error_of(c), "x: expected a tensor on cpu, got bf16 [5, 256] on cuda");
}

TEST(SpecValidation, ExpertMapEntryOutOfRange) {
  MoeCase c = valid_case();
  std::vector<int32_t> map = {0, 1, 2, 3, 4, 5, 6, 8};
  c.inputs.expert_map = Tensor::contiguous(map.data(), DType::kI32, {8});
  EXPECT_EQ(error_of(c), "expert_map[7]: expected -1 or a local expert index in [0, 8), got 8");
}

TEST(SpecValidation, ExpertMapEntryDuplicated) {
  MoeCase c = valid_case();
  std::vector<int32_t> map = {0, 1, 2, 3, 4, 5, 6, 3};
  c.inputs.expert_map = Tensor::contiguous(map.data(), DType::kI32, {8});
  EXPECT_EQ(error_of(c), "expert_map[7]: expected a local index no other expert uses, got 3, already the local index of expert 3");
}

TEST(SpecValidation, AllExpertsLocalWithoutAMap) {
  MoeCase c = valid_case();
  c.weights.w13.shape[0] = 4;
  c.weights.w2.shape[0] = 4;
  EXPECT_EQ(error_of(c), "w13: expected all 8 experts when no expert_map is given (E_local == E), got 4 local experts");
}

TEST(SpecValidation, ScaleOfTheWrongShape) {
  MoeCase c = valid_case(QuantScheme::kFp8Channel);
  Buffer scale(DType::kF32, {8, 128});
  c.weights.w13_scale = scale.view();
  EXPECT_EQ(error_of(c), "w13_scale: expected shape [8, 256] for fp8_channel, got shape [8, 128]");
}

TEST(SpecValidation, MissingScale) {
  MoeCase c = valid_case(QuantScheme::kFp8Tensor);
  c.weights.w2_scale.reset();
  EXPECT_EQ(error_of(c), "w2_scale: expected a scale tensor for fp8_tensor, got none");
}

TEST(SpecValidation, Fp8BlocksMustDivideTheMatrices) {
  MoeCase c = valid_case(QuantScheme::kFp8Block);
  c.spec.quant.block_n = 96;
  EXPECT_EQ(error_of(c), "w13: expected I divisible by block_n=96 and H divisible by block_k=128, got I=128, H=256");
}

TEST(SpecValidation, RoutingGivenTwice) {
  MoeCase c = valid_case();
  std::vector<int32_t> ids(10, 0);
  std::vector<float> weights(10, 0.5f);
  c.inputs.topk_ids = Tensor::contiguous(ids.data(), DType::kI32, {5, 2});
  c.inputs.topk_weights = Tensor::contiguous(weights.data(), DType::kF32, {5, 2});
  EXPECT_EQ(error_of(c), "routing: expected either router_logits or topk_ids with topk_weights, got both");
}

TEST(SpecValidation, PrecomputedIdsOutOfRange) {
  MoeCase c = valid_case();
  std::vector<int32_t> ids = {0, 1, 2, 3, 4, 5, 6, 7, 8, 1};
  std::vector<float> weights(10, 0.5f);
  c.inputs.router_logits.reset();
  c.inputs.topk_ids = Tensor::contiguous(ids.data(), DType::kI32, {5, 2});
  c.inputs.topk_weights = Tensor::contiguous(weights.data(), DType::kF32, {5, 2});
  EXPECT_EQ(error_of(c), "topk_ids[4, 0]: expected an expert id in [0, 8), got 8");
}

TEST(SpecValidation, CorrectionBiasOnlyForGroupedTopk) {
  MoeCase c = valid_case();
  std::vector<float> bias(8, 0.1f);
  c.inputs.correction_bias = Tensor::contiguous(bias.data(), DType::kF32, {8});
  EXPECT_EQ(error_of(c), "correction_bias: expected only with grouped_topk routing, got softmax_topk");
}

TEST(SpecValidation, StaticScaleOnlyForPerTensorFp8) {
  MoeCase c = valid_case(QuantScheme::kFp8Block);
  float scale = 0.01f;
  c.weights.input_scale = Tensor::contiguous(&scale, DType::kF32, {1});
  EXPECT_EQ(error_of(c), "input_scale: expected a static activation scale only with fp8_tensor, got fp8_block");
}

TEST(SpecValidation, OutputOfTheWrongShape) {
  const MoeCase c = valid_case();
  Buffer out(DType::kBF16, {4, 256});
  const Tensor view = out.view();
  EXPECT_EQ(moe_forward_cpu(c.spec, c.weights, c.inputs, view).message(), "out: expected shape [5, 256], got shape [4, 256]");
}

TEST(SpecValidation, SpecFromJsonRejectsUnknownNamesAndTypes) {
  EXPECT_EQ(spec_from_json(R"({"routing": {"kind": "topk", "num_experts": 8, "top_k": 2}, "quant": {}})").status().message(),
            "routing.kind: expected one of softmax_topk, topk_softmax, sigmoid_topk, grouped_topk, got 'topk'");
  EXPECT_EQ(spec_from_json(R"({"routing": {"num_experts": "8"}, "quant": {}})").status().message(),
            "epmoe.spec.routing.num_experts: expected a number, got \"8\"");
  EXPECT_EQ(spec_from_json("[1, 2]").status().message(), "epmoe.spec: expected a JSON object, got '[1, 2]'");
}

TEST(SpecValidation, SpecJsonRoundTrips) {
  MoeSpec spec;
  spec.routing = {.kind = RoutingKind::kGroupedTopk, .num_experts = 256, .top_k = 8, .renormalize = true,
                  .score_func = ScoreFunc::kSigmoid, .n_group = 8, .topk_group = 4, .routed_scaling_factor = 2.5f};
  spec.quant = {QuantScheme::kFp8Block, 128, 128};
  spec.activation = Activation::kGelu;
  Result<MoeSpec> parsed = spec_from_json(spec_to_json(spec));
  ASSERT_TRUE(parsed.ok()) << parsed.status().message();
  EXPECT_EQ(spec_to_json(parsed.value()), spec_to_json(spec));
  EXPECT_EQ(parsed->routing.routed_scaling_factor, 2.5f);
  EXPECT_EQ(parsed->activation, Activation::kGelu);
}

}  // namespace
}  // namespace epmoe
