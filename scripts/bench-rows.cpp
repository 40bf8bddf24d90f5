// Rows per local expert of rank 0 in `epmoe bench`'s four input sets (ep=8, linear placement,
// seed 1), drawn and routed on the host as bench_cuda.cu draws them, and the row tiles of 128
// they make: where an expert's rows just pass a multiple of 128, the specialised GEMMs run a
// row tile of a few rows that still streams the expert's whole weights.
// Build and run against a host build (build/ from the README):
//   g++ -std=c++20 -O2 -Iinclude -Isrc scripts/bench-rows.cpp build/src/libepmoe.a -o /tmp/bench-rows -lpthread
//   /tmp/bench-rows [TOKENS...]   (default 1024 2048 4096)
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <vector>

#include "core/random.h"
#include "epmoe/expert_map.h"
#include "epmoe/moe_cpu.h"
#include "epmoe/presets.h"

using namespace epmoe;

int main(int argc, char** argv) {
  std::vector<int64_t> token_counts;
  for (int i = 1; i < argc; ++i) token_counts.push_back(std::atoll(argv[i]));
  if (token_counts.empty()) token_counts = {1024, 2048, 4096};
  constexpr int kInputSets = 4, kRanks = 8, kTileRows = 128, kShown = 4;
  for (const ModelPreset& preset : model_presets())
    for (const int64_t T : token_counts) {
      const RoutingSpec& routing = preset.spec.routing;
      const int E = static_cast<int>(routing.num_experts), k = static_cast<int>(routing.top_k);
      const ExpertMap owned = ExpertMap::build(Placement::kLinear, E, kRanks, 0).value();
      Rng rng(1, 0xb1a5);  // the bench's stream: the bias first, then each set's logits
      std::vector<float> bias(E);
      for (float& v : bias) v = rng.centered(0.01f);
      std::optional<Tensor> bias_tensor;
      if (preset.correction_bias) bias_tensor = Tensor::contiguous(bias.data(), DType::kF32, {E});
      std::printf("%.*s T=%lld:", static_cast<int>(preset.name.size()), preset.name.data(), static_cast<long long>(T));
      for (int set = 0; set < kInputSets; ++set) {
        std::vector<float> logits(T * E);
        for (float& v : logits) v = rng.centered(1.5f);
        std::vector<int32_t> ids(T * k);
        std::vector<float> weights(T * k);
        const Status routed = route_cpu(routing, Tensor::contiguous(logits.data(), DType::kF32, {T, E}), bias_tensor,
                                        Tensor::contiguous(ids.data(), DType::kI32, {T, k}),
                                        Tensor::contiguous(weights.data(), DType::kF32, {T, k}));
        if (!routed.ok()) {
          std::fprintf(stderr, "%s\n", routed.message().c_str());
          return 1;
        }
        std::map<int, int> rows;  // local expert -> rows
        for (int32_t id : ids)
          if (owned.local_index(id) >= 0) ++rows[id];
        int tiles = 0;
        for (const auto& [expert, count] : rows) tiles += (count + kTileRows - 1) / kTileRows;
        std::printf(" [%d tiles; rows", tiles);
        int shown = 0;
        for (const auto& [expert, count] : rows)
          if (shown++ < kShown) std::printf(" %d", count);
        std::printf("%s]", rows.size() > kShown ? " ..." : "");
      }
      std::printf("\n");
    }
}
