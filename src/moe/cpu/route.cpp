// Routing on the CPU, the four kinds of DESIGN.md, in f32. Ties go to the lower index:
// the selection order is (score descending, index ascending).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "epmoe/moe_cpu.h"

namespace epmoe {

namespace {

// What a selection orders by: the score, NaN as -inf.
float order_value(float score) { return std::isnan(score) ? -INFINITY : score; }

// The indices of the k best scores, best first.
void select_top(const std::vector<float>& scores, int k, std::vector<int>& chosen) {
  chosen.resize(scores.size());
  std::iota(chosen.begin(), chosen.end(), 0);
  auto better = [&](int a, int b) {
    const float sa = order_value(scores[a]), sb = order_value(scores[b]);
    return sa > sb || (sa == sb && a < b);
  };
  std::partial_sort(chosen.begin(), chosen.begin() + k, chosen.end(), better);
  chosen.resize(k);
}

void softmax_in_place(std::vector<float>& values) {
  const float max_value = *std::max_element(values.begin(), values.end());
  float sum = 0.0f;
  for (float& value : values) sum += (value = std::exp(value - max_value));
  for (float& value : values) value /= sum;
}

float sigmoid(float value) { return 1.0f / (1.0f + std::exp(-value)); }

void renormalize(float* weights, int k) {
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += weights[j];
  for (int j = 0; j < k; ++j) weights[j] /= sum;
}

// Group-limited top k (DeepSeek-V2/V3). `selection` = scores (+ bias); groups outside the
// topk_group best are masked to -inf before the final top k.
void grouped_select(const RoutingSpec& spec, bool has_bias, std::vector<float>& selection,
                    std::vector<int>& chosen) {
  const int group_size = spec.num_experts / spec.n_group;
  std::vector<float> group_scores(spec.n_group);
  for (int g = 0; g < spec.n_group; ++g) {
    std::vector<float> members(selection.begin() + g * group_size,
                               selection.begin() + (g + 1) * group_size);
    // (std::sort needs an order NaN would break)
    for (float& member : members) member = order_value(member);
    std::sort(members.begin(), members.end(), std::greater<>());
    group_scores[g] = has_bias ? members[0] + members[1] : members[0];
  }
  std::vector<int> kept_groups;
  select_top(group_scores, spec.topk_group, kept_groups);
  std::vector<bool> kept(spec.n_group, false);
  for (int g : kept_groups) kept[g] = true;
  for (int e = 0; e < spec.num_experts; ++e)
    if (!kept[e / group_size]) selection[e] = -INFINITY;
  select_top(selection, spec.top_k, chosen);
}

}  // namespace

Status route_cpu(const RoutingSpec& spec, const Tensor& router_logits,
                 const std::optional<Tensor>& correction_bias, const Tensor& topk_ids,
                 const Tensor& topk_weights) {
  const int64_t T = router_logits.size(0);
  const int E = spec.num_experts, k = spec.top_k;
  if (!router_logits.has_shape({T, E}) || !topk_ids.has_shape({T, k}) || !topk_weights.has_shape({T, k}))
    return bad_argument("route_cpu", "logits [T, E] and top-k outputs [T, k]",
                        router_logits.shape_string() + ", " + topk_ids.shape_string() + ", " +
                            topk_weights.shape_string());
  const float* bias = correction_bias ? correction_bias->data_as<float>() : nullptr;
  std::vector<float> logits(E), scores(E), selection(E);
  std::vector<int> chosen;
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e)
      logits[e] = router_logits.dtype == DType::kF32
                      ? router_logits.data_as<float>()[t * E + e]
                      : bf16_to_f32(router_logits.data_as<uint16_t>()[t * E + e]);
    int32_t* ids = topk_ids.data_as<int32_t>() + t * k;
    float* weights = topk_weights.data_as<float>() + t * k;
    switch (spec.kind) {
      case RoutingKind::kSoftmaxTopk:
        scores = logits;
        softmax_in_place(scores);
        select_top(scores, k, chosen);
        for (int j = 0; j < k; ++j) weights[j] = scores[chosen[j]];
        break;
      case RoutingKind::kTopkSoftmax: {
        select_top(logits, k, chosen);
        std::vector<float> top(k);
        for (int j = 0; j < k; ++j) top[j] = logits[chosen[j]];
        softmax_in_place(top);
        std::copy(top.begin(), top.end(), weights);
        break;
      }
      case RoutingKind::kSigmoidTopk:
        select_top(logits, k, chosen);
        for (int j = 0; j < k; ++j) weights[j] = sigmoid(logits[chosen[j]]);
        break;
      case RoutingKind::kGroupedTopk:
        scores = logits;
        if (spec.score_func == ScoreFunc::kSoftmax) {
          softmax_in_place(scores);
        } else {
          for (float& score : scores) score = sigmoid(score);
        }
        for (int e = 0; e < E; ++e) selection[e] = scores[e] + (bias ? bias[e] : 0.0f);
        grouped_select(spec, bias != nullptr, selection, chosen);
        for (int j = 0; j < k; ++j) weights[j] = scores[chosen[j]];
        break;
    }
    if (spec.renormalize) renormalize(weights, k);
    if (spec.kind == RoutingKind::kGroupedTopk)
      for (int j = 0; j < k; ++j) weights[j] *= spec.routed_scaling_factor;
    for (int j = 0; j < k; ++j) ids[j] = chosen[j];
  }
  return {};
}

}  // namespace epmoe
