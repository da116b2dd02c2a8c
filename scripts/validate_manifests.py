#!/usr/bin/env python3
"""Offline schema validation of every Kubernetes manifest under envoy/ (make test-manifests).

  check [FILES...]   validates every document of every manifest (default: envoy/kubernetes,
                     envoy/istio, envoy/envoy-gateway) and prints `manifests: N passed, N failed`
  fixtures           regenerates envoy/schemas/kubernetes/ from the installed, pinned
                     kubernetes-validate package (envoy/schemas/requirements.txt)

Kinds and what checks them (provenance in envoy/schemas/README.md):
  - core Kubernetes (ConfigMap, Service, Deployment, HorizontalPodAutoscaler): the JSON
    schemas in envoy/schemas/kubernetes/ (strict: an unknown field fails), JSON Schema 2020-12;
  - Istio, Gateway API and Envoy Gateway kinds: the validators compiled from their CRDs in
    the pinned npm packages of envoy/schemas/package.json, run by scripts/validate-crds.mjs
    under node;
A document of any other kind fails: add its schema first.
"""

import json
import os
import subprocess
import sys

import yaml

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
K8S_DIR = os.path.join(ROOT, "envoy", "schemas", "kubernetes")
K8S_VERSION = "v1.33.0"
CORE = {
    ("v1", "ConfigMap"): "configmap-v1.json",
    ("v1", "Service"): "service-v1.json",
    ("apps/v1", "Deployment"): "deployment-apps-v1.json",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscaler-autoscaling-v2.json",
}
CRD_GROUPS = ("networking.istio.io/", "extensions.istio.io/", "gateway.networking.k8s.io/", "gateway.envoyproxy.io/")
DEFAULT_DIRS = ["envoy/kubernetes", "envoy/istio", "envoy/envoy-gateway"]
# Files in those folders that are not Kubernetes manifests, and what checks them instead.
NOT_MANIFESTS = {"envoy/kubernetes/prometheus.yml": "promtool check config (scripts/test-manifests.sh)"}


def fixtures():
    import kubernetes_validate  # the pinned package the fixtures come from

    src = os.path.join(os.path.dirname(kubernetes_validate.__file__), "kubernetes-json-schema", f"{K8S_VERSION}-local-strict")
    defs = json.load(open(os.path.join(src, "_definitions.json")))
    roots = {name: json.load(open(os.path.join(src, name))) for name in CORE.values()}
    keep, todo = set(), [roots[n] for n in roots]
    while todo:  # every definition reachable from the kinds we validate
        node = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if "#/$defs/" in ref:
                name = ref.split("#/$defs/", 1)[1]
                if name not in keep:
                    keep.add(name)
                    todo.append(defs["$defs"][name])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    os.makedirs(K8S_DIR, exist_ok=True)
    pruned = {k: v for k, v in defs.items() if k != "$defs"}
    pruned["$defs"] = {k: defs["$defs"][k] for k in sorted(keep)}
    json.dump(pruned, open(os.path.join(K8S_DIR, "_definitions.json"), "w"), indent=1, sort_keys=True)
    for name, schema in roots.items():
        json.dump(schema, open(os.path.join(K8S_DIR, name), "w"), indent=1, sort_keys=True)
    print(f"{K8S_DIR}: {len(roots)} kinds, {len(keep)} of {len(defs['$defs'])} definitions "
          f"(kubernetes-validate {kubernetes_validate.__version__ if hasattr(kubernetes_validate, '__version__') else ''}, {K8S_VERSION}-local-strict)")


def core_validator(name):
    import jsonschema
    from referencing import Registry, Resource

    schema = json.load(open(os.path.join(K8S_DIR, name)))
    defs = json.load(open(os.path.join(K8S_DIR, "_definitions.json")))
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def manifest_files(args):
    if args:
        return args
    files = []
    for d in DEFAULT_DIRS:
        for f in sorted(os.listdir(os.path.join(ROOT, d))):
            if f.endswith((".yaml", ".yml")):
                files.append(os.path.join(d, f))
    return files


def check(paths):
    passed = failed = 0
    crd_docs = []
    validators = {}

    def fail(where, msg):
        nonlocal failed
        failed += 1
        print(f"FAIL {where}: {msg}")

    def ok(where, how):
        nonlocal passed
        passed += 1
        print(f"ok   {where} ({how})")

    for path in paths:
        rel = os.path.relpath(os.path.join(ROOT, path) if not os.path.isabs(path) else path, ROOT)
        if rel in NOT_MANIFESTS:
            print(f"skip {rel}: not a Kubernetes manifest; checked by {NOT_MANIFESTS[rel]}")
            continue
        try:
            docs = [d for d in yaml.safe_load_all(open(os.path.join(ROOT, rel))) if d is not None]
        except yaml.YAMLError as e:
            fail(rel, f"not YAML: {e}")
            continue
        if not docs:
            fail(rel, "no document")
        for i, doc in enumerate(docs):
            kind, api = doc.get("kind"), doc.get("apiVersion")
            where = f"{rel}#{i} {kind}/{(doc.get('metadata') or {}).get('name')}"
            if (api, kind) in CORE:
                name = CORE[(api, kind)]
                v = validators.setdefault(name, core_validator(name))
                errors = sorted(v.iter_errors(doc), key=lambda e: list(e.absolute_path))
                if errors:
                    for e in errors[:5]:
                        fail(where, f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}")
                else:
                    ok(where, f"Kubernetes {K8S_VERSION} schema, strict")
            elif api and api.startswith(CRD_GROUPS):
                crd_docs.append({"where": where, "doc": doc})
            else:
                fail(where, f"no schema for apiVersion {api} kind {kind}: add one to envoy/schemas/")
    if crd_docs:
        p, f = run_crd_validators(crd_docs)
        passed += p
        failed += f
    print(f"manifests: {passed} passed, {failed} failed")
    return failed == 0


def run_crd_validators(docs):
    modules = os.environ.get("KVROUTE_SCHEMA_NODE_MODULES", os.path.join(ROOT, "target", "schemas-npm", "node_modules"))
    if not os.path.isdir(modules):
        print(f"FAIL: {modules} missing: run scripts/test-manifests.sh (it runs npm ci on envoy/schemas/package.json)")
        return 0, len(docs)
    env = dict(os.environ, NODE_PATH=modules)
    script = os.path.join(ROOT, "scripts", "validate-crds.mjs")
    r = subprocess.run(["node", script, modules], input=json.dumps(docs), capture_output=True, text=True, env=env)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    counts = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {"passed": 0, "failed": len(docs)}
    if r.returncode not in (0, 1):
        counts["failed"] = max(counts["failed"], 1)
    return counts["passed"], counts["failed"]


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "fixtures":
        fixtures()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "check":
        sys.exit(0 if check(manifest_files(sys.argv[2:])) else 1)
    sys.exit(__doc__)


if __name__ == "__main__":
    main()
