#!/usr/bin/env bash
# turnguard soak (issue 11): SECONDS (default 1800 = 30 min) of mixed traffic at CONCURRENCY
# (default 64) — non-stream and streamed calls, repairs, held calls approved and rejected on
# the admin plane, run nodes answered live and then replayed — against `benchtool mock`.
# Records turnguard's RSS, the journal's size and the traffic's counts every 10 s, then stops
# turnguard (SIGTERM, graceful) and runs `PRAGMA integrity_check` on the journal.
# Not part of CI. See bench/README.md.
#
#   bench/soak.sh                        # release build, 30 min
#   SECONDS_TOTAL=120 bench/soak.sh      # a smoke run
#
# Output in $OUT (default bench/out/soak): samples.csv (t_s, rss_kb, journal_bytes, requests,
# unexpected), driver.jsonl (the driver's ticks and summary), summary.json, turnguard.log;
# bench/plot_soak.py draws samples.csv.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${SECONDS_TOTAL:-1800}
C=${CONCURRENCY:-64}
OUT=${OUT:-bench/out/soak}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  echo "== build (release)"
  nice -n 10 cargo build --release --locked --bin turnguard --example benchtool 2>&1 | tail -1
fi
PROFILE=${PROFILE:-release}   # PROFILE=debug SKIP_BUILD=1: a smoke run on a debug build
TG=$CARGO_TARGET_DIR/$PROFILE/turnguard
TOOL=$CARGO_TARGET_DIR/$PROFILE/examples/benchtool

rm -rf "$OUT"; mkdir -p "$OUT"
WORK=$(mktemp -d)
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
MOCK_PORT=$(free_port); TG_PORT=$(free_port); TG_ADMIN=$(free_port)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

"$TOOL" mock --listen "127.0.0.1:$MOCK_PORT" --event-delay-us 1000 &
PIDS+=($!)

# The default bundle with its per-(principal, tool) bucket and per-run call limit raised (the
# soak's agents are few principals sending many calls); everything else as shipped.
cp -r policy "$WORK/policy"
sed -i -e 's/^burst = .*/burst = 100000000/' -e 's/^per_minute = .*/per_minute = 100000000/' \
  "$WORK/policy/turnguard.toml"
"$TG" policy check "$WORK/policy" >/dev/null
head -c 48 /dev/urandom | base64 | tr -d '\n' > "$WORK/hs256.secret"
"$TG" serve --listen "127.0.0.1:$TG_PORT" --admin-listen "127.0.0.1:$TG_ADMIN" \
  --journal "$WORK/journal.db" --policy "$WORK/policy" --upstream "openai=http://127.0.0.1:$MOCK_PORT" \
  --identity-issuer https://idp.soak.test --identity-audience turnguard-soak \
  --identity-hs256-secret-file "$WORK/hs256.secret" --approval-keepalive-ms 1000 \
  --max-concurrent-requests 512 --log-format json 2> "$OUT/turnguard.log" &
TG_PID=$!; PIDS+=($TG_PID)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$TG_ADMIN/readyz" >/dev/null && break; sleep 0.1; done

echo "== soak: ${SECS} s at c=$C (turnguard pid $TG_PID)"
"$TOOL" soak --url "http://127.0.0.1:$TG_PORT" --admin "http://127.0.0.1:$TG_ADMIN" \
  --concurrency "$C" --seconds "$SECS" --secret-file "$WORK/hs256.secret" \
  --issuer https://idp.soak.test --audience turnguard-soak > "$OUT/driver.jsonl" &
DRIVER=$!; PIDS+=($DRIVER)

echo "t_s,rss_kb,journal_bytes,requests,unexpected" > "$OUT/samples.csv"
start=$(date +%s)
while kill -0 "$DRIVER" 2>/dev/null; do
  t=$(( $(date +%s) - start ))
  rss=$(awk '/^VmRSS/{print $2}' "/proc/$TG_PID/status")
  jb=$(cat "$WORK"/journal.db* 2>/dev/null | wc -c)
  last=$(tail -n 1 "$OUT/driver.jsonl" 2>/dev/null || true)
  req=$(python3 -c 'import json,sys
try: v=json.loads(sys.argv[1]); print(v["requests"], v["unexpected"])
except Exception: print(0, 0)' "$last")
  echo "$t,$rss,$jb,${req// /,}" >> "$OUT/samples.csv"
  # On a 10 s grid from the start (the sampling itself takes time under load).
  next=$(( (t / 10 + 1) * 10 ))
  sleep "$(( next - ( $(date +%s) - start ) ))" 2>/dev/null || true
done
wait "$DRIVER" || true
tail -n 1 "$OUT/driver.jsonl" > "$OUT/summary.json"
curl -s "http://127.0.0.1:$TG_ADMIN/metrics" > "$OUT/metrics.txt" || true

echo "== stop turnguard (SIGTERM) and check the journal"
kill -TERM "$TG_PID"; wait "$TG_PID" || true
python3 - "$WORK/journal.db" "$OUT" <<'PY'
import json, sqlite3, sys
db, out = sys.argv[1], sys.argv[2]
c = sqlite3.connect(db)
ok = c.execute("PRAGMA integrity_check").fetchone()[0]
rows = {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
        for t in ("rounds", "tool_calls", "tool_results", "served", "interrupts", "events")}
s = json.load(open(f"{out}/summary.json"))
s["integrity_check"] = ok
s["journal_rows"] = rows
json.dump(s, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(s))
PY
PY=python3; [ -x target/plot-venv/bin/python ] && PY=target/plot-venv/bin/python
"$PY" bench/plot_soak.py "$OUT/samples.csv" "$OUT/soak-rss.png" | tee "$OUT/verdict.json" || true
