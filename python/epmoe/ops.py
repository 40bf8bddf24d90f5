"""fused_experts and route with vLLM's signatures, over the C ABI. Arguments are checked
here with the caller's names (hidden_states, w1, ...) before the library checks them again;
no tensor is copied except int64 ids and maps, which become int32."""
import ctypes

import torch

from . import _abi
from ._workspace import workspace

_TORCH_DTYPES = {getattr(torch, name): code for name, code in _abi.DTYPE_CODES.items() if hasattr(torch, name)}
_QUANT_SCHEMES = ("bf16", "fp8_tensor", "fp8_channel", "fp8_block")
_ROUTING_KINDS = ("softmax_topk", "topk_softmax", "sigmoid_topk", "grouped_topk")


def _describe(tensor):
    return f"{str(tensor.dtype).replace('torch.', '')} {list(tensor.shape)} on {tensor.device}"


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")


def _check_tensor(name, tensor, dtypes, shape=None, device=None):
    """Type, dtype, device, shape (None entries match anything) and contiguity of one argument."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {names}, got {_describe(tensor)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (hidden_states' device), got {_describe(tensor)}")
    if shape is not None and (tensor.dim() != len(shape) or
                              any(want is not None and got != want for got, want in zip(tensor.shape, shape))):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {wanted}, got {_describe(tensor)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got a strided {_describe(tensor)} "
                         "(call .contiguous() first)")


def _as_int32(name, tensor, shape, device):
    _check_tensor(name, tensor, (torch.int32, torch.int64), shape, device)
    return tensor if tensor.dtype == torch.int32 else tensor.to(torch.int32)


def _c_tensor(tensor):
    """The C view of a tensor, or the absent tensor for None."""
    c = _abi.Tensor()
    if tensor is None:
        return c
    c.data = tensor.data_ptr()
    c.dtype = _TORCH_DTYPES[tensor.dtype]
    c.device = _abi.CUDA if tensor.is_cuda else _abi.CPU
    c.rank = tensor.dim()
    for d in range(tensor.dim()):
        c.shape[d] = tensor.shape[d]
        c.strides[d] = tensor.stride(d)
    return c


def _stream(device):
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def _routing(kind, num_experts, top_k, renormalize=False, score_func="softmax", n_group=1, topk_group=1,
             routed_scaling_factor=1.0):
    return _abi.Routing(kind.encode(), num_experts, top_k, int(bool(renormalize)), score_func.encode(), n_group,
                        topk_group, float(routed_scaling_factor))


def _scale(name, tensor, quant, device):
    """A weight or activation scale: f32, with vLLM's trailing unit dimension of per-channel
    scales ([E, N, 1]) or a scalar's shape folded away."""
    if tensor is None:
        return None
    _check_tensor(name, tensor, (torch.float32,), None, device)
    if tensor.dim() == 0:
        return tensor.reshape(1)
    if quant == "fp8_channel" and tensor.dim() == 3 and tensor.shape[-1] == 1:
        return tensor.squeeze(-1)
    return tensor


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, *, activation="silu",
                  apply_router_weight_on_input=False, global_num_experts=-1, expert_map=None, quant="bf16",
                  w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None, block_shape=None, out=None):
    """The MoE layer: out[t] = sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(hidden_states[t]).

    hidden_states [T, H] bf16; w1 [E_local, 2I, H], w2 [E_local, H, I] (bf16, or float8_e4m3fn
    with w1_scale / w2_scale for the fp8 schemes); topk_weights [T, k] f32; topk_ids [T, k]
    int32 or int64 global ids; expert_map [E] (local index or -1) for expert parallelism,
    global_num_experts = E (-1: from expert_map, or E_local). quant: "bf16", "fp8_tensor",
    "fp8_channel" or "fp8_block" (block_shape [128, 128]); a1_scale / a2_scale: static
    activation scales of fp8_tensor. Returns out [T, H] (a new tensor unless `out` is given).
    """
    _check_choice("quant", quant, _QUANT_SCHEMES)
    _check_choice("activation", activation, ("silu", "gelu"))
    _check_tensor("hidden_states", hidden_states, (torch.bfloat16, torch.float32), (None, None))
    device = hidden_states.device
    T, H = hidden_states.shape
    weight_dtypes = (torch.float8_e4m3fn,) if quant != "bf16" else (hidden_states.dtype,)
    _check_tensor("w1", w1, weight_dtypes, (None, None, H), device)
    E_local, two_I, _ = w1.shape
    if two_I % 2:
        raise ValueError(f"w1: expected an even second dimension (gate rows, then up rows), got {_describe(w1)}")
    _check_tensor("w2", w2, weight_dtypes, (E_local, H, two_I // 2), device)
    _check_tensor("topk_weights", topk_weights, (torch.float32,), (T, None), device)
    k = topk_weights.shape[1]
    topk_ids = _as_int32("topk_ids", topk_ids, (T, k), device)
    if expert_map is not None:
        expert_map = _as_int32("expert_map", expert_map, (None,), device)
        if global_num_experts not in (-1, expert_map.shape[0]):
            raise ValueError(f"global_num_experts: expected expert_map's length {expert_map.shape[0]}, "
                             f"got {global_num_experts}")
    num_experts = global_num_experts if global_num_experts > 0 else (
        expert_map.shape[0] if expert_map is not None else E_local)
    if out is None:
        out = torch.empty_like(hidden_states)
    else:
        _check_tensor("out", out, (hidden_states.dtype,), (T, H), device)
    block_n, block_k = 128, 128
    if block_shape is not None:
        if quant != "fp8_block" or len(block_shape) != 2:
            raise ValueError(f"block_shape: expected [block_n, block_k] with quant='fp8_block', "
                             f"got {block_shape!r} with quant={quant!r}")
        block_n, block_k = (int(v) for v in block_shape)

    spec = _abi.Spec(_routing("softmax_topk", num_experts, k), quant.encode(), block_n, block_k, activation.encode(),
                     int(bool(apply_router_weight_on_input)))
    tensors = _abi.MoeTensors()
    scales = {"w13_scale": _scale("w1_scale", w1_scale, quant, device),
              "w2_scale": _scale("w2_scale", w2_scale, quant, device),
              "input_scale": _scale("a1_scale", a1_scale, quant, device),
              "intermediate_scale": _scale("a2_scale", a2_scale, quant, device)}
    for field, tensor in dict(x=hidden_states, w13=w1, w2=w2, topk_ids=topk_ids, topk_weights=topk_weights,
                              expert_map=expert_map, out=out, **scales).items():
        setattr(tensors, field, _c_tensor(tensor))
    if device.type == "cuda":
        with torch.cuda.device(device):
            nbytes = ctypes.c_size_t()
            _abi.check(_abi.LIB.epmoe_fused_experts_workspace_bytes(spec, tensors, ctypes.byref(nbytes)),
                       "fused_experts")
            space = workspace(device, nbytes.value)
            _abi.check(_abi.LIB.epmoe_fused_experts(spec, tensors, space.data_ptr(), space.numel(), _stream(device)),
                       "fused_experts")
    else:
        _abi.check(_abi.LIB.epmoe_fused_experts(spec, tensors, None, 0, None), "fused_experts")
    return out


def route(router_logits, kind, k, *, renormalize=False, num_expert_group=1, topk_group=1, scoring_func="softmax",
          routed_scaling_factor=1.0, e_score_correction_bias=None):
    """(topk_weights [T, k] f32, topk_ids [T, k] int32) from router_logits [T, E] (f32 or bf16),
    best first, ties to the lower expert id.

    kind: "softmax_topk" (Mixtral, Qwen3: vLLM's fused_topk), "topk_softmax" (gpt-oss),
    "sigmoid_topk" (Llama-4), "grouped_topk" (DeepSeek: vLLM's grouped_topk with
    num_expert_group, topk_group, scoring_func, routed_scaling_factor, e_score_correction_bias).
    """
    _check_choice("kind", kind, _ROUTING_KINDS)
    _check_choice("scoring_func", scoring_func, ("softmax", "sigmoid"))
    _check_tensor("router_logits", router_logits, (torch.float32, torch.bfloat16), (None, None))
    device = router_logits.device
    T, E = router_logits.shape
    if e_score_correction_bias is not None:
        _check_tensor("e_score_correction_bias", e_score_correction_bias, (torch.float32,), (E,), device)
    topk_weights = torch.empty((T, k), dtype=torch.float32, device=device)
    topk_ids = torch.empty((T, k), dtype=torch.int32, device=device)
    routing = _routing(kind, E, k, renormalize, scoring_func, num_expert_group, topk_group, routed_scaling_factor)
    c_bias = _c_tensor(e_score_correction_bias)
    args = (routing, _c_tensor(router_logits), c_bias, _c_tensor(topk_ids), _c_tensor(topk_weights))
    if device.type == "cuda":
        with torch.cuda.device(device):
            _abi.check(_abi.LIB.epmoe_route(*args, _stream(device)), "route")
    else:
        _abi.check(_abi.LIB.epmoe_route(*args, None), "route")
    return topk_weights, topk_ids
