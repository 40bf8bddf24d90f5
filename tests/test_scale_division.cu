// divide_by_scale (moe/cuda/fp8_codes.cuh) against the IEEE division it replaces in the fp8
// quantisers: for every bf16 amax, the scale the CPU quantiser makes of it (fp8_scale_for_amax,
// which the kernels' scale_for_amax matches bit for bit, test_quantize_gpu), and every bf16
// value a block with that amax can hold (|value| <= amax, both signs), the e4m3 code of the
// quotient must be the division's (the code the CPU quantiser writes). Exhaustive, on the
// host: ~1.1e9 pairs over the machine's cores. Runs without a GPU.
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "epmoe/quantize.h"
#include "moe/cuda/fp8_codes.cuh"

namespace epmoe {
namespace {

float bf16_pattern(uint32_t bits) {
  const uint32_t word = bits << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

uint8_t code(float quotient) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(quotient, __NV_SATFINITE, __NV_E4M3));
}

TEST(ScaleDivision, GivesTheDivisionsCodeForEveryBf16BlockValueAndItsScale) {
  constexpr uint32_t kInfinity = 0x7f80;  // bf16 bits of +inf: amax up to it (a NaN makes every code NaN either way)
  std::atomic<uint32_t> next{0};
  std::atomic<long long> mismatches{0}, checked{0};
  std::atomic<uint32_t> first_mismatch{~0u};  // amax bits << 16 | value bits
  auto check = [&] {
    for (uint32_t amax_bits = next++; amax_bits <= kInfinity; amax_bits = next++) {
      const float scale = fp8_scale_for_amax(bf16_pattern(amax_bits)), inverse = 1.0f / scale;
      for (uint32_t magnitude = 0; magnitude <= amax_bits; ++magnitude)
        for (uint32_t sign : {0u, 0x8000u}) {
          const float value = bf16_pattern(sign | magnitude);
          if (code(cuda::divide_by_scale(value, scale, inverse)) != code(value / scale)) {
            ++mismatches;
            uint32_t expected = ~0u;
            first_mismatch.compare_exchange_strong(expected, amax_bits << 16 | sign | magnitude);
          }
        }
      checked += 2 * (amax_bits + 1);
    }
  };
  std::vector<std::thread> threads(std::max(1u, std::thread::hardware_concurrency()));
  for (auto& thread : threads) thread = std::thread(check);
  for (auto& thread : threads) thread.join();
  EXPECT_GT(checked.load(), 1'000'000'000);
  const uint32_t first = first_mismatch.load();
  EXPECT_EQ(mismatches.load(), 0) << "first: value " << bf16_pattern(first & 0xffff) << ", amax "
                                  << bf16_pattern(first >> 16);
}

// Where the reciprocal form is not the division: a static scale (any float) keeps the IEEE
// division, and this is why (a subnormal scale's reciprocal overflows).
TEST(ScaleDivision, IsNotTheDivisionForSubnormalScales) {
  const float scale = 0x1.8p-130f, value = bf16_pattern(0x0080);  // the smallest normal bf16
  EXPECT_NE(code(cuda::divide_by_scale(value, scale, 1.0f / scale)), code(value / scale));
}

}  // namespace
}  // namespace epmoe
