#!/usr/bin/env python3
"""Writes an Envoy config shaped like what Istio (and Envoy Gateway) generate for the vLLM
pool, with envoy/istio/'s EnvoyFilter patches and envoy/envoy-gateway/'s patches applied and
kvroute's filter as Envoy gets it once istio-agent has pulled the module (the ECDS patch's
configuration, its remote code a local file), for `envoy --mode validate` and a real run
(scripts/test-manifests.sh). It checks that the patch values are valid Envoy config where
Istio puts them, next to the fields Istio sets itself; it does not run Istio.

  istio_patch_config.py OUT.yaml [WASM]
"""

import copy
import json
import sys

import yaml

out = sys.argv[1]
wasm = sys.argv[2] if len(sys.argv) > 2 else "dist/kvroute.wasm"
POOL = "outbound|8000||vllm.kvroute.svc.cluster.local"
EG_POOL = "httproute/kvroute/vllm/rule/0"
PEERS = "outbound|8080||kvroute-gateway-peers.istio-system.svc.cluster.local"


def merge(base, patch):
    """Istio's MERGE: messages merge field by field, lists are appended, scalars replaced."""
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge(base[k], v)
        elif isinstance(v, list) and isinstance(base.get(k), list):
            base[k].extend(v)
        else:
            base[k] = copy.deepcopy(v)
    return base


def patches(path):
    """The EnvoyFilter's patches by (applyTo, operation)."""
    doc = yaml.safe_load(open(path))
    found = {(p["applyTo"], p["patch"]["operation"]): p for p in doc["spec"]["configPatches"]}
    assert len(found) == len(doc["spec"]["configPatches"]), f"{path}: two patches of one kind"
    return found


gw = patches("envoy/istio/envoyfilter-gateway.yaml")
replica_docs = list(yaml.safe_load_all(open("envoy/istio/replicas-gateway.yaml")))
replicas_patch = next(d for d in replica_docs if d["kind"] == "EnvoyFilter")["spec"]["configPatches"][0]
assert replicas_patch["match"]["cluster"]["service"] == PEERS.split("|")[3] and replicas_patch["match"]["cluster"]["portNumber"] == int(PEERS.split("|")[1])
assert PEERS in open("envoy/istio/replicas-gateway.yaml").read(), "the configuration line to add names another cluster"
sidecar = patches("envoy/istio/envoyfilter-sidecar.yaml")
# The sidecar's patches carry the same values (only their match differs): checking the
# gateway's checks both. But for the header removal: the gateway also removes kvroute's
# hints (a client's, README "Threat model"), the sidecar keeps its application's.
HINTS = ["x-kvroute-tenant", "x-kvroute-priority", "x-kvroute-ttft-objective-ms"]
MUTATION = ("HTTP_FILTER", "INSERT_FIRST")


def removed(patch):
    return [m["remove"] for m in patch["patch"]["value"]["typed_config"]["mutations"]["request_mutations"]]


assert removed(gw[MUTATION]) == removed(sidecar[MUTATION]) + HINTS, (removed(gw[MUTATION]), removed(sidecar[MUTATION]))
assert sidecar.keys() == gw.keys() and all(sidecar[k]["patch"] == gw[k]["patch"] for k in gw if k != MUTATION), "sidecar and gateway patches differ"
# kvroute's filter: an ECDS configuration (EXTENSION_CONFIG) and the HTTP filter that names it,
# inserted before the router.
ecds = gw[("EXTENSION_CONFIG", "ADD")]["patch"]["value"]
kvroute_filter = gw[("HTTP_FILTER", "INSERT_BEFORE")]
assert kvroute_filter["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
discovery = kvroute_filter["patch"]["value"]["config_discovery"]
assert kvroute_filter["patch"]["value"]["name"] == ecds["name"]
assert ecds["typed_config"]["@type"] in discovery["type_urls"]
plugin = ecds["typed_config"]["config"]
# Without it Envoy never gives kvroute the body of a request it paused on its headers.
assert plugin["allow_on_headers_stop_iteration"] is True
assert plugin["failure_policy"] == "FAIL_OPEN"
remote = plugin["vm_config"]["code"]["remote"]
assert remote["http_uri"]["uri"].startswith("oci://") and remote["sha256"], remote
eg_docs = list(yaml.safe_load_all(open("envoy/envoy-gateway/kvroute.yaml")))
eg_policy = next(d for d in eg_docs if d["kind"] == "EnvoyExtensionPolicy")["spec"]["wasm"][0]
eg_patch, eg_stop = next(d for d in eg_docs if d["kind"] == "EnvoyPatchPolicy")["spec"]["jsonPatches"]
assert eg_patch["name"] == EG_POOL and eg_patch["operation"]["path"] == "/load_balancing_policy"


def endpoint(ip, port):
    return {"endpoint": {"address": {"socket_address": {"address": ip, "port_value": port}}}}


def istio_cluster(name, port=8000):
    # What Istio sets on an outbound EDS cluster (EDS swapped for STATIC: no xDS here).
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "common_lb_config": {},
        "circuit_breakers": {"thresholds": [{"max_connections": 4294967295, "max_pending_requests": 4294967295,
                                              "max_requests": 4294967295, "max_retries": 4294967295}]},
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint("10.0.0.1", port), endpoint("10.0.0.2", port)]}]},
    }


def istio_filter(name, config_json):
    """kvroute's filter as Envoy gets it on Istio: the ECDS patch's configuration with the
    module pulled (istio-agent rewrites the remote code to the local file it cached)."""
    typed = copy.deepcopy(ecds["typed_config"])
    typed["config"]["vm_config"]["code"] = {"local": {"filename": wasm}}
    typed["config"]["configuration"]["value"] = config_json
    return {"name": name, "typed_config": typed}


def eg_filter(config_json):
    """The wasm filter Envoy Gateway generates for the EnvoyExtensionPolicy (no
    allow_on_headers_stop_iteration: the policy has no such field), then the EnvoyPatchPolicy's
    listener patch applied where its JSONPath points."""
    name = "envoy.filters.http.wasm/envoyextensionpolicy/kvroute/kvroute/wasm/0"
    f = {
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": eg_policy["name"],
                "root_id": eg_policy["rootID"],
                "vm_config": {"vm_id": eg_policy["name"], "runtime": "envoy.wasm.runtime.v8", "code": {"local": {"filename": wasm}}},
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": config_json},
                "fail_open": eg_policy.get("failOpen", False),
            },
        },
    }
    op = eg_stop["operation"]
    assert eg_stop["type"].endswith("envoy.config.listener.v3.Listener") and op["op"] == "add"
    # Envoy Gateway's default listener name: GATEWAY_NAMESPACE/GATEWAY/LISTENER.
    gateway = next(d for d in eg_docs if d["kind"] == "Gateway")
    (http,) = gateway["spec"]["listeners"]
    assert eg_stop["name"] == f"{gateway['metadata']['namespace']}/{gateway['metadata']['name']}/{http['name']}", eg_stop["name"]
    assert op["jsonPath"] == f"..http_filters[?(@.name=='{name}')]", op["jsonPath"]
    *parents, leaf = op["path"].strip("/").split("/")
    target = f
    for key in parents:
        target = target[key]
    target[leaf] = op["value"]
    assert f["typed_config"]["config"]["allow_on_headers_stop_iteration"] is True
    return f


def build(plugin_config, eg_config, replicas_config):
    pool = merge(istio_cluster(POOL), gw[("CLUSTER", "MERGE")]["patch"]["value"])
    peers = merge(istio_cluster(PEERS, 8080), replicas_patch["patch"]["value"])
    eg_pool = istio_cluster(EG_POOL)
    eg_pool[eg_patch["operation"]["path"].strip("/")] = eg_patch["operation"]["value"]
    # Istio's route for the VirtualService, with its default retry additions, then the patch.
    route = {
        "name": "kvroute-inference",
        "match": {"prefix": "/"},
        "route": {
            "cluster": POOL,
            "timeout": "300s",
            "retry_policy": {
                "retry_on": "connect-failure,refused-stream,reset",
                "num_retries": 2,
                "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                                          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
                "host_selection_retry_max_attempts": 5,
                "retriable_status_codes": [503],
            },
        },
    }
    route = merge(route, gw[("HTTP_ROUTE", "MERGE")]["patch"]["value"])
    eg_route = {"name": "eg", "match": {"prefix": "/eg/"}, "route": {"cluster": EG_POOL, "timeout": "300s"}}
    hcm_filters = [
        gw[("HTTP_FILTER", "INSERT_FIRST")]["patch"]["value"],
        istio_filter(kvroute_filter["patch"]["value"]["name"], plugin_config),
        # The configuration with the replicas' exchange on (replicas-gateway.yaml's addition).
        istio_filter("kvroute.replicas", replicas_config),
        eg_filter(eg_config),
        {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
    ]
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "outbound_0.0.0.0_80",
            "route_config": {"name": "http.80", "virtual_hosts": [{"name": "*:80", "domains": ["*"], "routes": [eg_route, route]}]},
            "http_filters": hcm_filters,
        },
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "static_resources": {
            "listeners": [{"name": "0.0.0.0_8080", "address": {"socket_address": {"address": "0.0.0.0", "port_value": 8080}},
                           "filter_chains": [{"filters": [hcm]}]}],
            "clusters": [
                pool,
                eg_pool,
                peers,
                # Every Istio proxy's bootstrap: the admin, used by kvroute's discovery.
                {"name": "prometheus_stats", "type": "STATIC", "connect_timeout": "0.250s",
                 "load_assignment": {"cluster_name": "prometheus_stats", "endpoints": [{"lb_endpoints": [endpoint("127.0.0.1", 15000)]}]}},
            ],
        },
    }


istio_cfg, eg_cfg = json.loads(plugin["configuration"]["value"]), eg_policy["config"]
assert istio_cfg["discovery"]["admin_cluster"] == "prometheus_stats" and istio_cfg["discovery"]["cluster"] == POOL
assert eg_cfg["discovery"]["cluster"] == EG_POOL
replicas_cfg = dict(istio_cfg, share={"replicas": {"cluster": PEERS, "secret": "example-secret-0123456789"}})
yaml.safe_dump(build(json.dumps(istio_cfg), json.dumps(eg_cfg), json.dumps(replicas_cfg)), open(out, "w"), sort_keys=False)
print(f"wrote {out}")
