// One MoE layer read from a Hugging Face checkpoint the way it stores it: one matrix per
// expert and projection, and for fp8 checkpoints their scales. Names (under `prefix`, e.g.
// "model.layers.3.mlp."), as DeepSeek-V3/R1 and Qwen3-MoE write them:
//   experts.{e}.gate_proj.weight [I, H], experts.{e}.up_proj.weight [I, H],
//   experts.{e}.down_proj.weight [H, I], shared_experts.{gate,up,down}_proj.weight,
//   gate.weight [E, H], gate.e_score_correction_bias [E];
// fp8_block: each weight's `weight_scale_inv` [N / 128, K / 128] (value = code * scale_inv);
// fp8_channel / fp8_tensor: `weight_scale` [N, 1] or [N] / [] or [1].
// The layer's w13 stacks gate rows then up rows per expert ([E_local, 2I, H]), as the
// operator takes them, and the scales alike; those copies live in `storage`. What needs no
// stacking (shared w2, the router) stays a view of the file, which must outlive the layer.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epmoe/expert_map.h"
#include "epmoe/moe_spec.h"
#include "epmoe/safetensors.h"

namespace epmoe {

struct CheckpointLayer {
  MoeWeights weights;                     // the local experts, shared experts if present
  Tensor router_weight;                   // [E, H] gate.weight
  std::optional<Tensor> correction_bias;  // [E] f32
  std::vector<std::shared_ptr<const void>> storage;  // owns the stacked tensors
};

// The experts `experts` owns (local order), from `file`. Errors name the missing or
// misshapen tensor.
Result<CheckpointLayer> load_checkpoint_layer(const SafetensorsFile& file, const std::string& prefix,
                                              const MoeSpec& spec, const ExpertMap& experts);

}  // namespace epmoe
