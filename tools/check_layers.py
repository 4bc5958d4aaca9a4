#!/usr/bin/env python3
"""Fails when a header under include/squeeze/ includes one from a higher layer (docs/architecture.md, "Layers").

    python3 tools/check_layers.py [ROOT]     # ROOT: the repository (default: this file's parent's parent)

Each folder (or top-level header) has a rank; a header may include its own rank and lower ones. Includes are read
as text: quoted paths relative to the including file, and <squeeze/...> / "squeeze/..." paths from include/.
"""
import pathlib
import re
import sys

# Lowest first. Everything of one rank may include each other.
LAYERS = [
    ("base types", ["dtype.hpp", "error.hpp"]),
    ("policies, planner", ["policy/", "plan/", "policy.hpp", "plan.hpp"]),
    ("kernels", ["kernels/"]),
    ("communication", ["comm/", "comm.hpp"]),
    ("algorithms", ["optim/", "quant/"]),
    ("formats", ["io/"]),
    ("training engine", ["engine/"]),
    ("modules", ["nn/"]),
    ("trainer", ["train/"]),
    ("umbrellas", ["train.hpp", "squeeze.hpp"]),
]


def rank_of(rel: str):
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in prefixes):
            return i
    return None


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    base = root / "include" / "squeeze"
    include_re = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
    bad, unranked = [], []
    for f in sorted(base.rglob("*")):
        if f.suffix not in (".hpp", ".cuh", ".h"):
            continue
        rel = f.relative_to(base).as_posix()
        r = rank_of(rel)
        if r is None:
            unranked.append(rel)
            continue
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            m = include_re.match(line)
            if not m:
                continue
            path = m.group(2)
            if path.startswith("squeeze/"):
                target = (base / path[len("squeeze/"):]).resolve()
            elif m.group(1) == '"':
                target = (f.parent / path).resolve()
            else:
                continue  # a system or third-party header
            try:
                trel = target.relative_to(base.resolve()).as_posix()
            except ValueError:
                continue
            tr = rank_of(trel)
            if tr is not None and tr > r:
                bad.append(f"{rel}:{n}: includes {trel} ({LAYERS[tr][0]}) from {LAYERS[r][0]}")
    for u in unranked:
        print(f"{u}: in no layer: give its folder a rank in tools/check_layers.py and docs/architecture.md")
    for b in bad:
        print(b)
    if bad or unranked:
        print(f"{len(bad)} include(s) run up a layer; {len(unranked)} header(s) in no layer")
        return 1
    print("every include runs down or sideways")
    return 0


if __name__ == "__main__":
    sys.exit(main())
