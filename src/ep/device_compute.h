// The expert computation of EpMoe on the GPU. Built with CUDA only.
//   moe_on_device: host rows and routing in, host output out (the all_to_all strategy,
//     whose packing runs on the host);
//   DeviceExperts: rows, logits and output on the device (replicate_all_reduce and
//     all_gather_reduce_scatter, which never leave it).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "epmoe/device_case.h"
#include "epmoe/expert_map.h"
#include "epmoe/moe_spec.h"
#include "epmoe/tensor.h"

namespace epmoe {

// out [rows, H] (host, x's dtype) for x [rows, H] (host) routed by ids / weights [rows, k].
Result<Buffer> moe_on_device(const MoeSpec& spec, const MoeWeights& device_weights, const ExpertMap& experts,
                             const Tensor& x, const std::vector<int32_t>& ids, const std::vector<float>& weights);

// One rank's experts over device rows: routing on the device, then the operator, on the
// default stream. Keeps its device buffers (expert map, routing, workspace) between calls.
class DeviceExperts {
 public:
  static Result<DeviceExperts> create(const MoeSpec& spec, const MoeWeights& device_weights, const ExpertMap& experts,
                                      std::optional<Tensor> device_correction_bias);
  // out [rows, H] (device) for x [rows, H] and router_logits [rows, E] (device); the
  // shared experts only `with_shared`. `topk_ids` gets the routing (host) for statistics.
  Status forward(const Tensor& x, const Tensor& router_logits, bool with_shared, const Tensor& out,
                 std::vector<int32_t>& topk_ids);

 private:
  Status reserve(DeviceBuffer& buffer, size_t bytes);

  MoeSpec spec_;
  MoeWeights layer_weights_;
  std::optional<Tensor> correction_bias_;
  DeviceBuffer expert_map_, ids_, weights_buffer_, workspace_;
  Tensor expert_map_view_;
};

}  // namespace epmoe
