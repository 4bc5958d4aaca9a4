#!/usr/bin/env bash
# The "unchanged" check of a refactoring, in one GPU call: the same benchmark rows from two snapshots of the tree
# (a baseline and the change), built side by side and run alternately row by row, so both see the same machine.
#   usage: bash bench/compare_trees.sh BASE_DIR NEW_DIR build|run
#     build  configures and builds bench_table and bench_adamw in each tree (two builds of -j8 at once);
#     run    runs each table row in the base tree, then in the new one, then the fused AdamW benchmark in each, and
#            prints tokens/s and peak of new against base per row.
#   env: ROWS (default: the 1.1B rows bf16,bf16-ckpt,qlora,zero3-bf16,zero3-bf16-ckpt,zero3-offload-bf16-ckpt),
#        TABLE_ARGS (extra bench_table arguments), OUT (default ./compare-results). Results (six files, within what a
#        device call brings back): $OUT/{base,new}-table.jsonl, $OUT/{base,new}-adamw.jsonl (each line with the
#        tree's commit from its COMMIT file, the date and the device), $OUT/compare.txt, and $OUT/run.log.
set -uo pipefail
base=$(cd "$1" && pwd); new=$(cd "$2" && pwd); phase=$3
OUT=${OUT:-$PWD/compare-results}
mkdir -p "$OUT"
ROWS=${ROWS:-bf16,bf16-ckpt,qlora,zero3-bf16,zero3-bf16-ckpt,zero3-offload-bf16-ckpt}
TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
build_dir() { echo "/tmp/compare-build-$1"; }

if [ "$phase" = build ]; then
  t0=$(date +%s)
  for side in base new; do
    tree=${!side}
    (cmake -S "$tree" -B "$(build_dir $side)" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
       -DSQUEEZE_TORCH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DSQUEEZE_BUILD_TESTS=OFF >"$OUT/$side-build.log" 2>&1 &&
     cmake --build "$(build_dir $side)" -j8 --target bench_table bench_adamw >>"$OUT/$side-build.log" 2>&1;
     echo "$side build: exit $? after $(( $(date +%s) - t0 )) s") &
  done
  wait
  exit 0
fi

corpus=(); [ -f "$new/kjv.txt" ] && corpus=(--corpus "$new/kjv.txt")
export SQUEEZE_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
export SQUEEZE_DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo unknown)
commit_of() { cat "${!1}/COMMIT" 2>/dev/null || git -C "${!1}" rev-parse --short HEAD 2>/dev/null || echo unknown; }
IFS=, read -ra rows <<<"$ROWS"
for row in "${rows[@]}"; do
  for side in base new; do
    echo "== $side $row" | tee -a "$OUT/run.log"
    SQUEEZE_COMMIT=$(commit_of $side) "$(build_dir $side)/bench/table/bench_table" --rows "$row" "${corpus[@]}" ${TABLE_ARGS:-} \
      --out "$OUT/$side-table.jsonl" --csv /dev/null >>"$OUT/run.log" 2>&1 || echo "$side $row failed (see run.log)"
  done
done
for side in base new; do
  SQUEEZE_COMMIT=$(commit_of $side) "$(build_dir $side)/bench/kernels/bench_adamw" --out "$OUT/$side-adamw.jsonl" >>"$OUT/run.log" 2>&1 ||
    echo "$side adamw failed"
done
python3 - "$OUT" <<'PY' | tee "$OUT/compare.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def rows(name):
    p = out / name
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
for kind, key, fields in (("table", "case", ("tokens_per_s", "peak_gb")), ("adamw", "case", ("time_ms",))):
    def keyed(rs):  # a case may repeat (one line per kernel shape): pair the n-th of each
        seen = {}
        for r in rs:
            n = seen[r.get(key)] = seen.get(r.get(key), -1) + 1
            yield (r.get(key), n), r
    base = dict(keyed(rows(f"base-{kind}.jsonl")))
    for k, r in keyed(rows(f"new-{kind}.jsonl")):
        b = base.get(k)
        if not b:
            continue
        cells = [f"{f} {r.get(f)} / {b.get(f)} = {r[f] / b[f]:.3f}" for f in fields if b.get(f)]
        print(f"{kind} {r[key]} ({r.get('device', '?')}, {b.get('commit', '?')} -> {r.get('commit', '?')}): " + "; ".join(cells))
PY
