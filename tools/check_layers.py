#!/usr/bin/env python3
"""Fails when a library header includes one from a higher layer (docs/architecture.md, "Layers"), or a kernel (under
kernels/squeeze/kernels/) includes anything of include/ but the base types and errors.

    python3 tools/check_layers.py [ROOT]     # ROOT: the repository (default: this file's parent's parent)

Each folder (or top-level header) has a rank; a header may include its own rank and lower ones. Includes are read
as text: quoted paths relative to the including file, and <squeeze/...> / "squeeze/..." paths from include/ and kernels/
(the two roots are installed as one include/squeeze/).
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
    bases = [(root / "include" / "squeeze").resolve(), (root / "kernels" / "squeeze").resolve()]
    include_re = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
    bad, unranked = [], []

    def relative(path: pathlib.Path):  # "kernels/adamw.hpp" for a file under either root, None elsewhere
        for b in bases:
            try:
                return path.resolve().relative_to(b).as_posix()
            except ValueError:
                pass
        return None

    def find(rel: str):  # a squeeze/ include's file, in whichever root holds it
        for b in bases:
            if (b / rel).exists():
                return b / rel
        return bases[0] / rel

    files = sorted(f for b in bases for f in b.rglob("*") if f.suffix in (".hpp", ".cuh", ".h"))
    for b in bases[1:]:
        for f in sorted(b.rglob("*")):
            if f.is_file() and not f.relative_to(b).as_posix().startswith("kernels/"):
                bad.append(f"{f.relative_to(root)}: kernels/squeeze/ holds the kernels alone (kernels/squeeze/kernels/...)")
    for f in files:
        rel = relative(f)
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
                target = find(path[len("squeeze/"):])
            elif m.group(1) == '"':
                target = (f.parent / path).resolve()
            else:
                continue  # a system or third-party header
            trel = relative(target)
            if trel is None:
                continue
            tr = rank_of(trel)
            if tr is not None and tr > r:
                bad.append(f"{rel}:{n}: includes {trel} ({LAYERS[tr][0]}) from {LAYERS[r][0]}")
            elif rel.startswith("kernels/") and tr is not None and tr != 0 and not trel.startswith("kernels/"):
                bad.append(f"{rel}:{n}: includes {trel}: a kernel includes only other kernels and the base types and errors")
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
