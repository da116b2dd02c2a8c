"""aiperf (pinned in `aiperf.txt`, its own venv `.venv/aiperf/`) through real Envoy + kvroute +
`kvroute-sim serve`, offline, with the tokenizer `sim_tokenizer.py` builds.

Claims checked after one aiperf run (streaming completions, random-corpus prompts of ISL tokens,
OSL tokens each, CONCURRENCY in flight):
- aiperf completed every request with no error;
- its client-side token counts (`total_isl`, `total_osl`, counted with the project's tokenizer)
  match the servers' own (`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, summed
  over the fleet) within 2%;
- the servers finished exactly the requests aiperf sent (nothing generated twice);
- kvroute made one decision per request and skipped none.

No network: the tokenizer is a local directory, and every HTTP(S) proxy variable points at a
closed port (loopback excepted), so a Hugging Face lookup fails instead of reaching the hub.

Completions, not chat: a chat prompt's server-side count adds the role, separators and 4
template tokens per message (`filter/core/src/request.rs`), which a bare-text client count does
not see (about 6 tokens a request).

Run from the repository root: `.venv/aiperf/bin/python wasm-tests/clients/test_bench_tool.py`
(`KVROUTE_SIM`, `KVROUTE_ENVOY`, `AIPERF` name the binaries). The last line reads `N passed, N failed`.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import sim_tokenizer  # noqa: E402
from stack import ROOT, Stack  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REQUESTS, CONCURRENCY, ISL, OSL = 64, 8, 512, 48
TOLERANCE = 0.02
OFFLINE_ENV = {
    "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "ALL_PROXY": "http://127.0.0.1:9",
    "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "all_proxy": "http://127.0.0.1:9",
    "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
}


def run_aiperf(stack, tokenizer, out):
    aiperf = os.environ.get("AIPERF", os.path.join(ROOT, ".venv/aiperf/bin/aiperf"))
    argv = [aiperf, "profile", "--model-names", MODEL, "--url", stack.gateway,
            "--endpoint-type", "completions", "--streaming", "--tokenizer", tokenizer,
            "--prompt-corpus", "random", "--isl", str(ISL), "--isl-stddev", "0",
            "--osl", str(OSL), "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--request-count", str(REQUESTS), "--concurrency", str(CONCURRENCY),
            "--random-seed", "1", "--workers-max", "2", "--ui-type", "none",
            # The gateway answers /metrics itself (404): scrape the servers instead.
            "--server-metrics", *[f"http://127.0.0.1:{p}/metrics" for p in stack.servers],
            "--output-artifact-dir", out]
    env = {**os.environ, **OFFLINE_ENV}
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=300)
    took = time.monotonic() - started
    if done.returncode != 0:
        raise AssertionError(f"aiperf exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    with open(os.path.join(out, "profile_export_aiperf.json")) as f:
        return json.load(f), took


def metric(export, name, stat="avg"):
    return export[name][stat]


def check(stack, work):
    tokenizer = os.path.join(work, "tokenizer")
    sim_tokenizer.self_check(sim_tokenizer.build(tokenizer))
    families = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"]
    before = {f: stack.fleet_metric(f) for f in families}
    kvroute_before = stack.stats()
    export, took = run_aiperf(stack, tokenizer, os.path.join(work, "aiperf"))
    server = {f: stack.fleet_metric(f) - before[f] for f in families}
    client_isl, client_osl = metric(export, "total_isl"), metric(export, "total_osl")
    completed = metric(export, "request_count")
    errors = export.get("error_summary") or []
    print(f"  aiperf: {took:.1f} s, {completed:.0f} requests, ISL {client_isl:.0f} / server "
          f"{server['vllm:prompt_tokens_total']:.0f} tokens, OSL {client_osl:.0f} / server "
          f"{server['vllm:generation_tokens_total']:.0f}, TTFT p50 "
          f"{metric(export, 'time_to_first_token', 'p50'):.1f} ms, ITL p50 "
          f"{metric(export, 'inter_token_latency', 'p50'):.2f} ms")
    assert not errors and completed == REQUESTS, f"completed {completed}, errors {errors}"
    for what, client, family in [("input", client_isl, "vllm:prompt_tokens_total"),
                                 ("output", client_osl, "vllm:generation_tokens_total")]:
        ratio = abs(client - server[family]) / server[family]
        assert ratio <= TOLERANCE, f"{what} tokens: client {client}, server {server[family]} ({ratio:.2%})"
    assert server["vllm:request_success_total"] == REQUESTS, server
    assert metric(export, "inter_token_latency", "p50") > 0, "ITL reads 0: tokens were merged"
    kvroute = {k: v - kvroute_before.get(k, 0) for k, v in stack.stats().items()}
    decided = sum(kvroute.get(f"decision.{d}", 0) for d in ("cold", "prefix_hit", "fallback"))
    skipped = {k: v for k, v in kvroute.items() if k.startswith("skipped.") and v}
    print(f"  kvroute: {decided} decisions ({kvroute.get('decision.prefix_hit', 0)} prefix hits), skipped {skipped}")
    assert decided == REQUESTS and not skipped, kvroute


def main():
    started = time.monotonic()
    stack = Stack()
    passed = failed = 0
    work = tempfile.mkdtemp(prefix="kvroute-aiperf-")
    try:
        stack.start()
        check(stack, work)
        passed += 1
        print("ok   aiperf_token_counts_match_the_servers_within_2_percent")
    except Exception as e:  # a failed claim, reported with the logs
        failed += 1
        print(f"FAIL aiperf_token_counts_match_the_servers_within_2_percent: {e}")
        print(stack.logs())
    finally:
        stack.stop()
        if not failed:
            subprocess.run(["rm", "-rf", work], check=False)
    print(f"{time.monotonic() - started:.1f} s")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
