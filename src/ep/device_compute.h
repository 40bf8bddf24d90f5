// The expert computation of EpMoe on the GPU: host rows and routing in, host output out,
// moe_forward_cuda in between on the layer's device weights. Built with CUDA only.
#pragma once

#include <cstdint>
#include <vector>

#include "epmoe/expert_map.h"
#include "epmoe/moe_spec.h"
#include "epmoe/tensor.h"

namespace epmoe {

// out [rows, H] (host, x's dtype) for x [rows, H] (host) routed by ids / weights [rows, k].
Result<Buffer> moe_on_device(const MoeSpec& spec, const MoeWeights& device_weights, const ExpertMap& experts,
                             const Tensor& x, const std::vector<int32_t>& ids, const std::vector<float>& weights);

}  // namespace epmoe
