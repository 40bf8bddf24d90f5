// The C ABI (include/epmoe/c_api.h) on the CPU: its results equal the C++ operator's bit
// for bit, and every bad argument comes back as an error code with a message naming it.
#include "epmoe/c_api.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "epmoe/presets.h"
#include "moe_test_util.h"

namespace epmoe {
namespace {

using testing::fresh_seed;
using testing::random_case;

epmoe_tensor to_c(const Tensor& tensor) {
  epmoe_tensor c{};
  c.data = tensor.data;
  c.dtype = static_cast<int32_t>(tensor.dtype);
  c.device = tensor.device == Device::kCuda ? EPMOE_CUDA : EPMOE_CPU;
  c.rank = tensor.rank;
  for (int d = 0; d < tensor.rank; ++d) {
    c.shape[d] = tensor.shape[d];
    c.strides[d] = tensor.strides[d];
  }
  return c;
}

epmoe_tensor to_c(const std::optional<Tensor>& tensor) { return tensor ? to_c(*tensor) : epmoe_tensor{}; }

// The names and numbers of a RoutingSpec / MoeSpec as the C structs carry them.
struct CSpec {
  std::string kind, score_func, scheme, activation;
  epmoe_spec spec{};

  explicit CSpec(const MoeSpec& s)
      : kind(routing_kind_name(s.routing.kind)), score_func(score_func_name(s.routing.score_func)),
        scheme(quant_scheme_name(s.quant.scheme)), activation(activation_name(s.activation)) {
    spec.routing = {kind.c_str(), s.routing.num_experts, s.routing.top_k, s.routing.renormalize, score_func.c_str(),
                    s.routing.n_group, s.routing.topk_group, s.routing.routed_scaling_factor};
    spec.quant_scheme = scheme.c_str();
    spec.block_n = s.quant.block_n;
    spec.block_k = s.quant.block_k;
    spec.activation = activation.c_str();
    spec.apply_router_weight_on_input = s.apply_router_weight_on_input;
  }
};

// A case with precomputed routing (what vLLM's fused_experts receives).
MoeCase routed_case(MoeSpec spec, uint64_t seed) {
  RandomCaseOptions options{.spec = spec, .tokens = 9, .hidden = 256, .intermediate = 128, .seed = seed};
  options.num_ranks = 2;  // an expert map: half the experts local
  options.rank = 1;
  MoeCase moe_case = random_case(options);
  auto ids = std::make_shared<Buffer>(DType::kI32, std::initializer_list<int64_t>{9, spec.routing.top_k});
  auto weights = std::make_shared<Buffer>(DType::kF32, std::initializer_list<int64_t>{9, spec.routing.top_k});
  EXPECT_TRUE(route_cpu(spec.routing, *moe_case.inputs.router_logits, moe_case.inputs.correction_bias, ids->view(),
                        weights->view()).ok());
  moe_case.inputs.router_logits.reset();
  moe_case.inputs.correction_bias.reset();
  moe_case.inputs.topk_ids = ids->view();
  moe_case.inputs.topk_weights = weights->view();
  moe_case.storage.push_back(ids);
  moe_case.storage.push_back(weights);
  return moe_case;
}

epmoe_moe_tensors tensors_of(const MoeCase& c, const Tensor& out) {
  epmoe_moe_tensors t{};
  t.x = to_c(c.inputs.x);
  t.w13 = to_c(c.weights.w13);
  t.w2 = to_c(c.weights.w2);
  t.w13_scale = to_c(c.weights.w13_scale);
  t.w2_scale = to_c(c.weights.w2_scale);
  t.input_scale = to_c(c.weights.input_scale);
  t.intermediate_scale = to_c(c.weights.intermediate_scale);
  t.topk_ids = to_c(c.inputs.topk_ids);
  t.topk_weights = to_c(c.inputs.topk_weights);
  t.expert_map = to_c(c.inputs.expert_map);
  t.out = to_c(out);
  return t;
}

TEST(CApi, VersionMatchesHeader) { EXPECT_EQ(epmoe_c_api_version(), EPMOE_C_API_VERSION); }

TEST(CApi, FusedExpertsEqualsCppOperatorForEveryScheme) {
  for (const char* preset : {"deepseek-v3", "qwen3-30b-a3b"}) {
    for (QuantScheme scheme : {QuantScheme::kBf16, QuantScheme::kFp8Channel, QuantScheme::kFp8Block}) {
      MoeSpec spec = find_preset(preset)->spec;
      spec.quant.scheme = scheme;
      const uint64_t seed = fresh_seed();
      SCOPED_TRACE(std::string(preset) + " " + std::string(quant_scheme_name(scheme)) + " seed " + std::to_string(seed));
      const MoeCase c = routed_case(spec, seed);
      Buffer expected(DType::kBF16, {9, 256}), got(DType::kBF16, {9, 256});
      ASSERT_TRUE(moe_forward_cpu(c.spec, c.weights, c.inputs, expected.view()).ok());
      ASSERT_TRUE(fill_with_nan(got.view()).ok());
      const CSpec c_spec(c.spec);
      const epmoe_moe_tensors tensors = tensors_of(c, got.view());
      size_t bytes = 1;
      ASSERT_EQ(epmoe_fused_experts_workspace_bytes(&c_spec.spec, &tensors, &bytes), EPMOE_OK) << epmoe_last_error();
      EXPECT_EQ(bytes, 0u);  // the CPU needs none
      ASSERT_EQ(epmoe_fused_experts(&c_spec.spec, &tensors, nullptr, 0, nullptr), EPMOE_OK) << epmoe_last_error();
      EXPECT_EQ(std::memcmp(expected.view().data, got.view().data, expected.view().nbytes()), 0);
      EXPECT_GT(testing::norm(to_doubles(got.view())), 0.0);
    }
  }
}

TEST(CApi, RouteEqualsRouteCpuForEveryKind) {
  MoeSpec topk_softmax = find_preset("mixtral-8x7b")->spec;  // gpt-oss's routing
  topk_softmax.routing.kind = RoutingKind::kTopkSoftmax;
  for (const MoeSpec& spec : {find_preset("mixtral-8x7b")->spec, find_preset("deepseek-v3")->spec,
                              find_preset("llama4-scout")->spec, topk_softmax}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(std::string(routing_kind_name(spec.routing.kind)) + " seed " + std::to_string(seed));
    const MoeCase c = random_case({.spec = spec, .tokens = 13, .hidden = 64, .intermediate = 32,
                                   .correction_bias = spec.routing.kind == RoutingKind::kGroupedTopk,
                                   .seed = seed});
    const int k = c.spec.routing.top_k;
    Buffer ids(DType::kI32, {13, k}), weights(DType::kF32, {13, k}), got_ids(DType::kI32, {13, k}),
        got_weights(DType::kF32, {13, k});
    ASSERT_TRUE(route_cpu(c.spec.routing, *c.inputs.router_logits, c.inputs.correction_bias, ids.view(),
                          weights.view()).ok());
    const CSpec c_spec(c.spec);
    const epmoe_tensor logits = to_c(c.inputs.router_logits), bias = to_c(c.inputs.correction_bias);
    const epmoe_tensor out_ids = to_c(got_ids.view()), out_weights = to_c(got_weights.view());
    ASSERT_EQ(epmoe_route(&c_spec.spec.routing, &logits, c.inputs.correction_bias ? &bias : nullptr, &out_ids,
                          &out_weights, nullptr),
              EPMOE_OK)
        << epmoe_last_error();
    EXPECT_EQ(std::memcmp(ids.view().data, got_ids.view().data, ids.view().nbytes()), 0);
    EXPECT_EQ(std::memcmp(weights.view().data, got_weights.view().data, weights.view().nbytes()), 0);
  }
}

TEST(CApi, BadArgumentsReturnCodeAndNamedMessage) {
  const MoeCase c = routed_case(find_preset("qwen3-30b-a3b")->spec, fresh_seed());
  Buffer out(DType::kBF16, {9, 256});
  const CSpec good(c.spec);
  auto error_of = [&](const epmoe_spec& spec, const epmoe_moe_tensors& tensors) {
    const int code = epmoe_fused_experts(&spec, &tensors, nullptr, 0, nullptr);
    return std::to_string(code) + " " + epmoe_last_error();
  };
  epmoe_spec spec = good.spec;
  spec.routing.kind = "top2";
  EXPECT_EQ(error_of(spec, tensors_of(c, out.view())),
            "1 routing.kind: expected one of softmax_topk, topk_softmax, sigmoid_topk, grouped_topk, got 'top2'");
  spec = good.spec;
  spec.quant_scheme = nullptr;
  EXPECT_EQ(error_of(spec, tensors_of(c, out.view())),
            "1 quant.scheme: expected one of bf16, fp8_tensor, fp8_channel, fp8_block, got ''");
  epmoe_moe_tensors tensors = tensors_of(c, out.view());
  tensors.x = {};
  EXPECT_EQ(error_of(good.spec, tensors), "1 x: expected a tensor, got none");
  tensors = tensors_of(c, out.view());
  tensors.w2.dtype = 42;
  EXPECT_EQ(error_of(good.spec, tensors), "1 w2: expected a dtype code in 0..5 (EPMOE_F32..EPMOE_I64), got 42");
  tensors = tensors_of(c, out.view());
  tensors.out.shape[1] = 128;
  EXPECT_EQ(error_of(good.spec, tensors), "1 out: expected shape [9, 256], got shape [9, 128]");
  EXPECT_EQ(epmoe_fused_experts(nullptr, &tensors, nullptr, 0, nullptr), EPMOE_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(epmoe_last_error()), "spec, tensors: expected non-NULL pointers, got NULL");
  EXPECT_EQ(epmoe_fused_experts_workspace_bytes(&good.spec, &tensors, nullptr), EPMOE_INVALID_ARGUMENT);
  // A success clears the message.
  tensors = tensors_of(c, out.view());
  EXPECT_EQ(epmoe_fused_experts(&good.spec, &tensors, nullptr, 0, nullptr), EPMOE_OK);
  EXPECT_STREQ(epmoe_last_error(), "");
}

}  // namespace
}  // namespace epmoe
