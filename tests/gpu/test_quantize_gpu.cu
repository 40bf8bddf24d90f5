// The GPU's fp8 quantisers against the CPU quantiser: the same scales and the same e4m3
// codes, bit for bit, per token, per group of 128 and per tensor (dynamic and static), on
// fresh random rows of varied magnitude, plus a row of zeros, a row of huge values, and a
// NaN, which must make its block's scale and codes NaN; and only the rows a local pair reads
// where the caller asks so.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "epmoe/device_case.h"
#include "epmoe/dtype.h"
#include "epmoe/quantize.h"
#include "moe/cuda/launchers.h"

namespace epmoe {
namespace {

constexpr int64_t kRows = 37;

// `rows` rows of normal values scaled by 10^[-3, 3]; row 3 is zeros, row 5 huge (near bf16's
// largest), and, when asked, one NaN in row 7.
std::vector<uint16_t> random_rows(int64_t rows, int64_t cols, bool with_nan, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> exponent(-3.0f, 3.0f);
  std::vector<uint16_t> values(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float magnitude = r == 5 ? 1e37f : std::pow(10.0f, exponent(rng));
    for (int64_t c = 0; c < cols; ++c) values[r * cols + c] = f32_to_bf16(r == 3 ? 0.0f : normal(rng) * magnitude);
  }
  if (with_nan) values[7 * cols + cols / 3] = f32_to_bf16(NAN);
  return values;
}

struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

// group > 0: per row and group (group = cols: per row); 0: per tensor (static_scale when
// not NaN). slot_of_pair (rows x top_k, when not empty): only the rows with a slot there.
// Every launch also zeroes counters (Fp8Quantize::zero), more than its grid has threads.
Quantized on_gpu(const std::vector<uint16_t>& values, int64_t cols, int64_t group, float static_scale,
                 const std::vector<int32_t>& slot_of_pair = {}, int top_k = 0) {
  const int64_t rows = static_cast<int64_t>(values.size()) / cols;
  const int64_t scale_count = group > 0 ? rows * ((cols + group - 1) / group) : 1;
  DeviceBuffer d_values = DeviceBuffer::allocate(values.size() * 2).value();
  DeviceBuffer d_codes = DeviceBuffer::allocate(values.size()).value();
  DeviceBuffer d_scales = DeviceBuffer::allocate(scale_count * 4 + 8).value();
  EXPECT_EQ(cudaMemcpy(d_values.data(), values.data(), values.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(d_codes.data(), 0x55, values.size()), cudaSuccess);  // poison
  EXPECT_EQ(cudaMemset(d_scales.data(), 0xff, scale_count * 4 + 8), cudaSuccess);
  auto* scales = static_cast<float*>(d_scales.data());
  float* given = scales + scale_count;  // static scale
  uint32_t* amax_bits = reinterpret_cast<uint32_t*>(scales + scale_count + 1);
  if (!std::isnan(static_scale))
    EXPECT_EQ(cudaMemcpy(given, &static_scale, 4, cudaMemcpyHostToDevice), cudaSuccess);
  cuda::Fp8Quantize q{
      static_cast<const uint16_t*>(d_values.data()), static_cast<uint8_t*>(d_codes.data()), scales, rows, cols, cols};
  q.granularity = group == 0      ? cuda::Fp8Granularity::kPerTensor
                  : group == cols ? cuda::Fp8Granularity::kPerRow
                                  : cuda::Fp8Granularity::kPerGroup;
  q.group = group;
  q.static_scale = std::isnan(static_scale) ? nullptr : given;
  q.amax_bits = amax_bits;
  DeviceBuffer d_slots = DeviceBuffer::allocate(slot_of_pair.size() * 4 + 4).value();
  if (!slot_of_pair.empty()) {
    EXPECT_EQ(cudaMemcpy(d_slots.data(), slot_of_pair.data(), slot_of_pair.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    q.slot_of_pair = static_cast<const int32_t*>(d_slots.data());
    q.top_k = top_k;
  }
  constexpr int64_t kCounters = 300007;
  DeviceBuffer d_counters = DeviceBuffer::allocate(kCounters * 4).value();
  EXPECT_EQ(cudaMemset(d_counters.data(), 0x7f, kCounters * 4), cudaSuccess);
  q.zero = static_cast<int32_t*>(d_counters.data());
  q.zero_count = kCounters;
  EXPECT_EQ(cuda::launch_quantize_fp8(q, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<int32_t> counters(kCounters);
  EXPECT_EQ(cudaMemcpy(counters.data(), d_counters.data(), kCounters * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::count(counters.begin(), counters.end(), 0), kCounters) << "counters zeroed";
  Quantized out{std::vector<uint8_t>(values.size()), std::vector<float>(scale_count)};
  EXPECT_EQ(cudaMemcpy(out.codes.data(), d_codes.data(), values.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.scales.data(), scales, scale_count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

Quantized on_cpu(const std::vector<uint16_t>& values, int64_t cols, int64_t group, float static_scale) {
  const int64_t rows = static_cast<int64_t>(values.size()) / cols;
  std::vector<float> f32(values.size());
  for (size_t i = 0; i < values.size(); ++i) f32[i] = bf16_to_f32(values[i]);
  const Fp8Blocks blocks{rows, cols, group > 0 ? 1 : rows, group > 0 ? group : cols};
  Quantized out{std::vector<uint8_t>(values.size()), std::vector<float>(blocks.scale_rows() * blocks.scale_cols())};
  if (std::isnan(static_scale)) {
    quantize_fp8_blocks(f32.data(), blocks, out.codes.data(), out.scales.data());
  } else {
    quantize_fp8_static(f32.data(), static_cast<int64_t>(f32.size()), static_scale, out.codes.data());
    out.scales[0] = static_scale;
  }
  return out;
}

// The CPU's scale bit for bit, or NaN where the CPU's is NaN (a NaN's payload is no one's
// promise).
bool same_scale(float gpu, float cpu) {
  return std::isnan(cpu) ? std::isnan(gpu) : std::bit_cast<uint32_t>(gpu) == std::bit_cast<uint32_t>(cpu);
}

void expect_identical(const Quantized& gpu, const Quantized& cpu) {
  ASSERT_EQ(gpu.scales.size(), cpu.scales.size());
  for (size_t i = 0; i < cpu.scales.size(); ++i)
    EXPECT_TRUE(same_scale(gpu.scales[i], cpu.scales[i]))
        << "scale " << i << ": " << gpu.scales[i] << " vs " << cpu.scales[i];
  size_t mismatches = 0;
  for (size_t i = 0; i < cpu.codes.size(); ++i) mismatches += gpu.codes[i] != cpu.codes[i];
  EXPECT_EQ(mismatches, 0u) << "of " << cpu.codes.size() << " codes";
}

struct QuantCase {
  const char* name;
  int64_t rows, cols, group;  // group 0: per tensor
  bool with_nan;
  float static_scale;   // NaN: dynamic
};

class GpuQuantizer : public ::testing::TestWithParam<QuantCase> {};

TEST_P(GpuQuantizer, SameCodesAndScalesAsTheCpu) {
  const QuantCase& c = GetParam();
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::vector<uint16_t> values = random_rows(c.rows, c.cols, c.with_nan, seed);
  const Quantized cpu = on_cpu(values, c.cols, c.group, c.static_scale);
  expect_identical(on_gpu(values, c.cols, c.group, c.static_scale), cpu);
  if (c.group > 0) {
    // The zero row's scale is the floor's; the NaN row's group is NaN throughout.
    const int64_t groups = (c.cols + c.group - 1) / c.group;
    EXPECT_EQ(cpu.scales[3 * groups], kFp8MinAmax / kFp8E4M3Max);
    if (c.with_nan) EXPECT_TRUE(std::isnan(cpu.scales[7 * groups + (c.cols / 3) / c.group]));
  }
}

// x for the routed experts: only the rows of tokens with a local pair (a slot among their
// top_k) get codes and scales, as the CPU's; the others keep the poison.
TEST(GpuQuantizerRows, QuantisesOnlyTheRowsALocalPairReads) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  constexpr int kTopK = 8;
  constexpr int64_t kFilteredRows = 3001;  // per group: several units a warp (7168 columns)
  std::vector<int32_t> slot_of_pair(kFilteredRows * kTopK, -1);
  std::vector<bool> read(kFilteredRows, false);
  int32_t next_slot = 0;
  for (int64_t r = 0; r < kFilteredRows; ++r)
    for (int j = 0; j < kTopK; ++j)
      if (rng() % 12 == 0) slot_of_pair[r * kTopK + j] = next_slot++, read[r] = true;
  read[0] = true, slot_of_pair[kTopK - 1] = next_slot++;         // a row read through its last pair only
  for (int j = 0; j < kTopK; ++j) slot_of_pair[kTopK + j] = -1;  // row 1 read by none
  read[1] = false;
  for (const auto& [cols, group] : {std::pair<int64_t, int64_t>{7168, 128}, {1000, 128}, {2048, 2048}}) {
    SCOPED_TRACE("cols " + std::to_string(cols) + " group " + std::to_string(group));
    const std::vector<uint16_t> values = random_rows(kFilteredRows, cols, true, seed);
    const Quantized cpu = on_cpu(values, cols, group, NAN);
    const Quantized gpu = on_gpu(values, cols, group, NAN, slot_of_pair, kTopK);
    const int64_t scales_per_row = (cols + group - 1) / group;
    size_t wrong = 0;
    for (int64_t r = 0; r < kFilteredRows; ++r) {
      for (int64_t c = 0; c < cols; ++c)
        wrong += gpu.codes[r * cols + c] != (read[r] ? cpu.codes[r * cols + c] : uint8_t{0x55});
      for (int64_t g = 0; g < scales_per_row; ++g) {
        const float got = gpu.scales[r * scales_per_row + g];
        wrong += read[r] ? !same_scale(got, cpu.scales[r * scales_per_row + g])
                         : std::bit_cast<uint32_t>(got) != 0xffffffffu;  // the poison
      }
    }
    EXPECT_EQ(wrong, 0u);
  }
}

// A row filter with a per-tensor amax would change the scale: refused.
TEST(GpuQuantizerRows, RefusesARowFilterForAPerTensorAmax) {
  cuda::Fp8Quantize q{nullptr, nullptr, nullptr, 1, 128, 128, cuda::Fp8Granularity::kPerTensor};
  const int32_t slot = 0;
  q.slot_of_pair = &slot;
  q.top_k = 1;
  EXPECT_EQ(cuda::launch_quantize_fp8(q, nullptr), cudaErrorInvalidValue);
}

// (per_group_many_rows: more units of four groups than the warps the GPU holds at once, so
// that each warp of the per-group kernel walks several; per_token_many_rows: more rows than 32
// an SM on GPUs of up to 156 SMs, so that the row kernel runs a warp a row, where the others,
// few rows, run a block a row.)
INSTANTIATE_TEST_SUITE_P(Schemes, GpuQuantizer,
                         ::testing::Values(QuantCase{"per_token_7168", kRows, 7168, 7168, false, NAN},
                                           QuantCase{"per_token_nan", kRows, 2048, 2048, true, NAN},
                                           QuantCase{"per_group_128", kRows, 7168, 128, false, NAN},
                                           QuantCase{"per_group_nan", kRows, 1536, 128, true, NAN},
                                           QuantCase{"per_group_ragged", kRows, 1000, 128, true, NAN},
                                           QuantCase{"per_group_many_rows", 5003, 7168, 128, true, NAN},
                                           QuantCase{"per_tensor", kRows, 4096, 0, false, NAN},
                                           QuantCase{"per_tensor_nan", kRows, 4096, 0, true, NAN},
                                           // a static scale small enough that the huge row and many others saturate
                                           QuantCase{"per_tensor_static_saturating", kRows, 4096, 0, false, 0.01f},
                                           // widths of no whole number of quads: the row and tensor kernels'
                                           // warps read them a value at a time (rows start misaligned)
                                           QuantCase{"per_token_ragged", kRows, 1001, 1001, true, NAN},
                                           QuantCase{"per_token_many_rows", 5003, 2048, 2048, true, NAN},
                                           QuantCase{"per_tensor_ragged", kRows, 1001, 0, false, NAN},
                                           QuantCase{"per_tensor_static_ragged", kRows, 1001, 0, true, 0.02f}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace epmoe
