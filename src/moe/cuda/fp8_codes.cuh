// e4m3 codes and scales of bf16 values, code for code what the CPU quantiser
// (include/epmoe/quantize.h) produces: scale = max(amax, 1e-10) / 448 per block, codes =
// e4m3(value / scale) saturating (IEEE division, as on the CPU), and a NaN anywhere in a
// block makes its scale and codes NaN. Shared by the quantisation kernels (quantize.cu) and
// GEMM1's epilogue (grouped_gemm.cu), which must give the same codes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace epmoe::cuda {

inline constexpr float kFp8MaxCode = 448.0f;
inline constexpr float kFp8MinAmax = 1e-10f;
inline constexpr uint32_t kNanBits = 0x7fc00000u;  // above +inf (0x7f800000) as an unsigned number

__device__ inline float scale_for_amax(uint32_t amax_bits) {
  const float amax = __uint_as_float(amax_bits);
  return isnan(amax) ? __uint_as_float(kNanBits) : fmaxf(amax, kFp8MinAmax) / kFp8MaxCode;
}

__device__ inline uint8_t encode_e4m3(float value, float scale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(value / scale, __NV_SATFINITE, __NV_E4M3));
}

// |value| as ordered bits; NaN maps above every number.
__device__ inline uint32_t magnitude_bits(float value) {
  return isnan(value) ? kNanBits : __float_as_uint(fabsf(value));
}

__device__ inline uint32_t warp_max_bits(uint32_t bits) {
  for (int offset = 16; offset > 0; offset /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  return bits;
}

// Four bf16 values packed in 8 bytes, as floats.
__device__ inline void unpack_bf16x4(uint2 quad, float (&v)[4]) {
  auto to_float = [](uint32_t bits) { return __bfloat162float(__ushort_as_bfloat16(static_cast<uint16_t>(bits))); };
  v[0] = to_float(quad.x), v[1] = to_float(quad.x >> 16), v[2] = to_float(quad.y), v[3] = to_float(quad.y >> 16);
}

// The codes of four values, packed in value order.
__device__ inline uint32_t encode_e4m3x4(const float (&v)[4], float scale) {
  return encode_e4m3(v[0], scale) | encode_e4m3(v[1], scale) << 8 | encode_e4m3(v[2], scale) << 16 |
         uint32_t{encode_e4m3(v[3], scale)} << 24;
}

// Calls visit(i, v, n) for this lane's share of values[0, width): v[0, n) = values[i, i + n),
// n = 4 neighbours per 8-byte load when `quads` (width % 4 == 0, values 8-byte aligned), else
// n = 1. Eight loads are in flight at once; they bypass L1 (__ldcg): the second pass finds
// the span in L2 either way.
template <typename Visit>
__device__ void for_each_value(const uint16_t* values, int64_t width, bool quads, int lane, Visit visit) {
  if (quads) {
#pragma unroll 8
    for (int64_t i = 4 * lane; i < width; i += 128) {
      float v[4];
      unpack_bf16x4(__ldcg(reinterpret_cast<const uint2*>(values + i)), v);
      visit(i, v, 4);
    }
  } else {
    for (int64_t i = lane; i < width; i += 32) {
      const float v[4] = {__bfloat162float(__ushort_as_bfloat16(__ldcg(values + i))), 0.0f, 0.0f, 0.0f};
      visit(i, v, 1);
    }
  }
}

// One warp quantises values[0, width) with the scale of their amax. Two reads of the span
// (amax, then codes; the second from L2). Returns the scale.
__device__ inline float quantize_span(const uint16_t* values, uint8_t* codes, int64_t width, int lane) {
  const bool quads = width % 4 == 0 && reinterpret_cast<uintptr_t>(values) % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(codes) % 4 == 0;
  uint32_t amax = 0;
  for_each_value(values, width, quads, lane, [&](int64_t, const float (&v)[4], int n) {
    for (int j = 0; j < n; ++j) amax = max(amax, magnitude_bits(v[j]));
  });
  const float scale = scale_for_amax(warp_max_bits(amax));
  for_each_value(values, width, quads, lane, [&](int64_t i, const float (&v)[4], int n) {
    if (n == 4) {  // i % 4 == 0 and codes 4-byte aligned
      *reinterpret_cast<uint32_t*>(codes + i) = encode_e4m3x4(v, scale);
    } else {
      codes[i] = encode_e4m3(v[0], scale);
    }
  });
  return scale;
}

// One warp quantises a span of at most 128 values held in registers, four per lane (lane l
// holds values 4l..4l+3, `held` where the span has them): one read, no second pass. Writes
// lane l's codes at codes + 4 l (4-byte aligned) and returns the scale: the given static
// one, or that of the span's amax.
__device__ inline float quantize_held(uint2 quad, bool held, const float* static_scale, uint8_t* codes, int lane) {
  float v[4];
  unpack_bf16x4(quad, v);
  float scale;
  if (static_scale) {
    scale = *static_scale;
  } else {
    uint32_t amax = 0;
    if (held)
      for (float value : v) amax = max(amax, magnitude_bits(value));
    scale = scale_for_amax(warp_max_bits(amax));
  }
  if (held) *reinterpret_cast<uint32_t*>(codes + 4 * lane) = encode_e4m3x4(v, scale);
  return scale;
}

}  // namespace epmoe::cuda
