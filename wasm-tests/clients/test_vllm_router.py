"""vLLM's own router (`vllm-router --policy cache_aware`, pinned in `vllm-router.txt`) in front
of `kvroute-sim serve --servers 4`: the simulator's `/tokenize` is enough for its token path.

Why: `cache_aware` keys its prefix tree on token ids. For each inference body it asks every
worker (measured with a logging proxy: N workers, N calls of each) for
`/v1/{chat/}completions/render` (a vLLM endpoint that `vllm serve` leaves disabled unless
scale-out endpoints are enabled, so a default server and the simulator answer 404), then for
`/tokenize`; without usable tokens it records the `missing_tokens` outcome and routes like
round-robin, which would make the simulator useless for comparing kvroute with it.

Claims checked, reading the router's Prometheus counters:
- `vllm_router_prefix_routing_decisions_total` has no `missing_tokens` outcome, and its
  outcomes add up to the requests sent;
- `vllm_router_kv_routing_inputs_total` counts tokenize results only (no `empty_input`,
  `unsupported_input`, ...);
- repeats of a prefix are `prefix_hit`s, and the servers' own prefix caches agree
  (`vllm:prefix_cache_hits_total` > 0);
- `/tokenize` counts what inference reports as `prompt_tokens`, and `/detokenize` gives the
  prompt back.

Run from the repository root: `.venv/bin/python wasm-tests/clients/test_vllm_router.py`
(`KVROUTE_SIM` and `VLLM_ROUTER` name the binaries; `make test-vllm-router` builds and
installs both). The last line reads `N passed, N failed`.
"""

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from stack import ROOT, _die_with_parent, _tail, _wait, free_port, free_run, http_get  # noqa: E402

SERVERS = 4
GROUPS = 8
PER_GROUP = 6
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango").split()


LOG_DIR = tempfile.mkdtemp(prefix="kvroute-vllm-router-")


def _spawn_logged(procs, name, argv):
    log = os.path.join(LOG_DIR, f"{name}.log")
    with open(log, "wb") as out:
        procs.append(subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT, preexec_fn=_die_with_parent))
    return log


def post(base, path, body, timeout=30.0):
    req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def counters(port, path="/metrics"):
    """Prometheus text → {(name, frozenset(labels)): value} for the sample lines."""
    out = {}
    for line in http_get(port, path)[1].splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? ([-+0-9.eE]+|NaN)$", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def by_label(samples, name, label):
    return {dict(k[1]).get(label): v for k, v in samples.items() if k[0] == name}


def prefix(group):
    r = [(group * 7 + i * 13) % len(WORDS) for i in range(300)]
    return " ".join(WORDS[i] for i in r)


def request(i):
    """Group `i % GROUPS`: alternately a completion and a chat sharing that group's prefix."""
    g = i % GROUPS
    if (i // GROUPS) % 2 == 0:
        return "/v1/completions", {"model": MODEL, "prompt": f"{prefix(g)} question {i}", "max_tokens": 4}
    return "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": prefix(g)}, {"role": "user", "content": f"question {i}"}]}


def check_tokenize_agrees(server):
    base = f"http://127.0.0.1:{server}"
    text = "The quick brown fox jumps over the lazy dog, twice."
    _, tok = post(base, "/tokenize", {"model": MODEL, "prompt": text})
    _, done = post(base, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
    assert tok["count"] == len(tok["tokens"]) == done["usage"]["prompt_tokens"], (tok, done["usage"])
    _, back = post(base, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
    assert back["prompt"] == text, back
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    _, tok = post(base, "/tokenize", {"model": MODEL, "messages": messages})
    _, done = post(base, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1})
    assert tok["count"] == done["usage"]["prompt_tokens"], (tok["count"], done["usage"])


def check_router(router, metrics_port, servers):
    before = [counters(p) for p in servers]
    sent = GROUPS * PER_GROUP
    # Waves of GROUPS concurrent requests: the first wave is all cold (the router spreads it by
    # load), every later one repeats the prefixes.
    for wave in range(PER_GROUP):
        with concurrent.futures.ThreadPoolExecutor(GROUPS) as pool:
            futures = [pool.submit(post, router, *request(wave * GROUPS + g)) for g in range(GROUPS)]
            for f in futures:
                status, body = f.result()
                assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    r = counters(metrics_port)
    outcomes = by_label(r, "vllm_router_prefix_routing_decisions_total", "outcome")
    inputs = by_label(r, "vllm_router_kv_routing_inputs_total", "result")
    print(f"  router outcomes {outcomes}; token inputs {inputs}")
    assert outcomes.get("missing_tokens", 0) == 0, f"missing_tokens recorded: {outcomes}"
    assert sum(outcomes.values()) == sent, f"{sum(outcomes.values())} decisions for {sent} requests"
    assert outcomes.get("prefix_hit", 0) >= sent - 2 * GROUPS, f"repeats were not prefix hits: {outcomes}"
    assert set(inputs) == {"tokenize"} and inputs["tokenize"] == sent * SERVERS, f"token inputs: {inputs}"
    after = [counters(p) for p in servers]

    def total(samples, name):
        return sum(v for k, v in samples.items() if k[0] == name)

    served = [total(a, "vllm:request_success_total") - total(b, "vllm:request_success_total")
              for a, b in zip(after, before)]
    hits = sum(total(a, "vllm:prefix_cache_hits_total") - total(b, "vllm:prefix_cache_hits_total")
               for a, b in zip(after, before))
    queries = sum(total(a, "vllm:prefix_cache_queries_total") - total(b, "vllm:prefix_cache_queries_total")
                  for a, b in zip(after, before))
    print(f"  requests per server {served}; server-side prefix-cache hit rate {hits / queries:.1%}")
    assert sum(served) == sent, served
    assert hits > 0, "the servers' prefix caches saw no hit"


def main():
    started = time.monotonic()
    sim = os.environ.get("KVROUTE_SIM", os.path.join(ROOT, "target/release/kvroute-sim"))
    router_bin = os.environ.get("VLLM_ROUTER", os.path.join(ROOT, ".venv/bin/vllm-router"))
    procs, logs = [], []
    passed = failed = 0
    try:
        # The simulator's admin listener defaults to base - 1, which free_run does not check.
        base, sim_admin = free_run(SERVERS), free_port()
        servers = [base + i for i in range(SERVERS)]
        logs.append(_spawn_logged(procs, "sim", [sim, "serve", "--servers", str(SERVERS), "--host",
                                                 "127.0.0.1", "--base-port", str(base),
                                                 "--admin-port", str(sim_admin)]))
        _wait("kvroute-sim", lambda: all(http_get(p, "/health")[0] == 200 for p in servers), procs, logs)
        port, metrics_port = free_port(), free_port()
        logs.append(_spawn_logged(procs, "vllm-router", [
            router_bin, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", "warning", "--worker-urls", *[f"http://127.0.0.1:{p}" for p in servers]]))
        _wait("vllm-router", lambda: http_get(port, "/v1/models")[0] == 200, procs, logs)
        for name, check in [("tokenize_counts_what_inference_reports", lambda: check_tokenize_agrees(servers[0])),
                            ("cache_aware_records_no_missing_tokens", lambda: check_router(
                                f"http://127.0.0.1:{port}", metrics_port, servers))]:
            try:
                check()
                passed += 1
                print(f"ok   {name}")
            except Exception as e:  # a failed claim, reported with the logs
                failed += 1
                print(f"FAIL {name}: {e!r}")
                for log in logs:
                    print(f"--- {log}\n{_tail(log)}")
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
    if not failed:
        shutil.rmtree(LOG_DIR, ignore_errors=True)
    print(f"{time.monotonic() - started:.1f} s")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
