#!/usr/bin/env python3
"""Compares the benchmark runs of scripts/device-variant-check: for each variant NAME,
OUT/NAME/bench.json (a list of `epmoe bench --json` documents); the first NAME is the
baseline. Prints a Markdown table, one row per preset, scheme, ep and T: the baseline's
time and each variant's time with its change against the baseline.

    python3 scripts/compare-variants.py OUT base persistent-ring combine-chunks
"""
import json
import os
import sys


def times(path):
    """{(model, quant, ep, tokens): seconds} of one bench.json."""
    found = {}
    for run in json.load(open(path)):
        for result in run["results"]:
            found[(run["model"], run.get("quant", "bf16"), run["ep"], result["tokens"])] = result["seconds"]
    return found


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, names = sys.argv[1], sys.argv[2:]
    runs = {}
    for name in names:
        path = os.path.join(out, name, "bench.json")
        if os.path.exists(path):
            runs[name] = times(path)
        else:
            print(f"({name}: no {path})")
    if names[0] not in runs:
        sys.exit(f"no baseline: {names[0]}")
    base = runs[names[0]]
    others = [name for name in names[1:] if name in runs]
    print("| preset | scheme | ep | T | " + " | ".join([f"{names[0]} us"] + [f"{n} us (change)" for n in others]) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in range(1 + len(others))) + " |")
    for key in sorted(base, key=lambda k: (k[0], k[1], k[2], k[3])):
        cells = [f"{base[key] * 1e6:.1f}"]
        for name in others:
            seconds = runs[name].get(key)
            cells.append(f"{seconds * 1e6:.1f} ({(seconds / base[key] - 1) * 100:+.1f}%)" if seconds else "")
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
