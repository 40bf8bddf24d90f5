// An oracle no one here wrote: MoE blocks of Hugging Face transformers (Mixtral, Qwen3-MoE,
// DeepSeek-V3 with its grouped router and bias, Llama-4 with weights on the input), saved
// by scripts/make_oracle_data.py. Our operator must reproduce their outputs.
#include <gtest/gtest.h>

#include <cmath>

#include "epmoe/moe_case.h"
#include "epmoe/moe_cpu.h"
#include "epmoe/naive_moe.h"
#include "epmoe/safetensors.h"

namespace epmoe {
namespace {

class TransformersOracle : public ::testing::TestWithParam<std::string> {};

TEST_P(TransformersOracle, OperatorReproducesTransformersOutput) {
  const std::string path = std::string(EPMOE_TEST_DATA_DIR) + "/oracle_" + GetParam() + ".safetensors";
  Result<MoeCase> moe_case = load_moe_case(path);
  ASSERT_TRUE(moe_case.ok()) << moe_case.status().message();
  ASSERT_TRUE(moe_case->expected.has_value());
  const Tensor& x = moe_case->inputs.x;
  Buffer out(x.dtype, {x.size(0), x.size(1)});
  ASSERT_TRUE(fill_with_nan(out.view()).ok());
  const Status status = moe_forward_cpu(moe_case->spec, moe_case->weights, moe_case->inputs, out.view());
  ASSERT_TRUE(status.ok()) << status.message();
  const std::vector<double> expected = to_doubles(*moe_case->expected);
  const double error = relative_error(to_doubles(out.view()), expected);
  EXPECT_LT(error, 1e-2);
  // Both sides compute in f32 from the same f32 data: the agreement is far tighter.
  EXPECT_LT(error, 1e-5) << "f32 against f32 should agree to rounding";
  // The naive double loop agrees too.
  EXPECT_LT(relative_error(naive_moe(moe_case->spec, moe_case->weights, moe_case->inputs).value(), expected), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(FourFamilies, TransformersOracle,
                         ::testing::Values("mixtral", "qwen3_moe", "deepseek_v3", "llama4"));

TEST(TransformersOracle, FilesRecordTheirSource) {
  Result<SafetensorsFile> file = SafetensorsFile::open(std::string(EPMOE_TEST_DATA_DIR) + "/oracle_deepseek_v3.safetensors");
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_NE(file->metadata().at("epmoe.source").find("transformers"), std::string::npos);
  EXPECT_TRUE(file->contains("e_score_correction_bias"));
}

TEST(MoeCaseFile, SavedCaseLoadsBackAndReproducesItsOutput) {
  RandomCaseOptions options;
  options.spec.routing = {.kind = RoutingKind::kSoftmaxTopk, .num_experts = 8, .top_k = 2, .renormalize = true};
  options.spec.quant.scheme = QuantScheme::kFp8Block;
  options.tokens = 6;
  options.hidden = 128;
  options.intermediate = 128;
  options.shared_intermediate = 128;
  options.num_ranks = 2;
  options.seed = 99;
  Result<MoeCase> original = make_random_case(options);
  ASSERT_TRUE(original.ok()) << original.status().message();
  Buffer y(DType::kBF16, {6, 128});
  ASSERT_TRUE(moe_forward_cpu(original->spec, original->weights, original->inputs, y.view()).ok());
  const std::string path = ::testing::TempDir() + "/epmoe_case.safetensors";
  ASSERT_TRUE(save_moe_case(path, original.value(), y.view()).ok());

  Result<MoeCase> loaded = load_moe_case(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  ASSERT_TRUE(loaded->inputs.expert_map.has_value());
  Buffer again(DType::kBF16, {6, 128});
  ASSERT_TRUE(moe_forward_cpu(loaded->spec, loaded->weights, loaded->inputs, again.view()).ok());
  EXPECT_EQ(to_doubles(again.view()), to_doubles(*loaded->expected));
}

TEST(MoeCaseFile, MissingSpecIsReported) {
  std::vector<float> x(4, 1.0f);
  const std::string path = ::testing::TempDir() + "/epmoe_nospec.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"x", Tensor::contiguous(x.data(), DType::kF32, {2, 2})}}, {}).ok());
  EXPECT_EQ(load_moe_case(path).status().message(), path + ": __metadata__: expected the key 'epmoe.spec', got no such key");
}

}  // namespace
}  // namespace epmoe
