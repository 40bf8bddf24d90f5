"""epmoe: the fused MoE operator of the epmoe engine for PyTorch tensors.

    topk_weights, topk_ids = epmoe.route(router_logits, "softmax_topk", k, renormalize=True)
    out = epmoe.fused_experts(hidden_states, w1, w2, topk_weights, topk_ids)

Layouts and semantics are vLLM's fused_experts: w1 [E_local, 2I, H] (gate rows, then up
rows), w2 [E_local, H, I], global expert ids in topk_ids, expert_map entries of -1 skipped.
CUDA tensors run the H200 kernels on the current stream (CUDA-graph capturable); CPU
tensors run the CPU reference operator.
"""
from ._abi import abi_version

__all__ = ["abi_version", "fused_experts", "route"]


def __getattr__(name):
    # The operators need torch; the C ABI alone (epmoe._abi) does not, so import them late.
    if name in ("fused_experts", "route"):
        from . import ops
        return getattr(ops, name)
    raise AttributeError(f"module 'epmoe' has no attribute {name!r}")
