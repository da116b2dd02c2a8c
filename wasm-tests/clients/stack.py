"""The whole stack a client talks to: `kvroute-sim serve` (simulated vLLM 0.33 servers) and
real Envoy running `envoy/envoy.yaml` with `dist/kvroute.wasm`, on loopback and free ports.

The Envoy config is rewritten as `wasm-tests/src/envoy.rs` does it (pool 127.0.0.1:8001-8004
to the simulator's ports, listener 10000 and admin 9901 to free ones), so the shipped config
is what the client meets. Children get SIGTERM if this process dies (PR_SET_PDEATHSIG), and
`Stack.stop` ends them on every other path; the caller stops the stack in a `finally`.

`KVROUTE_SIM` and `KVROUTE_ENVOY` name the binaries (default: `target/release/kvroute-sim`
and `.venv/bin/envoy`); `KVROUTE_GATEWAY=http://host:port` and `KVROUTE_ADMIN=port` use a
stack already running instead (the server-side checks then read the servers listed in
`KVROUTE_SERVERS=port,port`; without them those checks are skipped). A given stack must
serve no other traffic during the run: the checks compare counters before and after each test.
"""

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SERVERS = 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_run(count):
    """The first of `count` consecutive free ports (the simulator binds base..base+count-1)."""
    for _ in range(100):
        base = free_port()
        if base + count < 65536 and all(_bindable(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def _die_with_parent():
    # Linux: the child gets SIGTERM when the test process dies, even by SIGKILL.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def rewrite_config(text, pool, listen, admin):
    """`envoy/envoy.yaml` with its pool, listener and admin ports moved (envoy.rs's rule)."""
    for i, port in enumerate(pool):
        old = 8001 + i
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{port}")
        text = text.replace(f"port_value: {old} ", f"port_value: {port} ")
    for unused in range(8001 + len(pool), 8005):
        text = text.replace(f', "127.0.0.1:{unused}"', "")
        text = "\n".join(l for l in text.split("\n") if f"port_value: {unused} " not in l)
    text = text.replace("port_value: 10000", f"port_value: {listen}")
    return text.replace("port_value: 9901", f"port_value: {admin}")


def http_get(port, path, timeout=2.0):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.status, r.read().decode()


def _wait(what, ready, procs, logs, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited with {p.returncode}:\n{_tail(log)}")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready after {seconds:.0f} s:\n" + "\n".join(_tail(l) for l in logs))


def _tail(path, lines=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class Stack:
    """The running stack: `gateway` (base URL for the client), `admin` (Envoy's admin port),
    `servers` (the simulated servers' ports)."""

    def __init__(self):
        self.procs = []
        self.dir = None
        self.gateway = os.environ.get("KVROUTE_GATEWAY")
        admin = os.environ.get("KVROUTE_ADMIN")
        self.admin = int(admin) if admin else None
        servers = os.environ.get("KVROUTE_SERVERS", "")
        self.servers = [int(p) for p in servers.split(",") if p]

    def start(self):
        if self.gateway:
            return self
        self.dir = tempfile.mkdtemp(prefix="kvroute-clients-")
        sim = os.environ.get("KVROUTE_SIM", os.path.join(ROOT, "target/release/kvroute-sim"))
        envoy = os.environ.get("KVROUTE_ENVOY", os.path.join(ROOT, ".venv/bin/envoy"))
        for path, fix in [(sim, "cargo build --release -p kvroute-sim"), (envoy, "make setup-envoy"),
                          (os.path.join(ROOT, "dist/kvroute.wasm"), "make build-wasm")]:
            if not os.path.exists(path):
                raise RuntimeError(f"no {path}: run `{fix}`")
        base, sim_admin = free_run(SERVERS), free_port()
        self.servers = [base + i for i in range(SERVERS)]
        sim_log = self._spawn("sim", [sim, "serve", "--servers", str(SERVERS), "--host", "127.0.0.1",
                                      "--base-port", str(base), "--admin-port", str(sim_admin)])
        _wait("kvroute-sim", lambda: all(http_get(p, "/health")[0] == 200 for p in self.servers),
              self.procs, [sim_log])
        listen, self.admin = free_port(), free_port()
        with open(os.path.join(ROOT, "envoy/envoy.yaml")) as f:
            config = rewrite_config(f.read(), self.servers, listen, self.admin)
        config_path = os.path.join(self.dir, "envoy.yaml")
        with open(config_path, "w") as f:
            f.write(config)
        envoy_log = self._spawn("envoy", [envoy, "-c", config_path, "--concurrency", "2",
                                          "--use-dynamic-base-id", "-l", "warning"])
        _wait("Envoy", lambda: http_get(self.admin, "/ready")[0] == 200, self.procs, [sim_log, envoy_log])
        # kvroute routes only with fresh metrics: wait for its first scrapes of every server.
        _wait("kvroute scrapes", lambda: self.stat("scrape.healthy_endpoints") == SERVERS,
              self.procs, [sim_log, envoy_log])
        self.gateway = f"http://127.0.0.1:{listen}"
        return self

    def _spawn(self, name, argv):
        log = os.path.join(self.dir, f"{name}.log")
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                               stderr=subprocess.STDOUT, preexec_fn=_die_with_parent))
        return log

    def stop(self, keep_logs=False):
        """Ends what `start` started (Envoy first), waiting up to 5 s before SIGKILL; removes
        the logs unless `keep_logs` (then a later `stop` removes them)."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        if self.dir and not keep_logs:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def logs(self):
        """The last lines of every log, for a failure report (before `stop`)."""
        if not self.dir:
            return ""
        return "\n".join(f"--- {name}\n{_tail(os.path.join(self.dir, name))}"
                         for name in sorted(os.listdir(self.dir)) if name.endswith(".log"))

    def stats(self):
        """kvroute's counters and gauges from Envoy's admin, without the `wasmcustom.kvroute.` prefix."""
        if self.admin is None:
            return {}
        _, text = http_get(self.admin, "/stats?filter=^wasmcustom%5C.kvroute%5C.")
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[name.removeprefix("wasmcustom.kvroute.")] = int(value)
        return out

    def stat(self, name):
        return self.stats().get(name, 0)

    def fleet_metric(self, family):
        """The sum over every server of the samples of a Prometheus `family` (labels ignored)."""
        total = 0.0
        pattern = re.compile(rf"^{re.escape(family)}(?:{{[^}}]*}})? (\S+)$")
        for port in self.servers:
            for line in http_get(port, "/metrics")[1].splitlines():
                m = pattern.match(line)
                if m:
                    total += float(m.group(1))
        return total
