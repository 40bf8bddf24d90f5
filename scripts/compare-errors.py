#!/usr/bin/env python3
"""Compares the GPU-vs-CPU relative errors that test_moe_gpu records in its XML report
(--gtest_output=xml; a property "relative_error <case>" a comparison) across variant trees: a
table of each case's error per tree, the first tree the reference, then how far each other
tree's errors moved (median and largest ratio). scripts/device-variant-check runs it under ERRORS.
The tests draw fresh random inputs on every run, so one case's ratio mixes the draw with the change;
the median over many cases is the figure that says whether a change moves the errors.

    python3 scripts/compare-errors.py errors-base.xml errors-variant.xml
"""
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

PREFIX = "relative_error "


def errors_of(path):
    """{(test, case): relative error} of one XML report."""
    errors = {}
    for testcase in ElementTree.parse(path).getroot().iter("testcase"):
        test = f"{testcase.get('classname')}.{testcase.get('name')}"
        for prop in testcase.iter("property"):
            name = prop.get("name", "")
            if name.startswith(PREFIX):
                errors[(test, name[len(PREFIX):])] = float(prop.get("value"))
    return errors


def tree_name(path):
    stem = Path(path).stem
    return stem[len("errors-"):] if stem.startswith("errors-") else stem


def main():
    paths = sys.argv[1:]
    if len(paths) < 1:
        sys.exit("usage: compare-errors.py REFERENCE.xml [OTHER.xml ...]")
    reports = [errors_of(path) for path in paths]
    names = [tree_name(path) for path in paths]
    cases = sorted(set().union(*reports))
    if not cases:
        sys.exit("no relative_error properties in " + ", ".join(paths))
    print("| test | case | " + " | ".join(names) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in names) + " |")
    for test, case in cases:
        reference = reports[0].get((test, case))
        cells = []
        for report in reports:
            value = report.get((test, case))
            if value is None:
                cells.append("-")
            elif report is reports[0] or not reference:
                cells.append(f"{value:.3e}")
            else:
                cells.append(f"{value:.3e} (x{value / reference:.2f})")
        print(f"| {test} | {case} | " + " | ".join(cells) + " |")
    for name, report in zip(names[1:], reports[1:]):
        ratios = [report[key] / reports[0][key] for key in cases if key in report and reports[0].get(key)]
        if ratios:
            print(f"\n{name} against {names[0]}: {len(ratios)} cases, error ratio median {statistics.median(ratios):.3f}, "
                  f"largest {max(ratios):.3f}; largest error {max(report.values()):.3e} "
                  f"({names[0]}: {max(reports[0].values()):.3e})")


if __name__ == "__main__":
    main()
