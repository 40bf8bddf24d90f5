#include "epmoe/naive_moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <tuple>

#include "core/parallel.h"

namespace epmoe {

namespace {

double element(const Tensor& tensor, int64_t index) {
  switch (tensor.dtype) {
    case DType::kF32: return tensor.data_as<float>()[index];
    case DType::kBF16: return bf16_to_f32(tensor.data_as<uint16_t>()[index]);
    case DType::kF16: return f16_to_f32(tensor.data_as<uint16_t>()[index]);
    case DType::kFP8E4M3: return fp8e4m3_to_f32(tensor.data_as<uint8_t>()[index]);
    case DType::kI32: return tensor.data_as<int32_t>()[index];
    case DType::kI64: return static_cast<double>(tensor.data_as<int64_t>()[index]);
  }
  return std::numeric_limits<double>::quiet_NaN();
}

// Dequantised weight (n, k) of matrix `expert` in a [.., N, K] tensor.
double weight(const Tensor& w, const std::optional<Tensor>& scale, const QuantSpec& quant,
              int64_t expert, int64_t N, int64_t K, int64_t n, int64_t k) {
  const double value = element(w, (expert * N + n) * K + k);
  switch (quant.scheme) {
    case QuantScheme::kBf16: return value;
    case QuantScheme::kFp8Tensor: return value * element(*scale, expert);
    case QuantScheme::kFp8Channel: return value * element(*scale, expert * N + n);
    case QuantScheme::kFp8Block: {
      const int64_t blocks_n = N / quant.block_n, blocks_k = K / quant.block_k;
      return value * element(*scale, (expert * blocks_n + n / quant.block_n) * blocks_k + k / quant.block_k);
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

std::vector<int> top_indices(const std::vector<double>& scores, int k) {
  std::vector<int> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return scores[a] > scores[b]; });
  order.resize(k);
  return order;
}

// (expert, weight) pairs of one token.
std::vector<std::pair<int, double>> route_token(const MoeSpec& spec, const MoeInputs& inputs, int64_t t) {
  const RoutingSpec& r = spec.routing;
  const int E = r.num_experts, k = r.top_k;
  std::vector<std::pair<int, double>> chosen;
  if (!inputs.router_logits) {
    for (int j = 0; j < k; ++j)
      chosen.emplace_back(inputs.topk_ids->data_as<int32_t>()[t * k + j],
                          inputs.topk_weights->data_as<float>()[t * k + j]);
    return chosen;
  }
  std::vector<double> logits(E);
  for (int e = 0; e < E; ++e) logits[e] = element(*inputs.router_logits, t * E + e);
  auto softmax = [](std::vector<double> v) {
    const double top = *std::max_element(v.begin(), v.end());
    double sum = 0;
    for (double& x : v) sum += (x = std::exp(x - top));
    for (double& x : v) x /= sum;
    return v;
  };
  auto sigmoid = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  std::vector<double> weights;
  std::vector<int> ids;
  if (r.kind == RoutingKind::kSoftmaxTopk) {
    const std::vector<double> p = softmax(logits);
    ids = top_indices(p, k);
    for (int e : ids) weights.push_back(p[e]);
  } else if (r.kind == RoutingKind::kTopkSoftmax) {
    ids = top_indices(logits, k);
    std::vector<double> top;
    for (int e : ids) top.push_back(logits[e]);
    weights = softmax(top);
  } else if (r.kind == RoutingKind::kSigmoidTopk) {
    ids = top_indices(logits, k);
    for (int e : ids) weights.push_back(sigmoid(logits[e]));
  } else {
    std::vector<double> scores = r.score_func == ScoreFunc::kSoftmax ? softmax(logits) : logits;
    if (r.score_func == ScoreFunc::kSigmoid)
      for (double& s : scores) s = sigmoid(s);
    std::vector<double> selection = scores;
    if (inputs.correction_bias)
      for (int e = 0; e < E; ++e) selection[e] += element(*inputs.correction_bias, e);
    const int size = E / r.n_group;
    std::vector<double> group_score(r.n_group);
    for (int g = 0; g < r.n_group; ++g) {
      std::vector<double> members(selection.begin() + g * size, selection.begin() + (g + 1) * size);
      for (double& member : members)  // NaN counts as -inf (and would break the sort's order)
        if (std::isnan(member)) member = -std::numeric_limits<double>::infinity();
      std::sort(members.rbegin(), members.rend());
      group_score[g] = inputs.correction_bias ? members[0] + members[1] : members[0];
    }
    const std::vector<int> groups = top_indices(group_score, r.topk_group);
    for (int e = 0; e < E; ++e)
      if (std::find(groups.begin(), groups.end(), e / size) == groups.end())
        selection[e] = -std::numeric_limits<double>::infinity();
    ids = top_indices(selection, k);
    for (int e : ids) weights.push_back(scores[e]);
  }
  if (r.renormalize) {
    const double sum = std::accumulate(weights.begin(), weights.end(), 0.0);
    for (double& w : weights) w /= sum;
  }
  if (r.kind == RoutingKind::kGroupedTopk)
    for (double& w : weights) w *= r.routed_scaling_factor;
  for (int j = 0; j < k; ++j) chosen.emplace_back(ids[j], weights[j]);
  return chosen;
}

// e4m3 rounding of `values` with scale max(amax, 1e-10) / 448 (or a given static scale).
void fake_quantize(double* values, int64_t count, std::optional<double> static_scale) {
  double amax = 0;
  for (int64_t i = 0; i < count; ++i) amax = std::isnan(values[i]) ? values[i] : std::max(amax, std::fabs(values[i]));
  const double scale = static_scale ? *static_scale : std::max(amax, 1e-10) / 448.0;
  for (int64_t i = 0; i < count; ++i)
    values[i] = fp8e4m3_to_f32(f32_to_fp8e4m3(static_cast<float>(values[i] / scale))) * scale;
}

// Rounds rows [rows, cols] as the scheme rounds an activation matrix: per token (channel),
// per token-group (block); per tensor is done by the caller, which knows the tensor.
void fake_quantize_rows(const QuantSpec& quant, double* values, int64_t rows, int64_t cols) {
  const int64_t group = quant.scheme == QuantScheme::kFp8Block ? quant.block_k : cols;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += group) fake_quantize(values + r * cols + c, group, std::nullopt);
}

std::optional<double> scalar(const std::optional<Tensor>& tensor) {
  if (!tensor) return std::nullopt;
  return element(*tensor, 0);
}

// One (token, expert) pair's journey: input row, intermediate, weight in the combine.
struct Pair {
  int64_t expert;  // local index, or -1 for the shared experts
  double weight;
  std::vector<double> input, intermediate;
};

}  // namespace

Result<std::vector<double>> naive_moe(const MoeSpec& spec, const MoeWeights& weights,
                                      const MoeInputs& inputs, const NaiveOptions& options) {
  const Tensor& x = inputs.x;
  Result<MoeShape> shape = validate_moe(spec, weights, inputs, nullptr, Device::kCpu);
  if (!shape.ok()) return shape.status();
  const int64_t T = shape->tokens, H = shape->hidden;
  const QuantSpec& quant = spec.quant;
  const bool fake_quant = options.quantize_activations && is_fp8(quant.scheme);
  const bool per_tensor = quant.scheme == QuantScheme::kFp8Tensor;

  // Route every token and build each pair's GEMM1 input.
  std::vector<std::vector<Pair>> pairs(T);
  // Largest |input| of each token, plain and (k = 1) times its router weight, local or not.
  std::vector<double> token_amax(T), weighted_amax(T);
  parallel_for(T, options.num_threads, [&](int64_t t) {
    std::vector<double> token(H);
    for (int64_t h = 0; h < H; ++h) token[h] = element(x, t * H + h);
    const auto chosen = route_token(spec, inputs, t);
    for (double v : token) {
      token_amax[t] = std::isnan(v) ? v : std::max(token_amax[t], std::fabs(v));
      double weighted = v * chosen[0].second;
      if (options.quantize_activations && x.dtype == DType::kBF16) weighted = round_to_bf16(static_cast<float>(weighted));
      weighted_amax[t] = std::isnan(v) ? v : std::max(weighted_amax[t], std::fabs(weighted));
    }
    for (const auto& [expert, w] : chosen) {
      const int64_t local = inputs.expert_map ? inputs.expert_map->data_as<int32_t>()[expert] : expert;
      if (local < 0) continue;
      Pair pair{local, spec.apply_router_weight_on_input ? 1.0 : w, token, {}};
      if (spec.apply_router_weight_on_input)
        for (double& v : pair.input) {
          v *= w;
          // The contract rounds x * w to x's dtype; an fp8 code read off the unrounded
          // value would differ in about one element of twenty.
          if (options.quantize_activations && x.dtype == DType::kBF16) v = round_to_bf16(static_cast<float>(v));
        }
      pairs[t].push_back(std::move(pair));
    }
    if (weights.shared_w13) pairs[t].push_back({-1, 1.0, token, {}});
  });

  // Per-tensor scales cover all T tokens of one input kind (routed or shared).
  auto for_each_pair = [&](auto body) {
    for (auto& token_pairs : pairs)
      for (Pair& pair : token_pairs) body(pair);
  };
  if (fake_quant && per_tensor) {
    std::optional<double> static_scale = scalar(weights.input_scale);
    for (bool shared : {false, true}) {
      const std::vector<double>& amaxes = shared || !spec.apply_router_weight_on_input ? token_amax : weighted_amax;
      double amax = 0;
      for (double a : amaxes) amax = std::isnan(a) ? a : std::max(amax, a);
      const double scale = static_scale ? *static_scale : std::max(amax, 1e-10) / 448.0;
      for_each_pair([&](Pair& p) {
        if ((p.expert < 0) == shared) fake_quantize(p.input.data(), H, scale);
      });
    }
  } else if (fake_quant) {
    for_each_pair([&](Pair& p) { fake_quantize_rows(quant, p.input.data(), 1, H); });
  }

  // GEMM1 and the activation.
  auto matrices = [&](const Pair& p) {
    return p.expert >= 0 ? std::tuple{&weights.w13, &weights.w13_scale, &weights.w2, &weights.w2_scale, p.expert,
                                      shape->intermediate}
                         : std::tuple{&*weights.shared_w13, &weights.shared_w13_scale, &*weights.shared_w2,
                                      &weights.shared_w2_scale, int64_t{0}, shape->shared_intermediate};
  };
  parallel_for(T, options.num_threads, [&](int64_t t) {
    for (Pair& p : pairs[t]) {
      const auto [w13, w13_scale, w2, w2_scale, expert, I] = matrices(p);
      p.intermediate.resize(I);
      for (int64_t i = 0; i < I; ++i) {
        double gate = 0, up = 0;
        for (int64_t h = 0; h < H; ++h) {
          gate += weight(*w13, *w13_scale, quant, expert, 2 * I, H, i, h) * p.input[h];
          up += weight(*w13, *w13_scale, quant, expert, 2 * I, H, I + i, h) * p.input[h];
        }
        const double act = spec.activation == Activation::kSilu ? gate / (1.0 + std::exp(-gate))
                                                                : 0.5 * gate * (1.0 + std::erf(gate / std::sqrt(2.0)));
        p.intermediate[i] = act * up;
        // fp8 quantises the activation output as the operators hold it: bf16 for bf16 x.
        if (fake_quant && x.dtype == DType::kBF16) p.intermediate[i] = round_to_bf16(static_cast<float>(p.intermediate[i]));
      }
      if (fake_quant && !per_tensor) fake_quantize_rows(quant, p.intermediate.data(), 1, I);
    }
  });

  // GEMM2's per-tensor input scale: static, or the amax of each expert's rows.
  if (fake_quant && per_tensor) {
    std::optional<double> static_scale = scalar(weights.intermediate_scale);
    std::map<int64_t, double> amax;
    for_each_pair([&](Pair& p) {
      double& a = amax[p.expert];
      for (double v : p.intermediate) a = std::isnan(v) ? v : std::max(a, std::fabs(v));
    });
    for_each_pair([&](Pair& p) {
      const double scale = static_scale ? *static_scale : std::max(amax[p.expert], 1e-10) / 448.0;
      fake_quantize(p.intermediate.data(), static_cast<int64_t>(p.intermediate.size()), scale);
    });
  }

  // GEMM2 and the weighted sum.
  std::vector<double> y(T * H, 0.0);
  parallel_for(T, options.num_threads, [&](int64_t t) {
    for (const Pair& p : pairs[t]) {
      const auto [w13, w13_scale, w2, w2_scale, expert, I] = matrices(p);
      for (int64_t h = 0; h < H; ++h) {
        double sum = 0;
        for (int64_t i = 0; i < I; ++i) sum += weight(*w2, *w2_scale, quant, expert, H, I, h, i) * p.intermediate[i];
        y[t * H + h] += p.weight * sum;
      }
    }
  });
  return y;
}

double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  if (a.size() != b.size()) return std::numeric_limits<double>::quiet_NaN();
  return std::sqrt(diff) / std::max(std::sqrt(norm), std::numeric_limits<double>::min());
}

std::vector<double> to_doubles(const Tensor& tensor) {
  std::vector<double> values(tensor.numel());
  for (int64_t i = 0; i < tensor.numel(); ++i) values[i] = element(tensor, i);
  return values;
}

}  // namespace epmoe
