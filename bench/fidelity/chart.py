#!/usr/bin/env python3
"""Draw the fidelity benchmark (fidelity.py's summary lines) as a PNG: per preset, each strategy's validation
perplexity (mean over seeds, with its standard deviation) beside fp32's and the 1% band around it, labelled with the
ratio to fp32 and its seed spread; with a finetune.jsonl, a second panel: each method's share of full fine-tuning's
improvement against the 90% target.

    python3 bench/fidelity/chart.py bench/results/h200/fidelity.jsonl [bench/results/h200/finetune.jsonl] [-o fidelity.png]

Needs matplotlib (Debian: apt-get install python3-matplotlib, then run it with /usr/bin/python3); fidelity.py itself
needs nothing but the standard library.
"""
import argparse
import json
import os


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+", help="fidelity.jsonl and/or finetune.jsonl")
    ap.add_argument("-o", "--out", help="PNG to write (default: the first file with .png)")
    args = ap.parse_args()

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory as blended

    lines = [ln for p in args.jsonl for ln in read(p)]
    fid = [ln for ln in lines if ln.get("bench") == "fidelity"]
    ft = [ln for ln in lines if ln.get("bench") == "finetune"]
    if not fid and not ft:
        raise SystemExit("no fidelity or finetune lines in " + ", ".join(args.jsonl))
    settings = []  # one panel per (preset, tokens)
    for ln in fid:
        key = (ln["preset"], str(ln["tokens"]))
        if key not in settings:
            settings.append(key)
    panels = len(settings) + (1 if ft else 0)
    heights = [max(2.5, 0.32 * sum(1 for ln in fid if (ln["preset"], str(ln["tokens"])) == s) + 1.2) for s in settings]
    if ft:
        heights.append(0.5 * len(ft) + 1.5)
    fig, axes = plt.subplots(panels, 1, figsize=(11, sum(heights)), gridspec_kw={"height_ratios": heights}, squeeze=False)
    axes = [a[0] for a in axes]

    for ax, (preset, tokens) in zip(axes, settings):
        rows = [ln for ln in fid if (ln["preset"], str(ln["tokens"])) == (preset, tokens)]
        y = list(range(len(rows)))
        ratio = [ln.get("ratio_vs_fp32") for ln in rows]
        spread = [ln.get("ratio_std") or 0 for ln in rows]
        # The axis spans the full-weight strategies (LoRA from scratch sits far right: drawn at the edge, labelled).
        near = [(r - e, r + e) for ln, r, e in zip(rows, ratio, spread) if r is not None and not ln.get("lora")]
        lo = min([0.985] + [a for a, _ in near])
        hi = max([1.015] + [b for _, b in near])
        pad = (hi - lo) * 0.04
        lo, hi = lo - pad, hi + pad
        ax.axvspan(0.99, 1.01, color="#a0aec0", alpha=0.35, label="fp32 ± 1%")
        ax.axvline(1.0, color="#2d3748", lw=0.8)
        for i, (ln, r, e) in enumerate(zip(rows, ratio, spread)):
            if r is None:
                ax.text(lo, i, "  " + ("no fp32 runs at this setting" if ln["ppl_mean"] is not None else ln.get("note", "no result")),
                        va="center", fontsize=7)
                continue
            color = "#4a5568" if ln["strategy"] == "fp32" else ("#38a169" if ln.get("within_target") else "#dd6b20")
            std = ln["ppl_std"]
            label = f"  ppl {ln['ppl_mean']:.3f}" + (f" ± {std:.3f}" if std is not None else "") + f"   ×{r:.4f}" + (f" ± {e:.4f}" if e else "")
            if r > hi:  # off the axis: an arrow at its edge
                ax.plot([hi], [i], marker=">", color=color, ms=7, clip_on=False)
            else:
                ax.errorbar([r], [i], xerr=[e], fmt="o", color=color, ms=4, elinewidth=1, capsize=2)
            ax.text(1.02, i, label.strip(), va="center", fontsize=7, transform=blended(ax.transAxes, ax.transData))
        ax.set_xlim(lo, hi)
        ax.set_yticks(y)
        ax.set_yticklabels([ln["strategy"] + (" (LoRA on a random base)" if ln.get("lora") else "") for ln in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("validation perplexity / fp32's (mean over seeds; bars: the strategy's seed standard deviation / fp32's mean)",
                      fontsize=8)
        seeds = "/".join(map(str, sorted({len(ln["seeds"]) for ln in rows})))
        title = f"{preset}: {int(tokens):,} tokens a run" if tokens.isdigit() else f"{preset}: {tokens} tokens"
        ax.set_title(f"{title}, {seeds} seeds; per-byte perplexity (green: within target)", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")

    if ft:
        ax = axes[-1]
        y = list(range(len(ft)))
        share = [(ln["share_of_full"] or 0) * 100 for ln in ft]
        ax.barh(y, share, color=["#718096" if ln["method"] == "full" else ("#38a169" if ln.get("within_target") else "#dd6b20") for ln in ft],
                height=0.6)
        ax.axvline(90, color="#c53030", lw=0.8, ls="--", label="90% target")
        for i, ln in enumerate(ft):
            ax.text(1.02, i, f"{share[i]:.1f}%  ppl {ln['base_ppl'] or 0:.3f} → {ln['ppl_mean'] or 0:.3f}"
                    + (f" ± {ln['ppl_std']:.3f}" if ln.get("ppl_std") is not None else "")
                    + (f" (start {ln['start_ppl']:.3f})" if ln.get("start_ppl") is not None else ""), va="center", fontsize=7,
                    transform=blended(ax.transAxes, ax.transData))
        ax.set_yticks(y)
        ax.set_yticklabels([f"{ln['method']} ({ln['strategy']}, lr {ln['lr']:g})" for ln in ft], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("share of full fine-tuning's perplexity improvement, %")
        first = ft[0]
        ax.set_title(f"fine-tuning a {first['preset']} base ({first['base_corpus']}, {first['base_tokens']:,} tokens) on {first['corpus']}, "
                     f"{first['tokens']:,} tokens a method, {len(first['seeds'])} seeds", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")

    fig.tight_layout()
    out = args.out or os.path.splitext(args.jsonl[0])[0] + ".png"
    fig.savefig(out, dpi=120, bbox_inches="tight")  # "tight": the labels right of the axes
    print("wrote", out)


if __name__ == "__main__":
    main()
