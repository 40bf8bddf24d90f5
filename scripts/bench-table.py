#!/usr/bin/env python3
"""Formats the JSON of scripts/bench-gpu (a list of `epmoe bench --json` documents) as
Markdown tables for docs/BENCHMARKS.md: one row per preset, scheme and ep, one column per T,
each cell "time us / ratio".

    python3 scripts/bench-table.py bench.json
"""
import json
import sys


def main():
    runs = json.load(open(sys.argv[1]))
    tokens = sorted({r["tokens"] for run in runs for r in run["results"]})
    print("| preset | scheme | ep | " + " | ".join(f"T={t}" for t in tokens) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in tokens) + " |")
    for run in runs:
        cells = {r["tokens"]: r for r in run["results"]}
        row = []
        for t in tokens:
            r = cells.get(t)
            row.append(f"{r['seconds'] * 1e6:.0f} / {r['ratio']:.2f}" if r else "")
        print(f"| {run['model']} | {run.get('quant', 'bf16')} | {run['ep']} | " + " | ".join(row) + " |")
    ceilings = [run["ceilings"] for run in runs]
    copy = [c["bytes_per_second"] / 1e12 for c in ceilings]
    bf16 = [c.get("bf16_flops_per_second", c["flops_per_second"]) / 1e12 for c in ceilings]
    line = (f"\nCeilings measured per run: copy {min(copy):.2f}-{max(copy):.2f} TB/s, "
            f"bf16 GEMM {min(bf16):.0f}-{max(bf16):.0f} TFLOP/s")
    e4m3 = [run["ceilings"]["flops_per_second"] / 1e12 for run in runs if run.get("quant", "bf16") != "bf16"]
    if e4m3:
        line += f", e4m3 GEMM {min(e4m3):.0f}-{max(e4m3):.0f} TFLOP/s (the fp8 floors' rate)"
    print(line + f" ({runs[0]['device']}).")
    # The SM clock (median of each timed region's NVML samples), where the bench could read it:
    # a time at a lower clock than the floor's GEMM ran at says the card held its clock down.
    timed = [r["clocks"] for run in runs for r in run["results"] if r.get("clocks")]
    rates = [c[key] for c in ceilings for key in ("rate_clocks", "bf16_rate_clocks") if c.get(key)]
    if timed and rates:
        mhz = [c["sm_mhz_median"] for c in timed]
        print(f"SM clock while timed: {min(mhz):.0f}-{max(mhz):.0f} MHz (the ceilings' GEMMs: "
              f"{min(c['sm_mhz_median'] for c in rates):.0f}-{max(c['sm_mhz_median'] for c in rates):.0f} MHz); "
              f"power-capped in up to {100 * max(c['power_capped_share'] for c in timed):.0f}% of a case's samples.")


if __name__ == "__main__":
    main()
