#!/usr/bin/env bash
# `make test-manifests`: every deployment artifact under envoy/ checked offline, in seconds.
#
#  1. Schemas: every Kubernetes, Istio, Gateway API and Envoy Gateway document under
#     envoy/kubernetes, envoy/istio, envoy/envoy-gateway (scripts/validate_manifests.py; the
#     schemas and their provenance: envoy/schemas/README.md). envoy/istio's EnvoyFilters are
#     validated as scripts/build-oci.sh fills them (with the image's `uri` and `sha256`),
#     and the wasm ConfigMap as scripts/k8s-wasm-configmap.py generates it from dist/kvroute.wasm.
#  2. The gateway's envoy.yaml (the ConfigMap in envoy/kubernetes/gateway.yaml), its variant
#     with the commented price-tier lines and the one with the replicas' exchange on (the
#     secret added; the replicas discovered from the shipped cluster), run through
#     `envoy --mode validate` with dist/kvroute.wasm, which loads the filter and its plugin
#     configuration (the pool learned from Envoy: `discovery`, no `endpoints`).
#     Then that envoy.yaml is run as a real Envoy (ports moved to free ones, its STRICT_DNS
#     pool pointed at 2 simulated servers on localhost): kvroute must discover both servers
#     through the locked-down admin and route requests, and the admin must refuse
#     /config_dump (needs KVROUTE_SIM or target/release/kvroute-sim).
#  3. The Istio and Envoy Gateway patches' Envoy values (override_host policy, route retry
#     policy and body limit, header_mutation filter, kvroute's filter as istio-agent hands it
#     to Envoy and as Envoy Gateway's listener patch leaves it, the gateway replicas' cluster
#     of envoy/istio/replicas-gateway.yaml with the configuration that uses it) merged into a
#     cluster, route and listener shaped like the ones Istio generates, through
#     `envoy --mode validate`; then that config run as a real Envoy in front of 2 simulated
#     servers, kvroute's filter delivered by ECDS (the HTTP_FILTER patch as it stands, from a
#     file holding the EXTENSION_CONFIG patch's resource instead of istiod): kvroute must
#     get the bodies of the requests it pauses (Istio's WasmPlugin
#     cannot say `allow_on_headers_stop_iteration`, and without it every request hangs),
#     discover the pool through `prometheus_stats` and route.
#  4. The Prometheus configuration for Kubernetes with `promtool check config` (Debian's
#     promtool is built without Kubernetes discovery: its kubernetes_sd_configs blocks are
#     swapped for static_configs; everything else, relabelling included, is checked as is)
#     and the Prometheus Adapter rules' queries parsed by promtool.
#  5. scripts/build-oci.sh: two builds give the same manifest digest, the layer holds
#     plugin.wasm byte for byte, and skopeo (when installed) reads the layout.
#
# Knobs: ENVOY (default .venv/bin/envoy), PYTHON (default .venv/bin/python, with
# envoy/schemas/requirements.txt installed), WASM, OUT (default target/test-manifests).
# Last line: `N passed, N failed`.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY=${ENVOY:-.venv/bin/envoy}
PYTHON=${PYTHON:-.venv/bin/python}
WASM=${WASM:-dist/kvroute.wasm}
OUT=${OUT:-target/test-manifests}
PROMTOOL=${PROMTOOL:-promtool}
rm -rf "$OUT"
mkdir -p "$OUT"
passed=0
failed=0
pass() { passed=$((passed + 1)); echo "ok   $*"; }
fail() { failed=$((failed + 1)); echo "FAIL $*"; }

echo "==> CRD validators (npm ci of envoy/schemas/package.json)"
mkdir -p target/schemas-npm
if ! cmp -s envoy/schemas/package-lock.json target/schemas-npm/package-lock.json || [ ! -d target/schemas-npm/node_modules ]; then
  cp envoy/schemas/package.json envoy/schemas/package-lock.json target/schemas-npm/
  (cd target/schemas-npm && npm ci --silent --no-audit --no-fund)
fi

echo "==> schemas"
bash scripts/build-oci.sh "$WASM" "$OUT/oci" registry.example.com/kvroute/kvroute:test >"$OUT/oci.txt"
"$PYTHON" scripts/k8s-wasm-configmap.py "$WASM" >"$OUT/kvroute-wasm-configmap.yaml"
files=()
for f in envoy/kubernetes/*.y*ml envoy/istio/*.yaml envoy/envoy-gateway/*.yaml; do
  case "$f" in envoy/istio/envoyfilter-*) files+=("$OUT/oci/$(basename "$f")") ;; *) files+=("$f") ;; esac
done
files+=("$OUT/kvroute-wasm-configmap.yaml")
if "$PYTHON" scripts/validate_manifests.py check "${files[@]}" | tee "$OUT/schemas.txt"; then :; fi
read -r p f < <(sed -n 's/^manifests: \([0-9]*\) passed, \([0-9]*\) failed$/\1 \2/p' "$OUT/schemas.txt")
passed=$((passed + ${p:-0}))
failed=$((failed + ${f:-1}))

echo "==> the gateway's envoy.yaml through envoy --mode validate"
"$PYTHON" - "$WASM" "$OUT" <<'PY'
import json, re, sys, yaml
wasm, out = sys.argv[1:3]
docs = list(yaml.safe_load_all(open("envoy/kubernetes/gateway.yaml")))
cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvroute-envoy")
text = cm["data"]["envoy.yaml"].replace("/etc/kvroute/kvroute.wasm", wasm)
open(f"{out}/gateway-envoy.yaml", "w").write(text)
# The plugin configuration learns the pool from Envoy: no static list.
cfg = yaml.safe_load(text)["bootstrap_extensions"][0]["typed_config"]["config"]["configuration"]["value"]
plugin = json.loads(cfg)
assert "endpoints" not in plugin and plugin["discovery"]["admin_cluster"] == "kvroute_admin", plugin
# The commented price-tier variant: the premium Service at priority 1 (its lines uncommented)
# and kvroute's tiers from the cluster's priorities.
lines = text.split("\n")
start = next(i for i, l in enumerate(lines) if l.strip() == "# - priority: 1")
end = next(i for i in range(start, len(lines)) if "vllm-premium" in lines[i])
for i in range(start, end + 1):
    lines[i] = lines[i].replace("# ", "", 1)
tiers = '"tiers": {"from_priority": true, "max_num_seqs": [256, 1024]}, "discovery": {'
tiered = "\n".join(lines).replace('"discovery": {', tiers)
pool = next(c for c in yaml.safe_load(tiered)["static_resources"]["clusters"] if c["name"] == "vllm_pool")
assert [e.get("priority", 0) for e in pool["load_assignment"]["endpoints"]] == [0, 1], pool
open(f"{out}/gateway-envoy-tiers.yaml", "w").write(tiered)
# The replicas' exchange turned on as the README says: the secret alone, the replicas
# discovered from the shipped kvroute_gateways cluster on the headless Service of the pods.
peers = next(c for c in yaml.safe_load(text)["static_resources"]["clusters"] if c["name"] == "kvroute_gateways")
assert peers["type"] == "STRICT_DNS", peers
service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "kvroute-gateway-peers")
assert service["spec"]["clusterIP"] == "None", service
address = peers["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
assert address["address"].startswith("kvroute-gateway-peers."), address
shared = text.replace('"discovery": {', '"share": {"replicas": {"secret": "example-secret-0123456789"}}, "discovery": {')
assert shared != text
open(f"{out}/gateway-envoy-replicas.yaml", "w").write(shared)
PY
# envoy --mode validate on $2.
envoy_validate() {
  local what=$1 config=$2 log=$OUT/$(basename "$2" .yaml).log
  if "$ENVOY" --mode validate -c "$config" -l error >"$log" 2>&1; then
    pass "$what: envoy --mode validate"
  else
    fail "$what: $(grep -v '^\s*$' "$log" | tail -1)"
  fi
}
envoy_validate "envoy/kubernetes/gateway.yaml's envoy.yaml" "$OUT/gateway-envoy.yaml"
envoy_validate "envoy/kubernetes/gateway.yaml's envoy.yaml with its price-tier lines" "$OUT/gateway-envoy-tiers.yaml"
envoy_validate "envoy/kubernetes/gateway.yaml's envoy.yaml with the replicas' exchange on" "$OUT/gateway-envoy-replicas.yaml"

echo "==> the Istio / Envoy Gateway patch values in an Istio-shaped Envoy config"
"$PYTHON" scripts/istio_patch_config.py "$OUT/istio-shaped.yaml" "$WASM" >/dev/null
envoy_validate "envoy/istio/envoyfilter-gateway.yaml (kvroute as istio-agent delivers it), envoy/envoy-gateway patches, in an Istio-shaped config" \
  "$OUT/istio-shaped.yaml"

echo "==> Prometheus configuration for Kubernetes, Prometheus Adapter queries"
mkdir -p "$OUT/prometheus"
"$PYTHON" - "$OUT/prometheus" <<'PY'
import sys, yaml
out = sys.argv[1]
cfg = yaml.safe_load(open("envoy/kubernetes/prometheus.yml"))
for job in cfg["scrape_configs"]:
    assert "kubernetes_sd_configs" in job, job["job_name"]
    job.pop("kubernetes_sd_configs")
    job["static_configs"] = [{"targets": ["127.0.0.1:1"]}]
yaml.safe_dump(cfg, open(f"{out}/prometheus.yml", "w"))
# The adapter's metricsQuery templates, rendered as the adapter would for one pod.
adapter = yaml.safe_load(open("envoy/kubernetes/prometheus-adapter-config.yaml"))
rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
with open(f"{out}/adapter-queries.txt", "w") as f:
    for r in rules:
        series = r["seriesQuery"].split("{")[0].strip("'")
        q = (r["metricsQuery"].replace("<<.Series>>", series)
             .replace("<<.LabelMatchers>>", 'namespace="kvroute",pod=~"vllm-.*"').replace("<<.GroupBy>>", "pod"))
        f.write(q + "\n")
PY
cp envoy/observability/kvroute-rules.yaml "$OUT/prometheus/"
if "$PROMTOOL" check config "$OUT/prometheus/prometheus.yml" >"$OUT/promtool.log" 2>&1; then
  pass "envoy/kubernetes/prometheus.yml: promtool check config (kubernetes_sd_configs swapped for static_configs)"
else
  fail "envoy/kubernetes/prometheus.yml: $(cat "$OUT/promtool.log")"
fi
while read -r q; do
  # promtool has no "parse this query"; a rule file with the query as a recording rule is parsed.
  printf 'groups:\n  - name: adapter\n    rules:\n      - record: adapter:check\n        expr: %s\n' "'$q'" >"$OUT/prometheus/adapter-rule.yaml"
  if "$PROMTOOL" check rules "$OUT/prometheus/adapter-rule.yaml" >/dev/null 2>&1; then
    pass "prometheus-adapter-config.yaml query parses: $q"
  else
    fail "prometheus-adapter-config.yaml query does not parse: $q"
  fi
done <"$OUT/prometheus/adapter-queries.txt"

echo "==> scripts/build-oci.sh"
bash scripts/build-oci.sh "$WASM" "$OUT/oci2" registry.example.com/kvroute/kvroute:test >/dev/null
if [ "$(cat "$OUT/oci/DIGEST")" = "$(cat "$OUT/oci2/DIGEST")" ]; then pass "build-oci.sh is reproducible (sha256:$(cat "$OUT/oci/DIGEST"))"; else fail "build-oci.sh: two builds, two digests"; fi
if "$PYTHON" - "$OUT/oci" "$WASM" <<'PY'; then pass "OCI layout: digests match their blobs, the layer's plugin.wasm is the module"; else fail "OCI layout"; fi
import gzip, hashlib, io, json, os, sys, tarfile
layout, wasm = sys.argv[1:3]
blob = lambda d: open(os.path.join(layout, "blobs", "sha256", d.split(":", 1)[1]), "rb").read()
index = json.load(open(os.path.join(layout, "index.json")))
desc = index["manifests"][0]
raw = blob(desc["digest"])
assert hashlib.sha256(raw).hexdigest() == desc["digest"].split(":")[1] and len(raw) == desc["size"]
manifest = json.loads(raw)
assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
for d in [manifest["config"]] + manifest["layers"]:
    b = blob(d["digest"])
    assert hashlib.sha256(b).hexdigest() == d["digest"].split(":")[1] and len(b) == d["size"], d
(layer,) = manifest["layers"]
assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob(layer["digest"])))) as t:
    assert t.getnames() == ["plugin.wasm"], t.getnames()
    assert t.extractfile("plugin.wasm").read() == open(wasm, "rb").read()
PY
if command -v skopeo >/dev/null; then
  if skopeo inspect "oci:$OUT/oci:test" >"$OUT/skopeo.json" 2>&1 &&
    grep -q "\"Digest\": \"sha256:$(cat "$OUT/oci/DIGEST")\"" "$OUT/skopeo.json"; then
    pass "skopeo reads the OCI layout and reports the same digest"
  else
    fail "skopeo inspect: $(head -3 "$OUT/skopeo.json")"
  fi
fi

echo "==> envoy/kubernetes/gateway.yaml's envoy.yaml, run: real Envoy + kvroute in front of 2 simulated servers"
SIM=${KVROUTE_SIM:-target/release/kvroute-sim}
if [ -x "$SIM" ]; then
  if "$PYTHON" - "$ENVOY" "$SIM" "$OUT" <<'PY'; then pass "the gateway's envoy.yaml runs: kvroute discovers the STRICT_DNS pool through the locked-down admin and routes; the Deployment's preStop hook drains it (clients get connection: close)"; else fail "the gateway's envoy.yaml did not run, route and drain (see $OUT/gateway-run.log)"; fi
import http.client, json, subprocess, sys, time, urllib.error, yaml
sys.path.insert(0, "scripts")
from envoy_run_check import Ports, get, routes_both
envoy, sim, out = sys.argv[1:4]
ports = Ports()
text = open(f"{out}/gateway-envoy.yaml").read()
# The pool's one lb_endpoint (the headless Service's name) becomes one per simulated server.
lines = text.splitlines()
at = next(i for i, l in enumerate(lines) if "vllm-pool.kvroute.svc.cluster.local" in l)
start = max(i for i in range(at) if lines[i].lstrip().startswith("- endpoint:"))
item = lines[start : at + 1]
copies = ["\n".join(item).replace("vllm-pool.kvroute.svc.cluster.local", "localhost").replace("port_value: 8000", f"port_value: {ports.base + i}") for i in range(2)]
text = "\n".join(lines[:start] + copies + lines[at + 1 :]) + "\n"
text = text.replace("address: 0.0.0.0", "address: 127.0.0.1")
text = text.replace("port_value: 10000", f"port_value: {ports.listen}").replace("port_value: 9902", f"port_value: {ports.stats}").replace("port_value: 9901", f"port_value: {ports.admin}")
open(f"{out}/gateway-run.yaml", "w").write(text)
log = open(f"{out}/gateway-run.log", "w")
# The Deployment's Envoy flags (the drain's) and its preStop hook, as shipped.
deployment = next(d for d in yaml.safe_load_all(open("envoy/kubernetes/gateway.yaml")) if d["kind"] == "Deployment")
container = deployment["spec"]["template"]["spec"]["containers"][0]
args = container["args"]
drain_args = args[args.index("--drain-time-s"):]
hook = container["lifecycle"]["preStop"]["exec"]["command"]
assert hook[:2] == ["/bin/bash", "-c"] and "127.0.0.1/9901" in hook[2] and "sleep 60" in hook[2], hook
hook_here = hook[2].replace("127.0.0.1/9901", f"127.0.0.1/{ports.admin}").replace("sleep 60", "sleep 0")
def chat(conn):
    body = json.dumps({"model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "drain check"}]})
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = conn.getresponse()
    r.read()
    return r.status, r.getheader("connection")
def admin_refuses_config_dump_then_the_hook_drains():
    try:
        get(ports.admin, "/config_dump")
        raise AssertionError("the admin answered /config_dump")
    except urllib.error.HTTPError as e:
        assert e.code == 403, e.code
    # A keep-alive client: kept open before the hook, told to close after it.
    client = http.client.HTTPConnection("127.0.0.1", ports.listen, timeout=10)
    assert chat(client) == (200, None), "a connection closed before the drain"
    # With no admin listening, the hook gives up on the drain at once and still sleeps
    # (here `sleep 0`): it ends, and within the drain call's bound.
    closed = Ports().admin
    started = time.time()
    down = subprocess.run(["bash", "-c", hook_here.replace(f"127.0.0.1/{ports.admin}", f"127.0.0.1/{closed}")],
                          capture_output=True, text=True, timeout=20)
    assert down.returncode == 0 and time.time() - started < 6, (down.returncode, down.stderr)
    assert chat(client) == (200, None), "the hook drained with no admin to ask"
    done = subprocess.run(["bash", "-c", hook_here], capture_output=True, text=True, timeout=20)
    print(f"preStop hook: rc {done.returncode} {done.stderr.strip()}", file=log, flush=True)
    status, connection = chat(client)
    assert (status, connection) == (200, "close"), f"after the hook: {status}, connection {connection}"
routes_both(envoy, sim, f"{out}/gateway-run.yaml", ports, log, admin_refuses_config_dump_then_the_hook_drains, drain_args)
PY
else
  fail "no simulator at $SIM to run the gateway's envoy.yaml against"
fi

echo "==> the Istio-shaped config, run: kvroute's filter as istio-agent delivers it, in front of 2 simulated servers"
if [ -x "$SIM" ]; then
  if "$PYTHON" - "$ENVOY" "$SIM" "$OUT" <<'PY'; then pass "envoy/istio's filter runs as Istio delivers it (by ECDS): kvroute gets the bodies it paused for, discovers the pool through prometheus_stats and routes"; else fail "envoy/istio's filter did not run and route (see $OUT/istio-run.log)"; fi
import sys, yaml
sys.path.insert(0, "scripts")
from envoy_run_check import Ports, routes_both
envoy, sim, out = sys.argv[1:4]
ports = Ports()
cfg = yaml.safe_load(open(f"{out}/istio-shaped.yaml"))
cfg["admin"]["address"]["socket_address"]["port_value"] = ports.admin
(listener,) = cfg["static_resources"]["listeners"]
listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": ports.listen}
hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
# The ingress gateway's chain: the header removal, kvroute, the router (not the variants
# the validation carries beside it).
hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] in ("envoy.filters.http.header_mutation", "kvroute", "envoy.filters.http.router")]
assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.header_mutation", "kvroute", "envoy.filters.http.router"]
# kvroute by ECDS as on Istio: the HTTP_FILTER patch's filter as it stands, its config source
# a file instead of istiod holding the EXTENSION_CONFIG patch's resource with the module
# pulled (Envoy then checks the name and the type the filter asks for).
patches = yaml.safe_load(open("envoy/istio/envoyfilter-gateway.yaml"))["spec"]["configPatches"]
(inserted,) = [p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_FILTER" and p["patch"]["operation"] == "INSERT_BEFORE"]
(added,) = [p["patch"]["value"] for p in patches if p["applyTo"] == "EXTENSION_CONFIG"]
at = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == "kvroute")
resource = {"@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig", "name": added["name"],
            "typed_config": hcm["http_filters"][at]["typed_config"]}
yaml.safe_dump({"version_info": "1", "resources": [resource]}, open(f"{out}/istio-ecds.yaml", "w"), sort_keys=False)
source = inserted["config_discovery"]["config_source"]
assert "ads" in source, source
source.pop("ads")
source["path_config_source"] = {"path": f"{out}/istio-ecds.yaml"}
hcm["http_filters"][at] = inserted
cfg["node"] = {"id": "router~10.0.0.9~istio-ingressgateway.istio-system~istio-system.svc.cluster.local", "cluster": "istio-ingressgateway.istio-system"}
for c in cfg["static_resources"]["clusters"]:
    eps = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
    if c["name"].startswith("outbound|8000||vllm."):
        for i, e in enumerate(eps):
            e["endpoint"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": ports.base + i}
    elif c["name"] == "prometheus_stats":
        eps[0]["endpoint"]["address"]["socket_address"]["port_value"] = ports.admin
yaml.safe_dump(cfg, open(f"{out}/istio-run.yaml", "w"), sort_keys=False)
log = open(f"{out}/istio-run.log", "w")
routes_both(envoy, sim, f"{out}/istio-run.yaml", ports, log)
PY
else
  fail "no simulator at $SIM to run the Istio-shaped config against"
fi

echo "test-manifests: $passed passed, $failed failed"
[ "$failed" = 0 ]
