// Validates Istio, Gateway API and Envoy Gateway documents (a JSON list of {where, doc} on stdin) with the
// validators the pinned npm packages of envoy/schemas/package.json compile from those
// projects' CRD schemas (@kubernetes-models/istio, @kubernetes-models/gateway-api,
// @kubernetes-models/envoy-gateway).
// Prints one line per document, then {"passed": N, "failed": N}; exits 1 if any failed.
// Run by scripts/validate_manifests.py; argv[2] is the node_modules folder.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import path from "node:path";

const modules = process.argv[2];
const PACKAGES = {
  "networking.istio.io": "@kubernetes-models/istio",
  "extensions.istio.io": "@kubernetes-models/istio",
  "gateway.networking.k8s.io": "@kubernetes-models/gateway-api",
  "gateway.envoyproxy.io": "@kubernetes-models/envoy-gateway",
};

async function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.split("/");
  const pkg = PACKAGES[group];
  if (!pkg) return null;
  const file = path.join(modules, pkg, group, version, `${kind}.js`);
  try {
    const mod = await import(pathToFileURL(file).href);
    return { Model: mod[kind], pkg };
  } catch (e) {
    return { error: `no validator for ${apiVersion} ${kind} in ${pkg} (${e.code || e.message})` };
  }
}

const docs = JSON.parse(readFileSync(0, "utf8"));
let passed = 0;
let failed = 0;
for (const { where, doc } of docs) {
  const found = await modelFor(doc.apiVersion, doc.kind);
  if (!found || found.error) {
    failed++;
    console.log(`FAIL ${where}: ${found ? found.error : "unknown group"}`);
    continue;
  }
  const version = JSON.parse(readFileSync(path.join(modules, found.pkg, "package.json"), "utf8")).version;
  try {
    new found.Model(doc).validate();
    passed++;
    console.log(`ok   ${where} (${found.pkg}@${version}, compiled from the CRD schema)`);
  } catch (e) {
    failed++;
    console.log(`FAIL ${where}: ${e.message}`);
  }
}
console.log(JSON.stringify({ passed, failed }));
process.exit(failed ? 1 : 0);
