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


def summary(out_dir):
    rows = [json.loads(l) for l in open(f"{out_dir}/results.jsonl")]
    rss = [json.loads(l) for l in open(f"{out_dir}/rss.jsonl")]
    cells = []
    for r in rows:
        key = (r["kind"], r["c"])
        if key not in cells:
            cells.append(key)
    med = statistics.median
    lines = []
    verdicts = []

    def cfg_rows(kind, c, cfg):
        return [r for r in rows if r["kind"] == kind and r["c"] == c and r["config"] == cfg]

    def cpu_us_per_req(rs):
        ticks = sum(r["tg_cpu_ticks"] for r in rs)
        reqs = sum(r["result"]["requests"] for r in rs)
        return ticks / rs[0]["clk_tck"] * 1e6 / reqs if reqs else 0

    json_cells = [c for c in cells if c[0] == "json"]
    stream_cells = [c for c in cells if c[0] == "stream"]
    if json_cells:
        lines.append("### Non-stream tool-call responses (~1 KB), wrk")
        lines.append("")
        lines.append("| c | config | rps | p50 ms | p99 ms | added p50 vs direct ms | added p99 vs direct ms | errors | turnguard CPU µs/req |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for kind, c in json_cells:
            base = {}
            for cfg in ["direct", "nginx", "turnguard"]:
                rs = cfg_rows(kind, c, cfg)
                if not rs:
                    continue
                rps = med(r["result"]["rps"] for r in rs)
                p50 = med(r["result"]["p50_us"] for r in rs) / 1e3
                p99 = med(r["result"]["p99_us"] for r in rs) / 1e3
                errs = sum(r["result"]["errors"] for r in rs)
                base[cfg] = (rps, p50, p99)
                d = base.get("direct", (0, 0, 0))
                cpu = f"{cpu_us_per_req(rs):.0f}" if cfg == "turnguard" else "–"
                lines.append(f"| {c} | {cfg} | {rps:,.0f} | {p50:.3f} | {p99:.3f} | {p50 - d[1]:+.3f} | {p99 - d[2]:+.3f} | {errs} | {cpu} |")
            if "nginx" in base and "turnguard" in base and "direct" in base:
                n, t, d = base["nginx"], base["turnguard"], base["direct"]
                lines.append(f"| {c} | turnguard vs nginx | {t[0] / n[0]:.2f}× | {t[1] - n[1]:+.3f} | {t[2] - n[2]:+.3f} | | | | |")
                if c == 64:
                    verdicts.append(("rps at c=64 ≥ 0.75× nginx", f"{t[0] / n[0]:.2f}×", t[0] >= 0.75 * n[0]))
                added_t, added_n = t[2] - d[2], n[2] - d[2]
                verdicts.append((f"added p99 at c={c} ≤ nginx added p99 + 1 ms", f"{added_t:+.3f} ms vs {added_n:+.3f} ms", added_t <= added_n + 1.0))
        lines.append("")
    if stream_cells:
        lines.append("### Streaming tool call (text chunk, call header, 8 argument deltas, finish, usage, [DONE]; 1 ms apart)")
        lines.append("")
        lines.append("| c | config | streams/s | TTFB p50 ms | TTFB p99 ms | release delay p50 ms | release delay p99 ms | stream p50 ms | stream p99 ms | errors | turnguard CPU µs/stream |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for kind, c in stream_cells:
            base = {}
            for cfg in ["direct", "nginx", "turnguard"]:
                rs = cfg_rows(kind, c, cfg)
                if not rs:
                    continue
                g = lambda k: med(r["result"][k] for r in rs) / 1e3
                vals = (med(r["result"]["rps"] for r in rs), g("ttfb_p50_us"), g("ttfb_p99_us"), g("release_p50_us"), g("release_p99_us"), g("total_p50_us"), g("total_p99_us"))
                base[cfg] = vals
                errs = sum(r["result"]["errors"] for r in rs)
                cpu = f"{cpu_us_per_req(rs):.0f}" if cfg == "turnguard" else "–"
                lines.append(f"| {c} | {cfg} | {vals[0]:,.0f} | {vals[1]:.3f} | {vals[2]:.3f} | {vals[3]:.3f} | {vals[4]:.3f} | {vals[5]:.3f} | {vals[6]:.3f} | {errs} | {cpu} |")
            if "nginx" in base and "turnguard" in base:
                n, t = base["nginx"], base["turnguard"]
                verdicts.append((f"streaming TTFB p50 at c={c} ≤ nginx + 0.5 ms", f"{t[1] - n[1]:+.3f} ms", t[1] - n[1] <= 0.5))
        lines.append("")
    peak = [r for r in rss if "peak_rss_kib_after_c64" in r]
    end = [r for r in rss if "peak_rss_kib_end" in r]
    ngx = [r for r in rss if "nginx_pid" in r]
    if peak:
        mib = peak[0]["peak_rss_kib_after_c64"] / 1024
        lines.append(f"Peak RSS of turnguard after the c=64 runs: **{mib:.1f} MiB** (end of run: {end[0]['peak_rss_kib_end'] / 1024:.1f} MiB); nginx master + worker: {sum(r['peak_rss_kib'] for r in ngx) / 1024:.1f} MiB.")
        verdicts.append(("peak RSS < 64 MiB at c=64", f"{mib:.1f} MiB", mib < 64))
        lines.append("")
    lines.append("### Targets")
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
