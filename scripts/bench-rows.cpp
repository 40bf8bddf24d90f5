// Rows per local expert of rank 0 in `epmoe bench`'s four input sets (ep=8, linear placement,
// seed 1: draw_bench_routing, as the bench draws them), and the row tiles of 128 they make:
// where an expert's rows just pass a multiple of 128, the specialised GEMMs run a row tile of
// a few rows that still streams the expert's whole weights.
// Build and run against a host build (build/ from the README):
//   g++ -std=c++20 -O2 -Iinclude -Isrc scripts/bench-rows.cpp build/src/libepmoe.a -o /tmp/bench-rows -lpthread
//   /tmp/bench-rows [TOKENS...]   (default 1024 2048 4096)
#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

#include "epmoe/expert_map.h"
#include "epmoe/moe_case.h"
#include "epmoe/presets.h"

using namespace epmoe;

int main(int argc, char** argv) {
  std::vector<int64_t> token_counts;
  for (int i = 1; i < argc; ++i) token_counts.push_back(std::atoll(argv[i]));
  if (token_counts.empty()) token_counts = {1024, 2048, 4096};
  constexpr int kInputSets = 4, kRanks = 8, kTileRows = 128, kShown = 4;
  for (const ModelPreset& preset : model_presets())
    for (const int64_t T : token_counts) {
      RandomCaseOptions options;  // the bench's defaults: seed 1
      options.spec = preset.spec;
      options.correction_bias = preset.correction_bias;
      const Result<BenchRouting> routing = draw_bench_routing(options, T, kInputSets);
      if (!routing.ok()) {
        std::fprintf(stderr, "%s\n", routing.status().to_string().c_str());
        return 1;
      }
      const ExpertMap owned =
          ExpertMap::build(Placement::kLinear, static_cast<int>(preset.spec.routing.num_experts), kRanks, 0).value();
      std::printf("%.*s T=%lld:", static_cast<int>(preset.name.size()), preset.name.data(), static_cast<long long>(T));
      for (const std::vector<int32_t>& ids : routing->ids) {
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
