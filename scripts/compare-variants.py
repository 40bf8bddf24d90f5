#!/usr/bin/env python3
"""Compares the benchmark runs of scripts/device-variant-check: for each variant NAME, the
rounds OUT/NAME/round<r>/bench.json (or one OUT/NAME/bench.json), each a list of `epmoe
bench --json` documents; the first NAME is the baseline. Prints a Markdown table, one row
per preset, scheme, ep and T: each variant's median time over the rounds, its change
against the baseline's median, and +- half the rounds' range (max - min) relative to the
median, the size of the noise a change has to exceed; and, where the bench read it, the
median SM clock over the rounds (a variant timed at a lower clock than the baseline lost
that much to the card, not to its code).

    python3 scripts/compare-variants.py OUT base persistent-ring combine-chunks
"""
import glob
import json
import os
import statistics
import sys

from bench_results import cases


def times(path):
    """{(model, quant, ep, tokens): (seconds, median SM MHz or None)} of one bench.json."""
    return {key: (result["seconds"], (result.get("clocks") or {}).get("sm_mhz_median"))
            for key, result in cases(json.load(open(path)))}


def rounds_of(out, name):
    """{key: [(seconds, SM MHz or None) of each round]} of variant `name`, or None when it has no run."""
    paths = sorted(glob.glob(os.path.join(out, name, "round*", "bench.json")))
    if not paths and os.path.exists(os.path.join(out, name, "bench.json")):
        paths = [os.path.join(out, name, "bench.json")]
    if not paths:
        return None
    found = {}
    for path in paths:
        try:
            runs = times(path)
        except (ValueError, KeyError) as error:  # a round whose benches all failed
            print(f"({path}: unreadable, {error})", file=sys.stderr)
            continue
        for key, measured in runs.items():
            found.setdefault(key, []).append(measured)
    return found or None


def cell(measured, base=None):
    values = [seconds for seconds, _ in measured]
    clocks = [mhz for _, mhz in measured if mhz]
    median = statistics.median(values)
    spread = (max(values) - min(values)) / 2 / median * 100
    change = f" ({(median / base - 1) * 100:+.1f}%)" if base else ""
    noise = f" ±{spread:.1f}%" if len(values) > 1 else ""
    clock = f" @{statistics.median(clocks):.0f} MHz" if clocks else ""
    return f"{median * 1e6:.1f}{change}{noise}{clock}"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, names = sys.argv[1], sys.argv[2:]
    runs = {}
    for name in names:
        found = rounds_of(out, name)
        if found is None:
            print(f"({name}: no bench.json under {os.path.join(out, name)})")
        else:
            runs[name] = found
    if names[0] not in runs:
        sys.exit(f"no baseline: {names[0]}")
    base = runs[names[0]]
    others = [name for name in names[1:] if name in runs]
    print("| preset | scheme | ep | T | " + " | ".join([f"{names[0]} us"] + [f"{n} us (change)" for n in others]) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in range(1 + len(others))) + " |")
    for key in sorted(base):
        base_median = statistics.median(seconds for seconds, _ in base[key])
        cells = [cell(base[key])]
        for name in others:
            values = runs[name].get(key)
            cells.append(cell(values, base_median) if values else "")
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
