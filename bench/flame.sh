#!/usr/bin/env bash
# A CPU flame graph of turnguard in the bench's c=64 non-stream cell (issue 13): the release
# build (ALLOCATOR: jemalloc, the default build; mimalloc; or system), the acme example
# bundle, journal on, alone on CPU 1; wrk and the mock on CPU 0. perf samples turnguard's
# threads at 999 Hz for PROFILE_SECONDS (default 10) with DWARF call stacks; inferno folds and
# draws them.
#
#   apt-get install linux-perf wrk; cargo install inferno
#   bench/flame.sh                      # writes bench/flame-c64.svg (+ bench/out-flame/)
#   RUN=1 bench/flame.sh                # with `Turnguard-Run` on every request (bench/post-run.lua)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
# Not `SECONDS`: bash sets that one itself (seconds since the shell started), so it is never
# unset and a default for it never applies.
SECS=${PROFILE_SECONDS:-10}
ALLOCATOR=${ALLOCATOR:-jemalloc}
OUT=${OUT:-bench/out-flame}
SVG=${SVG:-bench/flame-c64.svg}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
for t in perf wrk inferno-collapse-perf inferno-flamegraph; do
  command -v "$t" >/dev/null || { echo "$t is missing (see the header of $0)" >&2; exit 1; }
done
features=($(allocator_features "$ALLOCATOR"))
cargo build --release --locked --example benchtool 2>&1 | tail -1
cargo build --release --locked --bin turnguard "${features[@]}" 2>&1 | tail -1
TG=$CARGO_TARGET_DIR/release/turnguard
TOOL=$CARGO_TARGET_DIR/release/examples/benchtool
rm -rf "$OUT"; mkdir -p "$OUT"
WORK=$(mktemp -d)
MOCK=$(free_port); PORT=$(free_port); ADMIN=$(free_port)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT
taskset -c 0 "$TOOL" mock --listen "127.0.0.1:$MOCK" & PIDS+=($!)
bench_bundle "$WORK"
taskset -c 1 "$TG" serve --listen "127.0.0.1:$PORT" --admin-listen "127.0.0.1:$ADMIN" \
  --journal "$WORK/journal.db" --policy "$WORK/policy" --upstream "openai=http://127.0.0.1:$MOCK" \
  --log-format json 2> "$OUT/turnguard.log" &
TG_PID=$!; PIDS+=($TG_PID)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$ADMIN/readyz" >/dev/null && break; sleep 0.1; done
SCRIPT=bench/post.lua; [ -n "${RUN:-}" ] && SCRIPT=bench/post-run.lua
URL="http://127.0.0.1:$PORT/v1/chat/completions"
taskset -c 0 wrk -t1 -c64 -d2s -s "$SCRIPT" "$URL" > /dev/null   # warm-up
taskset -c 0 wrk -t1 -c64 -d"$((SECS + 2))s" --latency -s "$SCRIPT" "$URL" > "$OUT/wrk.txt" &
WRK=$!
sleep 1
perf record -F 999 -e cpu-clock --call-graph dwarf,16384 -p "$TG_PID" -o "$OUT/perf.data" -- sleep "$SECS" 2> "$OUT/perf-record.log"
wait "$WRK"
perf script -i "$OUT/perf.data" 2>/dev/null | inferno-collapse-perf > "$OUT/folded.txt"
inferno-flamegraph --title "turnguard, non-stream c=64${RUN:+, Turnguard-Run}, $ALLOCATOR allocator" < "$OUT/folded.txt" > "$SVG"
grep -E "Requests/sec" "$OUT/wrk.txt"
echo "flame graph: $SVG (folded stacks: $OUT/folded.txt)"
