#!/usr/bin/env python3
"""Summarises live runs (`kvroute-sim bench` JSON) as one Markdown table: per workload,
phase, router and worker count, the median and range over runs of the prefix hit rate and
TTFT p50/p95/p99, and failed requests. Used by scripts/demo.sh and scripts/bench-live.sh.

Input: an index file, one run per line, tab-separated:
    workload  phase  router  workers  run  json-path  run-position-in-json
where `phase` is `cold` or `steady` (a figure's regime), and the JSON is what `bench --json`
or KVROUTE_BENCH_PHASES_JSON wrote ({"runs": [...]}).

With --checks, also prints issue 11's live goals as measured here: kvroute at each worker
count within 3 points of one worker's hit rate (every phase), with a TTFT p95 at least 4×
lower than round-robin at the same count (steady state), and at 8 workers at least as good
as the single-process peer (every phase).
"""

import argparse
import json
import statistics
import sys
from collections import OrderedDict


def load(index_path):
    rows = OrderedDict()
    with open(index_path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            workload, phase, router, workers, _run, path, pos = line.split("\t")
            with open(path) as j:
                run = json.load(j)["runs"][int(pos)]
            rows.setdefault((workload, phase, router, workers), []).append(run)
    return rows


def fmt(values, unit="", digits=0):
    med = statistics.median(values)
    one = lambda v: f"{v:.{digits}f}{unit}"
    if len(values) == 1 or min(values) == max(values):
        return one(med)
    return f"{one(med)} [{one(min(values))}–{one(max(values))}]"


def metrics(runs):
    return {
        "hit": [r["prefix_hit_rate"] * 100 for r in runs],
        "p50": [r["ttft_ms"]["p50"] for r in runs],
        "p95": [r["ttft_ms"]["p95"] for r in runs],
        "p99": [r["ttft_ms"]["p99"] for r in runs],
        "failed": [r["failed"] for r in runs],
        "requests": [r["requests"] for r in runs],
    }


def table(rows):
    out = [
        "| workload | phase | router | Envoy workers | runs | requests | prefix hit rate | TTFT p50 (ms) | TTFT p95 (ms) | TTFT p99 (ms) | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, phase, router, workers), runs in rows.items():
        m = metrics(runs)
        out.append(
            f"| {workload} | {phase} | {router} | {workers} | {len(runs)} | {fmt(m['requests'])} "
            f"| {fmt(m['hit'], '%', 1)} | {fmt(m['p50'])} | {fmt(m['p95'])} | {fmt(m['p99'])} "
            f"| {fmt(m['failed'])} |"
        )
    return "\n".join(out)


def checks(rows):
    """Issue 11's live goals, each as a line that says met or missed."""
    med = lambda key, what: statistics.median(metrics(rows[key])[what]) if key in rows else None
    lines = []
    groups = sorted({(w, p) for (w, p, _, _) in rows})
    for workload, phase in groups:
        one = med((workload, phase, "kvroute", "1"), "hit")
        peer = (workload, phase, "smg cache_aware", "-")
        for workers in sorted({k[3] for k in rows if k[:3] == (workload, phase, "kvroute")}, key=int):
            if workers == "1" or one is None:
                continue
            key = (workload, phase, "kvroute", workers)
            hit, p95 = med(key, "hit"), med(key, "p95")
            verdict = lambda ok: "met" if ok else "MISSED"
            lines.append(
                f"- {workload} {phase}, {workers} workers: hit {hit:.1f}% vs {one:.1f}% at 1 worker "
                f"({hit - one:+.1f} points, goal ≥ −3): {verdict(hit >= one - 3)}"
            )
            rr_p95 = med((workload, phase, "round-robin", workers), "p95")
            if phase == "steady" and rr_p95 is not None and p95 > 0:
                lines.append(
                    f"  TTFT p95 {p95:.0f} ms vs round-robin {rr_p95:.0f} ms at {workers} workers "
                    f"({rr_p95 / p95:.1f}× lower, goal ≥ 4×): {verdict(rr_p95 >= 4 * p95)}"
                )
            if workers == "8" and peer in rows:
                phit, pp95 = med(peer, "hit"), med(peer, "p95")
                lines.append(
                    f"  against smg cache_aware: hit {hit:.1f}% vs {phit:.1f}%, TTFT p95 {p95:.0f} vs "
                    f"{pp95:.0f} ms: {verdict(hit >= phit and p95 <= pp95)}"
                )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("index")
    ap.add_argument("--checks", action="store_true")
    a = ap.parse_args()
    rows = load(a.index)
    if not rows:
        sys.exit(f"{a.index}: no runs")
    print(table(rows))
    if a.checks:
        c = checks(rows)
        if c:
            print("\nIssue 11's live goals (medians):")
            print(c)


if __name__ == "__main__":
    main()
