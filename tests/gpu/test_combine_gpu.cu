// The combine (launch_combine) against a sum on the host done the way the kernel does it
// (f32, fused multiply-add in j order, then the shared experts' row, one rounding to bf16),
// so the two agree bit for bit; on fresh random rows and weights, with pairs on other ranks
// (slot -1), tokens with no local pair, shared rows, split-K partial rows, unit weights, and
// every tokens_per_block from 1 to the most, over token counts that do not divide into the
// blocks and a hidden size with a partial column block. The output is poisoned first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "device_vectors.h"
#include "epmoe/dtype.h"
#include "moe/cuda/launchers.h"

namespace epmoe {
namespace {

struct CombineCase {
  const char* name;
  int64_t tokens, hidden;
  int top_k;
  double local_share;  // of the pairs, on this rank
  bool shared;         // a shared experts' group
  int k_splits;        // > 1: the routed rows as f32 partial rows
  bool shared_whole;   // with k_splits > 1: the shared rows as bf16 rows
  bool unit_weights;
};

class Combine : public ::testing::TestWithParam<CombineCase> {};

TEST_P(Combine, MatchesTheHostSumBitwiseForEveryTokensPerBlock) {
  const CombineCase c = GetParam();
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> value(-2.0f, 2.0f), weight(0.01f, 1.0f), share(0.0f, 1.0f);

  // Slots: the local pairs in a random order, then the shared group's T rows.
  const int64_t pairs = c.tokens * c.top_k;
  std::vector<int32_t> slot_of_pair(pairs, -1);
  int32_t local = 0;
  for (int32_t& slot : slot_of_pair)
    if (share(rng) < c.local_share) slot = local++;
  std::shuffle(slot_of_pair.begin(), slot_of_pair.end(), rng);
  const int64_t slots = local + (c.shared ? c.tokens : 0);
  const std::vector<int32_t> group_offsets = {0, local, static_cast<int32_t>(slots)};
  std::vector<float> topk_weights(pairs);
  for (float& w : topk_weights) w = weight(rng);

  std::vector<uint16_t> rows(slots * c.hidden);
  for (uint16_t& bits : rows) bits = f32_to_bf16(value(rng));
  std::vector<float> partials(c.k_splits > 1 ? c.k_splits * slots * c.hidden : 0);
  for (float& p : partials) p = value(rng);

  // A row as the kernel reads it: bf16, or its partial rows summed in split order and rounded.
  auto row_value = [&](int64_t slot, int64_t h, bool whole) {
    if (c.k_splits == 1 || whole) return bf16_to_f32(rows[slot * c.hidden + h]);
    float sum = 0.0f;
    for (int split = 0; split < c.k_splits; ++split) sum += partials[(split * slots + slot) * c.hidden + h];
    return round_to_bf16(sum);
  };
  std::vector<uint16_t> expected(c.tokens * c.hidden);
  for (int64_t t = 0; t < c.tokens; ++t)
    for (int64_t h = 0; h < c.hidden; ++h) {
      float acc = 0.0f;
      for (int j = 0; j < c.top_k; ++j) {
        const int32_t slot = slot_of_pair[t * c.top_k + j];
        if (slot >= 0)
          acc = std::fmaf(c.unit_weights ? 1.0f : topk_weights[t * c.top_k + j], row_value(slot, h, false), acc);
      }
      if (c.shared) acc = std::fmaf(1.0f, row_value(local + t, h, c.shared_whole), acc);
      expected[t * c.hidden + h] = f32_to_bf16(acc);
    }

  std::vector<DeviceBuffer> storage;
  cuda::CombineArgs args{
      {upload_vector(rows, storage), upload_vector(partials, storage), c.k_splits, slots * c.hidden, c.shared_whole},
      upload_vector(slot_of_pair, storage),
      upload_vector(topk_weights, storage),
      upload_vector(group_offsets, storage)};
  args.shared_group = c.shared ? 1 : -1;
  args.unit_weights = c.unit_weights;
  args.tokens = c.tokens;
  args.top_k = c.top_k;
  args.hidden = c.hidden;
  args.y = upload_vector(std::vector<uint16_t>(c.tokens * c.hidden, 0xffff), storage);  // NaN
  for (int tokens_per_block = 1; tokens_per_block <= cuda::kMaxCombineTokensPerBlock; ++tokens_per_block) {
    SCOPED_TRACE("tokens_per_block " + std::to_string(tokens_per_block));
    ASSERT_EQ(cudaMemset(args.y, 0xff, c.tokens * c.hidden * sizeof(uint16_t)), cudaSuccess);
    args.tokens_per_block = tokens_per_block;
    ASSERT_EQ(cuda::launch_combine(args, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> y = download(args.y, c.tokens * c.hidden);
    int64_t mismatches = 0;
    for (int64_t i = 0; i < c.tokens * c.hidden; ++i)
      if (y[i] != expected[i] && ++mismatches <= 5)
        ADD_FAILURE() << "token " << i / c.hidden << " column " << i % c.hidden << ": " << bf16_to_f32(y[i]) << " vs "
                      << bf16_to_f32(expected[i]);
    EXPECT_EQ(mismatches, 0);
  }
  args.tokens_per_block = cuda::kMaxCombineTokensPerBlock + 1;
  EXPECT_EQ(cuda::launch_combine(args, nullptr), cudaErrorInvalidValue);
}

INSTANTIATE_TEST_SUITE_P(Cases, Combine,
                         ::testing::Values(CombineCase{"ep8_shared", 301, 7168, 8, 0.125, true, 1, false, false},
                                           CombineCase{"ep1_all_local", 67, 2048, 8, 1.0, false, 1, false, false},
                                           CombineCase{"one_local_in_eight_partial_column_block", 130, 1288, 8, 0.125,
                                                       false, 1, false, false},
                                           CombineCase{"split_k_shared_whole", 45, 4096, 2, 0.5, true, 3, true, false},
                                           CombineCase{"split_k_shared_split", 45, 1024, 6, 0.3, true, 2, false, false},
                                           CombineCase{"top_k_32_unit_weights", 19, 512, 32, 0.9, true, 1, false, true},
                                           CombineCase{"one_token", 1, 7168, 8, 0.25, true, 1, false, false}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace epmoe
