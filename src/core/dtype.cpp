#include "epmoe/dtype.h"

#include <array>
#include <cmath>
#include <limits>

namespace epmoe {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kFP8E4M3: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kFP8E4M3: return "fp8_e4m3";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
  }
  return "unknown";
}

float f16_to_f32(uint16_t bits) {
  const uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Subnormal: mantissa * 2^-24, exact in f32.
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  return sign ? -magnitude : magnitude;
}

uint16_t f32_to_f16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude_bits = bits & 0x7fffffffu;
  if (magnitude_bits > 0x7f800000u) return 0x7fff;
  const float magnitude = std::bit_cast<float>(magnitude_bits);
  if (magnitude < 0x1p-14f) {
    // Subnormal range: the result is round(magnitude / 2^-24), exact scaling then RNE.
    return sign | static_cast<uint16_t>(std::nearbyint(magnitude * 0x1p24f));
  }
  // Normal: keep 10 of 23 mantissa bits with round to nearest even; a carry moves into
  // the exponent, and anything at or past 65520 lands on the infinity encoding.
  const uint32_t rounded = magnitude_bits + 0xfffu + ((magnitude_bits >> 13) & 1u);
  const int32_t exponent = static_cast<int32_t>(rounded >> 23) - 127 + 15;
  if (exponent >= 0x1f) return sign | 0x7c00;
  return sign | static_cast<uint16_t>((exponent << 10) | ((rounded >> 13) & 0x3ffu));
}

namespace {

float decode_fp8e4m3(uint8_t code) {
  const bool negative = code & 0x80;
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 0x7;
  float magnitude;
  if (exponent == 0xf && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  }
  return negative ? -magnitude : magnitude;
}

const std::array<float, 256> kFp8DecodeTable = [] {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) table[code] = decode_fp8e4m3(static_cast<uint8_t>(code));
  return table;
}();

}  // namespace

const float* fp8e4m3_decode_table() { return kFp8DecodeTable.data(); }

float fp8e4m3_to_f32(uint8_t code) { return kFp8DecodeTable[code]; }

uint8_t f32_to_fp8e4m3(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude_bits = bits & 0x7fffffffu;
  if (magnitude_bits > 0x7f800000u) return 0x7f;  // every NaN becomes 0x7f, as in CUDA
  const float magnitude = std::bit_cast<float>(magnitude_bits);
  if (magnitude > kFp8E4M3Max) return sign | 0x7e;  // saturate, infinities included
  if (magnitude < 0x1p-6f) {
    // Subnormal range (steps of 2^-9); a result of 8 is the smallest normal, code 0x08.
    return sign | static_cast<uint8_t>(std::nearbyint(magnitude * 0x1p9f));
  }
  // Normal: keep 3 of 23 mantissa bits, round to nearest even; a carry moves into the
  // exponent. Values up to 448 cannot round past 448 (464 would, and is handled above).
  const uint32_t rounded = magnitude_bits + 0x7ffffu + ((magnitude_bits >> 20) & 1u);
  const uint32_t exponent = (rounded >> 23) - 127 + 7;
  return sign | static_cast<uint8_t>((exponent << 3) | ((rounded >> 20) & 0x7u));
}

}  // namespace epmoe
