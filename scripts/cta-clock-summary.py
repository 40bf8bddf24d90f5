#!/usr/bin/env python3
"""Summarises the clocks that docs/prepared/timing-cta-clock.patch (with its K-loop clock,
timing-cta-clock-k-loop.patch or timing-cta-clock-k-loop-on-k-pairs.patch) makes the GEMM kernels record
(into a device buffer, printed one line a record when the program ends), launch by launch. The decode and medium tiles (lines "cta_clock ..." and "cta_exit ..."): when
the CTAs entered and were past their waits, how long each tile's K loop took, the weight bytes it
streamed per second, and how many CTAs shared an SM. The specialised 128-row tile ("item_clock
..."): per work item, the consumers' K loop and epilogue, the time between items, the
producer's issue, and the K loop's rate against the tensor work it did.

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
    "cta_clock": {"gated", "rows", "cols", "fp8", "early", "sm", "weight_bytes", "entry", "routed", "routed_again",
                  "ready", "tile_start", "k_loop_end", "done"},
    "cta_exit": {"gated", "rows", "cols", "fp8", "sm", "entry", "exit"},
    "item_clock": {"role", "gated", "fp8", "cols", "block", "item", "k_tiles", "rows", "start", "mark", "end"},
}


def parse(lines):
    """(kind, fields) for each whole clock line; kind is 'cta_clock', 'cta_exit' or 'item_clock'.
    Lines cut short (output interleaved with the bench's) are counted and left out."""
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
    """Splits one kernel's records into launches: ordered by entry, a record that enters gap_ns or
    more after every earlier one has ended starts the next launch."""
    records = sorted(records, key=lambda r: r[1]["entry"])
    current, latest_end = [], None
    for record in records:
        entry, end = record[1]["entry"], record[1]["until"]
        if latest_end is not None and entry - latest_end >= gap_ns:
            yield current
            current, latest_end = [], None
        current.append(record)
        latest_end = end if latest_end is None else max(latest_end, end)
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
        f"max {max(f['ready'] - f['entry'] for f in clocks) * us:.1f}" + "".join(
            f"; {name} median {statistics.median(f['routed'] - f['entry'] for f in group) * us:.1f} us routing in the "
            f"CTA (self-routing; again, warm: "
            f"{statistics.median(f['routed_again'] - f['routed'] for f in group) * us:.1f} us), "
            f"{statistics.median(f['ready'] - f['routed_again'] for f in group) * us:.1f} us the wait"
            for name, group in (("early CTAs", [f for f in clocks if f["early"]]),
                                ("the others", [f for f in clocks if not f["early"]])) if group),
        f"  K loops start {(first_loop - start) * us:.1f} to {(max(s for s, _ in streaming) - start) * us:.1f} us in, "
        f"last ends at {(last_loop - start) * us:.1f}; loop median {statistics.median(loops) * us:.1f} us "
        f"(p10 {percentile(loops, 0.1) * us:.1f}, p90 {percentile(loops, 0.9) * us:.1f}); after the loop "
        f"median {statistics.median(f['done'] - f['k_loop_end'] for f in clocks) * us:.1f} us",
        f"  a CTA's weight stream median {statistics.median(rates):.1f} GB/s (p10 {percentile(rates, 0.1):.1f}, "
        f"p90 {percentile(rates, 0.9):.1f}); {most_at_once(streaming)} loops at once at most; all weights "
        f"{weight_bytes / 1e6:.1f} MB over the loops' span {(last_loop - first_loop) * us:.1f} us = "
        f"{weight_bytes / max(1, last_loop - first_loop) / 1e3:.2f} TB/s",
    ])


def summarise_items(launch):
    """The specialised tile's items of one launch: roles 0 (producer), 1 and 2 (consumers)."""
    consumers = [f for _, f in launch if f["role"] > 0]
    producer = [f for _, f in launch if f["role"] == 0]
    if not consumers:
        return "  no consumer clocks"
    us = 1e-3
    start = min(f["start"] for _, f in launch)
    end = max(f["end"] for _, f in launch)
    loops = [f["mark"] - f["start"] for f in consumers]
    epilogues = [f["end"] - f["mark"] for f in consumers]
    per_k_tile = [(f["mark"] - f["start"]) / max(1, f["k_tiles"]) for f in consumers]
    # Between a consumer's items: from one item's end to the next one's start, per CTA and role.
    gaps, by_role = [], defaultdict(list)
    for f in consumers:
        by_role[(f["block"], f["role"])].append(f)
    for items in by_role.values():
        items.sort(key=lambda f: f["start"])
        gaps += [b["start"] - a["end"] for a, b in zip(items, items[1:])]
    # The two consumers of an item end their K loops how far apart.
    pairs = defaultdict(dict)
    for f in consumers:
        pairs[(f["block"], f["item"])][f["role"]] = f["mark"]
    skews = [abs(m[1] - m[2]) for m in pairs.values() if 1 in m and 2 in m]
    fp8, cols, gated = consumers[0]["fp8"], consumers[0]["cols"], consumers[0]["gated"]
    depth = 128 if fp8 else 64  # K a tile
    busy = sum(loops) + sum(epilogues)
    lines = [
        f"  {len(pairs)} items on {len({f['block'] for f in consumers})} CTAs over {(end - start) * us:.1f} us; "
        f"a consumer's time: K loops {sum(loops) / busy:.0%}, epilogues {sum(epilogues) / busy:.0%} "
        f"(between items, not in that sum: median {statistics.median(gaps) * us if gaps else 0:.2f} us)",
        f"  an item's K loop median {statistics.median(loops) * us:.2f} us (p90 {percentile(loops, 0.9) * us:.2f}), "
        f"a K tile {statistics.median(per_k_tile):.0f} ns: {2 * 64 * cols * depth / statistics.median(per_k_tile) / 1e3:.2f} "
        f"TFLOP/s a consumer; epilogue median {statistics.median(epilogues) * us:.2f} us "
        f"(p90 {percentile(epilogues, 0.9) * us:.2f}); the consumers' K loops end "
        f"{statistics.median(skews) * us if skews else 0:.2f} us apart (median)",
    ]
    if producer:
        issue = [f["end"] - f["start"] for f in producer]
        rows_wait = [f["mark"] - f["start"] for f in producer]
        lines.append(f"  the producer: an item's stages issued in {statistics.median(issue) * us:.2f} us (median, "
                     f"its waits for room included); {'waiting for GEMM1 rows median ' + format(statistics.median(rows_wait) * us, '.2f') + ' us' if not gated else 'no rows to wait for (GEMM1)'}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", help="the bench's output (default: stdin)")
    parser.add_argument("--gap", type=float, default=2.0,
                        help="microseconds from the end of a kernel's launch to the start of its next")
    parser.add_argument("--last", type=int, default=2, help="launches of each kernel to print, the last ones")
    args = parser.parse_args()
    lines = open(args.file) if args.file else sys.stdin
    kernels = defaultdict(list)
    for kind, fields in parse(lines):
        # (entry and until: the span launches() splits by; the specialised tile is 128 rows)
        if kind == "item_clock":
            key = ("item", fields["gated"], 128, fields["cols"], fields["fp8"])
            fields = dict(fields, entry=fields["start"], until=fields["end"])
        else:
            key = ("cta", fields["gated"], fields["rows"], fields["cols"], fields["fp8"])
            fields = dict(fields, until=fields["done"] if kind == "cta_clock" else fields["exit"])
        kernels[key].append((kind, fields))
    if not kernels:
        sys.exit("no clock lines: was the bench built with timing-cta-clock.patch?")
    for (family, gated, rows, cols, fp8), records in sorted(kernels.items()):
        split = list(launches(records, args.gap * 1e3))
        name = f"{'GEMM1' if gated else 'GEMM2'} {rows} x {cols} {'e4m3' if fp8 else 'bf16'}"
        for index, launch in enumerate(split[-args.last:], start=max(0, len(split) - args.last)):
            print(f"{name}, launch {index + 1} of {len(split)}:")
            print(summarise_items(launch) if family == "item" else summarise(launch))


if __name__ == "__main__":
    main()
