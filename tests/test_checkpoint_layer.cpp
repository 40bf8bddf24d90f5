// Reading a checkpoint's MoE layer (include/epmoe/checkpoint_layer.h): the stacked weights
// and scales decode to exactly the values the per-expert tensors hold, for the experts a
// rank owns; the layer runs through the operator; missing and misshapen tensors are named.
#include "epmoe/checkpoint_layer.h"

#include <gtest/gtest.h>

#include "checkpoint_test_util.h"
#include "epmoe/moe_cpu.h"
#include "epmoe/naive_moe.h"
#include "moe_test_util.h"

namespace epmoe {
namespace {

using testing::CheckpointFixture;

// Decoded value (row, col) of expert `local`'s matrix in a stacked [E_local, N, K] fp8
// tensor with block scales [E_local, N / 128, K / 128].
float decoded(const Tensor& codes, const Tensor& scales, int64_t local, int64_t row, int64_t col) {
  const int64_t N = codes.size(1), K = codes.size(2);
  const uint8_t code = codes.data_as<uint8_t>()[(local * N + row) * K + col];
  const float scale = scales.data_as<float>()[(local * (N / 128) + row / 128) * (K / 128) + col / 128];
  return fp8e4m3_to_f32(code) * scale;
}

TEST(CheckpointLayer, StackedExpertsDecodeToTheCheckpointsValues) {
  const CheckpointFixture checkpoint(testing::fresh_seed());
  const SafetensorsFile file = checkpoint.file();
  const ExpertMap owned = ExpertMap::build(Placement::kRoundRobin, CheckpointFixture::kExperts, 3, 1).value();
  Result<CheckpointLayer> layer = load_checkpoint_layer(file, checkpoint.prefix, CheckpointFixture::spec(), owned);
  ASSERT_TRUE(layer.ok()) << layer.status().message();
  const MoeWeights& w = layer->weights;
  const int64_t H = CheckpointFixture::kHidden, I = CheckpointFixture::kIntermediate;
  ASSERT_TRUE(w.w13.has_shape({owned.num_local(), 2 * I, H})) << w.w13.describe();
  ASSERT_TRUE(w.w13_scale->has_shape({owned.num_local(), 2 * I / 128, H / 128})) << w.w13_scale->describe();
  for (int local = 0; local < owned.num_local(); ++local) {
    const std::string base = checkpoint.prefix + "experts." + std::to_string(owned.global_ids()[local]) + ".";
    const auto& gate = checkpoint.dequantised.at(base + "gate_proj.weight");
    const auto& up = checkpoint.dequantised.at(base + "up_proj.weight");
    const auto& down = checkpoint.dequantised.at(base + "down_proj.weight");
    for (int64_t n = 0; n < I; ++n)
      for (int64_t k = 0; k < H; ++k) {
        ASSERT_EQ(decoded(w.w13, *w.w13_scale, local, n, k), gate[n * H + k]) << base << " gate " << n << "," << k;
        ASSERT_EQ(decoded(w.w13, *w.w13_scale, local, I + n, k), up[n * H + k]) << base << " up " << n << "," << k;
      }
    for (int64_t n = 0; n < H; ++n)
      for (int64_t k = 0; k < I; ++k)
        ASSERT_EQ(decoded(w.w2, *w.w2_scale, local, n, k), down[n * I + k]) << base << " down " << n << "," << k;
  }
  ASSERT_TRUE(w.shared_w13 && w.shared_w13->has_shape({2 * CheckpointFixture::kShared, H}));
  EXPECT_TRUE(layer->correction_bias.has_value());
  EXPECT_TRUE(layer->router_weight.has_shape({CheckpointFixture::kExperts, H}));
}

TEST(CheckpointLayer, RunsThroughTheOperator) {
  const CheckpointFixture checkpoint(testing::fresh_seed());
  const SafetensorsFile file = checkpoint.file();
  const MoeSpec spec = CheckpointFixture::spec();
  const ExpertMap all = ExpertMap::build(Placement::kLinear, CheckpointFixture::kExperts, 1, 0).value();
  Result<CheckpointLayer> layer = load_checkpoint_layer(file, checkpoint.prefix, spec, all);
  ASSERT_TRUE(layer.ok()) << layer.status().message();
  const int64_t T = 37, H = CheckpointFixture::kHidden;
  Buffer x(DType::kBF16, {T, H}), logits(DType::kF32, {T, CheckpointFixture::kExperts}), out(DType::kBF16, {T, H});
  std::mt19937_64 rng(testing::fresh_seed());
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < T * H; ++i) x.data_as<uint16_t>()[i] = f32_to_bf16(normal(rng));
  for (int64_t i = 0; i < T * CheckpointFixture::kExperts; ++i) logits.data_as<float>()[i] = normal(rng);
  MoeInputs inputs;
  inputs.x = x.view();
  inputs.router_logits = logits.view();
  inputs.correction_bias = layer->correction_bias;
  ASSERT_TRUE(fill_with_nan(out.view()).ok());
  const Status status = moe_forward_cpu(spec, layer->weights, inputs, out.view());
  ASSERT_TRUE(status.ok()) << status.message();
  Result<std::vector<double>> reference = naive_moe(spec, layer->weights, inputs, {.quantize_activations = true});
  ASSERT_TRUE(reference.ok());
  EXPECT_LT(relative_error(to_doubles(out.view()), reference.value()), 3e-2);
}

TEST(CheckpointLayer, MissingOrMisshapenTensorsAreNamed) {
  CheckpointFixture checkpoint(testing::fresh_seed());
  const MoeSpec spec = CheckpointFixture::spec();
  const ExpertMap all = ExpertMap::build(Placement::kLinear, CheckpointFixture::kExperts, 1, 0).value();
  // Drop expert 5's up-projection scale.
  std::erase_if(checkpoint.tensors, [&](const auto& entry) {
    return entry.first == checkpoint.prefix + "experts.5.up_proj.weight_scale_inv";
  });
  Result<CheckpointLayer> missing = load_checkpoint_layer(checkpoint.file(), checkpoint.prefix, spec, all);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(),
            "model.layers.3.mlp.experts.5.up_proj.weight_scale_inv: expected a tensor in the checkpoint, got none");
  // A per-channel spec finds block scales where it expects weight_scale.
  MoeSpec channel = spec;
  channel.quant.scheme = QuantScheme::kFp8Channel;
  Result<CheckpointLayer> wrong = load_checkpoint_layer(checkpoint.file(), checkpoint.prefix, channel, all);
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().message(),
            "model.layers.3.mlp.experts.0.gate_proj.weight_scale: expected a tensor in the checkpoint, got none");
}

}  // namespace
}  // namespace epmoe
