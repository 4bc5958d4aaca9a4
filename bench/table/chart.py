#!/usr/bin/env python3
"""Draw the strategy table (bench_table's CSV) as a PNG: peak GPU memory measured beside the planner's
prediction (and the widely shared claim where one applies), and tokens/s with the validation perplexity.

    python3 bench/table/chart.py table.csv [more.csv ...] [-o table.png]

Needs matplotlib (Debian: apt-get install python3-matplotlib, then run it with /usr/bin/python3). It runs on
the development machine from the CSV the GPU run brought back; the GPU machine needs nothing but bench_table.
"""
import argparse
import csv
import os


def number(row, key):
    try:
        return float(row.get(key, ""))
    except ValueError:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+", help="bench_table CSV file(s); rows are drawn in order")
    ap.add_argument("-o", "--out", help="PNG to write (default: the first CSV with .png)")
    args = ap.parse_args()

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for path in args.csv:
        with open(path, newline="") as f:
            rows.extend(csv.DictReader(f))
    if not rows:
        raise SystemExit("no rows in " + ", ".join(args.csv))
    labels = [f"{r['case']} ({r['preset']}, B={r['batch']})" if len({x['preset'] for x in rows}) > 1 else f"{r['case']} B={r['batch']}"
              for r in rows]
    peak = [number(r, "peak_gb") for r in rows]
    plan = [number(r, "planned_gb") for r in rows]
    claim = [number(r, "claimed_gb") for r in rows]
    tps = [number(r, "tokens_per_s") for r in rows]
    ppl = [number(r, "val_ppl") for r in rows]

    n = len(rows)
    fig, (ax_mem, ax_tps) = plt.subplots(1, 2, figsize=(14, 0.45 * n + 1.8), sharey=True)
    y = list(range(n))
    h = 0.27
    ax_mem.barh([i - h for i in y], [p or 0 for p in peak], height=h, label="measured peak", color="#2b6cb0")
    ax_mem.barh(y, [p or 0 for p in plan], height=h, label="planner", color="#a0aec0")
    if any(c for c in claim):
        ax_mem.barh([i + h for i in y], [c or 0 for c in claim], height=h, label="widely shared claim", color="#dd6b20")
    for i, r in enumerate(rows):
        if peak[i] is None:
            ax_mem.text(0.5, i - h, "OOM" if r.get("oom") == "1" else (r.get("error") or "no result")[:40], va="center", fontsize=7)
        elif plan[i]:
            ax_mem.text(peak[i], i - h, f" {peak[i]:.1f} ({peak[i] / plan[i]:.2f}x plan)", va="center", fontsize=7)
    ax_mem.set_xlabel("GB (1e9 bytes) on the GPU")
    ax_mem.set_yticks(y)
    ax_mem.set_yticklabels(labels, fontsize=8)
    ax_mem.invert_yaxis()
    ax_mem.legend(fontsize=8, loc="lower right")
    ax_mem.set_title("peak memory", fontsize=10)

    ax_tps.barh(y, [t or 0 for t in tps], height=0.6, color="#38a169")
    for i in y:
        if tps[i]:
            ax_tps.text(tps[i], i, f" {tps[i]:,.0f}" + (f"  ppl {ppl[i]:.2f}" if ppl[i] else ""), va="center", fontsize=7)
    ax_tps.set_xlabel("tokens/s (validation perplexity after the same tokens)")
    ax_tps.set_title("speed", fontsize=10)

    first = rows[0]
    fig.suptitle(f"squeeze strategy table: LLaMA {first['preset']}, T={first['seq']}", fontsize=11)
    fig.tight_layout()
    out = args.out or os.path.splitext(args.csv[0])[0] + ".png"
    fig.savefig(out, dpi=120)
    print("wrote", out)


if __name__ == "__main__":
    main()
