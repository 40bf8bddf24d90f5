// The host-side rules of the GEMMs' row-tile schedule (moe/cuda/launchers.h). The operator
// sizes its GEMM grids from them before any routing is known (no host synchronisation), so
// they must hold for every way the pairs can fall: max_row_tiles must bound the tiles
// sort_pairs makes for any spread of slots over the groups, and the tile and split choices
// must stay inside what the kernels were built for. Host code only: runs without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "moe/cuda/launchers.h"

namespace epmoe {
namespace {

// Row tiles sort_pairs makes: ceil(count / tile_rows) per group.
int64_t tiles_needed(const std::vector<int64_t>& counts, int tile_rows) {
  int64_t tiles = 0;
  for (int64_t count : counts) tiles += (count + tile_rows - 1) / tile_rows;
  return tiles;
}

TEST(TileSchedule, MaxRowTilesBoundsEverySpreadOfSlots) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t groups = 1 + static_cast<int64_t>(rng() % 40);
    const int64_t slots = static_cast<int64_t>(rng() % 5000);
    const int64_t used = slots == 0 ? 0 : static_cast<int64_t>(rng() % (slots + 1));  // pairs of local experts
    std::vector<int64_t> counts(groups, 0);
    switch (trial % 3) {
      case 0:  // spread at random
        for (int64_t s = 0; s < used; ++s) ++counts[rng() % groups];
        break;
      case 1:  // all in one group (worst imbalance)
        counts[rng() % groups] = used;
        break;
      default:  // one slot short of a whole tile in as many groups as possible (most partial tiles)
        for (int64_t g = 0, left = used; g < groups && left > 0; ++g) {
          counts[g] = std::min<int64_t>(left, 15);
          left -= counts[g];
          if (g == groups - 1) counts[g] += left;
        }
        break;
    }
    for (int tile_rows : {16, 64, 128}) {
      const int64_t bound = cuda::max_row_tiles(slots, groups, tile_rows);
      EXPECT_GE(bound, 1);
      EXPECT_LE(tiles_needed(counts, tile_rows), bound)
          << slots << " slots, " << used << " used, " << groups << " groups, tile rows " << tile_rows;
    }
  }
}

TEST(TileSchedule, TileRowsGrowWithRowsPerGroup) {
  int previous = 0;
  for (int64_t rows_per_group = 1; rows_per_group <= 4096; rows_per_group *= 2) {
    const int rows = cuda::choose_tile_rows(rows_per_group);
    EXPECT_GE(rows, previous) << rows_per_group << " rows per group";
    EXPECT_TRUE(rows == 16 || rows == 64 || rows == 128) << rows;
    previous = rows;
  }
  EXPECT_EQ(cuda::choose_tile_rows(16), 16);  // a decode step: up to 16 rows an expert
  EXPECT_EQ(cuda::choose_tile_rows(17), 64);
  EXPECT_EQ(cuda::choose_tile_rows(32), 64);  // measured: the medium tile up to 32 rows an expert
  EXPECT_EQ(cuda::choose_tile_rows(33), 128);
  EXPECT_EQ(cuda::choose_tile_rows(4096), 128);
}

// The plan's lists hold every tile sort_pairs can make: the main list (routed groups, and the
// shared group of T rows unless apart) for any spread of the T k pairs over the local experts,
// and the shared list exactly ceil(T / its height).
TEST(TileSchedule, PlanHoldsEveryTileForAnySpreadOfPairs) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t tokens = 1 + static_cast<int64_t>(rng() % 20000), top_k = 1 + static_cast<int64_t>(rng() % 8);
    const int64_t experts = top_k + static_cast<int64_t>(rng() % 256);
    const int64_t local = 1 + static_cast<int64_t>(rng() % experts);
    const int64_t shared_intermediate = trial % 2 == 0 ? 0 : 128 * (1 + static_cast<int64_t>(rng() % 80));
    const cuda::TilePlan plan = cuda::plan_tiles(tokens, top_k, experts, local, shared_intermediate, 1024, 1024);
    SCOPED_TRACE(std::to_string(tokens) + " tokens, k " + std::to_string(top_k) + ", " + std::to_string(local) + "/" +
                 std::to_string(experts) + " experts, I_s " + std::to_string(shared_intermediate));
    std::vector<int64_t> counts(local, 0);
    const int64_t local_pairs = static_cast<int64_t>(rng() % (tokens * top_k + 1));
    if (trial % 3 == 0) counts[rng() % local] = local_pairs;  // all on one expert
    else
      for (int64_t p = 0; p < local_pairs; ++p) ++counts[rng() % local];
    const bool shared_apart = plan.shared_tile_rows > 0;
    EXPECT_TRUE(shared_intermediate > 0 || !shared_apart);
    const int64_t shared_in_main = shared_intermediate > 0 && !shared_apart ? (tokens + plan.tile_rows - 1) / plan.tile_rows : 0;
    EXPECT_EQ(plan.shared_main_tiles, shared_in_main);
    EXPECT_LE(tiles_needed(counts, plan.tile_rows) + shared_in_main, plan.max_tiles);
    if (shared_apart) {
      EXPECT_NE(plan.shared_tile_rows, plan.tile_rows);
      EXPECT_EQ(plan.shared_tiles, (tokens + plan.shared_tile_rows - 1) / plan.shared_tile_rows);
    } else {
      EXPECT_EQ(plan.shared_tiles, 0);
    }
  }
}

TEST(TileSchedule, RoutedTilesFollowExpectedRowsAndSharedExpertsGoApartOnlyWhenTheyFillTheGpu) {
  // deepseek-v3 at ep=8 (32 of 256 experts local, one shared expert of I_s = 2048).
  EXPECT_EQ(cuda::plan_tiles(16, 8, 256, 32, 2048, 7168, 2048).tile_rows, 16);
  const cuda::TilePlan mid = cuda::plan_tiles(256, 8, 256, 32, 2048, 7168, 2048);
  EXPECT_EQ(mid.tile_rows, 64) << "8 routed rows an expert, but 256 shared rows in the same list";
  EXPECT_EQ(mid.shared_tiles, 0) << "256 shared rows alone would leave most SMs idle";
  const cuda::TilePlan large = cuda::plan_tiles(16384, 8, 256, 32, 2048, 7168, 2048);
  EXPECT_EQ(large.tile_rows, 128);
  EXPECT_EQ(large.shared_tiles, 0) << "same height: one list";
  // Without shared experts only the routed rows count: qwen3-235b-a22b (128 experts, k = 8)
  // at ep=8, 64 tokens: 4 rows an expert, not the 64 x 8 / 16 of the upper bound.
  EXPECT_EQ(cuda::plan_tiles(64, 8, 128, 16, 0, 4096, 1536).tile_rows, 16);
  // Llama-4 Maverick at ep=8 (16 of 128 experts local, k = 1, shared I_s = 8192) at 1024
  // tokens: 8 routed rows an expert on the decode tile; the 1024 shared rows on 8 x 64 CTAs
  // of their own.
  const cuda::TilePlan maverick = cuda::plan_tiles(1024, 1, 128, 16, 8192, 5120, 8192);
  EXPECT_EQ(maverick.tile_rows, 16);
  EXPECT_EQ(maverick.shared_tile_rows, 128);
  EXPECT_EQ(maverick.shared_tiles, 8);
  // Llama-4 Scout (16 experts, k = 1) at 1024 tokens: 64 routed rows an expert take the
  // shared rows' 128-row tile, so both share one list.
  const cuda::TilePlan scout = cuda::plan_tiles(1024, 1, 16, 16, 8192, 5120, 8192);
  EXPECT_EQ(scout.tile_rows, 128);
  EXPECT_EQ(scout.shared_tiles, 0);
}

TEST(TileSchedule, KSplitsOnlyForGridsUnderAWaveAndNeverBelowFourKTiles) {
  for (int tile_rows : {16, 64, 128})
    for (int64_t n : {256, 2048, 7168})
      for (int64_t k : {128, 256, 768, 2048, 7168, 14336}) {
        int previous = cuda::kMaxKSplits;
        for (int64_t row_tiles : {1, 2, 8, 64, 1000}) {
          const int splits = cuda::choose_k_splits(tile_rows, row_tiles, n, k);
          SCOPED_TRACE(std::to_string(tile_rows) + " rows, " + std::to_string(row_tiles) + " tiles, n " +
                       std::to_string(n) + ", k " + std::to_string(k));
          EXPECT_GE(splits, 1);
          EXPECT_LE(splits, previous) << "more tiles never split more";
          if (splits > 1) EXPECT_GE(k / splits, 4 * 64) << "each split keeps at least four bf16 K tiles";
          if (row_tiles == 1000) EXPECT_EQ(splits, 1) << "the grid fills the GPU on its own";
          previous = splits;
        }
      }
  // One expert's decode step over a wide matrix leaves SMs idle without a split.
  EXPECT_GT(cuda::choose_k_splits(16, 1, 7168, 2048), 1);
  // Mixtral at ep=8 holds one expert (H = 4096, I = 14336): GEMM2 has 32 column tiles of
  // 128 on one medium row tile (T = 256), 16 of 256 on two specialised ones (T = 1024).
  EXPECT_EQ(cuda::choose_k_splits(64, 1, 4096, 14336), cuda::kMaxKSplits);
  EXPECT_GT(cuda::choose_k_splits(128, 2, 4096, 14336), 1);
  EXPECT_EQ(cuda::plan_tiles(1024, 2, 8, 1, 0, 4096, 14336).k_splits, cuda::choose_k_splits(128, 2, 4096, 14336));
  // deepseek-v3 at ep=8, 16k tokens: thousands of CTAs, no split.
  EXPECT_EQ(cuda::plan_tiles(16384, 8, 256, 32, 2048, 7168, 2048).k_splits, 1);
}

// E[ceil(n / rows)], n ~ Binomial(T, p), against its exact value where n is at most one, and
// against the mean over many draws.
TEST(TileSchedule, ExpectedTilesPerExpertIsTheBinomialMean) {
  EXPECT_DOUBLE_EQ(cuda::expected_tiles_per_expert(0, 0.5, 16), 0.0);
  EXPECT_NEAR(cuda::expected_tiles_per_expert(1, 8.0 / 256, 16), 8.0 / 256, 1e-12);  // P(n = 1)
  EXPECT_NEAR(cuda::expected_tiles_per_expert(5, 0.25, 1), 5 * 0.25, 1e-12);          // rows of one: E[n]
  EXPECT_DOUBLE_EQ(cuda::expected_tiles_per_expert(300, 1.0, 128), 3.0);
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t tokens = 1 + static_cast<int64_t>(rng() % 20000);
    const double pick = std::uniform_real_distribution<double>(0.001, 0.5)(rng);
    const int rows = std::vector<int>{16, 64, 128}[rng() % 3];
    std::binomial_distribution<int64_t> rows_of_expert(tokens, pick);
    constexpr int kDraws = 4000;
    double sum = 0, sum_squares = 0;
    for (int d = 0; d < kDraws; ++d) {
      const double tiles = static_cast<double>((rows_of_expert(rng) + rows - 1) / rows);
      sum += tiles, sum_squares += tiles * tiles;
    }
    const double mean = sum / kDraws, spread = std::sqrt(std::max(0.0, sum_squares / kDraws - mean * mean) / kDraws);
    EXPECT_NEAR(cuda::expected_tiles_per_expert(tokens, pick, rows), mean, 5 * spread + 1e-3)
        << tokens << " tokens, pick " << pick << ", rows " << rows;
  }
}

// The plan's likely tile count against routings drawn as the model draws them (each token k
// distinct experts of E, uniformly), counting the tiles of the rank's first L experts.
TEST(TileSchedule, LikelyTilesMatchDrawnRoutings) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Shape {
    int64_t tokens, top_k, experts, local, shared_intermediate;
  };
  for (const Shape& s : {Shape{1, 8, 256, 32, 2048}, Shape{16, 8, 256, 32, 2048}, Shape{2048, 8, 128, 16, 0},
                         Shape{1024, 2, 8, 1, 0}, Shape{4096, 8, 256, 256, 0}, Shape{64, 8, 128, 128, 0}}) {
    const cuda::TilePlan plan =
        cuda::plan_tiles(s.tokens, s.top_k, s.experts, s.local, s.shared_intermediate, 1024, 1024);
    const int64_t shared_in_main = s.shared_intermediate > 0 && plan.shared_tile_rows == 0
                                       ? (s.tokens + plan.tile_rows - 1) / plan.tile_rows
                                       : 0;
    constexpr int kDraws = 200;
    double tiles = 0;
    std::vector<int> experts(s.experts);
    for (int d = 0; d < kDraws; ++d) {
      std::vector<int64_t> counts(s.local, 0);
      for (int64_t t = 0; t < s.tokens; ++t) {
        std::iota(experts.begin(), experts.end(), 0);
        for (int64_t j = 0; j < s.top_k; ++j) {  // a partial shuffle: k distinct experts
          std::swap(experts[j], experts[j + static_cast<int64_t>(rng() % (s.experts - j))]);
          if (experts[j] < s.local) ++counts[experts[j]];
        }
      }
      tiles += static_cast<double>(tiles_needed(counts, plan.tile_rows) + shared_in_main);
    }
    const double drawn = tiles / kDraws;
    EXPECT_NEAR(static_cast<double>(plan.likely_tiles), std::max(1.0, drawn), 0.5 + 0.03 * drawn)
        << s.tokens << " tokens, " << s.local << " of " << s.experts << " experts";
    EXPECT_LE(plan.likely_tiles, plan.max_tiles);
  }
}

// Which config a launch takes by its likely size: the decode ring's depth by how many CTAs an
// SM would hold of the likely ones (bf16 one: 16 stages, more: 8; e4m3 three: 6, more: 4);
// the specialised tile's width (bf16 and e4m3) by its rounds of one CTA an SM.
TEST(TileSchedule, ConfigsFollowTheLikelyLaunchSize) {
  const int64_t sms = cuda::multiprocessor_count();
  EXPECT_EQ(cuda::choose_decode_stages(false, 1), 16);
  EXPECT_EQ(cuda::choose_decode_stages(false, sms), 16);
  EXPECT_EQ(cuda::choose_decode_stages(false, sms + 1), 8);
  EXPECT_EQ(cuda::choose_decode_stages(false, 3 * sms + 1), 8);
  EXPECT_EQ(cuda::choose_decode_stages(true, 1), 6);
  EXPECT_EQ(cuda::choose_decode_stages(true, 3 * sms), 6);
  EXPECT_EQ(cuda::choose_decode_stages(true, 3 * sms + 1), 5);
  if (sms != 132) GTEST_SKIP() << "the widths below are worked out for 132 SMs (the H200's, and the fallback)";
  struct Launch {
    int64_t tiles, out_cols, k;
    bool gated;
    int cols;
  };
  // Worked out by hand: 256 wide, tiles x ceil(out / 128) items gated (256 not), in
  // ceil(items / 132) rounds; 192 wide, tiles x ceil(out / 96) (192); 128 wide, twice the
  // 256 items. bf16: a round of 192 takes 32/40 of a 256-wide one, of 128 25/40; e4m3 (256
  // or 128): a wide round 1.6 + (gated ? 6.4 : 2.4) / K tiles narrow ones.
  // Items and rounds below: 256 wide; 192; 128.
  for (const Launch& l : {
           Launch{24, 768, 2048, true, 192},     // qwen3-30b-a3b ep=8 T=2048 GEMM1: 144, 2; 192, 2; 288, 3
           Launch{16, 1536, 4096, true, 192},    // qwen3-235b-a22b ep=8 T=1024 GEMM1: 192, 2; 256, 2; 384, 3
           Launch{16, 4096, 1536, false, 256},   // its GEMM2: 256, 2; 352, 3; 512, 4
           Launch{40, 768, 2048, true, 256},     // qwen3-30b-a3b ep=8 T=4096 GEMM1: 240, 2; 320, 3; 480, 4
           Launch{16, 768, 2048, true, 192},     // qwen3-30b-a3b ep=8 T=1024 GEMM1: 96, 1; 128, 1; 192, 2
           Launch{12, 2048, 768, false, 192},    // 96, 1; 132 (the last of 11 column tiles 128 wide), 1; 192, 2
           Launch{1, 256, 2048, true, 128},      // 2, 1; 3, 1; 4, 1
           Launch{2000, 2048, 7168, true, 256},  // thousands of items: the wider tile's rate
       })
    EXPECT_EQ(cuda::specialized_tile_cols(false, l.gated, l.tiles, l.out_cols, l.k, 1), l.cols)
        << l.tiles << " tiles, " << l.out_cols << (l.gated ? " gated" : "") << " columns";
  // Split K multiplies the items: GEMM2 of 8 tiles over 2048 columns, 64 items (192: 88, 128:
  // 128, one round each), split 4 ways: 256 items, 2 rounds; 352, 3; 512, 4.
  EXPECT_EQ(cuda::specialized_tile_cols(false, false, 8, 2048, 768, 1), 128);
  EXPECT_EQ(cuda::specialized_tile_cols(false, false, 8, 2048, 768, 4), 256);
  for (const Launch& l : {
           // qwen3-30b-a3b ep=8 T=1024 GEMM1: 1 round against 2, K 16 tiles: 2.0 narrow ones
           Launch{16, 768, 2048, true, 128},
           // deepseek-v3 ep=8 T=16384 GEMM1: 33 rounds against 66, K 56 tiles: 1.71
           Launch{272, 2048, 7168, true, 256},
           // qwen3-235b-a22b ep=8 T=2048 GEMM1: 3 against 5, K 32 tiles: 1.8 (5.4 > 5)
           Launch{24, 1536, 4096, true, 128},
           // qwen3-30b-a3b ep=8 T=16384 GEMM2: 9 against 17, K 6 tiles: 2.0
           Launch{136, 2048, 768, false, 128},
           // qwen3-235b-a22b ep=8 T=16384 GEMM2: 17 against 33, K 12 tiles: 1.8
           Launch{136, 4096, 1536, false, 256},
       })
    EXPECT_EQ(cuda::specialized_tile_cols(true, l.gated, l.tiles, l.out_cols, l.k, 1), l.cols)
        << l.tiles << " tiles, " << l.out_cols << (l.gated ? " gated" : "") << " columns, e4m3";
  // mixtral-8x7b ep=8 T=1024 GEMM2, split 4 ways: 128 items against 256, 1 round against 2,
  // K 28 tiles a split: 1.69.
  EXPECT_EQ(cuda::specialized_tile_cols(true, false, 2, 4096, 14336, 4), 256);
}

// sort_pairs' blocks: one up to kPairsInOneSortBlock pairs, else one per kPairsPerSortBlock;
// and the plan that test_sort_pairs_gpu's shared_list_apart_eight_blocks case needs (the
// heuristic may move).
// Where GEMM1 routes for itself (routes_in_gemm1): the schemes, token and expert limits, and
// the early CTAs with one routed lane held by the SMs at once (worked out for 132 SMs).
TEST(TileSchedule, GemmRoutesForItselfOnlyWhereMeasuredFaster) {
  if (cuda::multiprocessor_count() != 132) GTEST_SKIP() << "worked out for 132 SMs (the H200's, and the fallback)";
  struct Case {
    const char* what;
    int64_t tokens, top_k, experts, local, shared_intermediate, intermediate;
    QuantScheme scheme;
    bool router_weight_on_input, expected;
  };
  const QuantScheme bf16 = QuantScheme::kBf16, fp8 = QuantScheme::kFp8Block;
  for (const Case& c : {
           // deepseek-v3 ep=8: the shared expert's 64 early CTAs and 64 of a lane fit one an SM;
           // bf16 beside a shared expert lost on the H200.
           Case{"deepseek-v3 bf16 T=1 (a shared expert)", 1, 8, 256, 32, 2048, 2048, bf16, false, false},
           Case{"deepseek-v3 bf16 T=1, no shared expert", 1, 8, 256, 32, 0, 2048, bf16, false, true},
           Case{"deepseek-v3 bf16 T=2, no shared expert", 2, 8, 256, 32, 0, 2048, bf16, false, true},
           Case{"deepseek-v3 bf16 T=4, no shared expert (bf16 lost there)", 4, 8, 256, 32, 0, 2048, bf16, false, false},
           Case{"deepseek-v3 fp8_block T=1", 1, 8, 256, 32, 2048, 2048, fp8, false, true},
           Case{"qwen3-235b-a22b bf16 T=1", 1, 8, 128, 16, 0, 1536, bf16, false, true},
           Case{"deepseek-v3 fp8_block T=4", 4, 8, 256, 32, 2048, 2048, fp8, false, true},
           Case{"deepseek-v3 fp8_block T=5 (past the tokens)", 5, 8, 256, 32, 2048, 2048, fp8, false, false},
           Case{"qwen3-30b-a3b fp8_block T=1", 1, 8, 128, 16, 0, 768, fp8, false, true},
           // mixtral-8x7b ep=8: 448 column tiles, 264 bf16 CTAs at once; 528 e4m3 (5 stages).
           Case{"mixtral-8x7b bf16 T=1", 1, 2, 8, 1, 0, 14336, bf16, false, false},
           Case{"mixtral-8x7b fp8_block T=1", 1, 2, 8, 1, 0, 14336, fp8, false, true},
           Case{"E = 512 from logits (past the experts)", 1, 8, 512, 64, 0, 768, bf16, false, false},
           Case{"router weight on the input", 1, 1, 16, 2, 8192, 8192, bf16, true, false},
           Case{"qwen3-30b-a3b fp8_channel T=1", 1, 8, 128, 16, 0, 768, QuantScheme::kFp8Channel, false, true},
           Case{"deepseek-v3 fp8_tensor T=4", 4, 8, 256, 32, 2048, 2048, QuantScheme::kFp8Tensor, false, true},
           Case{"deepseek-v3 fp8_channel T=5 (past the tokens)", 5, 8, 256, 32, 2048, 2048, QuantScheme::kFp8Channel,
                false, false},
       }) {
    const cuda::TilePlan plan =
        cuda::plan_tiles(c.tokens, c.top_k, c.experts, c.local, c.shared_intermediate, 4096, c.intermediate);
    const int64_t out_cols = std::max(c.intermediate, c.shared_intermediate);
    EXPECT_EQ(cuda::routes_in_gemm1(plan, c.tokens, c.top_k, c.experts, out_cols, c.scheme, c.router_weight_on_input),
              c.expected)
        << c.what;
  }
  // Precomputed ids need no routing in GEMM1: any number of experts.
  const cuda::TilePlan plan = cuda::plan_tiles(1, 8, 512, 64, 0, 4096, 768);
  EXPECT_TRUE(cuda::routes_in_gemm1(plan, 1, 8, 0, 768, QuantScheme::kBf16, false));
}

TEST(TileSchedule, SortTakesOneBlockUpToEightThousandPairsThenABlockPerTwoThousand) {
  EXPECT_EQ(cuda::sort_blocks(0), 1);
  EXPECT_EQ(cuda::sort_blocks(cuda::kPairsInOneSortBlock), 1);
  EXPECT_EQ(cuda::sort_blocks(cuda::kPairsInOneSortBlock + 8), 5);
  EXPECT_EQ(cuda::sort_blocks(2048 * 8), 8);
  EXPECT_EQ(cuda::sort_blocks(16384 * 8), 64);
  EXPECT_GT(cuda::plan_tiles(2048, 8, 512, 512, 4096, 7168, 2048).shared_tile_rows, 0)
      << "shared_list_apart_eight_blocks no longer sets the shared list apart";
}

}  // namespace
}  // namespace epmoe
