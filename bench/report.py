#!/usr/bin/env python3
"""bench/run.sh helper. `report.py wrk` parses wrk's --latency output (stdin) into one JSON
line; `report.py summary OUT` turns OUT/results.jsonl into the tables of RESULTS.md."""
import json
import re
import statistics
import sys


def to_us(v):
    m = re.match(r"([\d.]+)(us|ms|s)$", v)
    n, unit = float(m.group(1)), m.group(2)
    return n * {"us": 1, "ms": 1e3, "s": 1e6}[unit]


def wrk(text):
    out = {"requests": 0, "errors": 0, "rps": 0.0}
    for line in text.splitlines():
        line = line.strip()
        if m := re.match(r"(\d+) requests in", line):
            out["requests"] = int(m.group(1))
        elif line.startswith("Requests/sec:"):
            out["rps"] = float(line.split()[1])
        elif m := re.match(r"(50|99)%\s+(\S+)", line):
            out[f"p{m.group(1)}_us"] = to_us(m.group(2))
        elif line.startswith("Non-2xx or 3xx responses:"):
            out["errors"] += int(line.split()[-1])
        elif line.startswith("Socket errors:"):
            out["errors"] += sum(int(x) for x in re.findall(r"\d+", line))
    return out


KIND_TITLES = {
    "json": "Non-stream tool-call responses (~1 KB), wrk (closed loop)",
    "jsonrun": "Non-stream, `Turnguard-Run` of its own on every request (run journaling), wrk",
    "open": "Non-stream, open loop at a fixed rate (benchtool open; latency from the due time)",
    "openrun": "Non-stream, open loop, `Turnguard-Run` on every request",
    "stream": "Streaming tool call (text chunk, call header, 8 argument deltas, finish, usage, [DONE]; 1 ms apart)",
    "streamrun": "Streaming tool call, `Turnguard-Run` on every request",
}


def summary(out_dir):
    rows = [json.loads(l) for l in open(f"{out_dir}/results.jsonl")]
    rss = [json.loads(l) for l in open(f"{out_dir}/rss.jsonl")]
    cells, configs = [], []
    for r in rows:
        if (r["kind"], r["c"]) not in cells:
            cells.append((r["kind"], r["c"]))
        if r["config"] not in configs:
            configs.append(r["config"])
    tgs = [c for c in configs if c.startswith("turnguard")]
    med = statistics.median
    lines, verdicts = [], []

    def cfg_rows(kind, c, cfg):
        return [r for r in rows if r["kind"] == kind and r["c"] == c and r["config"] == cfg]

    def cpu_us_per_req(rs):
        ticks = sum(r["tg_cpu_ticks"] for r in rs)
        reqs = sum(r["result"]["requests"] for r in rs)
        return ticks / rs[0]["clk_tck"] * 1e6 / reqs if reqs else 0

    for kind, c in cells:
        stream = kind.startswith("stream")
        run = kind.endswith("run")
        lines.append(f"### {KIND_TITLES.get(kind, kind)}, c={c}")
        lines.append("")
        if stream:
            lines.append("| config | streams/s | TTFB p50 ms | TTFB p99 ms | release delay p50 ms | release delay p99 ms | stream p50 ms | stream p99 ms | errors | CPU µs/stream |")
            lines.append("|---|---|---|---|---|---|---|---|---|---|")
        else:
            lines.append("| config | rps | p50 ms | p99 ms | added p50 vs direct ms | added p99 vs direct ms | errors | CPU µs/req |")
            lines.append("|---|---|---|---|---|---|---|---|")
        vals = {}
        for cfg in configs:
            rs = cfg_rows(kind, c, cfg)
            if not rs:
                continue
            g = lambda k: med(r["result"].get(k, 0) for r in rs) / 1e3
            errs = sum(r["result"]["errors"] for r in rs)
            rps = med(r["result"]["rps"] for r in rs)
            cpu = f"{cpu_us_per_req(rs):.0f}" if cfg in tgs else "–"
            if stream:
                v = dict(rps=rps, ttfb50=g("ttfb_p50_us"), ttfb99=g("ttfb_p99_us"), rel50=g("release_p50_us"), rel99=g("release_p99_us"), tot50=g("total_p50_us"), tot99=g("total_p99_us"), cpu=cpu_us_per_req(rs))
                lines.append(f"| {cfg} | {rps:,.0f} | {v['ttfb50']:.3f} | {v['ttfb99']:.3f} | {v['rel50']:.3f} | {v['rel99']:.3f} | {v['tot50']:.3f} | {v['tot99']:.3f} | {errs} | {cpu} |")
            else:
                v = dict(rps=rps, p50=g("p50_us"), p99=g("p99_us"), cpu=cpu_us_per_req(rs))
                d = vals.get("direct", v)
                lines.append(f"| {cfg} | {rps:,.0f} | {v['p50']:.3f} | {v['p99']:.3f} | {v['p50'] - d['p50']:+.3f} | {v['p99'] - d['p99']:+.3f} | {errs} | {cpu} |")
            vals[cfg] = v
        lines.append("")
        n, d = vals.get("nginx"), vals.get("direct")
        for t in tgs:
            if t not in vals or not n:
                continue
            tv, tag = vals[t], f"{t}{' (run)' if run else ''}"
            if kind in ("json", "jsonrun") and c == 64:
                verdicts.append((f"{tag}: CPU ≤ 60 µs/request at c=64", f"{tv['cpu']:.0f} µs", tv["cpu"] <= 60))
                verdicts.append((f"{tag}: rps ≥ 0.4× nginx at c=64", f"{tv['rps'] / n['rps']:.2f}×", tv["rps"] >= 0.4 * n["rps"]))
            if kind in ("open", "openrun") and d:
                added_t, added_n = tv["p99"] - d["p99"], n["p99"] - d["p99"]
                verdicts.append((f"{tag}: added p99 at a fixed rate over {c} connections ≤ nginx's + 0.3 ms", f"{added_t:+.3f} ms vs nginx {added_n:+.3f} ms", added_t <= added_n + 0.3))
            if stream and c == 16:
                verdicts.append((f"{tag}: streaming release delay p50 at c={c} ≤ nginx + 0.2 ms", f"{tv['rel50'] - n['rel50']:+.3f} ms", tv["rel50"] - n["rel50"] <= 0.2))
    ngx = [r for r in rss if "nginx_pid" in r]
    for t in tgs:
        peak = [r for r in rss if r.get("config") == t and "peak_rss_kib_after_c64" in r]
        end = [r for r in rss if r.get("config") == t and "peak_rss_kib_end" in r]
        if peak:
            mib = peak[0]["peak_rss_kib_after_c64"] / 1024
            endm = end[0]["peak_rss_kib_end"] / 1024 if end else float("nan")
            lines.append(f"Peak RSS of {t} after the c=64 runs: **{mib:.1f} MiB** (end of run: {endm:.1f} MiB).")
            verdicts.append((f"{t}: peak RSS ≤ 32 MiB at c=64", f"{mib:.1f} MiB", mib <= 32))
    if ngx:
        lines.append(f"nginx master + worker: {sum(r['peak_rss_kib'] for r in ngx) / 1024:.1f} MiB.")
    lines.append("")
    lines.append("### Targets (issue 13)")
    lines.append("")
    lines.append("| target | measured | met |")
    lines.append("|---|---|---|")
    for name, val, ok in verdicts:
        lines.append(f"| {name} | {val} | {'yes' if ok else '**no**'} |")
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1] == "wrk":
        print(json.dumps(wrk(sys.stdin.read())))
    else:
        summary(sys.argv[2])
