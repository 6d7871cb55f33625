#!/usr/bin/env python3
"""Draws bench/soak.sh's samples.csv (RSS and journal size over time) as a small PNG and
prints the RSS verdict: flat when every sample of the last 10 minutes is within ±5 % of
their mean. matplotlib is optional (the verdict is printed without it):
    python3 -m venv target/plot-venv && target/plot-venv/bin/pip install matplotlib
    target/plot-venv/bin/python bench/plot_soak.py bench/out/soak/samples.csv bench/soak-rss.png
"""
import csv
import json
import sys

rows = list(csv.DictReader(open(sys.argv[1])))
t = [int(r["t_s"]) for r in rows]
rss = [int(r["rss_kb"]) / 1024 for r in rows]
jb = [int(r["journal_bytes"]) / 2**20 for r in rows]
end = t[-1]
window = [r for tt, r in zip(t, rss) if tt >= end - 600]
mean = sum(window) / len(window)
spread = max(abs(r - mean) / mean for r in window)
verdict = {
    "samples": len(rows),
    "rss_first_mib": round(rss[0], 1),
    "rss_peak_mib": round(max(rss), 1),
    "rss_last10min_mean_mib": round(mean, 1),
    "rss_last10min_min_mib": round(min(window), 1),
    "rss_last10min_max_mib": round(max(window), 1),
    "rss_last10min_max_deviation_pct": round(100 * spread, 2),
    "rss_flat": spread <= 0.05,
    "journal_last_mib": round(jb[-1], 1),
}
print(json.dumps(verdict))
if len(sys.argv) > 2:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(0)
    fig, ax = plt.subplots(figsize=(6, 3), dpi=100)
    ax.plot([x / 60 for x in t], rss, label="turnguard RSS (MiB)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(0, max(rss) * 1.2)
    ax2 = ax.twinx()
    ax2.plot([x / 60 for x in t], jb, color="tab:orange", linestyle="--", label="journal (MiB)")
    ax2.set_ylabel("journal (MiB)")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [l.get_label() for l in lines], loc="lower right", fontsize=8)
    ax.set_title("soak: c=64 mixed traffic", fontsize=9)
    fig.tight_layout()
    fig.savefig(sys.argv[2])
