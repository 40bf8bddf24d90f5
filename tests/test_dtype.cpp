// core/dtype: every bf16, f16 and fp8 bit pattern decoded, and f32 values around every
// pattern encoded, checked against an independent nearest-value search and (where the CUDA
// headers are present) against CUDA's own __nv_bfloat16 / __half / __nv_fp8_e4m3.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "epmoe/dtype.h"

#ifdef EPMOE_HAVE_CUDA_HEADERS
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace epmoe {
namespace {

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// f32 values that probe every rounding decision: each bf16 and f16 pattern, the midpoints
// to their neighbours and one f32 step either side, plus random bit patterns.
std::vector<float> probe_values() {
  std::vector<float> values;
  for (uint32_t code = 0; code < 65536; ++code) {
    const uint32_t bits = code << 16;
    for (uint32_t low : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0x0001u}) values.push_back(std::bit_cast<float>(bits | low));
    const float half = f16_to_f32(static_cast<uint16_t>(code));
    values.push_back(half);
    values.push_back(std::nextafter(half, 0.0f));
    values.push_back(std::nextafter(half, INFINITY));
  }
  for (int code = 0; code < 256; ++code) {
    const float value = fp8e4m3_to_f32(static_cast<uint8_t>(code));
    const float next = fp8e4m3_to_f32(static_cast<uint8_t>(code + 1));
    if (std::isfinite(value) && std::isfinite(next)) {
      const float midpoint = (value + next) / 2;  // exact in f32
      values.insert(values.end(), {midpoint, std::nextafter(midpoint, 0.0f), std::nextafter(midpoint, INFINITY)});
    }
  }
  std::mt19937 rng(std::random_device{}());
  for (int i = 0; i < (1 << 20); ++i) values.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  return values;
}

// Nearest of two candidate codes by exact (double) distance; ties to the even code.
uint32_t nearer(double value, uint32_t low_code, double low, uint32_t high_code, double high) {
  const double to_low = std::fabs(value - low), to_high = std::fabs(high - value);
  if (to_low != to_high) return to_low < to_high ? low_code : high_code;
  return (low_code & 1) == 0 ? low_code : high_code;
}

uint16_t reference_bf16(float value) {
  if (std::isnan(value)) return 0x7fff;
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t toward_zero = static_cast<uint16_t>(bits >> 16);
  if ((toward_zero & 0x7f80) == 0x7f80) return toward_zero;  // infinity
  const uint16_t away = toward_zero + 1;
  const double away_value = (away & 0x7fff) == 0x7f80
                                ? std::copysign(std::ldexp(1.0, 128), value)  // next step past the max: 2^128
                                : bf16_to_f32(away);
  return static_cast<uint16_t>(nearer(value, toward_zero, bf16_to_f32(toward_zero), away, away_value));
}

uint8_t reference_fp8(float value) {
  if (std::isnan(value)) return 0x7f;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const double magnitude = std::fabs(static_cast<double>(value));
  if (magnitude >= 448.0) return sign | 0x7e;  // saturating
  uint8_t below = 0;
  while (below < 0x7e && fp8e4m3_to_f32(below + 1) <= magnitude) ++below;
  if (fp8e4m3_to_f32(below) == magnitude) return sign | below;
  return sign | static_cast<uint8_t>(nearer(magnitude, below, fp8e4m3_to_f32(below), below + 1, fp8e4m3_to_f32(below + 1)));
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kFP8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_EQ(dtype_name(DType::kFP8E4M3), "fp8_e4m3");
}

TEST(DType, Bf16DecodeIsTheTopHalfOfF32ForEveryPattern) {
  for (uint32_t code = 0; code < 65536; ++code) {
    const float value = bf16_to_f32(static_cast<uint16_t>(code));
    ASSERT_EQ(std::bit_cast<uint32_t>(value), code << 16);
    if (!std::isnan(value)) {
      ASSERT_EQ(f32_to_bf16(value), code) << "round trip of " << code;
    }
  }
}

TEST(DType, Fp8DecodeKnownCodesAndRoundTripForEveryCode) {
  EXPECT_EQ(fp8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(fp8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(fp8e4m3_to_f32(0x38), 1.0f);
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(0xff)));
  for (int code = 0; code < 256; ++code) {
    const float value = fp8e4m3_to_f32(static_cast<uint8_t>(code));
    if (std::isnan(value)) continue;
    ASSERT_EQ(f32_to_fp8e4m3(value), code) << "round trip of code " << code;
  }
}

TEST(DType, F16DecodeAndRoundTripForEveryPattern) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  for (uint32_t code = 0; code < 65536; ++code) {
    const float value = f16_to_f32(static_cast<uint16_t>(code));
    if (!std::isnan(value)) {
      ASSERT_EQ(f32_to_f16(value), code) << "round trip of " << code;
    }
  }
}

TEST(DType, Fp8SaturatesAndKeepsNaN) {
  EXPECT_EQ(f32_to_fp8e4m3(449.0f), 0x7e);
  EXPECT_EQ(f32_to_fp8e4m3(1e30f), 0x7e);
  EXPECT_EQ(f32_to_fp8e4m3(INFINITY), 0x7e);
  EXPECT_EQ(f32_to_fp8e4m3(-INFINITY), 0xfe);
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(f32_to_fp8e4m3(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(f32_to_fp8e4m3(-std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(f32_to_fp8e4m3(464.0f), 0x7e);  // the midpoint to 480 (a NaN code) stays finite
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()), 0x7fff);
}

TEST(DType, EncodingIsNearestWithTiesToEven) {
  for (float value : probe_values()) {
    ASSERT_EQ(f32_to_bf16(value), reference_bf16(value)) << "bf16 of bits " << std::bit_cast<uint32_t>(value);
    ASSERT_EQ(f32_to_fp8e4m3(value), reference_fp8(value)) << "fp8 of bits " << std::bit_cast<uint32_t>(value);
  }
}

#ifdef EPMOE_HAVE_CUDA_HEADERS
TEST(DType, BitIdenticalToCudaHostConversions) {
  for (uint32_t code = 0; code < 65536; ++code) {
    __nv_bfloat16_raw bf16_raw{static_cast<unsigned short>(code)};
    __half_raw half_raw{static_cast<unsigned short>(code)};
    ASSERT_TRUE(same_float(bf16_to_f32(static_cast<uint16_t>(code)), __bfloat162float(__nv_bfloat16(bf16_raw))));
    ASSERT_TRUE(same_float(f16_to_f32(static_cast<uint16_t>(code)), __half2float(__half(half_raw))));
  }
  for (int code = 0; code < 256; ++code) {
    __nv_fp8_e4m3 fp8;
    fp8.__x = static_cast<__nv_fp8_storage_t>(code);
    ASSERT_TRUE(same_float(fp8e4m3_to_f32(static_cast<uint8_t>(code)), static_cast<float>(fp8))) << code;
  }
  for (float value : probe_values()) {
    const __nv_bfloat16_raw bf16 = __float2bfloat16_rn(value);
    const __half_raw half = __float2half_rn(value);
    ASSERT_EQ(f32_to_bf16(value), bf16.x) << "bf16 of bits " << std::bit_cast<uint32_t>(value);
    ASSERT_EQ(f32_to_f16(value), half.x) << "f16 of bits " << std::bit_cast<uint32_t>(value);
    ASSERT_EQ(f32_to_fp8e4m3(value), __nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3))
        << "fp8 of bits " << std::bit_cast<uint32_t>(value);
  }
}
#endif

}  // namespace
}  // namespace epmoe
