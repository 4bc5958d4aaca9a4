"""Print one line per benchmark case from JSON-lines result files: bench, case, ratio to peer, roofline."""
import json
import sys

for path in sys.argv[1:]:
    for line in open(path):
        if not line.strip():
            continue
        r = json.loads(line)
        ratio = r.get("ratio_vs_peer") or 0.0
        roof = r.get("roofline_fraction") or 0.0
        print(f"{r.get('bench', '?'):<8} {r.get('case', '?'):<44} x{ratio:6.2f} vs {r.get('peer', '?'):<22} "
              f"roof {roof:5.2f}  {r.get('time_ms') or 0:9.3f} ms")
