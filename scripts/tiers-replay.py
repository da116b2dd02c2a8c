#!/usr/bin/env python3
"""Price tiers in replay (BENCHMARKS.md, "Price tiers with spillover").

A workload at RATE req/s on all-H100 fleets and on 4 A100 (tier 0, cheap) + k H100 (tier 1)
fleets, kvroute with and without `tiers` (objective TTFT <= OBJECTIVE_MS, default 500 ms),
seeds 0-2: objective attainment (share of the requests within it, to a tenth of a point: 99.6
and 100 differ by four requests of 1,024), TTFT p95, ITL p95, the premium
tier's share of requests, and $/Mtok = fleet $/h / (input + output tokens per hour): the
attainment, share and cost as `kvroute-sim replay --price` reports them. WORKLOAD: `rag`
(prefill-heavy: 4,800-token prompts, 200 out; default) or
`chat` (decode-heavy: 128 system prompts of 512 tokens, 128-token questions, 1,024 out;
4,096 requests), where the A100's gap to the H100 is memory bandwidth rather than compute.
Prices: USD per GPU-hour, default the middle of the 2026 "specialty provider" on-demand
ranges (A100 80GB $1.10-1.50, H100 SXM $2.50-3.50; mercatus-ai.com, "Cloud GPU pricing
2026"); override with A100_PRICE / H100_PRICE; ALSO_PRICES=0.80,4.00 prices the same runs
at a second pair (A100, H100) in two more columns.

The tiered runs give each tier's sequence slots (`tiers.max_num_seqs`, vLLM's defaults the
simulator's profiles follow: 256 on the A100, 1024 on the H100); SLOTS=none leaves them out.

Steady state: the default traces end before the fleets' KV caches fill (chat) or before a
fleet reaches what it sustains (rag); PER_GROUP=96 replays chat three times as long (12,288
requests) and DOCUMENTS=384 gives rag 3,072 requests over 384 documents (the generator makes
8 queries per document unless QUERIES says how many: QUERIES=3072 replays the 128 documents
three times as long). BENCHMARKS.md, "Tiers in steady state".

COLD_S=S reports the steady state alone: the requests arriving after S seconds, their
attainment, latencies, GPU shares and $/Mtok (their tokens over their own span), as `replay
--cold-s S --price ...` does. Without it every figure is the whole run from a cold fleet.

FLEETS picks the fleets instead of the default set: `0+3,2+2` is 3 H100s, then 2 A100 + 2
H100 untiered and tiered; ROUTING=tiered keeps only the tiered rows.

TOPOLOGY adds replay's gateway-topology arguments to every run (e.g. the production topology
`--gateways 2 --workers 8 --share-gateways ...`). SHARE sets `tiers.objective_share`, the share of the objective the tier rule plans for
(default: the filter's, 0.6; 1 is the rule before 2026-11-29). SEEDS (default 0,1,2) picks
the seeds; PER_SEED=1 also writes each seed's attainment and its count of late requests to stderr.
COST='{"kv_pressure_ms": 1000}' gives every run (tiered or not) these `cost` settings.

Usage: [SIM=path] [SLOTS=none] [FLEETS=0+3,2+2] [PER_GROUP=96] [DOCUMENTS=384] [QUERIES=3072] [COLD_S=30] [OBJECTIVE_MS=500] [SHARE=0.6] [SEEDS=0,1,2] [TOPOLOGY="…"] [COST='{…}'] python3 scripts/tiers-replay.py RATE [WORKLOAD]   (needs `cargo build --release -p kvroute-sim`)
"""
import json, os, subprocess, statistics, sys, tempfile
SIM = os.environ.get("SIM", "target/release/kvroute-sim")
WORKLOADS = {
    "rag": ["--workload", "rag", "--groups", os.environ.get("DOCUMENTS", "128")]
           + (["--queries", os.environ["QUERIES"]] if "QUERIES" in os.environ else []),
    "chat": ["--workload", "shared-prefix", "--system-tokens", "512", "--question-tokens", "128",
             "--output-tokens", "1024", "--groups", "128", "--per-group", os.environ.get("PER_GROUP", "32")],
}
PRICE = {"a100-80g": float(os.environ.get("A100_PRICE", 1.30)), "h100-80g": float(os.environ.get("H100_PRICE", 3.00))}
# ALSO_PRICES="0.80,4.00": a second pair (A100, H100) priced from the same runs, in two more columns.
ALSO = [float(x) for x in os.environ["ALSO_PRICES"].split(",")] if "ALSO_PRICES" in os.environ else None
OBJECTIVE_MS = float(os.environ.get("OBJECTIVE_MS", 500))
SHARE = os.environ.get("SHARE")
COST = json.loads(os.environ["COST"]) if "COST" in os.environ else None  # `cost` settings for every run
TOPOLOGY = os.environ.get("TOPOLOGY", "").split()
COLD_S = os.environ.get("COLD_S")
SEEDS = [int(x) for x in os.environ.get("SEEDS", "0,1,2").split(",")]
os.makedirs("target/tiers", exist_ok=True)
WORK = tempfile.mkdtemp(prefix="run-", dir="target/tiers")  # this run's own files
def cfg(n_cheap, n_prem, tiered):
    doc = {"cost": COST} if COST else {}
    if tiered:
        eps = {f"127.0.0.1:{8001 + n_cheap + i}": 1 for i in range(n_prem)}
        tiers = {"endpoints": eps, "ttft_objective_ms": OBJECTIVE_MS}
        if SHARE is not None:
            tiers["objective_share"] = float(SHARE)
        if os.environ.get("SLOTS") != "none":
            tiers["max_num_seqs"] = [256, 1024]
        doc["tiers"] = tiers
    if not doc: return None
    path = f"{WORK}/cfg-{n_cheap}-{n_prem}-{int(tiered)}.json"
    json.dump(doc, open(path, "w"))
    return path
def run(n_cheap, n_prem, tiered, rate, seed):
    parts = ([f"{n_cheap}xa100-80g:llama-3.1-8b"] if n_cheap else []) + ([f"{n_prem}xh100-80g:llama-3.1-8b"] if n_prem else [])
    args = [SIM, "replay", "--fleet", ",".join(parts), *WORKLOADS[workload], "--rate", str(rate), "--seed", str(seed),
            "--policy", "kvroute", "--json", f"{WORK}/run.json",
            "--price", f"a100-80g={PRICE['a100-80g']},h100-80g={PRICE['h100-80g']}", "--ttft-slo-ms", f"{OBJECTIVE_MS:g}"]
    args += TOPOLOGY
    if COLD_S: args += ["--cold-s", COLD_S]
    c = cfg(n_cheap, n_prem, tiered)
    if c: args += ["--router-config", c]
    subprocess.run(args, check=True, capture_output=True)
    doc = json.load(open(f"{WORK}/run.json"))
    if COLD_S:  # the steady state alone: the requests arriving after COLD_S seconds
        r, c = doc["phases"]["steady"][0], doc["phases"]["steady_cost"]["runs"][0]
    else:
        r, c = doc["runs"][0], doc["cost"]["runs"][0]
    prem = c["share_by_gpu"].get("h100-80g", 0.0)
    also = None
    if ALSO:  # the same tokens an hour, the fleet priced at the second pair
        usd_h = n_cheap * PRICE["a100-80g"] + n_prem * PRICE["h100-80g"]
        also = c["usd_per_mtok"] * (n_cheap * ALSO[0] + n_prem * ALSO[1]) / usd_h
    late = round((1 - c["objective_met"]) * r["requests"])  # objective_met is late / requests, unrounded
    return c["objective_met"], r["ttft_ms"]["p95"], prem, c["usd_per_mtok"], r["itl_ms"]["p95"], also, late, r["requests"]
rate = float(sys.argv[1])
workload = sys.argv[2] if len(sys.argv) > 2 else "rag"
if workload not in WORKLOADS:
    sys.exit(f"unknown workload {workload!r}: one of {', '.join(WORKLOADS)}")
tier_note = (f", tiers.objective_share {SHARE}" if SHARE is not None else "") + (f", cost {json.dumps(COST)}" if COST else "") + \
    "".join(f", {k} {os.environ[k]}" for k in {"rag": ("DOCUMENTS", "QUERIES"), "chat": ("PER_GROUP",)}[workload] if k in os.environ) + (f", {' '.join(TOPOLOGY)}" if TOPOLOGY else "")
tier_note += f", steady state: requests arriving after {COLD_S} s" if COLD_S else ", whole run from a cold fleet"
print(f"{workload} at {rate:g} req/s, objective TTFT ≤ {OBJECTIVE_MS:g} ms{tier_note}, seeds {','.join(map(str, SEEDS))}, medians [min–max]")
also_head = f" $/h at {ALSO[0]:.2f} + {ALSO[1]:.2f} | $/Mtok at those |" if ALSO else ""
print(f"| fleet | routing | attainment (TTFT ≤ {OBJECTIVE_MS:g} ms) | TTFT p95 | ITL p95 | premium share of requests | $/h | $/Mtok (in+out) |{also_head}\n|---|---|---|---|---|---|---|---|{'---|---|' if ALSO else ''}")
def fleets():
    """The rows: FLEETS (e.g. `0+3,2+2`: A100s + H100s, each mixed fleet untiered and
    tiered) or the default set."""
    if "FLEETS" not in os.environ:
        rows = [(0, 3, False), (0, 4, False), (0, 5, False), (4, 4, False), (4, 4, True), (4, 3, False), (4, 3, True), (4, 2, False), (4, 2, True)]
    else:
        rows = []
        for f in os.environ["FLEETS"].split(","):
            a, h = (int(x) for x in f.split("+"))
            rows += [(a, h, False)] + ([(a, h, True)] if a and h else [])
    if os.environ.get("ROUTING") == "tiered":  # the tiered rows alone (comparing builds)
        rows = [r for r in rows if r[2]]
    return rows
for n_cheap, n_prem, tiered in fleets():
    rs = [run(n_cheap, n_prem, tiered, rate, s) for s in SEEDS]
    col = list(zip(*rs))
    m = lambda v, f: f"{f.format(statistics.median(v))} [{f.format(min(v))}–{f.format(max(v))}]"
    name = " + ".join(x for x in [f"{n_cheap} A100" if n_cheap else "", f"{n_prem} H100" if n_prem else ""] if x)
    usd_h = n_cheap * PRICE["a100-80g"] + n_prem * PRICE["h100-80g"]
    if os.environ.get("PER_SEED"):  # each seed's attainment, in SEEDS order, on a line of its own
        print(f"  {name} {'tiered' if tiered else 'kvroute'}: " + ", ".join(f"{100*a:.1f}% ({late} of {n} late)" for a, late, n in zip(col[0], col[6], col[7])), file=sys.stderr, flush=True)
    print(f"| {name} | {'tiered' if tiered else 'kvroute'} | {m([100*a for a in col[0]], '{:.1f}')}% | {m(col[1], '{:.0f}')} ms | {m(col[4], '{:.1f}')} ms | {m([100*p for p in col[2]], '{:.0f}')}% | {usd_h:.2f} | {m(col[3], '{:.3f}')} |" + (f" {n_cheap * ALSO[0] + n_prem * ALSO[1]:.2f} | {m(col[5], '{:.3f}')} |" if ALSO else ""), flush=True)
