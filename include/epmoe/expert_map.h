// Expert placement: which global experts a rank owns, as the map the operator takes
// (expert_map[e] = local index of global expert e on this rank, or -1).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "epmoe/status.h"
#include "epmoe/tensor.h"

namespace epmoe {

enum class Placement {
  kLinear,      // rank r owns a contiguous range; the first E % R ranks own one more
  kRoundRobin,  // rank r owns experts r, r + R, r + 2R, ...
  kExplicit,    // a list of global ids per rank
};

std::string_view placement_name(Placement placement);
Result<Placement> parse_placement(std::string_view name);

class ExpertMap {
 public:
  // One rank's share under a linear or round-robin placement of E experts over R ranks.
  static Result<ExpertMap> build(Placement placement, int num_experts, int num_ranks, int rank);
  // The rank owns `global_ids`, in that local order; ids must be distinct and in [0, E).
  static Result<ExpertMap> from_list(int num_experts, std::span<const int32_t> global_ids);
  // The experts used by `topk_ids` ([T, k] values in [0, E)) restricted to `owned` (or all
  // experts when `owned` is null), in ascending global order: the map that computes the
  // same output with weights for only the touched experts.
  static ExpertMap touched(int num_experts, std::span<const int32_t> topk_ids, const ExpertMap* owned);

  int num_experts() const { return static_cast<int>(local_index_.size()); }
  int num_local() const { return static_cast<int>(global_ids_.size()); }
  int32_t local_index(int global) const { return local_index_[global]; }
  std::span<const int32_t> global_ids() const { return global_ids_; }  // [E_local]
  // [E] i32 view for MoeInputs::expert_map; valid while this object lives.
  Tensor view() const;

 private:
  std::vector<int32_t> local_index_;  // [E]
  std::vector<int32_t> global_ids_;   // [E_local]
};

}  // namespace epmoe
