// Map and sort (launch_sort_pairs) against a count on the host, on fresh random ids, on one
// block (up to kPairsInOneSortBlock pairs) and on several of kPairsPerSortBlock (two
// launches through the block counts): each group's count and offset, every local pair in a
// slot of its own group, every slot taken exactly once (routed pairs and the shared group's
// tokens), the token of each slot, both tile lists, and the arrival counters zeroed. Every
// output is poisoned first, so an element left unwritten fails.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "device_vectors.h"
#include "epmoe/device_case.h"
#include "moe/cuda/launchers.h"

namespace epmoe {
namespace {

constexpr int32_t kPoison = 0x7eadbeef;

struct SortCase {
  const char* name;
  int64_t tokens;
  int top_k, experts, local_experts;
  bool mapped;                  // an expert map (this rank's experts a contiguous block, others -1)
  int64_t shared_intermediate;  // 0: no shared experts
  bool skewed;                  // most pairs on two experts
};

class SortPairs : public ::testing::TestWithParam<SortCase> {};

TEST_P(SortPairs, PlacesEveryLocalPairOnceAndSchedulesItsTiles) {
  const SortCase c = GetParam();
  std::mt19937_64 rng(std::random_device{}());
  const int64_t pairs = c.tokens * c.top_k;
  const bool shared = c.shared_intermediate > 0;
  const int groups = c.local_experts + (shared ? 1 : 0);
  const int first_local = c.mapped ? static_cast<int>(rng() % (c.experts / c.local_experts)) * c.local_experts : 0;

  // Ids: uniform (or mostly two experts), a few outside [0, E) which no group takes.
  std::vector<int32_t> ids(pairs);
  for (int32_t& id : ids) {
    const uint64_t draw = rng() % 1000;
    if (draw < 3) id = draw == 0 ? -1 : c.experts + static_cast<int32_t>(draw);
    else if (c.skewed && draw < 900) id = (first_local + static_cast<int32_t>(draw % 2)) % c.experts;
    else id = static_cast<int32_t>(rng() % c.experts);
  }
  std::vector<int32_t> map(c.experts, -1);
  for (int e = 0; e < c.local_experts; ++e) map[first_local + e] = e;
  auto group_of = [&](int32_t id) { return id < 0 || id >= c.experts ? -1 : c.mapped ? map[id] : id; };

  const cuda::TilePlan plan = cuda::plan_tiles(c.tokens, c.top_k, c.experts, c.local_experts, c.shared_intermediate,
                                               7168, 2048);
  const int64_t slots = pairs + (shared ? c.tokens : 0);
  const int64_t all_tiles = plan.max_tiles + plan.shared_tiles;
  const int64_t blocks = cuda::sort_blocks(pairs);
  std::vector<DeviceBuffer> storage;
  cuda::PairLayout layout{};
  layout.group_counts = upload_vector(std::vector<int32_t>(groups, kPoison), storage);
  layout.group_offsets = upload_vector(std::vector<int32_t>(groups + 1, kPoison), storage);
  layout.slot_of_pair = upload_vector(std::vector<int32_t>(pairs, kPoison), storage);
  layout.slot_token = upload_vector(std::vector<int32_t>(slots, kPoison), storage);
  layout.tile_group = upload_vector(std::vector<int32_t>(all_tiles, kPoison), storage);
  layout.tile_row = upload_vector(std::vector<int32_t>(all_tiles, kPoison), storage);
  layout.tile_count = upload_vector(std::vector<int32_t>(2, kPoison), storage);
  layout.arrival_count = 3 * all_tiles;
  layout.arrivals = upload_vector(std::vector<int32_t>(layout.arrival_count, kPoison), storage);
  layout.block_counts = upload_vector(std::vector<int32_t>(blocks > 1 ? blocks * groups : 0, kPoison), storage);
  ASSERT_EQ(cuda::launch_sort_pairs(upload_vector(ids, storage), c.mapped ? upload_vector(map, storage) : nullptr,
                                    c.tokens, c.top_k, c.experts, c.local_experts, shared, plan, layout, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // Counts and offsets.
  std::vector<int64_t> expected_counts(groups, 0);
  for (int32_t id : ids)
    if (group_of(id) >= 0) ++expected_counts[group_of(id)];
  if (shared) expected_counts[groups - 1] = c.tokens;
  const std::vector<int32_t> counts = download(layout.group_counts, groups);
  const std::vector<int32_t> offsets = download(layout.group_offsets, groups + 1);
  // The routed groups' slots one after another from 0, the shared group's at [T k, + T),
  // wherever the routing leaves the routed ones.
  int64_t offset = 0;
  for (int g = 0; g < groups; ++g) {
    const bool shared_group = shared && g == groups - 1;
    EXPECT_EQ(counts[g], expected_counts[g]) << "group " << g;
    EXPECT_EQ(offsets[g], shared_group ? pairs : offset) << "group " << g;
    if (!shared_group) offset += expected_counts[g];
  }
  ASSERT_EQ(offsets[groups], shared ? slots : offset);
  const int64_t routed_slots = offset;

  // Every local pair in a slot of its group, holding its token; every slot taken once, the
  // ones between the routed slots and the shared group's never.
  const std::vector<int32_t> slot_of_pair = download(layout.slot_of_pair, pairs);
  const std::vector<int32_t> slot_token = download(layout.slot_token, slots);
  std::vector<int> taken(slots, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int group = group_of(ids[p]);
    const int32_t slot = slot_of_pair[p];
    if (group < 0) {
      EXPECT_EQ(slot, -1) << "pair " << p << " of a non-local expert";
      continue;
    }
    ASSERT_TRUE(slot >= offsets[group] && slot < offsets[group] + counts[group]) << "pair " << p << " slot " << slot;
    ++taken[slot];
    EXPECT_EQ(slot_token[slot], p / c.top_k) << "slot " << slot;
  }
  if (shared)
    for (int64_t t = 0; t < c.tokens; ++t) {
      const int64_t slot = offsets[groups - 1] + t;
      ++taken[slot];
      EXPECT_EQ(slot_token[slot], t) << "shared slot " << slot;
    }
  int64_t slots_not_taken_once = 0;
  for (int64_t slot = 0; slot < slots; ++slot) {
    const bool used = slot < routed_slots || (shared && slot >= pairs);
    slots_not_taken_once += taken[slot] != (used ? 1 : 0);
  }
  EXPECT_EQ(slots_not_taken_once, 0);

  // Tile lists: each group's ceil(count / rows) tiles in group order; the shared group's
  // first in the main list (GEMM1 starts them before the sort ends), or in its own list from
  // max_tiles on when the plan sets it apart.
  const std::vector<int32_t> tile_group = download(layout.tile_group, all_tiles);
  const std::vector<int32_t> tile_row = download(layout.tile_row, all_tiles);
  const std::vector<int32_t> tile_count = download(layout.tile_count, 2);
  const bool apart = shared && plan.shared_tile_rows > 0;
  const int64_t shared_main_tiles = shared && !apart ? (c.tokens + plan.tile_rows - 1) / plan.tile_rows : 0;
  int64_t main_tile = shared_main_tiles, shared_tile = plan.max_tiles, shared_main_tile = 0;
  for (int g = 0; g < groups; ++g) {
    const bool shared_group = shared && g == groups - 1;
    const bool own_list = apart && shared_group;
    const int rows = own_list ? plan.shared_tile_rows : plan.tile_rows;
    int64_t& tile = own_list ? shared_tile : shared_group ? shared_main_tile : main_tile;
    for (int64_t row = 0; row < expected_counts[g]; row += rows, ++tile) {
      ASSERT_LT(tile, own_list ? all_tiles : plan.max_tiles) << "group " << g << " beyond its list's capacity";
      EXPECT_EQ(tile_group[tile], g) << "tile " << tile;
      EXPECT_EQ(tile_row[tile], offsets[g] + row) << "tile " << tile;
    }
  }
  if (shared && !apart) EXPECT_EQ(shared_main_tile, shared_main_tiles);
  EXPECT_EQ(tile_count[0], main_tile);
  EXPECT_EQ(tile_count[1], apart ? shared_tile - plan.max_tiles : 0);

  const std::vector<int32_t> arrivals = download(layout.arrivals, layout.arrival_count);
  int64_t nonzero_arrivals = 0;
  for (int32_t a : arrivals) nonzero_arrivals += a != 0;
  EXPECT_EQ(nonzero_arrivals, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, SortPairs,
    ::testing::Values(SortCase{"decode_mapped_shared", 1, 8, 256, 32, true, 2048, false},
                      SortCase{"one_block_full", cuda::kPairsInOneSortBlock / 8, 8, 256, 256, false, 0, false},
                      SortCase{"five_blocks_mapped_shared", cuda::kPairsInOneSortBlock / 8 + 1, 8, 256, 32, true, 2048,
                               false},
                      SortCase{"shared_list_apart_eight_blocks", 2048, 8, 512, 512, false, 4096, false},
                      SortCase{"sixty_four_blocks_mapped_shared", 16384, 8, 256, 32, true, 2048, false},
                      SortCase{"skewed_twenty_blocks_one_expert_map", 20000, 2, 8, 1, true, 0, true},
                      SortCase{"skewed_single_block", 3000, 2, 8, 8, false, 0, true}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace epmoe
