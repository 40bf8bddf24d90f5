#!/usr/bin/env python3
"""Checks the JSON of scripts/bench-gpu against the performance targets of the GPU issues
(bf16: issue 3; fp8: issue 4) and prints, for each measured case a target covers, the
target, the figure and whether it is met; then the fp8_block speed-up over bf16 of
deepseek-v3 at ep=8 where both were measured.

    python3 scripts/issue-targets.py bench.json

The targets, as the issues word them: ratio time / floor at most 1.3 where the floor is
set by bandwidth (T up to 64 at ep=8 for deepseek-v3 and qwen3-235b-a22b, T up to 16 for
qwen3-30b-a3b), at most 1.5 (bf16) or 1.6 (fp8) at T = 16384, and for bf16 at most 2.0
everywhere in between; fp8_block on deepseek-v3 at ep=8 at least 1.6 times faster than
bf16 at every T.
"""
import json
import sys

from bench_results import cases

BANDWIDTH_BOUND_TOKENS = {"deepseek-v3": 64, "qwen3-235b-a22b": 64, "qwen3-30b-a3b": 16}  # at ep=8


def target(model, quant, ep, tokens):
    """The ratio target of one case and its name, or None where no target covers it."""
    fp8 = quant != "bf16"
    if tokens == 16384:
        return (1.6, "math-bound") if fp8 else (1.5, "math-bound")
    if ep == 8 and tokens <= BANDWIDTH_BOUND_TOKENS.get(model, 0):
        return 1.3, "bandwidth-bound"
    return None if fp8 else (2.0, "in between")


def main():
    runs = json.load(open(sys.argv[1]))
    met = missed = 0
    print("| preset | scheme | ep | T | target | ratio | met |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    times = {}
    for (model, quant, ep, tokens), r in cases(runs):
        times[(model, quant, ep, tokens)] = r["seconds"]
        covered = target(model, quant, ep, tokens)
        if covered is None:
            continue
        limit, name = covered
        ok = r["ratio"] <= limit
        met, missed = met + ok, missed + (not ok)
        print(f"| {model} | {quant} | {ep} | {tokens} | <= {limit} ({name}) | {r['ratio']:.2f} | "
              f"{'yes' if ok else 'no'} |")
    print(f"\nRatio targets: {met} met, {missed} missed.")
    speedups = []
    for (model, quant, ep, tokens), seconds in sorted(times.items()):
        if (model, quant, ep) == ("deepseek-v3", "fp8_block", 8) and (model, "bf16", ep, tokens) in times:
            speedup = times[(model, "bf16", ep, tokens)] / seconds
            speedups.append(f"T={tokens} {speedup:.2f}{'' if speedup >= 1.6 else ' (missed)'}")
    if speedups:
        print("fp8_block over bf16, deepseek-v3 ep=8 (target >= 1.6): " + ", ".join(speedups) + ".")


if __name__ == "__main__":
    main()
