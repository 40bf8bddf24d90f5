// A MoE problem with its data: the spec and every tensor, owning what it points to.
// Cases come from three places: random data (check, bench, tests), safetensors files in
// the oracle format (docs/ORACLE_FORMAT.md; transformers' outputs, or anyone's own case),
// and presets. The oracle format's metadata key "epmoe.spec" holds the spec as JSON.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epmoe/expert_map.h"
#include "epmoe/moe_spec.h"

namespace epmoe {

struct MoeCase {
  MoeSpec spec;
  MoeWeights weights;
  MoeInputs inputs;
  std::optional<Tensor> expected;  // y [T, H] stored with the case (oracle files)
  std::vector<std::shared_ptr<const void>> storage;  // owns the tensors' memory
};

// The spec as the JSON object of the oracle format, with the field names of RoutingSpec
// and QuantSpec: {"routing": {...}, "quant": {...}, "activation": ..., ...}.
std::string spec_to_json(const MoeSpec& spec);
Result<MoeSpec> spec_from_json(const std::string& text);

// Reads a case in the oracle format; "epmoe.spec" and the tensors are checked as the
// operator would check them.
Result<MoeCase> load_moe_case(const std::string& path);
// Writes `moe_case` with `y` as its expected output.
Status save_moe_case(const std::string& path, const MoeCase& moe_case, const Tensor& y);

struct RandomCaseOptions {
  MoeSpec spec;
  int64_t tokens = 0, hidden = 0, intermediate = 0;
  int64_t shared_intermediate = 0;  // 0: no shared experts
  bool correction_bias = false;     // grouped_topk: draw e_score_correction_bias
  bool static_activation_scales = false;  // fp8_tensor: draw input/intermediate scales
  DType activation_dtype = DType::kBF16;  // x and out
  DType dense_weight_dtype = DType::kBF16;  // bf16 scheme: bf16 or f32 weights
  uint64_t seed = 1;
  // One rank's share: the placement decides which experts are local, and only rank 0
  // holds the shared experts, so the ranks' outputs sum to the whole layer.
  int num_ranks = 1, rank = 0;
  Placement placement = Placement::kLinear;
  // Draw weights only for local experts that receive tokens (the others contribute
  // nothing); the expert map then lists just those. Lets full-size presets fit in memory.
  bool touched_experts_only = false;
};

// Data drawn fresh from `seed`: x, router logits, bias, and each expert's weights from a
// stream of its own (global id), quantised the way a checkpoint of the scheme stores them.
Result<MoeCase> make_random_case(const RandomCaseOptions& options);

// The routing inputs of `epmoe bench`'s GPU timing for `tokens` tokens, from options.seed:
// a small correction bias (trained biases balance the load; large random ones would not) and
// `sets` draws of router logits [T, E], each with the top-k ids [T, k] route_cpu gives them
// (the floor needs the routing). scripts/bench-rows.cpp reads the same routings.
struct BenchRouting {
  std::vector<float> bias;                 // [E], applied where the case has a correction bias
  std::vector<std::vector<float>> logits;  // per set
  std::vector<std::vector<int32_t>> ids;   // per set
};
Result<BenchRouting> draw_bench_routing(const RandomCaseOptions& options, int64_t tokens, int sets);

// Bytes of the weights a case holds (every local expert, shared included).
int64_t weight_bytes(const MoeCase& moe_case);

}  // namespace epmoe
