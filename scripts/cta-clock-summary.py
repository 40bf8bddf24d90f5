#!/usr/bin/env python3
"""Summarises the per-CTA clocks that docs/prepared/timing-decode-cta-clock.patch makes the
decode and medium GEMM tiles print (lines "cta_clock ..." and "cta_exit ..." on stdout), launch
by launch: when the CTAs entered and were past their waits, how long each tile's K loop took,
the weight bytes it streamed per second, and how many CTAs shared an SM.

    epmoe bench --device cuda --model deepseek-v3 --ep 8 --quant fp8_block --tokens 1 \\
        --iterations 1 --graph-calls 1 | python3 scripts/cta-clock-summary.py

A launch is the CTAs of one kernel (gated or not, its tile) whose entries follow each other by
less than --gap microseconds; the last --last launches of each kernel are printed (the timed
graph replays come last).
"""
import argparse
import re
import statistics
import sys
from collections import defaultdict

FIELD = re.compile(r"(\w+)=(-?\d+)")


REQUIRED = {
    "cta_clock": {"gated", "rows", "cols", "fp8", "sm", "weight_bytes", "entry", "ready", "tile_start", "k_loop_end",
                  "done"},
    "cta_exit": {"gated", "rows", "cols", "fp8", "sm", "entry", "exit"},
}


def parse(lines):
    """(kind, fields) for each whole clock line; kind is 'cta_clock' or 'cta_exit'. Lines cut
    short (the device's printf buffer full, output interleaved) are counted and left out."""
    cut = 0
    for line in lines:
        words = line.split(maxsplit=1)
        if not words or words[0] not in REQUIRED:
            continue
        fields = {key: int(value) for key, value in FIELD.findall(line)}
        if REQUIRED[words[0]] <= fields.keys():
            yield words[0], fields
        else:
            cut += 1
    if cut:
        print(f"({cut} clock lines cut short, left out)", file=sys.stderr)


def launches(records, gap_ns):
    """Splits one kernel's records, ordered by entry, where entries are gap_ns apart or more."""
    records = sorted(records, key=lambda r: r[1]["entry"])
    current, previous_entry = [], None
    for record in records:
        entry = record[1]["entry"]
        if previous_entry is not None and entry - previous_entry >= gap_ns:
            yield current
            current = []
        current.append(record)
        previous_entry = entry
    if current:
        yield current


def most_at_once(intervals):
    """The most intervals [start, end) that overlap at one time."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summarise(launch):
    clocks = [f for kind, f in launch if kind == "cta_clock"]
    exits = [f for kind, f in launch if kind == "cta_exit"]
    start = min(f["entry"] for _, f in launch)
    us = 1e-3
    if not clocks:
        return f"{len(exits)} CTAs, all without a tile (exited {max(f['exit'] for f in exits) - start:.0f} ns in)"
    end = max(f["done"] for f in clocks)
    loops = [f["k_loop_end"] - f["tile_start"] for f in clocks]
    rates = [f["weight_bytes"] / max(1, f["k_loop_end"] - f["tile_start"]) for f in clocks]  # bytes/ns = GB/s
    streaming = [(f["tile_start"], f["k_loop_end"]) for f in clocks]
    by_sm = defaultdict(list)
    for f in clocks:
        by_sm[f["sm"]].append((f["tile_start"], f["done"]))
    weight_bytes = sum(f["weight_bytes"] for f in clocks)
    first_loop = min(f["tile_start"] for f in clocks)
    last_loop = max(f["k_loop_end"] for f in clocks)
    return "\n".join([
        f"  {len(clocks)} tiles on {len(by_sm)} SMs (at most {max(most_at_once(v) for v in by_sm.values())} a SM), "
        f"{len(exits)} CTAs without a tile; launch {(end - start) * us:.1f} us from the first entry",
        f"  entries over {(max(f['entry'] for f in clocks) - start) * us:.1f} us; past the waits "
        f"(ready - entry) median {statistics.median(f['ready'] - f['entry'] for f in clocks) * us:.1f} us, "
        f"max {max(f['ready'] - f['entry'] for f in clocks) * us:.1f}",
        f"  K loops start {(first_loop - start) * us:.1f} to {(max(s for s, _ in streaming) - start) * us:.1f} us in, "
        f"last ends at {(last_loop - start) * us:.1f}; loop median {statistics.median(loops) * us:.1f} us "
        f"(p10 {percentile(loops, 0.1) * us:.1f}, p90 {percentile(loops, 0.9) * us:.1f}); after the loop "
        f"median {statistics.median(f['done'] - f['k_loop_end'] for f in clocks) * us:.1f} us",
        f"  a CTA's weight stream median {statistics.median(rates):.1f} GB/s (p10 {percentile(rates, 0.1):.1f}, "
        f"p90 {percentile(rates, 0.9):.1f}); {most_at_once(streaming)} loops at once at most; all weights "
        f"{weight_bytes / 1e6:.1f} MB over the loops' span {(last_loop - first_loop) * us:.1f} us = "
        f"{weight_bytes / max(1, last_loop - first_loop) / 1e3:.2f} TB/s",
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", help="the bench's output (default: stdin)")
    parser.add_argument("--gap", type=float, default=5.0, help="microseconds between launches of a kernel")
    parser.add_argument("--last", type=int, default=2, help="launches of each kernel to print, the last ones")
    args = parser.parse_args()
    lines = open(args.file) if args.file else sys.stdin
    kernels = defaultdict(list)
    for kind, fields in parse(lines):
        key = (fields["gated"], fields["rows"], fields["cols"], fields["fp8"])
        kernels[key].append((kind, fields))
    if not kernels:
        sys.exit("no cta_clock lines: was the bench built with timing-decode-cta-clock.patch?")
    for (gated, rows, cols, fp8), records in sorted(kernels.items()):
        split = list(launches(records, args.gap * 1e3))
        name = f"{'GEMM1' if gated else 'GEMM2'} {rows} x {cols} {'e4m3' if fp8 else 'bf16'}"
        for index, launch in enumerate(split[-args.last:], start=max(0, len(split) - args.last)):
            print(f"{name}, launch {index + 1} of {len(split)}:")
            print(summarise(launch))


if __name__ == "__main__":
    main()
