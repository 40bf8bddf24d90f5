"""epmoe.fused_experts and epmoe.route against plain PyTorch references (a loop over
experts; vLLM's top-k routings written out), on the CPU operator and, where a GPU is
present, the CUDA operator; under CUDA-graph capture; and their argument checks."""
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the operator tests need it")
import torch.nn.functional as F  # noqa: E402

import epmoe  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FP8_MAX = 448.0


# ---- references ---------------------------------------------------------------------------

def reference_route(logits, kind, k, renormalize=False, n_group=1, topk_group=1, scoring_func="softmax",
                    routed_scaling_factor=1.0, bias=None):
    logits = logits.float()
    if kind == "softmax_topk":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    elif kind == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    elif kind == "sigmoid_topk":
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.sigmoid(top)
    else:  # grouped_topk, as vLLM's grouped_topk computes it
        scores = torch.softmax(logits, dim=-1) if scoring_func == "softmax" else torch.sigmoid(logits)
        selection = scores + bias if bias is not None else scores
        T, E = scores.shape
        grouped = selection.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if bias is not None else grouped.max(dim=-1).values
        kept = torch.topk(group_scores, topk_group, dim=-1)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, kept, 1).repeat_interleave(E // n_group, dim=1)
        _, ids = torch.topk(selection.masked_fill(mask == 0, float("-inf")), k, dim=-1)
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if kind == "grouped_topk":
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def fake_quantize(values, group):
    """values rounded through e4m3 with one dynamic scale per `group` trailing elements."""
    shape = values.shape
    blocks = values.reshape(-1, group)
    scale = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    codes = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).reshape(shape)


def quantize_activation(values, quant, block_k):
    """What the scheme does to a GEMM input [rows, K] (fp8_tensor: one scale for all rows)."""
    if quant == "fp8_tensor":
        return fake_quantize(values.reshape(1, -1), values.numel()).reshape(values.shape) if values.numel() else values
    if quant == "fp8_channel":
        return fake_quantize(values, values.shape[-1])
    if quant == "fp8_block":
        return fake_quantize(values, block_k)
    return values


def reference_moe(x, w1, w2, topk_weights, topk_ids, expert_map=None, activation="silu", on_input=False,
                  quant="bf16", block_k=128):
    """The layer in f32 over dequantised weights (w1 / w2 already f32), a loop over experts."""
    T, H = x.shape
    I = w2.shape[2]
    xf = x.float()
    x_in = quantize_activation(xf, quant, block_k) if quant == "fp8_tensor" else xf
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    act = F.silu if activation == "silu" else F.gelu
    for e in torch.unique(topk_ids).tolist():
        local = int(expert_map[e]) if expert_map is not None else e
        if local < 0:
            continue
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        w = topk_weights[token, slot].float()[:, None]
        rows = x_in[token]
        if on_input:
            rows = (rows * w).to(x.dtype).float()
        if quant != "fp8_tensor":
            rows = quantize_activation(rows, quant, block_k)
        h = rows @ w1[local].T
        a = act(h[:, :I]) * h[:, I:]
        if quant == "bf16":
            a = a.to(x.dtype).float()
        y = quantize_activation(a, quant, block_k) @ w2[local].T
        out.index_add_(0, token, y if on_input else y * w)
    return out


def rel_error(got, expected):
    """|got - expected| / |expected|; where expected is all zeros (no pair on a local
    expert), |got| itself, so only an exact zero passes."""
    difference = (got.float() - expected.float()).norm()
    scale = expected.float().norm()
    return (difference / scale).item() if scale > 0 else difference.item()


# ---- weights ------------------------------------------------------------------------------

def make_weights(E_local, H, I, quant, device, block=128):
    """(w1, w2, w1_scale, w2_scale, w1 f32, w2 f32): weights as a checkpoint of `quant` stores
    them, and their dequantised values for the reference."""
    w1 = torch.randn(E_local, 2 * I, H, device=device) / H ** 0.5
    w2 = torch.randn(E_local, H, I, device=device) / I ** 0.5
    if quant == "bf16":
        w1, w2 = w1.bfloat16(), w2.bfloat16()
        return w1, w2, None, None, w1.float(), w2.float()

    def quantize(w):
        E, N, K = w.shape
        if quant == "fp8_tensor":
            scale = w.abs().amax(dim=(1, 2)) / FP8_MAX                       # [E]
            full = scale[:, None, None]
        elif quant == "fp8_channel":
            scale = w.abs().amax(dim=2, keepdim=True) / FP8_MAX              # [E, N, 1] (vLLM's layout)
            full = scale
        else:
            blocks = w.view(E, N // block, block, K // block, block)
            scale = blocks.abs().amax(dim=(2, 4)) / FP8_MAX                  # [E, N / 128, K / 128]
            full = scale.repeat_interleave(block, 1).repeat_interleave(block, 2)
        codes = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return codes, scale.contiguous(), codes.float() * full

    c1, s1, d1 = quantize(w1)
    c2, s2, d2 = quantize(w2)
    return c1, c2, s1, s2, d1, d2


# ---- route --------------------------------------------------------------------------------

ROUTINGS = [
    dict(kind="softmax_topk", E=8, k=2, renormalize=True),                     # Mixtral
    dict(kind="softmax_topk", E=128, k=8, renormalize=True),                   # Qwen3-MoE
    dict(kind="topk_softmax", E=32, k=4),                                      # gpt-oss
    dict(kind="sigmoid_topk", E=16, k=1),                                      # Llama-4
    dict(kind="grouped_topk", E=256, k=8, renormalize=True, n_group=8, topk_group=4, scoring_func="sigmoid",
         routed_scaling_factor=2.5, bias=True),                                # DeepSeek-V3
    dict(kind="grouped_topk", E=64, k=6, n_group=8, topk_group=3),            # DeepSeek-V2
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ROUTINGS, ids=lambda c: f"{c['kind']}-E{c['E']}")
def test_route_matches_reference(device, case):
    T = 37
    logits = torch.randn(T, case["E"], device=device) * 2
    bias = torch.randn(case["E"], device=device) * 0.1 if case.get("bias") else None
    options = dict(renormalize=case.get("renormalize", False), routed_scaling_factor=case.get("routed_scaling_factor", 1.0))
    group = dict(n_group=case.get("n_group", 1), topk_group=case.get("topk_group", 1),
                 scoring_func=case.get("scoring_func", "softmax"))
    weights, ids = epmoe.route(logits, case["kind"], case["k"], num_expert_group=group["n_group"],
                               topk_group=group["topk_group"], scoring_func=group["scoring_func"],
                               e_score_correction_bias=bias, **options)
    expected_weights, expected_ids = reference_route(logits, case["kind"], case["k"], bias=bias, **group, **options)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), expected_ids.cpu())
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


# ---- fused_experts ------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("with_map", [False, True], ids=["all-local", "expert-map"])
def test_fused_experts_bf16_matches_reference(device, T, activation, with_map):
    E, H, I, k = 16, 256, 128, 4
    x = torch.randn(T, H, device=device).bfloat16()
    E_local = E // 2 if with_map else E
    w1, w2, _, _, w1f, w2f = make_weights(E_local, H, I, "bf16", device)
    weights, ids = epmoe.route(torch.randn(T, E, device=device), "softmax_topk", k, renormalize=True)
    expert_map = None
    if with_map:  # this rank owns the odd experts, in order
        expert_map = torch.full((E,), -1, dtype=torch.int32, device=device)
        expert_map[1::2] = torch.arange(E_local, dtype=torch.int32, device=device)
    out = torch.full_like(x, float("nan"))
    result = epmoe.fused_experts(x, w1, w2, weights, ids, activation=activation, expert_map=expert_map,
                                 global_num_experts=E, out=out)
    assert result is out
    assert not torch.isnan(out).any(), "every output element is written"
    expected = reference_moe(x, w1f, w2f, weights, ids, expert_map, activation)
    assert rel_error(out, expected) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_router_weight_on_input_and_int64_ids(device):
    T, E, H, I = 11, 16, 128, 64
    x = torch.randn(T, H, device=device).bfloat16()
    w1, w2, _, _, w1f, w2f = make_weights(E, H, I, "bf16", device)
    weights, ids = epmoe.route(torch.randn(T, E, device=device), "sigmoid_topk", 1)
    out = epmoe.fused_experts(x, w1, w2, weights, ids.long(), apply_router_weight_on_input=True)
    expected = reference_moe(x, w1f, w2f, weights, ids, on_input=True)
    assert rel_error(out, expected) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", ["fp8_tensor", "fp8_channel", "fp8_block"])
def test_fused_experts_fp8(device, quant):
    T, E, H, I, k = 13, 8, 256, 256, 2
    x = torch.randn(T, H, device=device).bfloat16()
    w1, w2, s1, s2, w1f, w2f = make_weights(E, H, I, quant, device)
    weights, ids = epmoe.route(torch.randn(T, E, device=device), "softmax_topk", k)
    out = epmoe.fused_experts(x, w1, w2, weights, ids, quant=quant, w1_scale=s1, w2_scale=s2,
                              block_shape=[128, 128] if quant == "fp8_block" else None)
    assert not torch.isnan(out).any()
    expected = reference_moe(x, w1f, w2f, weights, ids, quant=quant)
    assert rel_error(out, expected) < 3e-2


def test_replaces_a_pytorch_moe_block():
    """The README's example: a Mixtral-style block's experts (nn.Linear) stacked into w1 / w2."""
    device = DEVICES[-1]
    H, I, E, k = 128, 64, 8, 2

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(H, E, bias=False)
            self.w_gate = torch.nn.ModuleList(torch.nn.Linear(H, I, bias=False) for _ in range(E))
            self.w_up = torch.nn.ModuleList(torch.nn.Linear(H, I, bias=False) for _ in range(E))
            self.w_down = torch.nn.ModuleList(torch.nn.Linear(I, H, bias=False) for _ in range(E))

        def forward(self, x):
            weights, ids = torch.topk(torch.softmax(self.gate(x).float(), -1), k)
            weights = weights / weights.sum(-1, keepdim=True)
            out = torch.zeros_like(x, dtype=torch.float32)
            for j in range(k):
                for e in range(E):
                    rows = ids[:, j] == e
                    h = F.silu(self.w_gate[e](x[rows])) * self.w_up[e](x[rows])
                    out[rows] += weights[rows, j, None] * self.w_down[e](h).float()
            return out.to(x.dtype)

    block = Block().to(device).bfloat16()
    x = torch.randn(19, H, device=device).bfloat16()
    expected = block(x)
    w1 = torch.stack([torch.cat([block.w_gate[e].weight, block.w_up[e].weight]) for e in range(E)])
    w2 = torch.stack([block.w_down[e].weight for e in range(E)])
    weights, ids = epmoe.route(block.gate(x), "softmax_topk", k, renormalize=True)
    assert rel_error(epmoe.fused_experts(x, w1, w2, weights, ids), expected) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay_on_new_inputs():
    T, E, H, I, k = 33, 32, 256, 128, 4
    device = "cuda"
    w1, w2, _, _, _, _ = make_weights(E, H, I, "bf16", device)
    x = torch.randn(T, H, device=device).bfloat16()
    logits = torch.randn(T, E, device=device)

    def layer():
        weights, ids = epmoe.route(logits, "softmax_topk", k, renormalize=True)
        return epmoe.fused_experts(x, w1, w2, weights, ids)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()  # warm-up: the workspace exists before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out = layer()
    for _ in range(3):
        x.copy_(torch.randn(T, H, device=device).bfloat16())
        logits.copy_(torch.randn(T, E, device=device))
        captured_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured_out, layer()), "a replay equals an eager call on the same inputs"


# ---- argument checks ----------------------------------------------------------------------

def small_problem(device="cpu"):
    T, E, H, I, k = 4, 8, 64, 32, 2
    x = torch.randn(T, H, device=device).bfloat16()
    w1 = torch.randn(E, 2 * I, H, device=device).bfloat16()
    w2 = torch.randn(E, H, I, device=device).bfloat16()
    weights, ids = epmoe.route(torch.randn(T, E, device=device), "softmax_topk", k)
    return x, w1, w2, weights, ids


def test_bad_arguments_raise_clear_errors():
    x, w1, w2, weights, ids = small_problem()
    with pytest.raises(TypeError, match=r"w1: expected dtype bfloat16, got float16 \[8, 64, 64\]"):
        epmoe.fused_experts(x, w1.half(), w2, weights, ids)
    with pytest.raises(ValueError, match=r"w2: expected shape \[8, 64, 32\], got bfloat16 \[8, 64, 16\]"):
        epmoe.fused_experts(x, w1, w2[:, :, :16].contiguous(), weights, ids)
    with pytest.raises(ValueError, match="hidden_states: expected a contiguous tensor"):
        epmoe.fused_experts(x.t().contiguous().t(), w1, w2, weights, ids)
    with pytest.raises(TypeError, match="topk_weights: expected dtype float32"):
        epmoe.fused_experts(x, w1, w2, weights.bfloat16(), ids)
    with pytest.raises(TypeError, match="topk_ids: expected a torch.Tensor, got list"):
        epmoe.fused_experts(x, w1, w2, weights, ids.tolist())
    with pytest.raises(ValueError, match="quant: expected one of bf16"):
        epmoe.fused_experts(x, w1, w2, weights, ids, quant="int4")
    with pytest.raises(ValueError, match="global_num_experts: expected expert_map's length 8, got 16"):
        epmoe.fused_experts(x, w1, w2, weights, ids, expert_map=torch.arange(8, dtype=torch.int32),
                            global_num_experts=16)
    with pytest.raises(ValueError, match=r"expert_map\[3\]: expected -1 or a local expert index in \[0, 8\), got 9"):
        epmoe.fused_experts(x, w1, w2, weights, ids, expert_map=torch.tensor([0, 1, 2, 9, 4, 5, 6, 7],
                                                                             dtype=torch.int32))
    with pytest.raises(ValueError, match="kind: expected one of softmax_topk"):
        epmoe.route(torch.randn(4, 8), "top2", 2)
    with pytest.raises(ValueError, match=r"routing.top_k: expected 1 <= top_k <= num_experts \(8\), got 9"):
        epmoe.route(torch.randn(4, 8), "softmax_topk", 9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to mix devices")
def test_tensors_on_different_devices_are_refused():
    x, w1, w2, weights, ids = small_problem("cuda")
    with pytest.raises(ValueError, match=r"w2: expected a tensor on cuda:0 \(hidden_states' device\), got"):
        epmoe.fused_experts(x, w1, w2.cpu(), weights, ids)
