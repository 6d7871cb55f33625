#!/usr/bin/env bash
# Where turnguard's c=64 cost sits above the stack it is built on: nginx, `benchtool relay`
# (axum on hyper's HTTP/1 server, hyper-util's legacy client, a current-thread runtime, and
# no turnguard logic: the floor of any proxy built from these crates on this host) and
# turnguard, interleaved round by round. Same placement as run.sh: wrk and the mock on CPU 0,
# the proxy under test alone on CPU 1; turnguard on the acme bundle with its rate bucket
# raised, a SQLite journal on disk, JSON logs to a file.
#
#   bench/floor.sh                     # turnguard = this checkout's release build
#   TURNGUARD=/tmp/tg ROUNDS=5 bench/floor.sh
#   BENCHTOOL=/tmp/benchtool bench/floor.sh   # a benchtool build with `relay`: nothing compiled
#
# Reported per run: requests/s, the ratio to the round's nginx, and CPU µs per request (utime
# and stime over the run divided by wrk's requests); for turnguard split by thread: the
# request thread (the runtime's) and the journal writer. Needs wrk and nginx.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
ROUNDS=${ROUNDS:-3}
SECS=${SECONDS_PER_RUN:-6}
LOADGEN_CPU=${LOADGEN_CPU:-0}
PROXY_CPU=${PROXY_CPU:-1}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
for t in wrk nginx; do command -v "$t" >/dev/null || { echo "$t is missing: apt-get install $t" >&2; exit 1; }; done
TOOL=$(bench_tool)
if [ -z "${TURNGUARD:-}" ]; then
  cargo build --release --locked --bin turnguard 2>&1 | tail -1 >&2
  TURNGUARD=$CARGO_TARGET_DIR/release/turnguard
fi
WORK=$(mktemp -d)
MOCK_PORT=$(free_port)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT
taskset -c "$LOADGEN_CPU" "$TOOL" mock --listen "127.0.0.1:$MOCK_PORT" >/dev/null &
PIDS+=($!)
bench_bundle "$WORK"
mkdir -p "$WORK/nginx"
CLK=$(getconf CLK_TCK)
ticks() { awk '{print $14, $15}' "$1"; } # /proc/…/stat → utime stime

# measure LABEL PORT PID: warm-up, then the measured wrk run; prints one line (for a process
# with a journal writer thread, its time apart).
measure() {
  local label=$1 port=$2 pid=$3 tid url a b ja=() jb=() out reqs
  url="http://127.0.0.1:$port/v1/chat/completions"
  taskset -c "$LOADGEN_CPU" wrk -t1 -c64 -d2s -s bench/post.lua "$url" >/dev/null
  tid=$(grep -l '^turnguard-journ' /proc/"$pid"/task/*/comm 2>/dev/null | head -1 | xargs -r dirname | xargs -r basename || true)
  a=$(ticks "/proc/$pid/stat"); [ -n "$tid" ] && ja=($(ticks "/proc/$pid/task/$tid/stat"))
  out=$(taskset -c "$LOADGEN_CPU" wrk -t1 -c64 -d"${SECS}s" -s bench/post.lua "$url")
  b=$(ticks "/proc/$pid/stat"); [ -n "$tid" ] && jb=($(ticks "/proc/$pid/task/$tid/stat"))
  reqs=$(awk '/requests in/{print $1}' <<<"$out")
  python3 - "$label" "$reqs" "$SECS" "$CLK" "$a" "$b" "${ja[*]:-}" "${jb[*]:-}" <<'EOF' | tee -a "$WORK/floor.tsv"
import sys
label, reqs, secs, clk, a, b, ja, jb = sys.argv[1:]
n = max(int(reqs), 1)
us = lambda t: t / int(clk) * 1e6 / n
(ua, sa), (ub, sb) = map(int, a.split()), map(int, b.split())
line = f"{label}\t{n / float(secs):.0f}\t{us(ub - ua):.1f}\t{us(sb - sa):.1f}"
if ja:
    (jua, jsa), (jub, jsb) = map(int, ja.split()), map(int, jb.split())
    line += f"\t{us(ub - ua - jub + jua):.1f}/{us(sb - sa - jsb + jsa):.1f}\t{us(jub - jua):.1f}/{us(jsb - jsa):.1f}"
print(line)
EOF
}

echo -e "proxy\treq/s\tuser µs/req\tsys µs/req\tall but the journal writer, user/sys\tjournal writer, user/sys"
for r in $(seq "$ROUNDS"); do
  port=$(free_port)
  sed -e "s|@WORK@|$WORK|g" -e "s|@MOCK_PORT@|$MOCK_PORT|g" -e "s|@NGINX_PORT@|$port|g" \
    bench/nginx.conf > "$WORK/nginx.conf"
  taskset -c "$PROXY_CPU" nginx -p "$WORK/nginx" -c "$WORK/nginx.conf"
  sleep 0.5
  measure nginx "$port" "$(pgrep -P "$(cat "$WORK/nginx.pid")" | head -1)"
  kill "$(cat "$WORK/nginx.pid")"; sleep 0.5

  port=$(free_port)
  taskset -c "$PROXY_CPU" "$TOOL" relay --listen "127.0.0.1:$port" --upstream "http://127.0.0.1:$MOCK_PORT" &
  pid=$!; PIDS+=($pid)
  for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
  measure relay "$port" "$pid"
  kill "$pid"; wait "$pid" 2>/dev/null || true

  port=$(free_port); admin=$(free_port)
  rm -f "$WORK/journal.db"*
  taskset -c "$PROXY_CPU" "$TURNGUARD" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
    --journal "$WORK/journal.db" --policy "$WORK/policy" --upstream "openai=http://127.0.0.1:$MOCK_PORT" \
    --log-format json 2> "$WORK/turnguard-$r.log" &
  pid=$!; PIDS+=($pid)
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$admin/readyz" >/dev/null && break; sleep 0.1; done
  measure turnguard "$port" "$pid"
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
python3 - "$WORK/floor.tsv" <<'EOF'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
nginx = [float(r[1]) for r in rows if r[0] == "nginx"]
for label in ("nginx", "relay", "turnguard"):
    mine = [r for r in rows if r[0] == label]
    rps = [float(r[1]) for r in mine]
    cpu = [float(r[2]) + float(r[3]) for r in mine]
    ratios = " / ".join(f"{x / n:.2f}" for x, n in zip(rps, nginx))
    print(f"median {label}: {statistics.median(rps):.0f} req/s ({ratios}× nginx), "
          f"{statistics.median(cpu):.1f} µs/req")
EOF
