#!/usr/bin/env python3
"""kvroute against itself across builds or settings, replica by replica (BENCHMARKS.md, e.g.
"Placements that are news, sent by the workers" and "The workers' POSTs, bounded").

Reads the JSON of two or more `kvroute-sim matrix --json F` runs with the same workloads,
loads and replica count (replica k of every run replays the same arrivals) and prints, per
cell, kvroute's median TTFT p95 in the first run, then for each other run its median, the
median of its per-replica ratios to the first run, and in how many replicas it was lower.

Usage: python3 scripts/matrix-compare.py BASE.json OTHER.json [OTHER.json ...] [--policy P]
"""
import json
import statistics
import sys


def cells(path, policy):
    doc = json.load(open(path))
    out = {}
    for c in doc["cells"]:
        p95 = [r["ttft_ms"]["p95"] for rep in c["replicas"] for r in rep if r["policy"] == policy]
        if p95:
            out[(c["workload"], c["load_pct"])] = p95
    return out


def main(argv):
    policy = "kvroute"
    if "--policy" in argv:
        i = argv.index("--policy")
        if i + 1 >= len(argv):
            sys.exit("--policy needs a policy name")
        policy = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if len(argv) < 2:
        sys.exit(__doc__)
    runs = [cells(p, policy) for p in argv]
    if not runs[0]:
        sys.exit(f"{argv[0]}: no {policy} runs")
    print("| cell | " + " | ".join(p.split("/")[-1] for p in argv) + " |")
    print("|---" * (len(argv) + 1) + "|")
    for key, base in runs[0].items():
        row = [f"{statistics.median(base):.1f}"]
        for other in runs[1:]:
            if key not in other or len(other[key]) != len(base):
                row.append("-")
                continue
            ratios = [o / b for b, o in zip(base, other[key])]
            lower = sum(o < b for b, o in zip(base, other[key]))
            row.append(f"{statistics.median(other[key]):.1f} ({statistics.median(ratios):.3f}, lower in {lower} of {len(base)})")
        print(f"| {key[0]} {key[1]}% | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
