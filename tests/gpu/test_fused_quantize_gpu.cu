// GEMM1's fused quantisation (EpilogueQuantize) against the quantisation pass it replaces:
// a gated e4m3 grouped GEMM writes its bf16 output and quantises it in its epilogue; the
// standalone quantiser (launch_quantize_fp8, itself bit-identical to the CPU quantiser,
// test_quantize_gpu) then runs over that same bf16 output. Codes and scales must agree bit
// for bit on every used row, both buffers poisoned first, for the decode and the wgmma
// tiles, per group of 128 and with a static per-tensor scale, with a shared-expert
// group narrower than the routed experts (I_s < I: scopes cut short at its edge). Neither
// width is a multiple of 128: the last group of each is 64 columns, one column tile of the
// specialised tile, whose partner in the pair (a cluster of two) has no columns; and the
// routed width's 5 column tiles make the grid pad a sixth. The wide e4m3 tile (128 outputs,
// a whole group, no pair) holds 64 columns in its last tile. GEMM1 keeps its bf16 copy here
// (EpilogueQuantize::bf16_copy), which the operator leaves off.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "device_vectors.h"
#include "epmoe/device_case.h"
#include "epmoe/dtype.h"
#include "moe/cuda/launchers.h"

namespace epmoe {
namespace {

constexpr int64_t kHidden = 512, kIntermediate = 320, kSharedIntermediate = 192;
constexpr int kLocalExperts = 5, kTopK = 2;

// e4m3 codes of normal values, and positive scales spread over two decades.
std::vector<uint8_t> random_codes(size_t count, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<uint8_t> codes(count);
  for (uint8_t& code : codes) code = f32_to_fp8e4m3(normal(rng));
  return codes;
}
std::vector<float> random_scales(size_t count, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> exponent(-3.0f, -1.0f);
  std::vector<float> scales(count);
  for (float& scale : scales) scale = std::pow(10.0f, exponent(rng));
  return scales;
}

struct FusedCase {
  const char* name;
  cuda::Fp8Granularity granularity;
  int64_t tokens;
  int tile_rows;  // the tile these tokens take: 16 (decode), 64 (medium) or 128 (specialised)
  bool more_items_than_ctas = false;  // specialised: persistent CTAs walk several work items each
  int fp8_decode_stages = 0;  // decode tile: the ring depth the launch is made to take (0: the plan's)
  int64_t hidden = kHidden;
  int specialized_cols = 0;   // specialised tile: the width the launch is made to take (0: the plan's)
};

class FusedQuantize : public ::testing::TestWithParam<FusedCase> {};

TEST_P(FusedQuantize, MatchesTheQuantiserOverGemm1Output) {
  const FusedCase& c = GetParam();
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<DeviceBuffer> storage;
  const int groups = kLocalExperts + 1;  // + the shared experts
  const int64_t T = c.tokens, pairs = T * kTopK, slots = pairs + T;
  const int64_t K = c.hidden, blocks_k = K / 128;
  const bool per_group = c.granularity == cuda::Fp8Granularity::kPerGroup;  // else a static per-tensor scale

  // Routing: each token picks kTopK distinct local experts.
  std::vector<int32_t> ids(pairs);
  for (int64_t t = 0; t < T; ++t) {
    const int first = static_cast<int>(rng() % kLocalExperts);
    ids[t * kTopK] = first;
    ids[t * kTopK + 1] = (first + 1 + static_cast<int>(rng() % (kLocalExperts - 1))) % kLocalExperts;
  }
  const cuda::TilePlan plan = cuda::plan_tiles(T, kTopK, kLocalExperts, kLocalExperts, kSharedIntermediate, K,
                                               kIntermediate);
  ASSERT_EQ(plan.tile_rows, c.tile_rows) << "the case no longer covers the tile it names";
  ASSERT_EQ(plan.shared_tiles, 0) << "one tile list";
  const int tile_rows = plan.tile_rows;
  const int64_t max_tiles = plan.max_tiles;
  const int64_t scopes = per_group ? (kIntermediate + 127) / 128 : 0;
  cuda::PairLayout layout{};
  layout.group_counts = upload_vector(std::vector<int32_t>(groups), storage);
  layout.group_offsets = upload_vector(std::vector<int32_t>(groups + 1), storage);
  layout.slot_of_pair = upload_vector(std::vector<int32_t>(pairs), storage);
  layout.slot_token = upload_vector(std::vector<int32_t>(slots), storage);
  layout.tile_group = upload_vector(std::vector<int32_t>(max_tiles), storage);
  layout.tile_row = upload_vector(std::vector<int32_t>(max_tiles), storage);
  layout.tile_count = upload_vector(std::vector<int32_t>(2), storage);
  layout.arrival_count = max_tiles * scopes;
  layout.arrivals = upload_vector(std::vector<int32_t>(layout.arrival_count, 12345), storage);  // sort_pairs zeroes
  ASSERT_EQ(cuda::launch_sort_pairs(upload_vector(ids, storage), nullptr, T, kTopK, kLocalExperts, kLocalExperts,
                                    true, plan, layout, nullptr),
            cudaSuccess);

  // e4m3 activations and weights with the scheme's scales (per tensor: a static activation
  // scale and one weight scale per expert).
  const int64_t n = 2 * kIntermediate, n_shared = 2 * kSharedIntermediate;
  cuda::GemmGroups gemm{};
  gemm.fp8 = true;
  gemm.a_routed = gemm.a_shared = upload_vector(random_codes(T * K, rng), storage);
  gemm.a_row_of_slot = layout.slot_token;
  gemm.a_stride = K;
  gemm.b_routed = upload_vector(random_codes(kLocalExperts * n * K, rng), storage);
  gemm.b_shared = upload_vector(random_codes(n_shared * K, rng), storage);
  gemm.n = n;
  gemm.k = gemm.k_shared = K;
  gemm.n_shared = n_shared;
  gemm.local_experts = kLocalExperts;
  gemm.shared_first_slot = static_cast<int32_t>(pairs);  // where sort_pairs puts the shared group
  gemm.shared_rows = static_cast<int32_t>(T);
  // Per tensor: x's static scale, and the intermediate's, under which outputs of 1e-5 to 0.1
  // give codes from subnormal to saturated.
  const float* x_scale = upload_vector(std::vector<float>{0.05f}, storage);
  const float* intermediate_scale = upload_vector(std::vector<float>{1e-4f}, storage);
  if (per_group) {
    gemm.a_routed_scale = {upload_vector(random_scales(T * blocks_k, rng), storage), 1, blocks_k, 1, 0};
    gemm.b_routed_scale = {upload_vector(random_scales(kLocalExperts * (n / 128) * blocks_k, rng), storage), 128,
                           blocks_k, 1, (n / 128) * blocks_k};
    gemm.b_shared_scale = {upload_vector(random_scales((n_shared / 128) * blocks_k, rng), storage), 128, blocks_k, 1, 0};
  } else {
    gemm.a_routed_scale = {x_scale, 1, 0, 0, 0};
    gemm.b_routed_scale = {upload_vector(random_scales(kLocalExperts, rng), storage), n, 1, 0, 1};
    gemm.b_shared_scale = {upload_vector(random_scales(1, rng), storage), n_shared, 1, 0, 0};
  }
  gemm.a_shared_scale = gemm.a_routed_scale;
  const int64_t widest = kIntermediate;
  gemm.c = upload_vector(std::vector<uint16_t>(slots * widest, 0x7fc1), storage);  // poison: NaN
  gemm.c_stride = widest;
  const int64_t scale_count = per_group ? slots * ((widest + 127) / 128) : groups;  // the pass: one per expert
  cuda::EpilogueQuantize& q = gemm.quantize;
  q.codes = upload_vector(std::vector<uint8_t>(slots * widest, 0x55), storage);
  q.scales = upload_vector(std::vector<float>(scale_count, NAN), storage);
  q.granularity = c.granularity;
  q.group = 128;
  q.static_scale = per_group ? nullptr : intermediate_scale;
  q.scopes_per_tile = scopes;
  // The likely tile count picks the decode tile's ring depth (and nothing that matters for
  // the results): a count past what three CTAs an SM hold makes e4m3 take 5 stages, not 6
  // (which carry their K tile's scales; the 5 leave them to each thread's loads).
  // So does the specialised tile's width: a third as many likely tiles as SMs makes one
  // round of 256-wide items (3 a row tile) against two of 128-wide ones (5), which a K loop of
  // 24 K tiles or more pays for.
  const int64_t likely_tiles = c.specialized_cols == 256 ? cuda::multiprocessor_count() / 3
                               : c.fp8_decode_stages == 0 ? plan.likely_tiles
                               : c.fp8_decode_stages == 6 ? 1
                                                          : 1 << 20;
  if (c.fp8_decode_stages != 0)
    ASSERT_EQ(cuda::choose_decode_stages(/*fp8=*/true, likely_tiles * (kIntermediate / 32)), c.fp8_decode_stages);
  if (c.specialized_cols != 0)
    ASSERT_EQ(cuda::specialized_tile_cols(/*fp8=*/true, /*gated=*/true, likely_tiles, kIntermediate, K, 1),
              c.specialized_cols);
  ASSERT_EQ(cuda::launch_grouped_gemm(gemm, layout, max_tiles, likely_tiles, /*gated=*/true, Activation::kSilu,
                                      tile_rows, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (c.more_items_than_ctas) {
    int multiprocessors = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
    // gated e4m3: 64 outputs a tile, paired; the wide tile 128
    const int64_t column_tiles =
        c.specialized_cols == 256 ? (kIntermediate + 127) / 128 : ((kIntermediate + 63) / 64 + 1) / 2 * 2;
    ASSERT_GT(download(layout.tile_count, 1)[0] * column_tiles, multiprocessors)
        << "the case no longer has more work items than the GPU holds CTAs";
  }

  // The quantisation pass over the same bf16 output, into its own poisoned buffers.
  cuda::Fp8Quantize pass{gemm.c, upload_vector(std::vector<uint8_t>(slots * widest, 0xaa), storage),
                         upload_vector(std::vector<float>(scale_count, -1.0f), storage), slots, kIntermediate, widest,
                         c.granularity};
  pass.group = 128;
  pass.static_scale = q.static_scale;
  pass.row_groups = {layout.group_offsets, groups, groups - 1, kSharedIntermediate, layout.group_counts};
  ASSERT_EQ(cuda::launch_quantize_fp8(pass, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const std::vector<int32_t> offsets = download(layout.group_offsets, groups + 1);
  ASSERT_EQ(offsets[groups], slots);
  const std::vector<uint16_t> output = download(gemm.c, slots * widest);
  const std::vector<uint8_t> fused_codes = download(q.codes, slots * widest), pass_codes = download(pass.codes, slots * widest);
  const std::vector<float> fused_scales = download(q.scales, scale_count), pass_scales = download(pass.scales, scale_count);
  int64_t code_mismatches = 0, scale_mismatches = 0, nonzero_codes = 0;
  for (int64_t slot = 0; slot < slots; ++slot) {
    const int64_t width = slot >= offsets[groups - 1] ? kSharedIntermediate : kIntermediate;
    for (int64_t i = 0; i < width; ++i) {
      ASSERT_FALSE(std::isnan(bf16_to_f32(output[slot * widest + i]))) << "GEMM1 left slot " << slot << " col " << i;
      code_mismatches += fused_codes[slot * widest + i] != pass_codes[slot * widest + i];
      nonzero_codes += (fused_codes[slot * widest + i] & 0x7f) != 0;
    }
    if (!per_group) continue;
    const int64_t per_row = (widest + 127) / 128;
    for (int64_t g = 0; g < (width + 127) / 128; ++g)
      scale_mismatches += std::bit_cast<uint32_t>(fused_scales[slot * per_row + g]) !=
                          std::bit_cast<uint32_t>(pass_scales[slot * per_row + g]);
  }
  EXPECT_EQ(code_mismatches, 0) << "of the used codes";
  EXPECT_EQ(scale_mismatches, 0);
  EXPECT_GT(nonzero_codes, slots * kSharedIntermediate / 2) << "the codes carry the output";
  // sort_pairs zeroed every counter (poisoned above); those of tiles past the count stay 0.
  if (scopes > 0) {
    const std::vector<int32_t> arrivals = download(layout.arrivals, layout.arrival_count);
    const int32_t tiles = download(layout.tile_count, 1)[0];
    for (int64_t i = tiles * scopes; i < layout.arrival_count; ++i) EXPECT_EQ(arrivals[i], 0) << "unused counter " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schemes, FusedQuantize,
    ::testing::Values(FusedCase{"per_group_decode_tile", cuda::Fp8Granularity::kPerGroup, 3, 16, false, 6},
                      FusedCase{"per_group_decode_tile_shallow_ring", cuda::Fp8Granularity::kPerGroup, 3, 16, false, 5},
                      FusedCase{"per_group_medium_tile", cuda::Fp8Granularity::kPerGroup, 60, 64},
                      FusedCase{"per_group_specialized_tile", cuda::Fp8Granularity::kPerGroup, 400, 128},
                      FusedCase{"static_per_tensor_decode_tile", cuda::Fp8Granularity::kPerTensor, 3, 16, false, 6},
                      FusedCase{"static_per_tensor_decode_tile_shallow_ring", cuda::Fp8Granularity::kPerTensor, 3, 16,
                                false, 5},
                      FusedCase{"static_per_tensor_medium_tile", cuda::Fp8Granularity::kPerTensor, 60, 64},
                      FusedCase{"static_per_tensor_specialized_tile", cuda::Fp8Granularity::kPerTensor, 400, 128},
                      // More work items than the GPU holds CTAs: each persistent CTA (pair)
                      // walks several, the exchange's two buffers in turn.
                      FusedCase{"per_group_specialized_tile_many_items", cuda::Fp8Granularity::kPerGroup, 1200, 128, true},
                      FusedCase{"static_per_tensor_specialized_tile_many_items", cuda::Fp8Granularity::kPerTensor,
                                1200, 128, true},
                      // The wide tile (K of 24 K tiles), its persistent CTAs walking several items.
                      FusedCase{"per_group_specialized_wide_tile", cuda::Fp8Granularity::kPerGroup, 2400, 128, true, 0,
                                3072, 256}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace epmoe
