// A small DeepSeek-V3-style fp8 checkpoint layer written the way the public checkpoints
// store it: per expert and projection an e4m3 weight and its weight_scale_inv [N/128, K/128]
// (value = code * scale_inv), shared experts alike, the router's gate.weight and
// e_score_correction_bias; as safetensors bytes, parsed back.
#pragma once

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "epmoe/quantize.h"
#include "epmoe/safetensors.h"

namespace epmoe::testing {

struct CheckpointFixture {
  static constexpr int kExperts = 8;
  static constexpr int64_t kHidden = 256, kIntermediate = 256, kShared = 256;
  std::string prefix = "model.layers.3.mlp.";
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<std::shared_ptr<Buffer>> storage;
  // Dequantised values of every stored matrix, by name: what the layer must reproduce.
  std::map<std::string, std::vector<float>> dequantised;

  explicit CheckpointFixture(uint64_t seed) {
    std::mt19937_64 rng(seed);
    auto matrix = [&](const std::string& name, int64_t n, int64_t k) {
      std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(k)));
      std::vector<float> values(n * k);
      for (float& v : values) v = normal(rng) * (1.0f + static_cast<float>(rng() % 4));  // blocks of varied range
      const Fp8Blocks blocks{n, k, 128, 128};
      auto codes = std::make_shared<Buffer>(DType::kFP8E4M3, std::initializer_list<int64_t>{n, k});
      auto scales = std::make_shared<Buffer>(DType::kF32, std::initializer_list<int64_t>{n / 128, k / 128});
      quantize_fp8_blocks(values.data(), blocks, codes->data_as<uint8_t>(), scales->data_as<float>());
      std::vector<float>& decoded = dequantised[prefix + name];
      decoded.resize(n * k);
      for (int64_t i = 0; i < n * k; ++i)
        decoded[i] = fp8e4m3_to_f32(codes->data_as<uint8_t>()[i]) * scales->data_as<float>()[(i / k / 128) * (k / 128) + (i % k) / 128];
      tensors.emplace_back(prefix + name, codes->view());
      tensors.emplace_back(prefix + name + "_scale_inv", scales->view());
      storage.push_back(codes);
      storage.push_back(scales);
    };
    for (int e = 0; e < kExperts; ++e) {
      const std::string base = "experts." + std::to_string(e) + ".";
      matrix(base + "gate_proj.weight", kIntermediate, kHidden);
      matrix(base + "up_proj.weight", kIntermediate, kHidden);
      matrix(base + "down_proj.weight", kHidden, kIntermediate);
    }
    matrix("shared_experts.gate_proj.weight", kShared, kHidden);
    matrix("shared_experts.up_proj.weight", kShared, kHidden);
    matrix("shared_experts.down_proj.weight", kHidden, kShared);
    auto router = std::make_shared<Buffer>(DType::kBF16, std::initializer_list<int64_t>{kExperts, kHidden});
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < kExperts * kHidden; ++i) router->data_as<uint16_t>()[i] = f32_to_bf16(normal(rng) * 0.1f);
    auto bias = std::make_shared<Buffer>(DType::kF32, std::initializer_list<int64_t>{kExperts});
    for (int e = 0; e < kExperts; ++e) bias->data_as<float>()[e] = normal(rng) * 0.05f;
    tensors.emplace_back(prefix + "gate.weight", router->view());
    tensors.emplace_back(prefix + "gate.e_score_correction_bias", bias->view());
    storage.push_back(router);
    storage.push_back(bias);
  }

  SafetensorsFile file() const {
    Result<std::vector<uint8_t>> bytes = serialize_safetensors(tensors, {{"format", "pt"}});
    return SafetensorsFile::parse(bytes.value(), "<checkpoint>").value();
  }

  // DeepSeek-V3's routing at this size: sigmoid scores, 4 groups of 2, top 2 groups, k = 2.
  static MoeSpec spec() {
    MoeSpec spec;
    spec.routing = {.kind = RoutingKind::kGroupedTopk, .num_experts = kExperts, .top_k = 2, .renormalize = true,
                    .score_func = ScoreFunc::kSigmoid, .n_group = 4, .topk_group = 2, .routed_scaling_factor = 2.5f};
    spec.quant = {QuantScheme::kFp8Block, 128, 128};
    return spec;
  }
};

}  // namespace epmoe::testing
