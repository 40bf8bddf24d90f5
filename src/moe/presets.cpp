#include "epmoe/presets.h"

#include <string>

namespace epmoe {

namespace {

MoeSpec softmax_topk(int experts, int k, QuantScheme scheme) {
  MoeSpec spec;
  spec.routing = {.kind = RoutingKind::kSoftmaxTopk, .num_experts = experts, .top_k = k, .renormalize = true};
  spec.quant.scheme = scheme;
  return spec;
}

MoeSpec llama4(int experts, QuantScheme scheme) {
  MoeSpec spec;
  spec.routing = {.kind = RoutingKind::kSigmoidTopk, .num_experts = experts, .top_k = 1};
  spec.quant.scheme = scheme;
  spec.apply_router_weight_on_input = true;
  return spec;
}

MoeSpec deepseek_v3() {
  MoeSpec spec;
  spec.routing = {.kind = RoutingKind::kGroupedTopk, .num_experts = 256, .top_k = 8, .renormalize = true,
                  .score_func = ScoreFunc::kSigmoid, .n_group = 8, .topk_group = 4,
                  .routed_scaling_factor = 2.5f};
  spec.quant.scheme = QuantScheme::kFp8Block;
  return spec;
}

// Default quantisation = the scheme of the public checkpoint named beside it.
const ModelPreset kPresets[] = {
    {"deepseek-v3", "deepseek-ai/DeepSeek-V3", 7168, 2048, 2048, true, deepseek_v3()},
    {"qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B-FP8", 4096, 1536, 0, false,
     softmax_topk(128, 8, QuantScheme::kFp8Block)},
    {"qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 2048, 768, 0, false, softmax_topk(128, 8, QuantScheme::kBf16)},
    {"llama4-scout", "meta-llama/Llama-4-Scout-17B-16E-Instruct", 5120, 8192, 8192, false,
     llama4(16, QuantScheme::kBf16)},
    {"llama4-maverick", "meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8", 5120, 8192, 8192, false,
     llama4(128, QuantScheme::kFp8Channel)},
    {"mixtral-8x7b", "mistralai/Mixtral-8x7B-Instruct-v0.1", 4096, 14336, 0, false,
     softmax_topk(8, 2, QuantScheme::kBf16)},
};

}  // namespace

std::span<const ModelPreset> model_presets() { return kPresets; }

const ModelPreset* find_preset(std::string_view name) {
  for (const ModelPreset& preset : kPresets)
    if (preset.name == name) return &preset;
  return nullptr;
}

std::string preset_names() {
  std::string names;
  for (const ModelPreset& preset : kPresets) names += (names.empty() ? "" : ", ") + std::string(preset.name);
  return names;
}

}  // namespace epmoe
