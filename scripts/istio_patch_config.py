#!/usr/bin/env python3
"""Writes an Envoy config shaped like what Istio (and Envoy Gateway) generate for the vLLM
pool, with envoy/istio/'s EnvoyFilter patches and envoy/envoy-gateway/'s patch applied and
the WasmPlugin's pluginConfig as the filter configuration, for `envoy --mode validate`
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
    doc = yaml.safe_load(open(path))
    return {p["applyTo"]: p for p in doc["spec"]["configPatches"]}


gw = patches("envoy/istio/envoyfilter-gateway.yaml")
replica_docs = list(yaml.safe_load_all(open("envoy/istio/replicas-gateway.yaml")))
replicas_patch = next(d for d in replica_docs if d["kind"] == "EnvoyFilter")["spec"]["configPatches"][0]
assert replicas_patch["match"]["cluster"]["service"] == PEERS.split("|")[3] and replicas_patch["match"]["cluster"]["portNumber"] == int(PEERS.split("|")[1])
assert PEERS in open("envoy/istio/replicas-gateway.yaml").read(), "the pluginConfig line to add names another cluster"
sidecar = patches("envoy/istio/envoyfilter-sidecar.yaml")
# The sidecar's patches carry the same values (only their match differs): checking the
# gateway's checks both.
assert sidecar.keys() == gw.keys() and all(sidecar[k]["patch"] == gw[k]["patch"] for k in gw), "sidecar and gateway patches differ"
plugin = yaml.safe_load(open("envoy/istio/wasmplugin-gateway.yaml"))["spec"]
assert yaml.safe_load(open("envoy/istio/wasmplugin-sidecar.yaml"))["spec"]["pluginConfig"] == plugin["pluginConfig"]
assert plugin["failStrategy"] == "FAIL_OPEN"
eg_docs = list(yaml.safe_load_all(open("envoy/envoy-gateway/kvroute.yaml")))
eg_policy = next(d for d in eg_docs if d["kind"] == "EnvoyExtensionPolicy")["spec"]["wasm"][0]
eg_patch = next(d for d in eg_docs if d["kind"] == "EnvoyPatchPolicy")["spec"]["jsonPatches"][0]
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


def wasm_filter(name, config_json, fail_open):
    # What an ECDS wasm filter from a WasmPlugin looks like: no vm_id, config as a JSON string.
    return {
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": name,
                "root_id": "kvroute",
                "vm_config": {"runtime": "envoy.wasm.runtime.v8", "code": {"local": {"filename": wasm}}},
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": config_json},
                "allow_on_headers_stop_iteration": True,
                "failure_policy": "FAIL_OPEN" if fail_open else "FAIL_CLOSED",
            },
        },
    }


def build(plugin_config, eg_config, replicas_config):
    pool = merge(istio_cluster(POOL), gw["CLUSTER"]["patch"]["value"])
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
    route = merge(route, gw["HTTP_ROUTE"]["patch"]["value"])
    eg_route = {"name": "eg", "match": {"prefix": "/eg/"}, "route": {"cluster": EG_POOL, "timeout": "300s"}}
    hcm_filters = [
        gw["HTTP_FILTER"]["patch"]["value"],  # INSERT_FIRST
        wasm_filter("istio.kvroute", plugin_config, True),
        # The pluginConfig with the replicas' exchange on (replicas-gateway.yaml's addition).
        wasm_filter("istio.kvroute.replicas", replicas_config, True),
        wasm_filter("eg.kvroute", eg_config, eg_policy.get("failOpen", False)),
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


istio_cfg, eg_cfg = plugin["pluginConfig"], eg_policy["config"]
assert istio_cfg["discovery"]["admin_cluster"] == "prometheus_stats" and istio_cfg["discovery"]["cluster"] == POOL
assert eg_cfg["discovery"]["cluster"] == EG_POOL
replicas_cfg = dict(istio_cfg, share={"replicas": {"cluster": PEERS, "secret": "example-secret-0123456789"}})
yaml.safe_dump(build(json.dumps(istio_cfg), json.dumps(eg_cfg), json.dumps(replicas_cfg)), open(out, "w"), sort_keys=False)
print(f"wrote {out}")
