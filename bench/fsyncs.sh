#!/usr/bin/env bash
# fsyncs per round (issues 13 and 15): N non-stream requests as chat turns (no
# `Turnguard-Run`), then N with a run of their own each, against a turnguard (release build) on
# each journal backend in JOURNALS. SQLite: turnguard runs under `strace -f` and its
# fsync/fdatasync calls are counted. PostgreSQL (a throwaway cluster from .ci/postgres.sh, or
# BENCH_PG_URL): the server does the syncing, so `pg_stat_wal.wal_sync` (WAL syncs, every
# backend and the WAL writer) is read before and after. strace slows the process: this counts,
# it does not time.
#
#   apt-get install strace; bench/fsyncs.sh [N]             (default N = 200)
#   JOURNALS="sqlite postgres" bench/fsyncs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
N=${1:-200}
JOURNALS=${JOURNALS:-sqlite}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
cargo build --release --locked --bin turnguard --example benchtool 2>&1 | tail -1
TG=$CARGO_TARGET_DIR/release/turnguard
TOOL=$CARGO_TARGET_DIR/release/examples/benchtool
WORK=$(mktemp -d)
MOCK=$(free_port)
PIDS=()
PG_DIR=""
cleanup() {
  # strace detaches from its tracee when killed: stop the traced turnguard (its child) first.
  for p in "${PIDS[@]}"; do pkill -TERM -P "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ -n "$PG_DIR" ]; then .ci/postgres.sh stop "$PG_DIR"; fi
}
trap cleanup EXIT
"$TOOL" mock --listen "127.0.0.1:$MOCK" & PIDS+=($!)
bench_bundle "$WORK"
if [[ " $JOURNALS " == *" postgres "* ]] && [ -z "${BENCH_PG_URL:-}" ]; then
  read -r PG_DIR BENCH_PG_URL < <(TURNGUARD_CI_PG_PORT=${BENCH_PG_PORT:-55434} .ci/postgres.sh)
fi

for j in $JOURNALS; do
  PORT=$(free_port); ADMIN=$(free_port)
  case "$j" in
    sqlite)
      : > "$WORK/strace.txt"
      strace -f -qq -e trace=fsync,fdatasync -o "$WORK/strace.txt" "$TG" serve --listen "127.0.0.1:$PORT" \
        --admin-listen "127.0.0.1:$ADMIN" --journal "$WORK/journal.db" --policy "$WORK/policy" \
        --upstream "openai=http://127.0.0.1:$MOCK" 2> "$WORK/turnguard-sqlite.log" &
      count() { grep -cE '(fsync|fdatasync)\(' "$WORK/strace.txt" || true; } ;;
    postgres)
      psql -q "$BENCH_PG_URL" -c "DROP DATABASE IF EXISTS fsyncs" -c "CREATE DATABASE fsyncs" >/dev/null
      url=$(python3 -c 'import sys,urllib.parse as u;p=u.urlsplit(sys.argv[1]);print(u.urlunsplit(p._replace(path="/fsyncs")))' "$BENCH_PG_URL")
      "$TG" serve --listen "127.0.0.1:$PORT" --admin-listen "127.0.0.1:$ADMIN" --journal "$url" \
        --policy "$WORK/policy" --upstream "openai=http://127.0.0.1:$MOCK" 2> "$WORK/turnguard-pg.log" &
      count() { psql -At "$BENCH_PG_URL" -c "select wal_sync from pg_stat_wal"; } ;;
    *) echo "unknown journal backend: $j" >&2; exit 2 ;;
  esac
  PIDS+=($!)
  for _ in $(seq 200); do curl -sf "http://127.0.0.1:$ADMIN/readyz" >/dev/null && break; sleep 0.1; done
  URL="http://127.0.0.1:$PORT/v1/chat/completions"
  measure() { # label benchtool-args...
    local label=$1; shift
    local before after
    sleep 1; before=$(count)
    "$TOOL" open --url "$URL" --rate 100 --connections 4 --seconds "$((N / 100))" "$@" > "$WORK/$j-$label.json"
    sleep 1; after=$(count)
    python3 - "$j" "$label" "$before" "$after" "$WORK/$j-$label.json" <<'PY'
import json, sys
backend, label, before, after, f = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
r = json.load(open(f))
n = r["requests"]
what = "fsync/fdatasync calls" if backend == "sqlite" else "WAL syncs (pg_stat_wal.wal_sync)"
print(f"{backend}, {label}: {n} requests ({r['errors']} errors), {after - before} {what}, {(after - before) / max(n, 1):.2f} per request")
PY
  }
  measure "chat turns (no Turnguard-Run)"
  measure "run rounds (Turnguard-Run each)" --run-prefix "fsync-bench-$j"
  # (each backend's turnguard is stopped by the EXIT trap)
done
