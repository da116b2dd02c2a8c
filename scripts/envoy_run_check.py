"""Runs a deployment's Envoy configuration as a real Envoy in front of 2 simulated vLLM
servers and sends it chat requests until kvroute has routed a few
(scripts/test-manifests.sh). A request that does not complete within 10 s (a filter that
paused it and never got its body) counts as not routed.
"""

import contextlib
import json
import socket
import subprocess
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.status, r.read().decode()


class Ports:
    """`base` and `base + 1` for the two simulated servers (a port whose next one is free
    too), and distinct free ports for Envoy's listener, its admin, a second listener
    (`stats`) and the simulator's fault-injection admin."""

    def __init__(self):
        for _ in range(100):
            base = free_port()
            try:
                s = socket.socket()
                s.bind(("127.0.0.1", base + 1))
                s.close()
                break
            except OSError:
                continue
        else:
            raise RuntimeError("no two consecutive free ports")
        self.base = base
        taken = {base, base + 1}

        def other():
            while True:
                p = free_port()
                if p not in taken:
                    taken.add(p)
                    return p

        self.listen, self.stats, self.admin, self.sim_admin = other(), other(), other(), other()


@contextlib.contextmanager
def running(envoy, sim, config, ports, log, envoy_args=()):
    """The two simulated servers and Envoy on `config` (with `envoy_args` too), stopped on
    leaving."""
    procs = [subprocess.Popen([sim, "serve", "--servers", "2", "--base-port", str(ports.base),
                               "--admin-port", str(ports.sim_admin)], stdout=log, stderr=log)]
    try:
        procs.append(subprocess.Popen([envoy, "-c", config, "--concurrency", "2", "--use-dynamic-base-id",
                                       "-l", "warning", *envoy_args], stdout=log, stderr=log))
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def prometheus(ports, prefixes):
    """The admin's Prometheus lines starting with one of `prefixes`."""
    _, prom = get(ports.admin, "/stats/prometheus")
    return [line for line in prom.splitlines() if line.startswith(prefixes)]


def route(ports, log, wanted=4, within_s=30):
    """Sends chat requests (10 s each at most) until kvroute's decisions count `wanted` or
    `within_s` passed; returns how many kvroute routed."""
    deadline = time.time() + within_s
    routed = 0
    while time.time() < deadline and routed < wanted:
        try:
            body = json.dumps({"model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 4,
                               "messages": [{"role": "user", "content": f"hello gateway {routed} " * 40}]}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{ports.listen}/v1/chat/completions", body,
                                         {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200
            routed = sum(int(float(line.split()[-1]))
                         for line in prometheus(ports, ("kvroute_decision_cold", "kvroute_decision_prefix_hit")))
        except Exception as e:
            print(f"waiting: {e}", file=log, flush=True)
            time.sleep(0.3)
    return routed


def routes_both(envoy, sim, config, ports, log, then=lambda: None, envoy_args=()):
    """Runs `config` in front of the two simulated servers: kvroute must route 4 requests and
    count both servers in its pool; `then` checks more while it runs."""
    with running(envoy, sim, config, ports, log, envoy_args):
        routed = route(ports, log)
        hosts = prometheus(ports, "kvroute_discovery_hosts")
        print(f"routed by kvroute: {routed}; {hosts}", file=log)
        assert routed >= 4, f"kvroute routed {routed} requests"
        assert hosts and float(hosts[0].split()[-1]) == 2, hosts
        then()
