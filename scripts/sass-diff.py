#!/usr/bin/env python3
"""Kernel by kernel, whether two builds of a CUDA object compile to the same SASS.

Compares each kernel's instructions with addresses and encodings left out; kernels pair up by
demangled name, after removing each --drop text from both (a template gaining a defaulted
argument renames every kernel of it: --drop ', false>' pairs Config<..., false> with
Config<...>). Prints per kernel "same", the number of instruction lines that differ (a unified
diff's), or on which side it alone is. Needs cuobjdump and c++filt on PATH.
Usage: python3 scripts/sass-diff.py BEFORE.o AFTER.o [--drop TEXT ...]
"""
import argparse
import difflib
import re
import subprocess


def kernels(path, drops):
    sass = subprocess.run(["cuobjdump", "--dump-sass", path], capture_output=True, text=True, check=True).stdout
    parts = re.split(r"\n\s*Function : (\S+)\n", sass)
    names = subprocess.run(["c++filt"], input="\n".join(parts[1::2]), capture_output=True, text=True,
                           check=True).stdout.splitlines()
    found = {}
    for name, body in zip(names, parts[2::2]):
        for drop in drops:
            name = name.replace(drop, ">" if drop.endswith(">") else "")
        # "/*0040*/  IMAD R1, ... ;  /* 0x... */": the instruction only.
        found[name] = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split(";")[0].strip()
                       for line in body.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--drop", action="append", default=[], help="text removed from kernel names before pairing")
    args = parser.parse_args()
    before, after = kernels(args.before, args.drop), kernels(args.after, args.drop)
    for name in sorted(before.keys() | after.keys()):
        if name not in after:
            print(f"only before  {name}")
        elif name not in before:
            print(f"only after   {name}")
        elif before[name] == after[name]:
            print(f"same         {name}")
        else:
            changed = sum(1 for line in difflib.unified_diff(before[name], after[name], lineterm="", n=0)
                          if line[:1] in "+-" and line[:3] not in ("+++", "---"))
            print(f"{changed:5d} differ  {name}")


if __name__ == "__main__":
    main()
