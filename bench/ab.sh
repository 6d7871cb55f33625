#!/usr/bin/env bash
# A/B two turnguard binaries on the non-stream c=64 cell (wrk, closed loop), alternating
# A, B, A, B, … so the VM's drift hits both alike. Same placement as run.sh: wrk and the mock
# on CPU 0, turnguard alone on CPU 1; the acme bundle with its rate bucket raised; a SQLite
# journal on disk; JSON logs to a file. Prints one line per run and the medians.
#
#   bench/ab.sh OLD_BINARY NEW_BINARY      # needs wrk and a release benchtool
#   ROUNDS=5 SECONDS_PER_RUN=8 CELL=jsonrun bench/ab.sh old new
#   CELL=jsontools bench/ab.sh old new   # each request carries a new tool result (post-tools.lua)
#   CELL=jsonagent bench/ab.sh old new   # a coding agent's request: 16 tools, a long system prompt
#   CELL=jsontranscript CONCURRENCY=8 bench/ab.sh old new   # a 31st turn: 30 earlier results
#   BENCHTOOL=/tmp/benchtool bench/ab.sh old new   # an earlier benchtool build: nothing compiled
#
# Reported per run: requests/s, p99, turnguard CPU µs per request (utime+stime of the whole
# process over the run divided by wrk's requests), peak RSS (VmHWM) at the end of the run,
# from turnguard's metrics the journal commits and the mean records per commit, and the
# journal writer thread's own CPU µs and bytes written (`wchar`) per request (its
# `/proc/PID/task/TID` counters over the run).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
[ $# -eq 2 ] || { echo "usage: bench/ab.sh OLD_BINARY NEW_BINARY" >&2; exit 2; }
A=$(realpath "$1"); B=$(realpath "$2")
ROUNDS=${ROUNDS:-3}
SECS=${SECONDS_PER_RUN:-6}
C=${CONCURRENCY:-64}
CELL=${CELL:-json}
LOADGEN_CPU=${LOADGEN_CPU:-0}
PROXY_CPU=${PROXY_CPU:-1}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
command -v wrk >/dev/null || { echo "wrk is missing: apt-get install wrk" >&2; exit 1; }
TOOL=$(bench_tool)
WORK=$(mktemp -d)
MOCK_PORT=$(free_port)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT
taskset -c "$LOADGEN_CPU" "$TOOL" mock --listen "127.0.0.1:$MOCK_PORT" >/dev/null &
PIDS+=($!)
bench_bundle "$WORK"
case "$CELL" in
  json) script=bench/post.lua ;;
  jsonrun) script=bench/post-run.lua ;;
  jsontools) script=bench/post-tools.lua ;;
  jsonagent) script=bench/post-agent.lua ;;
  jsontranscript) script=bench/post-transcript.lua ;;
  *) echo "CELL is json, jsonrun, jsontools, jsonagent or jsontranscript" >&2; exit 2 ;;
esac
CLK=$(getconf CLK_TCK)
metric() { # metrics-text name → summed value of every sample of `name`
  awk -v n="$2" '$1 ~ "^"n"(\\{|$)" {s += $NF} END {print s + 0}' "$1"
}
one() { # label binary round
  local label=$1 bin=$2 round=$3 port admin pid t0 t1 out reqs
  port=$(free_port); admin=$(free_port)
  rm -f "$WORK/journal.db"*
  taskset -c "$PROXY_CPU" "$bin" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
    --journal "$WORK/journal.db" --policy "$WORK/policy" --upstream "openai=http://127.0.0.1:$MOCK_PORT" \
    --log-format json 2> "$WORK/$label-$round.log" &
  pid=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$admin/readyz" >/dev/null && break; sleep 0.1; done
  taskset -c "$LOADGEN_CPU" wrk -t1 -c16 -d2s -s "$script" "http://127.0.0.1:$port/v1/chat/completions" >/dev/null
  local writer w0 w1 b0 b1
  writer=$(grep -l '^turnguard-journ' /proc/"$pid"/task/*/comm | head -1 | xargs dirname)
  t0=$(awk '{print $14+$15}' "/proc/$pid/stat")
  w0=$(awk '{print $14+$15}' "$writer/stat"); b0=$(awk '/^wchar/{print $2}' "$writer/io")
  out=$(taskset -c "$LOADGEN_CPU" wrk -t1 -c"$C" -d"${SECS}s" --latency -s "$script" "http://127.0.0.1:$port/v1/chat/completions")
  t1=$(awk '{print $14+$15}' "/proc/$pid/stat")
  w1=$(awk '{print $14+$15}' "$writer/stat"); b1=$(awk '/^wchar/{print $2}' "$writer/io")
  curl -s "http://127.0.0.1:$admin/metrics" > "$WORK/metrics"
  if grep -qE '^turnguard_tool_calls_total\{.*outcome="(invalid|refused|held)' "$WORK/metrics"; then
    echo "$label did not release every call" >&2; exit 1
  fi
  local rss commits records
  rss=$(awk '/VmHWM/{print $2}' "/proc/$pid/status")
  commits=$(metric "$WORK/metrics" turnguard_journal_commits_total)
  records=$(metric "$WORK/metrics" turnguard_journal_batch_size_records_sum)
  kill "$pid"; wait "$pid" 2>/dev/null || true
  reqs=$(awk '/requests in/{print $1}' <<<"$out")
  echo "$out" > "$WORK/wrk-$label-$round.txt"
  python3 - "$WORK/wrk-$label-$round.txt" "$label" "$round" "$reqs" "$((t1 - t0))" "$CLK" "$SECS" "$rss" "$commits" "$records" "$((w1 - w0))" "$((b1 - b0))" <<'EOF' | tee -a "$WORK/ab.tsv"
import re, sys
wrk_out, label, rnd, reqs, ticks, clk, secs, rss, commits, records, wticks, wbytes = sys.argv[1:]
text = open(wrk_out).read()
def ms(v):
    m = re.match(r"([\d.]+)(us|ms|s|m)$", v)
    if not m:
        return float("nan")
    n, u = m.groups()
    return float(n) * {"us": 1e-3, "ms": 1, "s": 1e3, "m": 6e4}[u]
p99 = ms(re.search(r"^\s*99%\s+(\S+)", text, re.M).group(1))
reqs = int(reqs)
cpu_us = int(ticks) / int(clk) * 1e6 / max(reqs, 1)
per = float(records) / max(float(commits), 1)
writer_us = int(wticks) / int(clk) * 1e6 / max(reqs, 1)
writer_bytes = int(wbytes) / max(reqs, 1)
print(f"{label}\t{rnd}\t{reqs / float(secs):.0f}\t{p99:.2f}\t{cpu_us:.0f}\t{int(rss) / 1024:.1f}\t{float(commits):.0f}\t{per:.1f}\t{writer_us:.1f}\t{writer_bytes:.0f}")
EOF
}
echo -e "build\tround\treq/s\tp99 ms\tCPU µs/req\tpeak RSS MiB\tcommits\trecords/commit\twriter µs/req\twriter B/req"
for r in $(seq "$ROUNDS"); do one A "$A" "$r"; one B "$B" "$r"; done
python3 - "$WORK/ab.tsv" <<'EOF'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines()]
for label in ("A", "B"):
    mine = [r for r in rows if r[0] == label]
    med = lambda i: statistics.median(float(r[i]) for r in mine)
    print(f"median {label}: {med(2):.0f} req/s, p99 {med(3):.2f} ms, {med(4):.0f} µs/req, "
          f"RSS {med(5):.1f} MiB, {med(7):.1f} records/commit, "
          f"writer {med(8):.1f} µs and {med(9):.0f} B/req")
EOF
