#!/usr/bin/env python3
"""Prints the ConfigMap `kvroute-wasm` that delivers kvroute's filter to the gateway
(envoy/kubernetes/gateway.yaml mounts it at /etc/kvroute/kvroute.wasm), with the module in
binaryData and its SHA-256 in an annotation:

    python3 scripts/k8s-wasm-configmap.py dist/kvroute.wasm | kubectl apply --server-side --force-conflicts -n kvroute -f -

Server-side apply: a client-side `kubectl apply` copies the whole object into its
`last-applied-configuration` annotation, and annotations are capped at 256 KiB, so the
API server would refuse the ConfigMap. A ConfigMap holds at most 1 MiB: a larger module is
refused with a message (then deliver it with an init container or an OCI image instead, as
envoy/istio/ does).

The 1 MiB counts the module's own bytes, not its base64: the API server's validation
(`ValidateConfigMap`, kubernetes pkg/apis/core/validation/validation.go) sums `len(value)`
over `data` and `binaryData`, and `binaryData` values are decoded bytes (`[]byte`) by then.
The base64 travels only in the request (a third larger, within the API server's 3 MiB
request body), and etcd stores the object as protobuf, raw bytes, within its default 1.5 MiB
request limit (`--max-request-bytes`). The SHA-256 annotation does not count.
"""

import base64
import hashlib
import sys

LIMIT = 1 << 20


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "dist/kvroute.wasm"
    name = sys.argv[2] if len(sys.argv) > 2 else "kvroute-wasm"
    data = open(path, "rb").read()
    if not data.startswith(b"\0asm"):
        sys.exit(f"{path} is not a wasm module")
    if len(data) > LIMIT:
        sys.exit(f"{path}: {len(data)} bytes does not fit a ConfigMap (at most {LIMIT} bytes of data)")
    encoded = base64.b64encode(data).decode()
    print("apiVersion: v1")
    print("kind: ConfigMap")
    print("metadata:")
    print(f"  name: {name}")
    print("  labels: { app.kubernetes.io/name: kvroute-gateway, app.kubernetes.io/part-of: kvroute }")
    print("  annotations:")
    print(f'    kvroute.io/wasm-sha256: "{hashlib.sha256(data).hexdigest()}"')
    print("binaryData:")
    print(f"  kvroute.wasm: {encoded}")


if __name__ == "__main__":
    main()
