// The host-side rules of the GEMMs' row-tile schedule (moe/cuda/launchers.h). The operator
// sizes its GEMM grids from them before any routing is known (no host synchronisation), so
// they must hold for every way the pairs can fall: max_row_tiles must bound the tiles
// sort_pairs makes for any spread of slots over the groups, and the tile and split choices
// must stay inside what the kernels were built for. Host code only: runs without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
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
    const int rows = cuda::choose_tile_rows(rows_per_group * 33, 33);
    EXPECT_GE(rows, previous) << rows_per_group << " rows per group";
    EXPECT_TRUE(rows == 16 || rows == 64 || rows == 128) << rows;
    previous = rows;
  }
  EXPECT_EQ(cuda::choose_tile_rows(16 * 8, 8), 16);  // a decode step: up to 16 rows an expert
  EXPECT_EQ(cuda::choose_tile_rows(4096 * 8, 8), 128);
}

TEST(TileSchedule, KSplitsOnlyForTheDecodeTileAndNeverBelowFourKTiles) {
  for (int tile_rows : {16, 64, 128})
    for (int64_t row_tiles : {1, 2, 8, 64, 1000})
      for (int64_t n : {256, 2048, 7168})
        for (int64_t k : {128, 256, 768, 2048, 7168}) {
          const int splits = cuda::choose_k_splits(tile_rows, row_tiles, n, k);
          SCOPED_TRACE(std::to_string(tile_rows) + " rows, " + std::to_string(row_tiles) + " tiles, n " +
                       std::to_string(n) + ", k " + std::to_string(k));
          EXPECT_GE(splits, 1);
          EXPECT_LE(splits, cuda::kMaxKSplits);
          if (tile_rows != 16) EXPECT_EQ(splits, 1);
          if (splits > 1) EXPECT_GE(k / splits, 4 * 64) << "each split keeps at least four bf16 K tiles";
        }
  // One expert's decode step over a wide matrix leaves SMs idle without a split.
  EXPECT_GT(cuda::choose_k_splits(16, 1, 7168, 2048), 1);
}

}  // namespace
}  // namespace epmoe
