// FP8 (e4m3) quantisation on the CPU: the reference the GPU quantisers must match code
// for code. A matrix [rows, cols] is cut into blocks of block_rows x block_cols; each block
// gets scale = max(amax, 1e-10) / 448 and codes = e4m3(value / scale), saturating.
//   activations per tensor:  block = rows x cols      weights per tensor:  N x K
//   activations per token:   block = 1 x cols         weights per channel: 1 x K
//   activations per group:   block = 1 x group        weights per block:   block_n x block_k
// A NaN anywhere in a block makes its scale and every code of the block NaN: the error
// stays visible instead of being clamped away.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "epmoe/moe_spec.h"

namespace epmoe {

inline constexpr float kFp8MinAmax = 1e-10f;

// The scale grid of a blocked matrix: [ceil(rows / block_rows), ceil(cols / block_cols)].
struct Fp8Blocks {
  int64_t rows = 0, cols = 0;
  int64_t block_rows = 1, block_cols = 1;
  int64_t scale_rows() const { return (rows + block_rows - 1) / block_rows; }
  int64_t scale_cols() const { return (cols + block_cols - 1) / block_cols; }
};

// How a scheme cuts a weight matrix [N, K] into scale blocks (the checkpoint's layout):
// fp8_tensor N x K, fp8_channel 1 x K, fp8_block block_n x block_k; bf16: N x K.
Fp8Blocks weight_scale_blocks(const QuantSpec& quant, int64_t n, int64_t k);

// The shape of a weight's scale tensor: fp8_tensor [E] (or [1] without an expert
// dimension), fp8_channel [E, N], fp8_block [E, N / block_n, K / block_k]; empty for bf16.
std::vector<int64_t> weight_scale_shape(const QuantSpec& quant, std::optional<int64_t> experts, int64_t n,
                                        int64_t k);

// Scale that maps a block whose largest magnitude is `amax` onto the e4m3 range.
float fp8_scale_for_amax(float amax);

// Largest |value| of `count` values; NaN if any value is NaN.
float amax_of(const float* values, int64_t count, int64_t stride = 1);

// values [rows, cols] f32 -> codes [rows, cols] e4m3, scales [scale_rows, scale_cols] f32.
void quantize_fp8_blocks(const float* values, const Fp8Blocks& blocks, uint8_t* codes, float* scales);

// The same with one given (static) scale for every element.
void quantize_fp8_static(const float* values, int64_t count, float scale, uint8_t* codes);

}  // namespace epmoe
