#include "epmoe/expert_map.h"

#include <string>

namespace epmoe {

std::string_view placement_name(Placement placement) {
  switch (placement) {
    case Placement::kLinear: return "linear";
    case Placement::kRoundRobin: return "round_robin";
    case Placement::kExplicit: return "explicit";
  }
  return "unknown";
}

Result<Placement> parse_placement(std::string_view name) {
  for (Placement placement : {Placement::kLinear, Placement::kRoundRobin, Placement::kExplicit})
    if (placement_name(placement) == name) return placement;
  return bad_argument("placement", "one of linear, round_robin, explicit",
                      in_quotes(name));
}

Result<ExpertMap> ExpertMap::build(Placement placement, int num_experts, int num_ranks, int rank) {
  if (num_experts <= 0)
    return bad_argument("num_experts", "a positive number", std::to_string(num_experts));
  if (num_ranks <= 0 || num_ranks > num_experts)
    return bad_argument("num_ranks", "1 <= ranks <= num_experts (" + std::to_string(num_experts) + ")",
                        std::to_string(num_ranks));
  if (rank < 0 || rank >= num_ranks)
    return bad_argument("rank", "0 <= rank < " + std::to_string(num_ranks), std::to_string(rank));
  std::vector<int32_t> owned;
  switch (placement) {
    case Placement::kLinear: {
      const int base = num_experts / num_ranks, extra = num_experts % num_ranks;
      const int begin = rank * base + std::min(rank, extra);
      const int count = base + (rank < extra ? 1 : 0);
      for (int e = begin; e < begin + count; ++e) owned.push_back(e);
      break;
    }
    case Placement::kRoundRobin:
      for (int e = rank; e < num_experts; e += num_ranks) owned.push_back(e);
      break;
    case Placement::kExplicit:
      return bad_argument("placement", "linear or round_robin (explicit placements take a list)",
                          "explicit");
  }
  return from_list(num_experts, owned);
}

Result<ExpertMap> ExpertMap::from_list(int num_experts, std::span<const int32_t> global_ids) {
  ExpertMap map;
  map.local_index_.assign(num_experts, -1);
  for (size_t local = 0; local < global_ids.size(); ++local) {
    const int32_t global = global_ids[local];
    const std::string where = "expert list[" + std::to_string(local) + "]";
    if (global < 0 || global >= num_experts)
      return bad_argument(where, "a global expert id in [0, " + std::to_string(num_experts) + ")",
                          std::to_string(global));
    if (map.local_index_[global] >= 0)
      return bad_argument(where, "distinct expert ids",
                          std::to_string(global) + " again (first at index " +
                              std::to_string(map.local_index_[global]) + ")");
    map.local_index_[global] = static_cast<int32_t>(local);
  }
  map.global_ids_.assign(global_ids.begin(), global_ids.end());
  return map;
}

ExpertMap ExpertMap::touched(int num_experts, std::span<const int32_t> topk_ids, const ExpertMap* owned) {
  std::vector<bool> used(num_experts, false);
  for (int32_t id : topk_ids) used[id] = true;
  std::vector<int32_t> ids;
  for (int e = 0; e < num_experts; ++e)
    if (used[e] && (!owned || owned->local_index(e) >= 0)) ids.push_back(e);
  return std::move(from_list(num_experts, ids)).value();
}

Tensor ExpertMap::view() const {
  return Tensor::contiguous(const_cast<int32_t*>(local_index_.data()), DType::kI32,
                            {static_cast<int64_t>(local_index_.size())});
}

}  // namespace epmoe
