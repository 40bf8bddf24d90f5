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

// value / scale as the IEEE division rounds it, from inverse = 1 / scale (IEEE), for the
// quantiser's scales (scale_for_amax of a bf16 amax: at least 1e-10 / 448, so nothing
// underflows) and the bf16 values of their blocks (|value| <= amax: the quotient stays within
// 448, nothing overflows): q = value x inverse, then one correction by the residual value -
// q x scale, which an FMA gives exactly (Markstein: from a correctly rounded reciprocal, one
// such step rounds the quotient correctly). A zero residual keeps q (and the sign of a zero
// value); so does an infinite scale (inverse 0: q is 0, or NaN for an infinite value, as the
// division gives). Checked code for code against the division for every bf16 amax and every
// bf16 value of its blocks (tests/test_scale_division.cu). One multiply and two FMAs where
// the division takes about eight instructions, a range check and a slow-path call.
__host__ __device__ inline float divide_by_scale(float value, float scale, float inverse) {
  const float quotient = value * inverse;
  const float residual = fmaf(-quotient, scale, value);
  return inverse == 0.0f || residual == 0.0f ? quotient : fmaf(residual, inverse, quotient);
}

// A scale and how values are divided by it. The quantiser's own scales (of a block's amax)
// go by their reciprocal (divide_by_scale); a static scale the caller gives (any float) by
// the IEEE division. A kernel that may meet either picks the type once, not per value.
struct AmaxScale {
  float scale, inverse;
  __device__ explicit AmaxScale(uint32_t amax_bits) : scale(scale_for_amax(amax_bits)), inverse(1.0f / scale) {}
  __device__ float quotient(float value) const { return divide_by_scale(value, scale, inverse); }
};
struct StaticScale {
  float scale;
  __device__ float quotient(float value) const { return value / scale; }
};

template <typename Scale>
__device__ inline uint8_t encode_e4m3(float value, const Scale& scale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(scale.quotient(value), __NV_SATFINITE, __NV_E4M3));
}
// The codes of two values, the first in the low byte: one conversion (cvt ...e4m3x2) for both,
// each code the one encode_e4m3 gives.
template <typename Scale>
__device__ inline uint16_t encode_e4m3x2(float first, float second, const Scale& scale) {
  return __nv_cvt_float2_to_fp8x2(make_float2(scale.quotient(first), scale.quotient(second)), __NV_SATFINITE,
                                  __NV_E4M3);
}

// |value| as ordered bits; NaN maps above every number. (The sign bit cleared alone would
// order a NaN above +inf as well, one LOP3 where this takes three instructions, but it moved
// the register allocation of the wide GEMM1 with epilogue scales: 44 -> 136 bytes of spill.)
__device__ inline uint32_t magnitude_bits(float value) {
  return isnan(value) ? kNanBits : __float_as_uint(fabsf(value));
}

// The max of magnitude_bits over four bf16 values packed in 8 bytes, from their bits: a
// bf16's float has its bits above 16 zeros, so the max of the halves' magnitudes (two at a
// time, VIMNMX.U16x2) shifted up is the floats' max; a NaN's bits (exponent all ones,
// mantissa not zero) order above +inf's, so a NaN makes it a NaN, which scale_for_amax turns
// into its NaN scale as it does kNanBits.
__device__ inline uint32_t bf16x4_amax_bits(uint2 quad) {
  const uint32_t halves = __vmaxu2(quad.x & 0x7fff7fffu, quad.y & 0x7fff7fffu);
  return max(halves & 0xffffu, halves >> 16) << 16;
}

// The max over groups of `lanes` neighbouring lanes (a power of two up to 32); every lane of
// the warp calls it.
__device__ inline uint32_t warp_max_bits(uint32_t bits, int lanes = 32) {
  for (int offset = lanes / 2; offset > 0; offset /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  return bits;
}

// Four bf16 values packed in 8 bytes, as floats.
__device__ inline void unpack_bf16x4(uint2 quad, float (&v)[4]) {
  auto to_float = [](uint32_t bits) { return __bfloat162float(__ushort_as_bfloat16(static_cast<uint16_t>(bits))); };
  v[0] = to_float(quad.x), v[1] = to_float(quad.x >> 16), v[2] = to_float(quad.y), v[3] = to_float(quad.y >> 16);
}

// The codes of four values, packed in value order.
template <typename Scale>
__device__ inline uint32_t encode_e4m3x4(const float (&v)[4], const Scale& scale) {
  return encode_e4m3x2(v[0], v[1], scale) | uint32_t{encode_e4m3x2(v[2], v[3], scale)} << 16;
}

// Calls visit(i, v, n) for this thread's share of values[0, width), the span read by
// `threads` threads (a warp, or a block): v[0, n) = values[i, i + n), n = 4 neighbours per
// 8-byte load when `quads` (width % 4 == 0, values 8-byte aligned), else n = 1. Eight loads
// are in flight at once; they bypass L1 (__ldcg): the second pass finds the span in L2
// either way.
template <typename Visit>
__device__ void for_each_value(const uint16_t* values, int64_t width, bool quads, int thread, int threads,
                               Visit visit) {
  if (quads) {
#pragma unroll 8
    for (int64_t i = 4 * thread; i < width; i += 4 * threads) {
      float v[4];
      unpack_bf16x4(__ldcg(reinterpret_cast<const uint2*>(values + i)), v);
      visit(i, v, 4);
    }
  } else {
    for (int64_t i = thread; i < width; i += threads) {
      const float v[4] = {__bfloat162float(__ushort_as_bfloat16(__ldcg(values + i))), 0.0f, 0.0f, 0.0f};
      visit(i, v, 1);
    }
  }
}

// Whether a span goes by quads of values (for_each_value): widths of whole quads, values and
// codes aligned to them.
__device__ inline bool span_in_quads(const uint16_t* values, const uint8_t* codes, int64_t width) {
  return width % 4 == 0 && reinterpret_cast<uintptr_t>(values) % 8 == 0 && reinterpret_cast<uintptr_t>(codes) % 4 == 0;
}

// The amax bits of values[0, width), read by kSpanThreads threads: a warp (32), or the whole
// block (its threads all call it, the same number of times). Every one of them gets it.
template <int kSpanThreads = 32>
__device__ inline uint32_t span_amax_bits(const uint16_t* values, int64_t width, bool quads, int thread) {
  static_assert(kSpanThreads % 32 == 0, "a span is read by whole warps");
  uint32_t amax = 0;
  for_each_value(values, width, quads, thread, kSpanThreads, [&](int64_t, const float(&v)[4], int n) {
    for (int j = 0; j < n; ++j) amax = max(amax, magnitude_bits(v[j]));
  });
  amax = warp_max_bits(amax);
  if constexpr (kSpanThreads > 32) {
    __shared__ uint32_t warp_amax[kSpanThreads / 32];
    if (thread % 32 == 0) warp_amax[thread / 32] = amax;
    __syncthreads();
    for (int warp = 0; warp < kSpanThreads / 32; ++warp) amax = max(amax, warp_amax[warp]);
    __syncthreads();  // (read by all before a later span writes it)
  }
  return amax;
}

// kSpanThreads threads write the codes of values[0, width) under `scale`.
template <int kSpanThreads = 32, typename Scale>
__device__ inline void encode_span(const uint16_t* values, uint8_t* codes, int64_t width, bool quads, int thread,
                                   const Scale& scale) {
  for_each_value(values, width, quads, thread, kSpanThreads, [&](int64_t i, const float(&v)[4], int n) {
    if (n == 4) {  // i % 4 == 0 and codes 4-byte aligned
      *reinterpret_cast<uint32_t*>(codes + i) = encode_e4m3x4(v, scale);
    } else {
      codes[i] = encode_e4m3(v[0], scale);
    }
  });
}

// One warp quantises values[0, width) with the scale of their amax. Two reads of the span
// (amax, then codes; the second from L2). Returns the scale.
__device__ inline float quantize_span(const uint16_t* values, uint8_t* codes, int64_t width, int lane) {
  const bool quads = span_in_quads(values, codes, width);
  const AmaxScale scale(span_amax_bits(values, width, quads, lane));
  encode_span(values, codes, width, quads, lane, scale);
  return scale.scale;
}

// A span of at most 128 values held in registers, quantised by the lanes that hold it: kQuads
// quads of four values a lane (lane l holds values 4 kQuads l .. 4 kQuads l + 4 kQuads - 1,
// `held` where the span has them), so a warp a span for one quad (8-byte loads), a half-warp
// for two (16-byte loads; the other half, with its own span, must call it too: the
// shuffles). One read, no second pass. Writes lane l's codes at codes + 4 kQuads l (aligned
// to that) and returns the scale: the given static one, or that of the span's amax.
template <int kQuads>
__device__ inline float quantize_held(const uint2 (&quads)[kQuads], bool held, const float* static_scale,
                                      uint8_t* codes, int lane) {
  float v[kQuads][4];
  for (int i = 0; i < kQuads; ++i) unpack_bf16x4(quads[i], v[i]);
  auto write = [&](const auto& scale) {
    if (!held) return;
    if constexpr (kQuads == 1)
      *reinterpret_cast<uint32_t*>(codes + 4 * lane) = encode_e4m3x4(v[0], scale);
    else
      *reinterpret_cast<uint2*>(codes + 8 * lane) = make_uint2(encode_e4m3x4(v[0], scale), encode_e4m3x4(v[1], scale));
  };
  if (static_scale) {
    write(StaticScale{*static_scale});
    return *static_scale;
  }
  uint32_t amax = 0;
  if (held)
    for (int i = 0; i < kQuads; ++i) amax = max(amax, bf16x4_amax_bits(quads[i]));
  const AmaxScale scale(warp_max_bits(amax, 32 / kQuads));
  write(scale);
  return scale.scale;
}

}  // namespace epmoe::cuda
