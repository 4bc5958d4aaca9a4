"""Print one line per benchmark case from JSON-lines result files: bench, case, ratio to peer, roofline.
Strategy-table lines (bench "table") also show peak memory beside the planner and validation perplexity."""
import json
import sys


def num(r, key):
    v = r.get(key)
    return v if isinstance(v, (int, float)) else 0.0


for path in sys.argv[1:]:
    for line in open(path):
        if not line.strip():
            continue
        r = json.loads(line)
        ratio = num(r, "ratio_vs_peer")
        if r.get("bench") == "table":
            name = f"{r.get('case', '?')} {r.get('preset', '')} B={r.get('batch', '?')}"
            if r.get("error"):
                print(f"table    {name:<44} {'OOM' if r.get('oom') else 'error'}: {r['error'][:80]}")
                continue
            plan = num(r, "planned_gb")
            plan_txt = f"plan {plan:6.2f} GB ({num(r, 'plan_ratio'):5.3f}x)" if plan else "plan      -         "
            print(f"table    {name:<44} x{ratio:6.2f} vs {r.get('peer', '?'):<22} peak {num(r, 'peak_gb'):6.2f} GB {plan_txt} "
                  f"{num(r, 'tokens_per_s'):8.0f} tok/s  ppl {num(r, 'val_ppl'):7.2f}")
            continue
        roof = num(r, "roofline_fraction")
        print(f"{r.get('bench', '?'):<8} {r.get('case', '?'):<44} x{ratio:6.2f} vs {r.get('peer', '?'):<22} "
              f"roof {roof:5.2f}  {num(r, 'time_ms'):9.3f} ms")
