// The fused MoE operator on the CPU (contract and rounding points: include/epmoe/moe_cpu.h).
//
// Data flow, mirroring the GPU pipeline:
//   pairs (t, j) -> local expert via expert_map -> slots grouped by expert (stable order)
//   GEMM1:  h[slot, 0:2I]  = A_in[token(slot)] . w13[e]^T     (A_in: x, scaled/quantised)
//   act:    a[slot, 0:I]   = act(h[:, :I]) * h[:, I:]          (then bf16 or fp8 rounding)
//   GEMM2:  o[slot, 0:H]   = a[slot] . w2[e]^T                 (then bf16 rounding)
//   combine y[t] = sum_j w_tj o[slot(t, j)] + o_shared[t]
// The shared experts are one more "job" whose slots are all T tokens.
#include <algorithm>
#include <cmath>
#include <new>
#include <vector>

#include "core/parallel.h"
#include "epmoe/moe_cpu.h"
#include "epmoe/quantize.h"

namespace epmoe {

namespace {

// Rows of f32 values with an optional scale grid; the value of element (r, c) is
// values[r, c] * scale(r, c / block_cols). For fp8, values hold the decoded codes.
struct ScaledRows {
  std::vector<float> values;  // [rows, cols]
  std::vector<float> scales;  // [scale_rows, scale_cols]; empty: no scaling
  Fp8Blocks blocks;

  float scale(int64_t row, int64_t k_block) const {
    return scales.empty() ? 1.0f
                          : scales[(row / blocks.block_rows) * blocks.scale_cols() + k_block];
  }
};

// One weight matrix [N, K] of one expert, with its fp8 scale grid.
struct WeightMatrix {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0, cols = 0;
  const float* scales = nullptr;  // null for bf16
  Fp8Blocks blocks;

  void load_row(int64_t row, float* out) const {
    const int64_t offset = row * cols;
    switch (dtype) {
      case DType::kF32:
        std::copy_n(static_cast<const float*>(data) + offset, cols, out);
        break;
      case DType::kBF16: {
        const uint16_t* source = static_cast<const uint16_t*>(data) + offset;
        for (int64_t c = 0; c < cols; ++c) out[c] = bf16_to_f32(source[c]);
        break;
      }
      default: {  // fp8 e4m3
        const uint8_t* source = static_cast<const uint8_t*>(data) + offset;
        const float* table = fp8e4m3_decode_table();
        for (int64_t c = 0; c < cols; ++c) out[c] = table[source[c]];
      }
    }
  }
  float scale(int64_t row, int64_t k_block) const {
    return scales ? scales[(row / blocks.block_rows) * blocks.scale_cols() + k_block] : 1.0f;
  }
};

WeightMatrix weight_matrix(const Tensor& weights, const std::optional<Tensor>& scales,
                           const QuantSpec& quant, int64_t expert, int64_t n, int64_t k) {
  WeightMatrix matrix;
  matrix.dtype = weights.dtype;
  matrix.rows = n;
  matrix.cols = k;
  matrix.data = static_cast<const std::byte*>(weights.data) + expert * n * k * dtype_size(weights.dtype);
  matrix.blocks = weight_scale_blocks(quant, n, k);
  if (is_fp8(quant.scheme))
    matrix.scales = scales->data_as<float>() +
                    expert * matrix.blocks.scale_rows() * matrix.blocks.scale_cols();
  return matrix;
}

// Quantises activation rows [rows, cols] in place per the scheme (no-op for bf16): the
// values become the decoded codes and the scale grid is filled. `static_scale` is the
// fp8_tensor static scale when the checkpoint has one.
void quantize_activations(const QuantSpec& quant, const std::optional<Tensor>& static_scale,
                          ScaledRows& rows) {
  if (!is_fp8(quant.scheme)) return;
  const int64_t row_count = rows.blocks.rows, cols = rows.blocks.cols;
  switch (quant.scheme) {
    case QuantScheme::kFp8Tensor: rows.blocks = {row_count, cols, std::max<int64_t>(row_count, 1), cols}; break;
    case QuantScheme::kFp8Channel: rows.blocks = {row_count, cols, 1, cols}; break;
    default: rows.blocks = {row_count, cols, 1, quant.block_k}; break;
  }
  std::vector<uint8_t> codes(rows.values.size());
  rows.scales.assign(rows.blocks.scale_rows() * rows.blocks.scale_cols(), 0.0f);
  if (static_scale) {
    rows.scales.assign(rows.scales.size(), *static_scale->data_as<float>());
    quantize_fp8_static(rows.values.data(), static_cast<int64_t>(codes.size()), rows.scales[0], codes.data());
  } else {
    quantize_fp8_blocks(rows.values.data(), rows.blocks, codes.data(), rows.scales.data());
  }
  for (size_t i = 0; i < codes.size(); ++i) rows.values[i] = fp8e4m3_to_f32(codes[i]);
}

// One expert's work: which input rows feed which output slots, and its weights.
struct Job {
  WeightMatrix w13, w2;
  const ScaledRows* input = nullptr;  // GEMM1's A operand, indexed by token
  int64_t first_slot = 0, slot_count = 0;
};

// Weight rows decoded and multiplied together: each activation element loaded once feeds
// this many multiply-adds.
constexpr int kRowTile = 4;

// out[slot, n] = sum over K blocks of scale_a * scale_w * dot(a_row, w_row), for the job's
// slots; a_row(slot) is row source_row(slot) of `a`. Rows n_begin..n_end of `w`;
// `w_rows` holds kRowTile decoded rows.
template <typename SourceRow>
void gemm_rows(const ScaledRows& a, SourceRow source_row, const WeightMatrix& w, const Job& job,
               int64_t n_begin, int64_t n_end, float* out, int64_t out_cols, float* w_rows) {
  const int64_t K = w.cols;
  const int64_t k_block = std::min(w.blocks.block_cols, a.scales.empty() ? K : a.blocks.block_cols);
  const bool scaled = !a.scales.empty() || w.scales;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kRowTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowTile, n_end - n0));
    for (int r = 0; r < rows; ++r) w.load_row(n0 + r, w_rows + r * K);
    // A short tile repeats its first row; those results are not stored.
    const float* w0 = w_rows;
    const float* w1 = w_rows + (rows > 1 ? K : 0);
    const float* w2 = w_rows + (rows > 2 ? 2 * K : 0);
    const float* w3 = w_rows + (rows > 3 ? 3 * K : 0);
    for (int64_t s = job.first_slot; s < job.first_slot + job.slot_count; ++s) {
      const int64_t row = source_row(s);
      const float* a_row = a.values.data() + row * K;
      float acc[kRowTile] = {};
      for (int64_t k0 = 0, kb = 0; k0 < K; k0 += k_block, ++kb) {
        float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
        const int64_t k_end = std::min(K, k0 + k_block);
#pragma omp simd reduction(+ : p0, p1, p2, p3)
        for (int64_t kk = k0; kk < k_end; ++kk) {
          const float value = a_row[kk];
          p0 += value * w0[kk];
          p1 += value * w1[kk];
          p2 += value * w2[kk];
          p3 += value * w3[kk];
        }
        const float partial[kRowTile] = {p0, p1, p2, p3};
        for (int r = 0; r < rows; ++r)
          acc[r] += scaled ? partial[r] * (a.scale(row, kb) * w.scale(n0 + r, kb)) : partial[r];
      }
      for (int r = 0; r < rows; ++r) out[s * out_cols + n0 + r] = acc[r];
    }
  }
}

float activate(Activation activation, float value) {
  if (activation == Activation::kSilu) return value / (1.0f + std::exp(-value));
  return 0.5f * value * (1.0f + std::erf(value * 0.70710678118654752f));
}

float load_activation(const Tensor& x, int64_t index) {
  return x.dtype == DType::kF32 ? x.data_as<float>()[index] : bf16_to_f32(x.data_as<uint16_t>()[index]);
}

class CpuMoe {
 public:
  CpuMoe(const MoeSpec& spec, const MoeWeights& weights, const MoeInputs& inputs, const MoeShape& shape,
         const CpuOptions& options)
      : spec_(spec), weights_(weights), inputs_(inputs), shape_(shape), threads_(options.num_threads),
        round_bf16_(inputs.x.dtype == DType::kBF16) {}

  Status run(const Tensor& out) {
    EPMOE_RETURN_IF_ERROR(route());
    sort_pairs();
    prepare_inputs();
    build_jobs();
    gemm1();
    activate_and_quantize();
    gemm2();
    combine(out);
    return {};
  }

 private:
  static constexpr int64_t kRowsPerItem = 32;  // weight rows per parallel work item

  Status route() {
    const int64_t T = shape_.tokens, k = shape_.top_k;
    topk_ids_.resize(T * k);
    topk_weights_.resize(T * k);
    if (inputs_.router_logits) {
      const Tensor ids = Tensor::contiguous(topk_ids_.data(), DType::kI32, {T, k});
      const Tensor weights = Tensor::contiguous(topk_weights_.data(), DType::kF32, {T, k});
      return route_cpu(spec_.routing, *inputs_.router_logits, inputs_.correction_bias, ids, weights);
    }
    std::copy_n(inputs_.topk_ids->data_as<int32_t>(), T * k, topk_ids_.begin());
    std::copy_n(inputs_.topk_weights->data_as<float>(), T * k, topk_weights_.begin());
    return {};
  }

  // Counts pairs per local expert and lays their slots out grouped by expert, in pair
  // order inside each group; pairs of non-local experts get no slot.
  void sort_pairs() {
    const int64_t pairs = shape_.tokens * shape_.top_k, E_local = shape_.num_local_experts;
    const int32_t* map = inputs_.expert_map ? inputs_.expert_map->data_as<int32_t>() : nullptr;
    std::vector<int64_t> counts(E_local, 0);
    pair_expert_.assign(pairs, -1);
    for (int64_t p = 0; p < pairs; ++p) {
      const int32_t local = map ? map[topk_ids_[p]] : topk_ids_[p];
      pair_expert_[p] = local;
      if (local >= 0) ++counts[local];
    }
    expert_offsets_.assign(E_local + 1, 0);
    for (int64_t e = 0; e < E_local; ++e) expert_offsets_[e + 1] = expert_offsets_[e] + counts[e];
    std::vector<int64_t> cursor(expert_offsets_.begin(), expert_offsets_.end() - 1);
    slot_of_pair_.assign(pairs, -1);
    routed_slots_ = expert_offsets_[E_local];
    slot_token_.resize(routed_slots_ + (weights_.shared_w13 ? shape_.tokens : 0));
    for (int64_t p = 0; p < pairs; ++p) {
      if (pair_expert_[p] < 0) continue;
      const int64_t slot = cursor[pair_expert_[p]]++;
      slot_of_pair_[p] = slot;
      slot_token_[slot] = p / shape_.top_k;
    }
    for (int64_t t = 0; t < static_cast<int64_t>(slot_token_.size()) - routed_slots_; ++t)
      slot_token_[routed_slots_ + t] = t;
  }

  // GEMM1's inputs: x (for shared experts and plain routing) and x * w (router weight on
  // the input, rounded to x's dtype), each quantised per the scheme.
  void prepare_inputs() {
    const int64_t T = shape_.tokens, H = shape_.hidden;
    auto load = [&](ScaledRows& rows, bool scale_by_router_weight) {
      rows.values.resize(T * H);
      rows.blocks = {T, H, std::max<int64_t>(T, 1), H};
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
          float value = load_activation(inputs_.x, t * H + h);
          if (scale_by_router_weight) {
            value *= topk_weights_[t];
            if (round_bf16_) value = round_to_bf16(value);
          }
          rows.values[t * H + h] = value;
        }
      quantize_activations(spec_.quant, weights_.input_scale, rows);
    };
    load(x_rows_, false);
    if (spec_.apply_router_weight_on_input) load(x_weighted_rows_, true);
  }

  void build_jobs() {
    const int64_t H = shape_.hidden, I = shape_.intermediate;
    const ScaledRows* routed_input = spec_.apply_router_weight_on_input ? &x_weighted_rows_ : &x_rows_;
    for (int64_t e = 0; e < shape_.num_local_experts; ++e) {
      Job job;
      job.w13 = weight_matrix(weights_.w13, weights_.w13_scale, spec_.quant, e, 2 * I, H);
      job.w2 = weight_matrix(weights_.w2, weights_.w2_scale, spec_.quant, e, H, I);
      job.input = routed_input;
      job.first_slot = expert_offsets_[e];
      job.slot_count = expert_offsets_[e + 1] - expert_offsets_[e];
      if (job.slot_count > 0) jobs_.push_back(job);
    }
    if (weights_.shared_w13 && shape_.tokens > 0) {
      const int64_t Is = shape_.shared_intermediate;
      Job job;
      job.w13 = weight_matrix(*weights_.shared_w13, weights_.shared_w13_scale, spec_.quant, 0, 2 * Is, H);
      job.w2 = weight_matrix(*weights_.shared_w2, weights_.shared_w2_scale, spec_.quant, 0, H, Is);
      job.input = &x_rows_;
      job.first_slot = routed_slots_;
      job.slot_count = shape_.tokens;
      jobs_.push_back(job);
    }
    // Shared experts may be wider than routed ones: buffers use the widest.
    widest_intermediate_ = std::max(I, shape_.shared_intermediate);
  }

  // Runs `body(job, n_begin, n_end, w_rows_scratch)` over all jobs' weight rows in parallel.
  template <typename Body>
  void for_weight_rows(int64_t rows_of(const Job&), Body body) {
    std::vector<std::pair<int64_t, int64_t>> items;  // (job, first row)
    for (size_t j = 0; j < jobs_.size(); ++j)
      for (int64_t n = 0; n < rows_of(jobs_[j]); n += kRowsPerItem) items.emplace_back(j, n);
    const int64_t scratch_cols = std::max(shape_.hidden, widest_intermediate_);
    parallel_for(static_cast<int64_t>(items.size()), threads_, [&](int64_t i) {
      thread_local std::vector<float> w_row;
      w_row.resize(kRowTile * scratch_cols);
      const auto [j, n_begin] = items[i];
      body(jobs_[j], n_begin, std::min(rows_of(jobs_[j]), n_begin + kRowsPerItem), w_row.data());
    });
  }

  void gemm1() {
    gate_up_.assign(slot_token_.size() * 2 * widest_intermediate_, 0.0f);
    const int64_t stride = 2 * widest_intermediate_;
    for_weight_rows([](const Job& job) { return job.w13.rows; },
                    [&](const Job& job, int64_t n_begin, int64_t n_end, float* w_row) {
                      gemm_rows(*job.input, [&](int64_t slot) { return slot_token_[slot]; }, job.w13,
                                job, n_begin, n_end, gate_up_.data(), stride, w_row);
                    });
  }

  // act(gate) * up per slot, rounded to bf16 for bf16 x (the tensor the GPU's GEMM1 writes),
  // then for fp8 schemes quantised per the scheme (per tensor: the static scale, or one
  // dynamic scale per job) from those bf16 values, as vLLM and DeepSeek's kernels quantise it.
  void activate_and_quantize() {
    const int64_t width = widest_intermediate_;
    intermediate_.resize(jobs_.size());
    parallel_for(static_cast<int64_t>(jobs_.size()), threads_, [&](int64_t j) {
      const Job& job = jobs_[j];
      const int64_t I = job.w2.cols;
      ScaledRows& rows = intermediate_[j];
      rows.values.resize(job.slot_count * I);
      rows.blocks = {job.slot_count, I, job.slot_count, I};
      for (int64_t r = 0; r < job.slot_count; ++r) {
        const float* gate_up = gate_up_.data() + (job.first_slot + r) * 2 * width;
        for (int64_t i = 0; i < I; ++i) {
          const float value = activate(spec_.activation, gate_up[i]) * gate_up[I + i];
          rows.values[r * I + i] = round_bf16_ ? round_to_bf16(value) : value;
        }
      }
      quantize_activations(spec_.quant, weights_.intermediate_scale, rows);
    });
  }

  void gemm2() {
    const int64_t H = shape_.hidden;
    expert_out_.assign(slot_token_.size() * H, 0.0f);
    for_weight_rows([](const Job& job) { return job.w2.rows; },
                    [&](const Job& job, int64_t n_begin, int64_t n_end, float* w_row) {
                      const size_t j = static_cast<size_t>(&job - jobs_.data());
                      gemm_rows(intermediate_[j], [&](int64_t slot) { return slot - job.first_slot; },
                                job.w2, job, n_begin, n_end, expert_out_.data(), H, w_row);
                    });
    if (round_bf16_)
      for (float& value : expert_out_) value = round_to_bf16(value);
  }

  void combine(const Tensor& out) {
    const int64_t T = shape_.tokens, H = shape_.hidden, k = shape_.top_k;
    const bool shared = weights_.shared_w13.has_value();
    parallel_for(T, threads_, [&](int64_t t) {
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t slot = slot_of_pair_[t * k + j];
          if (slot < 0) continue;
          const float weight = spec_.apply_router_weight_on_input ? 1.0f : topk_weights_[t * k + j];
          acc += weight * expert_out_[slot * H + h];
        }
        if (shared) acc += expert_out_[(routed_slots_ + t) * H + h];
        if (out.dtype == DType::kF32) {
          out.data_as<float>()[t * H + h] = acc;
        } else {
          out.data_as<uint16_t>()[t * H + h] = f32_to_bf16(acc);
        }
      }
    });
  }

  const MoeSpec& spec_;
  const MoeWeights& weights_;
  const MoeInputs& inputs_;
  const MoeShape shape_;
  const int threads_;
  const bool round_bf16_;

  std::vector<int32_t> topk_ids_;      // [T, k]
  std::vector<float> topk_weights_;    // [T, k]
  std::vector<int32_t> pair_expert_;   // [T * k] local expert or -1
  std::vector<int64_t> expert_offsets_;  // [E_local + 1] first slot of each expert
  std::vector<int64_t> slot_of_pair_;  // [T * k] slot or -1
  std::vector<int64_t> slot_token_;    // [slots] token of each slot
  int64_t routed_slots_ = 0;
  int64_t widest_intermediate_ = 0;
  ScaledRows x_rows_, x_weighted_rows_;  // GEMM1 inputs [T, H]
  std::vector<Job> jobs_;
  std::vector<float> gate_up_;          // [slots, 2 * widest I]
  std::vector<ScaledRows> intermediate_;  // per job [slot_count, I]
  std::vector<float> expert_out_;       // [slots, H]
};

}  // namespace

Status moe_forward_cpu(const MoeSpec& spec, const MoeWeights& weights, const MoeInputs& inputs,
                       const Tensor& out, const CpuOptions& options) {
  Result<MoeShape> shape = validate_moe(spec, weights, inputs, &out, Device::kCpu);
  if (!shape.ok()) return shape.status();
  try {
    return CpuMoe(spec, weights, inputs, shape.value(), options).run(out);
  } catch (const std::bad_alloc&) {
    return {StatusCode::kOutOfMemory,
            "moe_forward_cpu: out of host memory for T=" + std::to_string(shape->tokens) +
                ", H=" + std::to_string(shape->hidden) + ", I=" + std::to_string(shape->intermediate)};
  }
}

}  // namespace epmoe
