# Shared by scripts/demo.sh (`make run`) and scripts/bench-live.sh (`make bench-live`):
# start and stop the simulated fleet, Envoy (one or two processes) and SGLang's model
# gateway, all on 127.0.0.1, and make sure every process started is stopped on exit,
# failure or Ctrl-C. Source it from the repository root after `set -euo pipefail`.
#
# Every process is started in its own session (setsid), so stopping it stops whatever it
# spawned; only the process groups started here are ever signalled. The functions return
# non-zero on failure rather than exit, so a caller may go on after a failed run (each
# failing step says `|| return 1`: errexit is off inside a function called from `if`).

SIM=${SIM:-target/release/kvroute-sim}
WASM=${WASM:-dist/kvroute.wasm}
ENVOY=${ENVOY:-.venv/bin/envoy}
SMG=${SMG:-.venv/bin/smg}
OUT=${OUT:?set OUT before sourcing scripts/lib.sh}

# Ports (all on 127.0.0.1, all below Linux's ephemeral range so no test's free port lands
# on them): the servers SIM_BASE..SIM_BASE+3 with their admin port SIM_BASE-1; Envoy
# replica k listens on ENVOY_PORT+k with admin ADMIN_PORT+k; the model gateway on SMG_PORT
# with its metrics on SMG_METRICS_PORT.
SIM_BASE=${SIM_BASE:-8001}
ENVOY_PORT=${ENVOY_PORT:-10000}
ADMIN_PORT=${ADMIN_PORT:-9901}
SMG_PORT=${SMG_PORT:-30000}
SMG_METRICS_PORT=${SMG_METRICS_PORT:-29000}
SERVERS=4

pids=()

# Stops every process group started here: TERM, then KILL after 5 s.
stop_all() {
  local p
  for p in "${pids[@]+"${pids[@]}"}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  for _ in $(seq 1 50); do
    local alive=0
    for p in "${pids[@]+"${pids[@]}"}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]+"${pids[@]}"}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
  for p in "${pids[@]+"${pids[@]}"}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap stop_all EXIT
trap 'echo; echo "interrupted: stopping everything"; exit 130' INT TERM

# Starts "$@" in its own session with stdout and stderr to the file $1; records its pid.
spawn() {
  local log=$1
  shift
  setsid "$@" >"$log" 2>&1 </dev/null &
  pids+=($!)
}

# Runs "$@" like spawn, with stdout to $1 and stderr to $2, and waits for it. In the
# background rather than in the foreground so that a signal to this script is handled at
# once (bash runs traps only between foreground commands) and stops it too.
run_waited() {
  local out=$1 err=$2 rc=0 p q keep=()
  shift 2
  setsid "$@" >"$out" 2>"$err" </dev/null &
  p=$!
  pids+=("$p")
  wait "$p" || rc=$?
  for q in "${pids[@]}"; do [ "$q" = "$p" ] || keep+=("$q"); done
  pids=("${keep[@]+"${keep[@]}"}")
  return "$rc"
}

# Copies the filter and the simulator into $OUT/bin and uses the copies from then on, so a
# rebuild in the same checkout during a long series (others build there too) cannot change
# what is measured. BUILD names what was copied: the commit, "+uncommitted" when filter/ or
# simulator/ differed from it.
snapshot_artifacts() {
  mkdir -p "$OUT/bin"
  cp "$WASM" "$OUT/bin/kvroute.wasm"
  cp "$SIM" "$OUT/bin/kvroute-sim"
  WASM="$OUT/bin/kvroute.wasm"
  SIM="$OUT/bin/kvroute-sim"
  BUILD=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  if [ -n "$(git status --porcelain -- filter simulator 2>/dev/null)" ]; then BUILD="$BUILD+uncommitted"; fi
  (cd "$OUT/bin" && sha256sum kvroute.wasm kvroute-sim >SHA256SUMS)
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Fails unless every port given is free.
require_free() {
  local p busy=()
  for p in "$@"; do port_open "$p" && busy+=("$p"); done
  if [ ${#busy[@]} -gt 0 ]; then
    echo "port(s) ${busy[*]} on 127.0.0.1 already in use: stop whatever listens there, or move this run" \
      "(SIM_BASE, ENVOY_PORT, ADMIN_PORT, SMG_PORT, SMG_METRICS_PORT)" >&2
    return 1
  fi
}

sim_ports() { seq $((SIM_BASE - 1)) $((SIM_BASE + SERVERS - 1)); }

# Waits (up to 15 s) until `check` succeeds; `what` names it in the error.
wait_for() {
  local what=$1
  shift
  for _ in $(seq 1 150); do
    "$@" && return 0
    sleep 0.1
  done
  echo "$what did not come up within 15 s; logs in $OUT/" >&2
  return 1
}

# Fails if a process started here listens anywhere but on loopback.
require_loopback_only() {
  command -v ss >/dev/null || return 0
  local p bad
  for p in "${pids[@]+"${pids[@]}"}"; do
    bad=$(ss -ltnpH 2>/dev/null | grep -E "pid=$p," | awk '{print $4}' | grep -vE '^(127\.0\.0\.1|\[::1\]):' || true)
    if [ -n "$bad" ]; then
      echo "process $p listens on a non-loopback address: $bad" >&2
      return 1
    fi
  done
}

all_sim_ports_open() {
  local p
  for p in $(sim_ports); do port_open "$p" || return 1; done
}

# A fresh simulated fleet: 4 servers (Llama-3.1-8B on H100) on 127.0.0.1.
start_fleet() {
  local tag=$1
  require_free $(sim_ports) || return 1
  spawn "$OUT/sim-$tag.log" "$SIM" serve --servers "$SERVERS" --host 127.0.0.1 --base-port "$SIM_BASE"
  wait_for "the simulated servers" all_sim_ports_open
}

# Writes envoy/<config> to $OUT with its pool, listener and admin ports moved to ours
# (replica k: listener ENVOY_PORT+k, admin ADMIN_PORT+k) and the filter loaded from $WASM.
envoy_config() {
  local src=$1 dst=$2 k=$3 i expr=()
  for i in 0 1 2 3; do
    expr+=(-e "s/127\.0\.0\.1:800$((i + 1))\b/127.0.0.1:$((SIM_BASE + i))/g")
    expr+=(-e "s/port_value: 800$((i + 1))\b/port_value: $((SIM_BASE + i))/g")
  done
  expr+=(-e "s/port_value: 10000\b/port_value: $((ENVOY_PORT + k))/")
  expr+=(-e "s/port_value: 9901\b/port_value: $((ADMIN_PORT + k))/")
  expr+=(-e "s#filename: dist/kvroute.wasm#filename: $WASM#")
  sed "${expr[@]}" "$src" >"$dst"
  if grep -qE 'address: (0\.0\.0\.0|::)[^0-9]|"0\.0\.0\.0' "$dst"; then
    echo "$dst binds a non-loopback address" >&2
    return 1
  fi
}

# Makes the config `dst` one of two gateway replicas that exchange placements (kvroute's
# share.replicas): the replicas' cluster from envoy/fragments/replicas-cluster.yaml naming
# both replicas' listeners, and the exchange in the plugin configuration.
add_replicas() {
  local dst=$1 a=$ENVOY_PORT b=$((ENVOY_PORT + 1)) cluster
  cluster=$(grep -v '^#' envoy/fragments/replicas-cluster.yaml |
    sed -e "s/port_value: 10100\b/port_value: $a/" -e "s/port_value: 10200\b/port_value: $b/")
  # No peers list: each replica reads them from the cluster (the shipped Kubernetes shape).
  # REPLICAS_OPTIONS: more of share.replicas, e.g. '"from_workers": false'.
  local share="\"share\": {\"replicas\": {\"secret\": \"bench-live-replica-secret\"${REPLICAS_OPTIONS:+, $REPLICAS_OPTIONS}}},"
  python3 - "$dst" "$cluster" "$share" <<'PY'
import sys
path, cluster, share = sys.argv[1:4]
text = open(path).read()
text = text.replace('"policy": "cost",', '"policy": "cost", ' + share)
text = text.replace("  clusters:\n", "  clusters:\n" + cluster + "\n", 1)
open(path, "w").write(text)
PY
}

envoy_ready() { port_open "$1" && curl -sf "http://127.0.0.1:$2/ready" >/dev/null 2>&1; }

# Envoy replica k (0, 1, ...) with `config` and `workers` worker threads; a fifth
# argument `exchange` makes it exchange placements with the other replica (add_replicas).
start_envoy() {
  local tag=$1 config=$2 workers=$3 k=${4:-0} exchange=${5:-}
  local port=$((ENVOY_PORT + k)) admin=$((ADMIN_PORT + k))
  require_free "$port" "$admin" || return 1
  envoy_config "$config" "$OUT/envoy-$tag-$k.yaml" "$k" || return 1
  if [ "$exchange" = exchange ]; then add_replicas "$OUT/envoy-$tag-$k.yaml" || return 1; fi
  # A dynamic base id: two Envoys (ours, or a test's) never share hot-restart memory.
  spawn "$OUT/envoy-$tag-$k.out" "$ENVOY" -c "$OUT/envoy-$tag-$k.yaml" --concurrency "$workers" \
    --use-dynamic-base-id -l warn --log-path "$OUT/envoy-$tag-$k.log"
  wait_for "Envoy (replica $k, $config)" envoy_ready "$port" "$admin"
}

smg_ready() { curl -sf "http://127.0.0.1:$SMG_PORT/readiness" >/dev/null 2>&1; }

# SGLang's model gateway (PyPI `smg`), cache_aware over the fleet, on loopback only.
start_smg() {
  local tag=$1 urls=() i
  require_free "$SMG_PORT" "$SMG_METRICS_PORT" || return 1
  for i in $(seq 0 $((SERVERS - 1))); do urls+=("http://127.0.0.1:$((SIM_BASE + i))"); done
  spawn "$OUT/smg-$tag.log" "$SMG" launch --host 127.0.0.1 --port "$SMG_PORT" \
    --prometheus-host 127.0.0.1 --prometheus-port "$SMG_METRICS_PORT" \
    --worker-urls "${urls[@]}" --policy cache_aware --log-level warn --shutdown-grace-period-secs 1
  wait_for "smg" smg_ready
}
