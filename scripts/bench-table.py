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

    def spread(values):
        return f"{min(values):.0f}-{max(values):.0f}"

    # The floors' GEMM rates are sustained ones (blocks of back-to-back runs, the card at its
    # power limit); the burst rates (runs timed alone) beside them where the JSON has them.
    def rate(key, label, fp8_runs_only):
        chosen = [run["ceilings"] for run in runs if not fp8_runs_only or run.get("quant", "bf16") != "bf16"]
        sustained = [c.get(key, c["flops_per_second"]) / 1e12 for c in chosen]
        if not sustained:
            return ""
        burst_key = key.replace("flops_per_second", "burst_flops_per_second")
        burst = [c[burst_key] / 1e12 for c in chosen if burst_key in c]
        text = f", {label} GEMM {spread(sustained)} TFLOP/s"
        return text + (f" sustained (burst {spread(burst)})" if burst else "")

    line = (f"\nCeilings measured per run: copy {min(copy):.2f}-{max(copy):.2f} TB/s"
            + rate("bf16_flops_per_second", "bf16", False) + rate("flops_per_second", "e4m3", True))
    if any(run.get("quant", "bf16") != "bf16" for run in runs):
        line += " (the fp8 floors' rate is the e4m3 one)"
    print(line + f" ({runs[0]['device']}).")
    if any("burst_floor_seconds" in r for run in runs for r in run["results"]):
        print("\nThe same times against floors at the GEMMs' burst rates (time / burst floor):\n")
        print("| preset | scheme | ep | " + " | ".join(f"T={t}" for t in tokens) + " |")
        print("| --- | --- | --- | " + " | ".join("---" for _ in tokens) + " |")
        for run in runs:
            cells = {r["tokens"]: r for r in run["results"]}
            row = [f"{cells[t]['seconds'] / cells[t]['burst_floor_seconds']:.2f}"
                   if t in cells and "burst_floor_seconds" in cells[t] else "" for t in tokens]
            print(f"| {run['model']} | {run.get('quant', 'bf16')} | {run['ep']} | " + " | ".join(row) + " |")
    # The SM clock (median of each timed region's NVML samples), where the bench could read it:
    # a time at a lower clock than the floor's GEMM ran at says the card held its clock down.
    timed = [r["clocks"] for run in runs for r in run["results"] if r.get("clocks")]
    # (JSON from before the sustained rates: its rate clocks are of runs timed alone.)
    sustained_rates = any("bf16_burst_flops_per_second" in c for c in ceilings)
    for label, keys in (("sustained" if sustained_rates else "burst", ("rate_clocks", "bf16_rate_clocks")),
                        ("burst", ("burst_rate_clocks", "bf16_burst_rate_clocks"))):
        rates = [c[key] for c in ceilings for key in keys if c.get(key)]
        if timed and rates:
            mhz = [c["sm_mhz_median"] for c in timed]
            print(f"SM clock while timed: {min(mhz):.0f}-{max(mhz):.0f} MHz (the ceilings' {label} GEMMs: "
                  f"{spread([c['sm_mhz_median'] for c in rates])} MHz); power-capped in up to "
                  f"{100 * max(c['power_capped_share'] for c in timed):.0f}% of a case's samples.")


if __name__ == "__main__":
    main()
