// Element types and their conversions. The narrow formats round exactly as CUDA's
// __nv_bfloat16, __half and __nv_fp8_e4m3 do (tests/test_dtype.cpp checks every bit
// pattern against cuda_bf16.h / cuda_fp16.h / cuda_fp8.h), so the CPU reference and the
// GPU kernels produce the same codes from the same float.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace epmoe {

enum class DType : uint8_t { kF32, kBF16, kF16, kFP8E4M3, kI32, kI64 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // "f32", "bf16", "f16", "fp8_e4m3", "i32", "i64"

// The largest finite e4m3fn value; conversions saturate to it.
inline constexpr float kFp8E4M3Max = 448.0f;

// bf16: the top 16 bits of an f32.
inline float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

// Round to nearest even; every NaN becomes the canonical quiet NaN 0x7fff (as CUDA does).
inline uint16_t f32_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

// The f32 value nearest to `value` that bf16 can hold.
inline float round_to_bf16(float value) { return bf16_to_f32(f32_to_bf16(value)); }

// IEEE binary16, round to nearest even, overflow to infinity, NaN to 0x7fff.
float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

// e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities): 0x7f and
// 0xff are NaN. Decoding is exact; encoding rounds to nearest even, saturates finite and
// infinite values beyond ±448 to ±448 (CUDA's __NV_SATFINITE) and turns every NaN into
// 0x7f (a NaN stays a NaN; its sign is dropped, as CUDA drops it).
float fp8e4m3_to_f32(uint8_t code);
uint8_t f32_to_fp8e4m3(float value);

// All 256 decoded values, for inner loops that decode many codes.
const float* fp8e4m3_decode_table();

}  // namespace epmoe
