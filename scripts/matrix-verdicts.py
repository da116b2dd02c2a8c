#!/usr/bin/env python3
"""Issue 15's first goal, judged replica by replica (BENCHMARKS.md, "Goal 1 on 9 replicas").

Reads the JSON of `kvroute-sim matrix --json PEERS.json` (kvroute and its peers, one router)
and prints, per cell, kvroute's TTFT p95 against the peer with the lowest median: the
medians [min-max] over the replicas, the median of kvroute / that peer per replica, and in
how many replicas kvroute's p95 was the lower. With a second file (`--json KV.json` of a run
with `--policy kvroute` on another topology, the same workloads, loads and replica count),
that run's kvroute is judged against the first file's peers, replica by replica: replica k
of every run replays the same arrivals.

Verdict per cell, a sign test on the replicas (n of them, w won by kvroute): "kvroute" when
w >= n - n//4, "peer" when w <= n//4, "tie" otherwise (9 replicas: 7 or more won, 2 or fewer
won). A tie means the replicas do not tell the two apart, whatever the medians say.

Usage: python3 scripts/matrix-verdicts.py PEERS.json [KV.json]
"""
import json
import statistics
import sys


def cells(path):
    with open(path) as f:
        data = json.load(f)
    return {(c["workload"], c["load_pct"]): c for c in data["cells"]}


def p95s(cell, policy):
    return [r["ttft_ms"]["p95"] for rep in cell["replicas"] for r in rep if r["policy"] == policy]


def steady_p95(cell, policy):
    return next((r["ttft_ms"]["p95"] for r in cell.get("steady", []) if r["policy"] == policy), None)


def fmt(xs):
    return f"{statistics.median(xs):,.1f} [{min(xs):,.1f}–{max(xs):,.1f}]"


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    peers = cells(sys.argv[1])
    mine = cells(sys.argv[2]) if len(sys.argv) == 3 else peers
    print("| cell | kvroute | best peer (by median) | kvroute / peer, per replica (median) | kvroute lower in | verdict | steady: kvroute / peer |")
    print("|---|---|---|---|---|---|---|")
    tally = {"kvroute": 0, "tie": 0, "peer": 0}
    for key, cell in peers.items():
        if key not in mine:
            continue
        kv = p95s(mine[key], "kvroute")
        names = sorted({r["policy"] for rep in cell["replicas"] for r in rep} - {"kvroute", "oracle"})
        if not kv or not names:
            continue
        best = min(names, key=lambda p: statistics.median(p95s(cell, p)))
        peer = p95s(cell, best)
        if len(kv) != len(peer):
            sys.exit(f"{key}: {len(kv)} replicas of kvroute against {len(peer)} of {best}")
        n = len(kv)
        won = sum(a < b for a, b in zip(kv, peer))
        verdict = "kvroute" if won >= n - n // 4 else "peer" if won <= n // 4 else "tie"
        tally[verdict] += 1
        ratio = statistics.median(a / b for a, b in zip(kv, peer))
        sk, sp = steady_p95(mine[key], "kvroute"), steady_p95(cell, best)
        steady = f"{sk:,.1f} / {sp:,.1f}" if sk is not None and sp is not None else "-"
        print(f"| {key[0]} {key[1]}% | {fmt(kv)} | {best} {fmt(peer)} | {ratio:.3f} | {won} of {n} | {verdict} | {steady} |")
    print(f"\nkvroute's: {tally['kvroute']}, ties: {tally['tie']}, the peer's: {tally['peer']}")


main()
