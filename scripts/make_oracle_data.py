#!/usr/bin/env python3
"""Writes tests/data/oracle_*.safetensors: MoE blocks of Hugging Face transformers, built
from small configs with random weights, with their inputs, weights and outputs in
epmoe's oracle format (docs/ORACLE_FORMAT.md). tests/test_oracle.cpp requires epmoe's CPU
operator to reproduce them. Runs on the CPU in float32; needs torch, transformers and
safetensors.

    python3 scripts/make_oracle_data.py [--out tests/data]
"""
import argparse
import json
import os

import torch
import transformers
from safetensors.torch import save_file

TOKENS = 24


def init_(module, seed):
    """Fresh random parameters: every parameter ~ N(0, 1/fan_in) (fan_in = last dim)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def spec(kind, experts, k, renormalize, **extra):
    routing = {"kind": kind, "num_experts": experts, "top_k": k, "renormalize": renormalize}
    routing.update({key: v for key, v in extra.items() if key != "apply_router_weight_on_input"})
    return {
        "routing": routing,
        "quant": {"scheme": "bf16"},
        "activation": "silu",
        "apply_router_weight_on_input": extra.get("apply_router_weight_on_input", False),
    }


def softmax_routed(block, seed, experts, k):
    """A block with a linear router `block.gate` and 3-D experts (Mixtral, Qwen3-MoE)."""
    init_(block, seed)
    x = torch.randn(1, TOKENS, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        y = block(x)
        logits = torch.nn.functional.linear(x[0], block.gate.weight)
    tensors = {"x": x[0], "router_logits": logits, "w13": block.experts.gate_up_proj,
               "w2": block.experts.down_proj, "y": y[0]}
    return tensors, spec("softmax_topk", experts, k, True)


def mixtral(seed):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_local_experts=8,
                                     num_experts_per_tok=2)
    return softmax_routed(MixtralSparseMoeBlock(cfg).eval(), seed, 8, 2)


def qwen3_moe(seed):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=48, num_experts=16,
                                      num_experts_per_tok=4, norm_topk_prob=True)
    return softmax_routed(Qwen3MoeSparseMoeBlock(cfg).eval(), seed, 16, 4)


def deepseek_v3(seed):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    cfg = transformers.DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16,
                                        num_experts_per_tok=4, n_group=4, topk_group=2,
                                        n_shared_experts=1, routed_scaling_factor=2.5,
                                        norm_topk_prob=True)
    block = DeepseekV3MoE(cfg).eval()
    init_(block, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        # A bias large enough to change which experts win, as trained ones do.
        block.gate.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.2)
    x = torch.randn(1, TOKENS, 64, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        y = block(x)
        logits = torch.nn.functional.linear(x[0], block.gate.weight)
    shared = block.shared_experts
    tensors = {"x": x[0], "router_logits": logits,
               "e_score_correction_bias": block.gate.e_score_correction_bias.clone(),
               "w13": block.experts.gate_up_proj, "w2": block.experts.down_proj,
               "shared_w13": torch.cat([shared.gate_proj.weight, shared.up_proj.weight], dim=0),
               "shared_w2": shared.down_proj.weight, "y": y[0]}
    return tensors, spec("grouped_topk", 16, 4, True, score_func="sigmoid", n_group=4, topk_group=2,
                         routed_scaling_factor=2.5)


def llama4(seed):
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
    cfg = transformers.Llama4TextConfig(hidden_size=64, intermediate_size=48, num_local_experts=8,
                                        num_experts_per_tok=1)
    block = Llama4TextMoe(cfg).eval()
    init_(block, seed)
    x = torch.randn(1, TOKENS, 64, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        y, logits = block(x)
    shared = block.shared_expert
    tensors = {"x": x[0], "router_logits": logits,
               # Llama-4 stores gate_up_proj as [E, H, 2I] and down_proj as [E, I, H].
               "w13": block.experts.gate_up_proj.transpose(1, 2),
               "w2": block.experts.down_proj.transpose(1, 2),
               "shared_w13": torch.cat([shared.gate_proj.weight, shared.up_proj.weight], dim=0),
               "shared_w2": shared.down_proj.weight, "y": y.reshape(TOKENS, 64)}
    return tensors, spec("sigmoid_topk", 8, 1, False, apply_router_weight_on_input=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_grad_enabled(False)
    for index, (name, build) in enumerate([("mixtral", mixtral), ("qwen3_moe", qwen3_moe),
                                           ("deepseek_v3", deepseek_v3), ("llama4", llama4)]):
        tensors, moe_spec = build(seed=1000 * (index + 1))
        tensors = {key: v.detach().float().contiguous() for key, v in tensors.items()}
        assert torch.isfinite(tensors["y"]).all() and tensors["y"].abs().max() > 0
        metadata = {"epmoe.spec": json.dumps(moe_spec), "epmoe.source": f"transformers {transformers.__version__}, "
                    f"torch {torch.__version__}, float32, CPU, {name}"}
        path = os.path.join(args.out, f"oracle_{name}.safetensors")
        save_file(tensors, path, metadata=metadata)
        print(f"{path}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items()))


if __name__ == "__main__":
    main()
