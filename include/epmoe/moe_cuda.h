// The MoE operator on an NVIDIA GPU (sm_90a), bf16 and the three fp8 schemes: the same
// function as moe_forward_cpu (include/epmoe/moe_cpu.h), computed without host
// synchronisation or allocation: every buffer lives in a workspace the caller owns, so a
// CUDA graph can capture the call and replay it on new inputs.
#pragma once

#include <cstddef>

#include "epmoe/moe_spec.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace epmoe {

// Bytes of workspace one call with these sizes and this scheme needs (an upper bound over
// all routings).
size_t moe_workspace_bytes(const MoeSpec& spec, const MoeShape& shape);

struct CudaWorkspace {
  void* data = nullptr;  // device memory, 256-byte aligned
  size_t bytes = 0;
};

// out [T, H] bf16 on the device; all tensors on the device. Precomputed topk_ids outside
// [0, E) are skipped (they cannot be checked without reading device memory on the host).
Status moe_forward_cuda(const MoeSpec& spec, const MoeWeights& weights, const MoeInputs& inputs,
                        const Tensor& out, const CudaWorkspace& workspace, CUstream_st* stream);

// Routing alone, as route_cpu computes it: topk_ids / topk_weights [T, k] from
// router_logits [T, E], all on the device (validate_route checks them).
Status route_cuda(const RoutingSpec& routing, const Tensor& router_logits, const std::optional<Tensor>& correction_bias,
                  const Tensor& topk_ids, const Tensor& topk_weights, CUstream_st* stream);

}  // namespace epmoe
