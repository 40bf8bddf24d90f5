#!/usr/bin/env python3
"""Compares the benchmark runs of scripts/device-variant-check: for each variant NAME, the
rounds OUT/NAME/round<r>/bench.json (or one OUT/NAME/bench.json), each a list of `epmoe
bench --json` documents; the first NAME is the baseline. Prints a Markdown table, one row
per preset, scheme, ep and T: each variant's median time over the rounds, its change
against the baseline's median, and +- half the rounds' range (max - min) relative to the
median, the size of the noise a change has to exceed.

    python3 scripts/compare-variants.py OUT base persistent-ring combine-chunks
"""
import glob
import json
import os
import statistics
import sys

from bench_results import cases


def times(path):
    """{(model, quant, ep, tokens): seconds} of one bench.json."""
    return {key: result["seconds"] for key, result in cases(json.load(open(path)))}


def rounds_of(out, name):
    """{key: [seconds of each round]} of variant `name`, or None when it has no run."""
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
        for key, seconds in runs.items():
            found.setdefault(key, []).append(seconds)
    return found or None


def cell(values, base=None):
    median = statistics.median(values)
    spread = (max(values) - min(values)) / 2 / median * 100
    change = f" ({(median / base - 1) * 100:+.1f}%)" if base else ""
    noise = f" ±{spread:.1f}%" if len(values) > 1 else ""
    return f"{median * 1e6:.1f}{change}{noise}"


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
        base_median = statistics.median(base[key])
        cells = [cell(base[key])]
        for name in others:
            values = runs[name].get(key)
            cells.append(cell(values, base_median) if values else "")
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
