#!/usr/bin/env bash
# The long run of the property fuzzing in tests/it/fuzz.rs (issue 11): the same properties
# as CI, with many more cases and a fresh seed per round, until the time is up.
#
#   bench/fuzz.sh [SECONDS] [CASES_PER_ROUND]     (defaults: 600 s, 2000)
#
# Each round runs every property of `fuzz::` with PROPTEST_CASES=CASES_PER_ROUND and a new
# PROPTEST_RNG_SEED, niced, in a debug build (the build is not counted). A failing round's
# output is kept in target/fuzz/round-N.log with its seed. The summary — CPU time spent,
# rounds, cases, crashes — replaces the "Property fuzzing" section of bench/RESULTS.md.
set -euo pipefail
duration=${1:-600}
cases=${2:-2000}
cd "$(dirname "$0")/.."

exe=$(cargo test --test it --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="it":
        print(m["executable"])')
[ -x "$exe" ] || { echo "fuzz: no test binary" >&2; exit 1; }
mkdir -p target/fuzz
properties=$("$exe" --list 2>/dev/null | grep '^fuzz::.*: test$' | grep -v -e templates -e forms_disagree -c || true)

start=$(date +%s)
rounds=0
crashes=0
cpu_file=target/fuzz/cpu
: >"$cpu_file"
while [ $(( $(date +%s) - start )) -lt "$duration" ]; do
    rounds=$((rounds + 1))
    seed=$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')
    log=target/fuzz/round-$rounds.log
    if PROPTEST_CASES=$cases PROPTEST_RNG_SEED=$seed \
        /usr/bin/time -a -o "$cpu_file" -f '%U %S' \
        nice -n 10 "$exe" fuzz:: --test-threads=2 >"$log" 2>&1; then
        rm -f "$log"
    else
        crashes=$((crashes + 1))
        echo "seed $seed" >>"$log"
        echo "fuzz: round $rounds failed (seed $seed), see $log" >&2
    fi
done
wall=$(( $(date +%s) - start ))
cpu=$(awk '{u+=$1; s+=$2} END {printf "%.0f", u+s}' "$cpu_file")
total=$((rounds * cases * properties))
date=$(date -u +%Y-%m-%d)

summary=$(cat <<MD
<!-- fuzz:begin (written by bench/fuzz.sh; do not edit by hand) -->
## Property fuzzing (\`bench/fuzz.sh $duration $cases\`, $date)

The properties of \`tests/it/fuzz.rs\` (SSE framing, the three adapters' request and response
parsers, rewrites and repair builders, their stream state machines through the relay
\`Pipeline\` with the forwarding invariant, the policy loader, JCS), debug build, niced, on
this machine's 2 cores.

| wall time | CPU time | rounds | properties | cases per property per round | cases | crashes |
|---|---|---|---|---|---|---|
| ${wall} s | ${cpu} s | $rounds | $properties | $cases | $total | $crashes |
<!-- fuzz:end -->
MD
)
python3 - "$summary" <<'PY'
import re, sys
path = "bench/RESULTS.md"
text = open(path).read()
block = sys.argv[1]
pattern = re.compile(r"<!-- fuzz:begin.*?<!-- fuzz:end -->", re.S)
text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
open(path, "w").write(text)
PY
echo "fuzz: ${wall} s wall, ${cpu} s CPU, $rounds rounds, $total cases, $crashes crashes"
[ "$crashes" -eq 0 ]
