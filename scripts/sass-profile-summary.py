#!/usr/bin/env python3
"""Where a kernel's instructions and stall samples go, from the per-SASS-instruction CSV that
`SASS=FILE bash scripts/profile-gemm` writes (ncu's source page).

Lines executed equally often form one block of the code (a loop body, an epilogue branch), so
the lines are grouped by their execution count: per group its lines, its share of executed
instructions and of warp samples, and the stall reasons behind those samples. Then the
instructions with the most samples, with their own reasons.

Usage: python3 scripts/sass-profile-summary.py FILE.csv [--groups N] [--lines N]
"""
import argparse
import collections
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--groups", type=int, default=10, help="execution-count groups to print")
    parser.add_argument("--lines", type=int, default=15, help="instructions with the most samples to print")
    args = parser.parse_args()
    with open(args.csv, newline="") as source:
        rows = list(csv.reader(source))
    header_at = next((i for i, row in enumerate(rows) if "Instructions Executed" in row), None)
    if header_at is None:
        sys.exit(f"{args.csv}: no 'Instructions Executed' column (not an ncu source-page CSV?)")
    # The page of one kernel; ncu may print it more than once (a "Kernel Name" row starts each).
    blocks = [i for i, row in enumerate(rows) if row[:1] == ["Kernel Name"]]
    end = next((i for i in blocks if i > header_at), len(rows))
    if blocks:
        print(f"{rows[blocks[0]][1][:160]}" + (f" (the first of {len(blocks)} pages)" if len(blocks) > 1 else ""))
    header, lines = rows[header_at], rows[header_at + 1:end]
    column = {name: i for i, name in enumerate(header)}
    stalls = [name for name in header if name.startswith("stall_") and "Not" not in name]

    def value(line, name):
        return number(line[column[name]]) if column[name] < len(line) else 0.0

    executed = [value(line, "Instructions Executed") for line in lines]
    samples = [value(line, "Warp Stall Sampling (All Samples)") for line in lines]
    total_executed, total_samples = sum(executed) or 1.0, sum(samples) or 1.0
    print(f"{len(lines)} SASS lines, {sum(executed):.0f} warp instructions executed, {sum(samples):.0f} samples")

    def reasons(members, weight):
        counts = collections.Counter()
        for i in members:
            for name in stalls:
                counts[name[len("stall_"):]] += value(lines[i], name)
        return ", ".join(f"{name} {100 * n / weight:.1f}" for name, n in counts.most_common(4) if n)

    groups = collections.defaultdict(list)
    for i, count in enumerate(executed):
        if count > 0:
            groups[count].append(i)
    print(f"\nBy execution count (% of all instructions / of all samples; reasons in % of all samples):")
    ranked = sorted(groups.items(), key=lambda item: -(item[0] * len(item[1]) + total_executed / total_samples *
                                                        sum(samples[i] for i in item[1])))
    for count, members in ranked[:args.groups]:
        share = 100 * count * len(members) / total_executed
        sampled = sum(samples[i] for i in members)
        print(f"  x{count:>11.0f}  {len(members):5d} lines  {share:5.1f}% instr  {100 * sampled / total_samples:5.1f}% samples"
              f"  {reasons(members, total_samples)}")
    print(f"\nInstructions with the most samples (reasons in % of the line's samples):")
    for i in sorted(range(len(lines)), key=lambda i: -samples[i])[:args.lines]:
        text = lines[i][column["Source"]].strip() if "Source" in column else ""
        print(f"  {100 * samples[i] / total_samples:5.1f}%  x{executed[i]:>11.0f}  {text[:64]:64}  "
              f"{reasons([i], samples[i] or 1.0)}")


if __name__ == "__main__":
    main()
