"""Shared by the live scripts that run real Envoy + the filter in front of a fleet of their
own (scripts/live-tiers.sh, scripts/live-admission.sh): Envoy's configuration for that
fleet, and what a `kvroute-sim bench --json` run says about a TTFT objective.

The scripts import it from the repository root (`sys.path.insert(0, "scripts")`).
"""

import json
import statistics
import sys

# envoy/envoy.yaml's pool: four servers on 127.0.0.1:8001-8004.
POOL_LINE = "              - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: %d } } }\n"


def envoy_config(servers, base_port, listen_port, admin_port, plugin=""):
    """envoy/envoy.yaml with the pool replaced by `servers` servers on `base_port` on,
    listening on `listen_port` with its admin on `admin_port`; `plugin` (JSON members, each
    ending in a comma) is added to the filter's configuration after its policy."""
    s = open("envoy/envoy.yaml").read()
    old = "".join(POOL_LINE % (8001 + i) for i in range(4))
    assert old in s, "envoy/envoy.yaml's pool is not the four servers the live scripts expect"
    s = s.replace(old, "".join(POOL_LINE % (base_port + i) for i in range(servers)))
    s = s.replace("port_value: 9901", f"port_value: {admin_port}")
    s = s.replace("port_value: 10000", f"port_value: {listen_port}")
    if plugin:
        old = '"policy": "cost",'
        assert old in s, "envoy/envoy.yaml's plugin configuration names no cost policy"
        s = s.replace(old, f'"policy": "cost", {plugin}')
    return s


def met(run, objective_ms):
    """The share of the requests offered whose TTFT met `objective_ms`: from the bench's
    TTFT distribution of the completed requests (quantiles in 1% steps), a failed request
    missing it."""
    cdf = run["ttft_cdf_ms"]
    met_done = 1.0 if cdf[-1] <= objective_ms else sum(q <= objective_ms for q in cdf[1:]) / (len(cdf) - 1)
    return met_done * run["completed"] / max(run["requests"], 1)


def share_of(doc, run, base_port, wanted):
    """The share of `run`'s requests served by the servers on `base_port` + i for which
    `wanted(i)` holds (the bench names each server by its address)."""
    total = 0.0
    for server, stats in zip(doc["servers"], run["per_server"]):
        port = server.rsplit(":", 1)[-1]
        if port.isdigit() and int(port) >= base_port and wanted(int(port) - base_port):
            total += stats["share"]
    return total


def spread(values, form):
    """The median of `values` and their range, each written with `form`."""
    return f"{form.format(statistics.median(values))} [{form.format(min(values))}–{form.format(max(values))}]"


def bench_runs(out, name, runs):
    """The bench JSON of runs 1..`runs` named `name` in `out` (`NAME-N.json`), with each
    run's number; a run without a readable result is reported on stderr and left out."""
    for n in range(1, runs + 1):
        try:
            with open(f"{out}/{name}-{n}.json") as f:
                yield n, json.load(f)
        except (OSError, ValueError) as e:
            print(f"  {name} run {n}: no result ({e})", file=sys.stderr)
