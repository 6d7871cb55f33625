#!/usr/bin/env bash
# Instructions per request of one or more turnguard binaries, counted by valgrind's callgrind:
# a number that repeats for the same binary and input whatever else the VM is doing, where
# CPU time per request moves ±25 % (bench/RESULTS.md). For changes too small for ab.sh.
#
#   bench/instructions.sh OLD_BINARY NEW_BINARY         # json cell (post.lua's request)
#   CELL=jsonagent REQUESTS=1200 bench/instructions.sh old new
#   KEEP=/tmp/cg bench/instructions.sh new   # also keeps the last busy callgrind file there
#   BENCHTOOL=/tmp/benchtool bench/instructions.sh new   # a benchtool built before: no build
#   WITHOUT_SHA=1 bench/instructions.sh new   # SHA-256's compression function not counted
#
# Per binary: one run with REQUESTS requests (8 keep-alive connections, one at a time each)
# and one with 8, both under callgrind; instructions/request = (total − idle) / (REQUESTS − 8),
# so start-up, policy compilation and shutdown cancel out. Prints the top inclusive turnguard
# functions of the last binary. Caveats: user space only (no syscalls, no kernel time);
# valgrind does not emulate the SHA extensions, so SHA-256 runs in software and digest work is
# overstated next to a native run (a third of the json cell's count; WITHOUT_SHA=1 leaves
# sha2's compression function out: valgrind's --toggle-collect); the journal's group commits
# are smaller under valgrind's slowdown, so per-commit costs are overstated too. Needs
# valgrind and a release benchtool.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
[ $# -ge 1 ] || { echo "usage: bench/instructions.sh BINARY [BINARY…]" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "valgrind is missing: apt-get install valgrind" >&2; exit 1; }
CELL=${CELL:-json}
VG=(valgrind --tool=callgrind)
[ -n "${WITHOUT_SHA:-}" ] && VG+=(--toggle-collect='sha2::sha256::compress256*' --collect-atstart=yes)
REQUESTS=${REQUESTS:-2400}
case "$CELL" in
  json) script=bench/post.lua ;;
  jsonagent) script=bench/post-agent.lua ;;
  *) echo "CELL is json or jsonagent" >&2; exit 2 ;;
esac
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
TOOL=$(bench_tool)
WORK=$(mktemp -d)
MOCK_PORT=$(free_port)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"' EXIT
"$TOOL" mock --listen "127.0.0.1:$MOCK_PORT" >/dev/null &
PIDS+=($!)
bench_bundle "$WORK"

count() { # binary requests → instructions of the whole process
  local bin=$1 n=$2 port admin pid out
  port=$(free_port); admin=$(free_port); out="$WORK/cg.$n.out"
  rm -f "$WORK/journal.db"*
  "${VG[@]}" --callgrind-out-file="$out" "$bin" serve --listen "127.0.0.1:$port" \
    --admin-listen "127.0.0.1:$admin" --journal "$WORK/journal.db" --policy "$WORK/policy" \
    --upstream "openai=http://127.0.0.1:$MOCK_PORT" --log-format json 2> "$WORK/vg.log" &
  pid=$!
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$admin/readyz" >/dev/null && break; sleep 0.2; done
  python3 - "$script" "$port" "$n" <<'EOF'
import http.client, sys, threading
text = open(sys.argv[1]).read()
body = (text.split("wrk.body = [[", 1)[1].rsplit("]]", 1)[0] if "wrk.body = [[" in text
        else text.split("wrk.body = '", 1)[1].rsplit("'", 1)[0])
port, n = int(sys.argv[2]), int(sys.argv[3])
def run():
    c = http.client.HTTPConnection("127.0.0.1", port)
    for _ in range(n // 8):
        c.request("POST", "/v1/chat/completions", body,
                  {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"})
        r = c.getresponse(); r.read()
        assert r.status == 200, r.status
threads = [threading.Thread(target=run) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
EOF
  kill -INT "$pid"; wait "$pid" || true
  awk '/^summary:/ {print $2}' "$out"
}

for bin in "$@"; do
  bin=$(realpath "$bin")
  idle=$(count "$bin" 8)
  busy=$(count "$bin" "$REQUESTS")
  python3 -c "import sys; b,i,n=map(int,sys.argv[1:4]); print(f'{sys.argv[4]}\t{(b-i)/(n-8):,.0f} instructions/request ({n} requests, {sys.argv[5]})')" \
    "$busy" "$idle" "$REQUESTS" "$bin" "$CELL"
done
if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP"; cp "$WORK/cg.$REQUESTS.out" "$KEEP/callgrind.out"; fi
echo "top inclusive turnguard functions of the last binary (all requests):"
callgrind_annotate --inclusive=yes "$WORK/cg.$REQUESTS.out" 2>/dev/null | grep 'turnguard::' | head -25 | cut -c1-150
