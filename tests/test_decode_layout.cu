// The pair layout the self-routing decode GEMM1 makes in each CTA (moe/cuda/decode_layout.cuh),
// run on the host step by step as the CTA's threads run it between barriers, against the
// layout written out plainly: slots grouped by ascending group, a group's pairs in pair order,
// each group cut into row tiles in that order. Every CTA must find the same layout, so it must
// not depend on anything but the choices. Host code only: runs without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "moe/cuda/decode_layout.cuh"

namespace epmoe {
namespace {

constexpr int kTileRows = cuda::kDecodeTileRows;

struct Tile {
  int group, first, end;
};

// What the layout should be for these groups (-1: not local).
struct Expected {
  std::vector<int> slot_of_pair, slot_token, group_count, group_first;
  std::vector<Tile> tiles;
};

Expected expected_layout(const std::vector<int>& groups, int top_k, int group_count) {
  Expected e;
  e.slot_of_pair.assign(groups.size(), -1);
  e.group_count.assign(group_count, 0);
  e.group_first.assign(group_count, 0);
  int slot = 0;
  for (int g = 0; g < group_count; ++g) {
    e.group_first[g] = slot;
    for (size_t p = 0; p < groups.size(); ++p)
      if (groups[p] == g) {
        e.slot_of_pair[p] = slot++;
        e.slot_token.push_back(static_cast<int>(p) / top_k);
        ++e.group_count[g];
      }
    for (int row = 0; row < e.group_count[g]; row += kTileRows)
      e.tiles.push_back({g, e.group_first[g] + row, e.group_first[g] + e.group_count[g]});
  }
  return e;
}

// Runs the CTA's steps on the host, as its threads run them between barriers.
cuda::DecodePairs run_steps(const std::vector<int>& groups, int top_k) {
  cuda::DecodePairs d{};
  const int pairs = static_cast<int>(groups.size());
  for (int p = 0; p < pairs; ++p) d.group[p] = static_cast<cuda::PairIndex>(groups[p]);
  for (int p = 0; p < pairs; ++p) cuda::place_pair(d, p, pairs, top_k, kTileRows);
  cuda::count_routed(d, pairs);
  for (int p = 0; p < pairs; ++p) cuda::list_tiles(d, p, pairs, kTileRows);
  return d;
}

void check_layout(const std::vector<int>& groups, int top_k, int group_count) {
  const Expected e = expected_layout(groups, top_k, group_count);
  const int pairs = static_cast<int>(groups.size());
  const cuda::DecodePairs d = run_steps(groups, top_k);
  ASSERT_EQ(d.routed_tiles, static_cast<int>(e.tiles.size()));
  ASSERT_EQ(d.local_pairs, static_cast<int>(e.slot_token.size()));
  for (int p = 0; p < pairs; ++p) {
    ASSERT_EQ(d.slot[p], e.slot_of_pair[p]) << "pair " << p;
    if (d.slot[p] >= 0) ASSERT_EQ(d.slot_token[d.slot[p]], e.slot_token[d.slot[p]]) << "pair " << p;
  }
  for (size_t t = 0; t < e.tiles.size(); ++t) {
    EXPECT_EQ(d.tile_group[t], e.tiles[t].group) << "tile " << t;
    EXPECT_EQ(d.tile_first[t], e.tiles[t].first) << "tile " << t;
    EXPECT_EQ(d.tile_end[t], e.tiles[t].end) << "tile " << t;
  }
  for (int g = 0; g < group_count; ++g) {
    const cuda::GroupExtent extent = cuda::group_extent(d, pairs, g);
    EXPECT_EQ(extent.count, e.group_count[g]) << "group " << g;
    EXPECT_EQ(extent.first, e.group_first[g]) << "group " << g;
  }
}

// The groups of T tokens' k distinct choices among E experts through a map that puts
// `local` experts (a random set) on this rank, as the route and an expert map make them.
std::vector<int> draw_groups(std::mt19937_64& rng, int tokens, int top_k, int experts, int local) {
  std::vector<int> map(experts, -1), order(experts);
  for (int e = 0; e < experts; ++e) order[e] = e;
  std::shuffle(order.begin(), order.end(), rng);
  for (int i = 0; i < local; ++i) map[order[i]] = i;
  std::vector<int> groups;
  for (int t = 0; t < tokens; ++t) {
    std::shuffle(order.begin(), order.end(), rng);
    for (int j = 0; j < top_k; ++j) groups.push_back(cuda::local_group(order[j], map.data(), experts));
  }
  return groups;
}

TEST(DecodeLayout, MatchesTheLayoutWrittenOutForRandomRouting) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Shape {
    int experts, top_k, local;
  };
  // deepseek-v3 at ep=8 and ep=1, qwen3 at ep=8, mixtral, llama4-scout, the most choices.
  for (const Shape shape : {Shape{256, 8, 32}, Shape{256, 8, 256}, Shape{128, 8, 16}, Shape{8, 2, 1}, Shape{8, 2, 8},
                            Shape{16, 1, 2}, Shape{64, cuda::kMaxTopK, 64}})
    for (int tokens = 1; tokens <= cuda::kMaxSelfRoutedTokens && tokens * shape.top_k <= cuda::kMaxSelfRoutedPairs;
         ++tokens)
      for (int draw = 0; draw < 20; ++draw) {
        SCOPED_TRACE("E " + std::to_string(shape.experts) + " k " + std::to_string(shape.top_k) + " local " +
                     std::to_string(shape.local) + " T " + std::to_string(tokens));
        check_layout(draw_groups(rng, tokens, shape.top_k, shape.experts, shape.local), shape.top_k, shape.local);
        if (HasFailure()) return;
      }
}

TEST(DecodeLayout, OneExpertTakesEveryPair) {
  // Precomputed routing may repeat an expert: 128 pairs (16 tokens of 8) on one group make
  // eight row tiles.
  const int pairs = cuda::kMaxSelfRoutedPairs, top_k = pairs / cuda::kMaxSelfRoutedTokens;
  check_layout(std::vector<int>(pairs, 3), top_k, 5);
}

TEST(DecodeLayout, NoPairIsLocal) {
  check_layout(std::vector<int>(8, -1), 8, 32);
  EXPECT_EQ(run_steps(std::vector<int>(8, -1), 8).routed_tiles, 0);
}

TEST(DecodeLayout, MixedGroupsKeepPairOrderInsideAGroup) {
  // Pairs 0, 2, 5 on group 1 and 1, 4 on group 0; 3 not local.
  const std::vector<int> groups{1, 0, 1, -1, 0, 1};
  const cuda::DecodePairs d = run_steps(groups, 2);
  const std::vector<int> slots{2, 0, 3, -1, 1, 4};
  for (size_t p = 0; p < groups.size(); ++p) EXPECT_EQ(d.slot[p], slots[p]) << "pair " << p;
  ASSERT_EQ(d.routed_tiles, 2);
  EXPECT_EQ(d.tile_group[0], 0);
  EXPECT_EQ(d.tile_first[0], 0);
  EXPECT_EQ(d.tile_end[0], 2);
  EXPECT_EQ(d.tile_group[1], 1);
  EXPECT_EQ(d.tile_first[1], 2);
  EXPECT_EQ(d.tile_end[1], 5);
  check_layout(groups, 2, 2);
}

}  // namespace
}  // namespace epmoe
