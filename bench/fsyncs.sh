#!/usr/bin/env bash
# fsyncs per round (issue 13): turnguard (release build) under `strace -f`, N non-stream
# requests as chat turns (no `Turnguard-Run`), then N with a run of their own each; counts
# fsync/fdatasync calls per request and the journal's commits. strace slows the process: this
# counts, it does not time.
#
#   apt-get install strace wrk; bench/fsyncs.sh [N]     (default N = 200)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-200}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
cargo build --release --locked --bin turnguard --example benchtool 2>&1 | tail -1
TG=$CARGO_TARGET_DIR/release/turnguard
TOOL=$CARGO_TARGET_DIR/release/examples/benchtool
WORK=$(mktemp -d)
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
MOCK=$(free_port); PORT=$(free_port); ADMIN=$(free_port)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT
"$TOOL" mock --listen "127.0.0.1:$MOCK" & PIDS+=($!)
cp -r policy/examples/acme "$WORK/policy"
sed -i -e 's/^burst = .*/burst = 100000000/' -e 's/^per_minute = .*/per_minute = 100000000/' "$WORK/policy/turnguard.toml"
strace -f -qq -e trace=fsync,fdatasync -o "$WORK/strace.txt" "$TG" serve --listen "127.0.0.1:$PORT" \
  --admin-listen "127.0.0.1:$ADMIN" --journal "$WORK/journal.db" --policy "$WORK/policy" \
  --upstream "openai=http://127.0.0.1:$MOCK" 2> "$WORK/turnguard.log" &
PIDS+=($!)
for _ in $(seq 200); do curl -sf "http://127.0.0.1:$ADMIN/readyz" >/dev/null && break; sleep 0.1; done
URL="http://127.0.0.1:$PORT/v1/chat/completions"
count() { grep -cE '(fsync|fdatasync)\(' "$WORK/strace.txt" || true; }
measure() { # label rate-prefix-args...
  local label=$1; shift
  local before after
  sleep 1; before=$(count)
  "$TOOL" open --url "$URL" --rate 100 --connections 4 --seconds "$((N / 100))" "$@" > "$WORK/$label.json"
  sleep 1; after=$(count)
  python3 - "$label" "$before" "$after" "$WORK/$label.json" <<'PY'
import json, sys
label, before, after, f = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
r = json.load(open(f))
n = r["requests"]
print(f"{label}: {n} requests ({r['errors']} errors), {after - before} fsync/fdatasync calls, {(after - before) / max(n, 1):.2f} per request")
PY
}
measure "chat turns (no Turnguard-Run)"
measure "run rounds (Turnguard-Run each)" --run-prefix fsync-bench
