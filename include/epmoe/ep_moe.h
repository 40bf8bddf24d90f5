// EpMoe: one MoE layer whose experts live on the ranks of a Communicator, giving on every
// rank the output a single rank holding all experts would give. Three strategies
// (DESIGN.md, Expert parallelism):
//   replicate_all_reduce:        every rank holds all T tokens; each computes its experts
//                                and an all-reduce sums the partial outputs;
//   all_gather_reduce_scatter:   each rank holds its own tokens; an all-gather gives every
//                                rank every token (padded to the largest rank's count), each
//                                computes its experts, a reduce-scatter returns the sums;
//   all_to_all:                  each token travels only to the ranks that own one of its
//                                experts (once per rank), comes back as that rank's weighted
//                                partial sum, and is summed in rank order at home.
// Shared experts are replicated: rank 0 computes them in the first two strategies, every
// rank for its own tokens in the third. With a CPU communicator the layer runs the CPU
// operator; with a GPU one (NCCL) it runs moe_forward_cuda on device weights. On the GPU the
// first two strategies stay on the device (routing, experts and the NCCL collectives on
// device buffers; the host only learns the token counts and, for EpStats, the routing);
// all_to_all still routes, counts and packs on the host and stages its exchanges through
// host memory (a host synchronisation per collective): correct on any number of GPUs, not
// yet fast.
#pragma once

#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "epmoe/communicator.h"
#include "epmoe/expert_map.h"
#include "epmoe/moe_case.h"
#include "epmoe/moe_spec.h"

namespace epmoe {

class DeviceExperts;  // the GPU computation (src/ep/device_compute.h)

enum class EpStrategy { kReplicateAllReduce, kAllGatherReduceScatter, kAllToAll };
std::string_view ep_strategy_name(EpStrategy strategy);  // "replicate_all_reduce", ...
Result<EpStrategy> parse_ep_strategy(std::string_view name);

// What one forward moved, so imbalance is visible.
struct EpStats {
  int64_t bytes_sent = 0, bytes_received = 0;
  std::vector<int64_t> rows_sent;      // [R] token rows sent to each rank
  std::vector<int64_t> rows_received;  // [R] token rows received from each rank
  // [E_local] pairs this rank computed (all_gather_reduce_scatter: with the zero-weight
  // rows that pad every rank to the largest rank's count, which it computes too)
  std::vector<int64_t> pairs_per_local_expert;
};

// One rank's part of the layer.
struct EpLayer {
  MoeSpec spec;
  ExpertMap experts;       // the global experts this rank owns, in local order
  MoeWeights weights;      // w13 / w2: those experts; shared experts replicated on every rank
  std::optional<Tensor> correction_bias;  // [E] router bias (grouped_topk), the same on every rank
  std::vector<std::shared_ptr<const void>> storage;  // memory the layer's tensors live in, if it owns any
};

// A rank's part of a whole layer held on one host (all E experts, expert map absent): copies
// of its experts' w13 / w2 rows (and scales), the shared experts and the router bias shared
// with `whole`, which must outlive the result.
EpLayer slice_layer(const MoeCase& whole, const ExpertMap& experts);

class EpMoe {
 public:
  // Collective: every rank calls it. Checks that all ranks agree on the spec, the sizes
  // and the strategy, and that the ranks' experts partition the E experts; a violation is
  // the same error on every rank.
  static Result<EpMoe> create(Communicator& comm, EpLayer layer, EpStrategy strategy);

  // Collective. x [T_r, H] and router_logits [T_r, E] are this rank's tokens (for
  // replicate_all_reduce: the same T tokens on every rank); out [T_r, H] gets their output.
  Status forward(const Tensor& x, const Tensor& router_logits, const Tensor& out, EpStats* stats = nullptr);

 private:
  EpMoe(Communicator& comm, Communicator& device_comm, std::shared_ptr<Communicator> staged, EpLayer layer,
        EpStrategy strategy, std::vector<int32_t> owner_of, std::shared_ptr<DeviceExperts> device_experts)
      : comm_(&comm), device_comm_(&device_comm), staged_(std::move(staged)), layer_(std::move(layer)),
        strategy_(strategy), owner_of_(std::move(owner_of)), device_experts_(std::move(device_experts)) {}
  Status run_strategy(const Tensor& x, const Tensor& logits, const Tensor& out, EpStats& stats);
  Status replicate_all_reduce(const Tensor& x, const Tensor& logits, const Tensor& out, EpStats& stats);
  Status all_gather_reduce_scatter(const Tensor& x, const Tensor& logits, const Tensor& out, EpStats& stats);
  Status all_to_all(const Tensor& x, const Tensor& logits, const Tensor& out, EpStats& stats);
  // The first two strategies with every tensor on the device.
  Status replicate_all_reduce_on_device(const Tensor& x, const Tensor& logits, const Tensor& out, EpStats& stats);
  Status all_gather_reduce_scatter_on_device(const Tensor& x, const Tensor& logits, const Tensor& out,
                                             EpStats& stats);

  Communicator* comm_;  // host-memory collectives: the CPU communicator, or staged_
  Communicator* device_comm_;  // the communicator given to create (device buffers for NCCL)
  std::shared_ptr<Communicator> staged_;  // host view of a GPU communicator
  EpLayer layer_;
  EpStrategy strategy_;
  std::vector<int32_t> owner_of_;  // [E] the rank that owns each expert
  std::shared_ptr<DeviceExperts> device_experts_;  // with a GPU communicator and device weights
};

}  // namespace epmoe
