#!/usr/bin/env bash
# turnguard benchmark: direct vs an nginx hop vs turnguard, interleaved, on loopback only.
# Bounded: 9 cells × ROUNDS × (2 + one turnguard per allocator) configurations × SECONDS
# (defaults: 9 × 3 × 3 × 6 s ≈ 8 min of load plus warm-ups). Not part of CI. See bench/README.md.
#
#   bench/run.sh                 # needs: wrk, nginx (apt-get install wrk nginx), python3
#   ROUNDS=1 SECONDS_PER_RUN=3 bench/run.sh   # a quick smoke run
#   ALLOCATORS="jemalloc mimalloc system" bench/run.sh   # one turnguard per global allocator
#   JOURNALS="sqlite postgres" bench/run.sh   # + a turnguard on a PostgreSQL journal (a
#                                # throwaway cluster from .ci/postgres.sh, or BENCH_PG_URL)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
ROUNDS=${ROUNDS:-3}
SECS=${SECONDS_PER_RUN:-6}
EVENT_DELAY_US=${EVENT_DELAY_US:-1000}
OUT=${OUT:-bench/out}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
# Load generator and mock on CPU 0, the proxy under test (nginx or turnguard) alone on CPU 1.
LOADGEN_CPU=${LOADGEN_CPU:-0}
PROXY_CPU=${PROXY_CPU:-1}
# One turnguard build per global allocator (`jemalloc` = the default build; `mimalloc` = its
# cargo feature; `system` = `--no-default-features`), all measured in the same interleaved run.
ALLOCATORS=${ALLOCATORS:-jemalloc}
OPEN_RATE=${OPEN_RATE:-1000}
# Journal backends: `sqlite` (a file, the embedded default) and/or `postgres` (config names get
# a `-pg` suffix). PostgreSQL runs on the load generator's CPU, so the proxy's core stays its
# own; its CPU is reported separately (postgres-cpu.txt), not in turnguard's per-request CPU.
JOURNALS=${JOURNALS:-sqlite}

command -v wrk >/dev/null || { echo "wrk is missing: apt-get install wrk" >&2; exit 1; }
command -v nginx >/dev/null || { echo "nginx is missing: apt-get install nginx" >&2; exit 1; }

rm -rf "$OUT"; mkdir -p "$OUT"
WORK=$(mktemp -d)
echo "== build (release)"
cargo build --release --locked --example benchtool 2>&1 | tail -1
TOOL=$CARGO_TARGET_DIR/release/examples/benchtool
for a in $ALLOCATORS; do
  features=($(allocator_features "$a"))
  cargo build --release --locked --bin turnguard "${features[@]}" 2>&1 | tail -1
  cp "$CARGO_TARGET_DIR/release/turnguard" "$WORK/turnguard-$a"
done
TG=$WORK/turnguard-${ALLOCATORS%% *}
MOCK_PORT=$(free_port); NGINX_PORT=$(free_port)

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap 'cleanup; stop_pg 2>/dev/null || true' EXIT

echo "== start mock :$MOCK_PORT, nginx :$NGINX_PORT, turnguard per allocator ($ALLOCATORS)"
taskset -c "$LOADGEN_CPU" "$TOOL" mock --listen "127.0.0.1:$MOCK_PORT" --event-delay-us "$EVENT_DELAY_US" &
PIDS+=($!)

mkdir -p "$WORK/nginx"
sed -e "s/@NGINX_PORT@/$NGINX_PORT/g" -e "s/@MOCK_PORT@/$MOCK_PORT/g" -e "s#@WORK@#$WORK#g" \
  bench/nginx.conf > "$WORK/nginx.conf"
taskset -c "$PROXY_CPU" nginx -p "$WORK/nginx" -c "$WORK/nginx.conf"

# Full pipeline: the acme example bundle (policy/examples/acme: a catalog that lists the
# bench's `get_weather`, so its arguments are validated against the catalog schema too, Cedar
# rules over arguments, limits, redaction) with its per-(principal, tool) token bucket raised
# so the bench's one agent is not rate-limited (the bucket still runs), journal on (a file on
# disk, synchronous=FULL), JSON logs.
bench_bundle "$WORK"
"$TG" policy check "$WORK/policy" >/dev/null
declare -A URL=(
  [direct]="http://127.0.0.1:$MOCK_PORT/v1/chat/completions"
  [nginx]="http://127.0.0.1:$NGINX_PORT/v1/chat/completions"
)
declare -A PID_OF=() ADMIN_OF=()
CONFIGS=(direct nginx)
PG_DIR=""
if [[ " $JOURNALS " == *" postgres "* ]] && [ -z "${BENCH_PG_URL:-}" ]; then
  read -r PG_DIR BENCH_PG_URL < <(TURNGUARD_CI_PG_PORT=${BENCH_PG_PORT:-55433} .ci/postgres.sh)
  PG_PID=$(head -1 "$PG_DIR/db/postmaster.pid")
  for p in "$PG_PID" $(pgrep -P "$PG_PID"); do taskset -pc "$LOADGEN_CPU" "$p" >/dev/null; done
fi
stop_pg() { [ -n "$PG_DIR" ] && .ci/postgres.sh stop "$PG_DIR"; }
pg_db() { # name → URL of a fresh database on the bench cluster
  psql -q "$BENCH_PG_URL" -c "DROP DATABASE IF EXISTS $1" -c "CREATE DATABASE $1" >/dev/null
  python3 -c 'import sys,urllib.parse as u;p=u.urlsplit(sys.argv[1]);print(u.urlunsplit(p._replace(path="/"+sys.argv[2])))' "$BENCH_PG_URL" "$1"
}
for a in $ALLOCATORS; do for j in $JOURNALS; do
  port=$(free_port); admin=$(free_port); cfg=turnguard-$a; journal="$WORK/journal-$a.db"
  if [ "$j" = postgres ]; then cfg=turnguard-$a-pg; journal=$(pg_db "bench_${a}"); fi
  taskset -c "$PROXY_CPU" "$WORK/turnguard-$a" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
    --journal "$journal" --policy "$WORK/policy" --upstream "openai=http://127.0.0.1:$MOCK_PORT" \
    --log-format json 2> "$OUT/$cfg.log" &
  PID_OF[$cfg]=$!; PIDS+=($!)
  URL[$cfg]="http://127.0.0.1:$port/v1/chat/completions"
  ADMIN_OF[$cfg]="http://127.0.0.1:$admin"
  CONFIGS+=("$cfg")
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$admin/readyz" >/dev/null && break; sleep 0.1; done
done; done
for _ in $(seq 100); do curl -sf -o /dev/null "http://127.0.0.1:$NGINX_PORT/healthz-nginx" && break; sleep 0.1; done

ticks() { if [ -n "${1:-}" ]; then awk '{print $14+$15}' "/proc/$1/stat"; else echo 0; fi; }
CLK=$(getconf CLK_TCK)

# Cells: KIND CONCURRENCY. `json*` is wrk (closed loop), `open*` benchtool's open loop at
# OPEN_RATE requests/s over CONCURRENCY connections, `stream*` benchtool's streaming load;
# a `run` suffix puts a `Turnguard-Run` of its own on every request (run journaling).
run_cell() { # kind concurrency config round
  local kind=$1 c=$2 cfg=$3 round=$4 t0 t1 out pid=${PID_OF[$cfg]:-} prefix=()
  t0=$(ticks "$pid")
  case "$kind" in *run) prefix=(--run-prefix "bench-$cfg-$kind-c$c-r$round") ;; esac
  case "$kind" in
    json|jsonrun)
      local script=bench/post.lua; [ "$kind" = jsonrun ] && script=bench/post-run.lua
      out=$(taskset -c "$LOADGEN_CPU" wrk -t1 -c"$c" -d"${SECS}s" --latency -s "$script" "${URL[$cfg]}")
      echo "$out" > "$OUT/wrk-$kind-c$c-$cfg-r$round.txt"
      line=$(python3 bench/report.py wrk <<<"$out") ;;
    open|openrun)
      line=$(taskset -c "$LOADGEN_CPU" "$TOOL" open --url "${URL[$cfg]}" --rate "$OPEN_RATE" --connections "$c" --seconds "$SECS" "${prefix[@]}") ;;
    *)
      line=$(taskset -c "$LOADGEN_CPU" "$TOOL" stream --url "${URL[$cfg]}" --concurrency "$c" --seconds "$SECS" "${prefix[@]}") ;;
  esac
  t1=$(ticks "$pid")
  echo "{\"kind\":\"$kind\",\"c\":$c,\"config\":\"$cfg\",\"round\":$round,\"tg_cpu_ticks\":$((t1-t0)),\"clk_tck\":$CLK,\"result\":$line}" >> "$OUT/results.jsonl"
  echo "   $kind c=$c $cfg r$round: $line"
}

echo "== warm-up"
for cfg in "${CONFIGS[@]}"; do
  taskset -c "$LOADGEN_CPU" wrk -t1 -c16 -d2s -s bench/post.lua "${URL[$cfg]}" >/dev/null
done

echo "== measure (interleaved: every round runs every configuration back to back)"
for cell in "json 1" "json 16" "json 64" "jsonrun 64" "open 64" "openrun 64" "stream 1" "stream 16" "streamrun 16"; do
  set -- $cell
  for round in $(seq "$ROUNDS"); do
    for cfg in "${CONFIGS[@]}"; do run_cell "$1" "$2" "$cfg" "$round"; done
  done
  # Which cell moves the peak: VmHWM and the thread count after every cell (rss-cells.jsonl).
  for cfg in "${CONFIGS[@]}"; do
    [ -n "${PID_OF[$cfg]:-}" ] || continue
    hwm=$(awk '/^VmHWM/{print $2}' "/proc/${PID_OF[$cfg]}/status")
    threads=$(ls "/proc/${PID_OF[$cfg]}/task" | wc -l)
    echo "{\"config\":\"$cfg\",\"cell\":\"$1 c=$2\",\"peak_rss_kib\":$hwm,\"threads\":$threads}" >> "$OUT/rss-cells.jsonl"
  done
  if [ "$1 $2" = "json 64" ]; then
    for cfg in "${CONFIGS[@]}"; do
      [ -n "${PID_OF[$cfg]:-}" ] || continue
      grep VmHWM "/proc/${PID_OF[$cfg]}/status" | awk -v c="$cfg" '{print "{\"config\":\""c"\",\"peak_rss_kib_after_c64\":"$2"}"}' >> "$OUT/rss.jsonl"
    done
  fi
done
for cfg in "${CONFIGS[@]}"; do
  [ -n "${PID_OF[$cfg]:-}" ] || continue
  grep VmHWM "/proc/${PID_OF[$cfg]}/status" | awk -v c="$cfg" '{print "{\"config\":\""c"\",\"peak_rss_kib_end\":"$2"}"}' >> "$OUT/rss.jsonl"
done
for p in $(pgrep -P "$(cat "$WORK/nginx.pid")") "$(cat "$WORK/nginx.pid")"; do
  grep VmHWM "/proc/$p/status" | awk -v p="$p" '{print "{\"nginx_pid\":"p",\"peak_rss_kib\":"$2"}"}' >> "$OUT/rss.jsonl"
done
for cfg in "${CONFIGS[@]}"; do
  [ -n "${ADMIN_OF[$cfg]:-}" ] || continue
  curl -s "${ADMIN_OF[$cfg]}/metrics" > "$OUT/$cfg-metrics.txt"
  # Every call must have been released: a bench of refused calls would measure something else.
  if grep -E '^turnguard_tool_calls_total\{.*outcome="(invalid|refused|held)' "$OUT/$cfg-metrics.txt"; then
    echo "$cfg did not release every call: the bench request does not fit the policy" >&2
    exit 1
  fi
done
for a in $ALLOCATORS; do
  sqlite3 "$WORK/journal-$a.db" "select count(*) from rounds" > "$OUT/journal-rounds-$a.txt" 2>/dev/null || true
done
if [ -n "$PG_DIR" ]; then
  # PostgreSQL's own CPU over the whole run (the postmaster and its live children; backends
  # that already exited are not counted), beside turnguard's.
  ticks_pg=0
  for p in "$PG_PID" $(pgrep -P "$PG_PID"); do ticks_pg=$((ticks_pg + $(awk '{print $14+$15}' "/proc/$p/stat"))); done
  echo "postgres cpu ticks (whole run, clk_tck $CLK): $ticks_pg" > "$OUT/postgres-cpu.txt"
fi

echo "== environment"
{
  echo "date: $(date -u +%FT%TZ)"
  echo "kernel: $(uname -sr)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) × $(nproc)"
  echo "memory: $(free -m | awk '/Mem:/{print $2}') MiB"
  echo "turnguard: $($TG --version) ($(git rev-parse --short HEAD)); allocators: $ALLOCATORS; journals: $JOURNALS"
  [ -n "${BENCH_PG_URL:-}" ] && echo "postgresql: $(psql "$BENCH_PG_URL" -Atc 'show server_version'), on CPU $LOADGEN_CPU"
  echo "rustc: $(rustc --version)"
  echo "nginx: $(nginx -v 2>&1 | cut -d/ -f2)"
  echo "wrk: $(wrk -v 2>&1 | head -1)"
  echo "rounds: $ROUNDS × ${SECS}s per configuration and cell; stream event delay ${EVENT_DELAY_US}µs; open loop ${OPEN_RATE} req/s"
} > "$OUT/env.txt"
cat "$OUT/env.txt"
python3 bench/report.py summary "$OUT" | tee "$OUT/summary.md"
