#include "epmoe/quantize.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "epmoe/dtype.h"

namespace epmoe {

Fp8Blocks weight_scale_blocks(const QuantSpec& quant, int64_t n, int64_t k) {
  switch (quant.scheme) {
    case QuantScheme::kFp8Channel: return {n, k, 1, k};
    case QuantScheme::kFp8Block: return {n, k, quant.block_n, quant.block_k};
    case QuantScheme::kFp8Tensor:
    case QuantScheme::kBf16: break;
  }
  return {n, k, n, k};
}

std::vector<int64_t> weight_scale_shape(const QuantSpec& quant, std::optional<int64_t> experts, int64_t n,
                                        int64_t k) {
  if (!is_fp8(quant.scheme)) return {};
  std::vector<int64_t> shape;
  if (experts) shape.push_back(*experts);
  if (quant.scheme == QuantScheme::kFp8Channel) shape.push_back(n);
  if (quant.scheme == QuantScheme::kFp8Block) {
    const Fp8Blocks blocks = weight_scale_blocks(quant, n, k);
    shape.push_back(blocks.scale_rows());
    shape.push_back(blocks.scale_cols());
  }
  if (shape.empty()) shape.push_back(1);
  return shape;
}

float fp8_scale_for_amax(float amax) {
  if (std::isnan(amax)) return std::numeric_limits<float>::quiet_NaN();
  return std::max(amax, kFp8MinAmax) / kFp8E4M3Max;
}

float amax_of(const float* values, int64_t count, int64_t stride) {
  float amax = 0.0f;
  for (int64_t i = 0; i < count; ++i) {
    const float magnitude = std::fabs(values[i * stride]);
    if (std::isnan(magnitude)) return std::numeric_limits<float>::quiet_NaN();
    amax = std::max(amax, magnitude);
  }
  return amax;
}

void quantize_fp8_blocks(const float* values, const Fp8Blocks& blocks, uint8_t* codes, float* scales) {
  for (int64_t block_row = 0; block_row < blocks.scale_rows(); ++block_row) {
    const int64_t row_begin = block_row * blocks.block_rows;
    const int64_t row_end = std::min(blocks.rows, row_begin + blocks.block_rows);
    for (int64_t block_col = 0; block_col < blocks.scale_cols(); ++block_col) {
      const int64_t col_begin = block_col * blocks.block_cols;
      const int64_t width = std::min(blocks.cols, col_begin + blocks.block_cols) - col_begin;
      float amax = 0.0f;
      for (int64_t row = row_begin; row < row_end; ++row) {
        const float row_amax = amax_of(values + row * blocks.cols + col_begin, width);
        amax = std::isnan(row_amax) ? row_amax : std::max(amax, row_amax);
        if (std::isnan(amax)) break;
      }
      const float scale = fp8_scale_for_amax(amax);
      scales[block_row * blocks.scale_cols() + block_col] = scale;
      for (int64_t row = row_begin; row < row_end; ++row) {
        const int64_t offset = row * blocks.cols + col_begin;
        quantize_fp8_static(values + offset, width, scale, codes + offset);
      }
    }
  }
}

void quantize_fp8_static(const float* values, int64_t count, float scale, uint8_t* codes) {
  for (int64_t i = 0; i < count; ++i) codes[i] = f32_to_fp8e4m3(values[i] / scale);
}

}  // namespace epmoe
