#!/usr/bin/env bash
# Packs dist/kvroute.wasm as the OCI image istio-agent pulls for envoy/istio/'s EnvoyFilters
# (their ECDS patch's `uri: oci://...`),
# without Docker: an OCI image layout directory (oci-layout, index.json, blobs/sha256/...)
# holding one image manifest whose single layer (application/vnd.oci.image.layer.v1.tar+gzip)
# is a tar with `plugin.wasm` — the "compat" variant of the Wasm image specification, which
# istio-agent extracts. The build is reproducible: same module, same digest.
#
#   scripts/build-oci.sh [WASM] [OUT] [IMAGE]
#     WASM   the module (default dist/kvroute.wasm)
#     OUT    the layout directory (default target/oci)
#     IMAGE  where you will push it, REGISTRY/REPOSITORY:TAG (default
#            registry.example.com/kvroute/kvroute:dev)
#
# It prints the manifest digest and writes OUT/envoyfilter-*.yaml: envoy/istio/'s EnvoyFilters
# with the module's `uri` set to oci://IMAGE and `sha256` to that digest (istio-agent compares
# `sha256` with the digest of the manifest it pulls). Push the layout with a tool that keeps the
# manifest bytes, e.g.
#   skopeo copy --preserve-digests oci:target/oci:TAG docker://REGISTRY/REPOSITORY:TAG
#   oras cp --from-oci-layout target/oci:TAG REGISTRY/REPOSITORY:TAG
set -euo pipefail
cd "$(dirname "$0")/.."

WASM=${1:-dist/kvroute.wasm}
OUT=${2:-target/oci}
IMAGE=${3:-registry.example.com/kvroute/kvroute:dev}
[ -f "$WASM" ] || { echo "$WASM not found: run 'make build-wasm' first" >&2; exit 1; }
case "$IMAGE" in
  *:*) ;;
  *) echo "IMAGE must be REGISTRY/REPOSITORY:TAG, got $IMAGE" >&2; exit 1 ;;
esac

python3 - "$WASM" "$OUT" "$IMAGE" <<'PY'
import gzip, hashlib, io, json, os, shutil, sys, tarfile

wasm_path, out, image = sys.argv[1:4]
tag = image.rsplit(":", 1)[1]
module = open(wasm_path, "rb").read()
if not module.startswith(b"\0asm"):
    sys.exit(f"{wasm_path} is not a wasm module")

shutil.rmtree(out, ignore_errors=True)
blobs = os.path.join(out, "blobs", "sha256")
os.makedirs(blobs)

def blob(data):
    digest = hashlib.sha256(data).hexdigest()
    with open(os.path.join(blobs, digest), "wb") as f:
        f.write(data)
    return {"digest": "sha256:" + digest, "size": len(data)}

# The layer: plugin.wasm in a tar, fixed owner and times so the digest depends on the module only.
raw = io.BytesIO()
with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
    info = tarfile.TarInfo("plugin.wasm")
    info.size, info.mode, info.mtime, info.uid, info.gid = len(module), 0o444, 0, 0, 0
    tar.addfile(info, io.BytesIO(module))
layer_tar = raw.getvalue()
layer = blob(gzip.compress(layer_tar, mtime=0))
layer["mediaType"] = "application/vnd.oci.image.layer.v1.tar+gzip"

config = blob(json.dumps({
    "architecture": "wasm",
    "os": "wasip1",
    "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer_tar).hexdigest()]},
    "config": {},
}, sort_keys=True, separators=(",", ":")).encode())
config["mediaType"] = "application/vnd.oci.image.config.v1+json"

manifest_bytes = json.dumps({
    "schemaVersion": 2,
    "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": config,
    "layers": [layer],
    "annotations": {
        "org.opencontainers.image.title": "kvroute.wasm",
        "org.opencontainers.image.description": "kvroute proxy-wasm filter (KV-cache-aware routing for vLLM pools)",
        "kvroute.io/module-sha256": hashlib.sha256(module).hexdigest(),
    },
}, sort_keys=True, separators=(",", ":")).encode()
manifest = blob(manifest_bytes)
manifest["mediaType"] = "application/vnd.oci.image.manifest.v1+json"
manifest["annotations"] = {"org.opencontainers.image.ref.name": tag}

with open(os.path.join(out, "oci-layout"), "w") as f:
    json.dump({"imageLayoutVersion": "1.0.0"}, f)
with open(os.path.join(out, "index.json"), "w") as f:
    json.dump({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest]}, f, indent=2)

digest = manifest["digest"].split(":", 1)[1]
with open(os.path.join(out, "DIGEST"), "w") as f:
    f.write(digest + "\n")
print(f"{out}: OCI image layout, tag {tag}")
print(f"manifest digest sha256:{digest}")
print(f"module sha256 {hashlib.sha256(module).hexdigest()} ({len(module)} bytes)")
PY

digest=$(cat "$OUT/DIGEST")
for f in envoy/istio/envoyfilter-*.yaml; do
  sed -e "s#oci://REGISTRY/kvroute:TAG#oci://$IMAGE#" -e "s#sha256: SHA256_OF_THE_OCI_MANIFEST#sha256: $digest#" "$f" >"$OUT/$(basename "$f")"
  grep -q "sha256: $digest" "$OUT/$(basename "$f")" || { echo "$f has no sha256 placeholder to fill" >&2; exit 1; }
  echo "wrote $OUT/$(basename "$f") (uri oci://$IMAGE, sha256 $digest)"
done
