#!/usr/bin/env bash
# The QLoRA comparison on one H200: per preset (TinyLlama-1.1B, then LLaMA-7B; B=8, T=2048), bench_table's qlora
# row (squeeze), then the transformers + bitsandbytes + PEFT peer (qlora_peer.py), plain and with Liger's kernels, then
# compare.py over them.
# About 5 minutes after the build; every command is stopped at the deadline, so the whole ends within it.
#   usage: bash bench/qlora/run_h200.sh [BENCH_TABLE]
#     BENCH_TABLE: the bench_table binary (default: $BENCH_TABLE, else build-gpu/bench/table/bench_table, which
#     `TARGETS=bench_table GPU_TESTS=0 bash bench/run_gpu.sh none` builds)
#   env: OUT (default ./gpu-results); QLORA_PRESETS ("tinyllama-1.1b llama-7b"); QLORA_ROWS: bench_table's rows ("qlora:8";
#        e.g. "qlora:8,qlora-hostckpt:8": every qlora-* row is compared with the one peer); QLORA_SEQ (2048) both sides'
#        tokens a sample and QLORA_BATCH (8) the peer's samples a step (ours: the rows'); QLORA_STEPS (3) and QLORA_WARMUP (2),
#        both sides; QLORA_DEADLINE seconds from the start after which nothing more is started and a running command
#        is stopped (540); QLORA_TABLE_ARGS / QLORA_PEER_ARGS: extra arguments of one side (e.g. "--layers 2";
#        the peer's "--device cpu" for a smoke run without a GPU); QLORA_LIGER (1: the peer again with --liger, Liger's
#        kernels, when liger_kernel imports; 0: not); TMPDIR: where the peer writes its random bf16 checkpoint (13.5 GB at 7B), removed after.
#   needs: python3 with torch, transformers, accelerate, bitsandbytes and peft (the GPU machine lacks
#        bitsandbytes: carry the wheels, README.md beside this says how).
# Writes $OUT/qlora-table.jsonl (bench_table), $OUT/qlora-peer.jsonl (the peer), $OUT/qlora-compare.jsonl (one line
# per preset: the fields compare.py's docstring lists), $OUT/qlora-compare.txt (the table) and $OUT/qlora.log
# (everything both programs printed); bench_table's CSVs go to TMPDIR.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BT=${1:-${BENCH_TABLE:-$ROOT/build-gpu/bench/table/bench_table}}
TMP=${TMPDIR:-/tmp}
if [ ! -x "$BT" ]; then
  echo "run_h200.sh: no bench_table at $BT (build it: TARGETS=bench_table GPU_TESTS=0 bash bench/run_gpu.sh none)"
  exit 1
fi
if ! python3 -c 'import bitsandbytes, peft, transformers' 2>/dev/null; then
  echo "run_h200.sh: python3 lacks bitsandbytes / peft / transformers; install the carried wheels first:"
  echo "  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site"
  exit 1
fi
# As bench/run_gpu.sh (kept when it calls this script).
export SQUEEZE_COMMIT=${SQUEEZE_COMMIT:-$(cat "$ROOT/COMMIT" 2>/dev/null || git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}
export SQUEEZE_DATE=${SQUEEZE_DATE:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
export SQUEEZE_DEVICE=${SQUEEZE_DEVICE:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo unknown)}
export PYTHONUNBUFFERED=1
corpus=(); [ -f "$ROOT/kjv.txt" ] && corpus=(--corpus "$ROOT/kjv.txt")
steps=(--steps "${QLORA_STEPS:-3}" --warmup "${QLORA_WARMUP:-2}")
t0=$(date +%s)
deadline=$(( t0 + ${QLORA_DEADLINE:-540} ))

bounded() {  # bounded <label> <command...>: runs it until the deadline, output appended to qlora.log, its summary lines shown
  local label=$1 left rc; shift
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 20 ]; then echo "   $label: not started (deadline)"; return; fi
  echo "### $label: $*" >>"$OUT/qlora.log"
  timeout "$left" "$@" >>"$OUT/qlora.log.part" 2>&1
  rc=$?
  cat "$OUT/qlora.log.part" >>"$OUT/qlora.log"
  grep -E "^(qlora|hf-bnb)|failed|Error|error:" "$OUT/qlora.log.part" | grep -vE "Warning|warn" | head -4
  rm -f "$OUT/qlora.log.part"
  [ $rc -eq 0 ] || echo "   $label: exit $rc (124: stopped at the deadline; full output: qlora.log)"
}

echo "== qlora (B=8, T=2048, NF4 + DoubleQuant, LoRA r=8 on q/v, bf16, checkpointing): squeeze, then transformers + bitsandbytes + PEFT"
for preset in ${QLORA_PRESETS:-tinyllama-1.1b llama-7b}; do
  bounded "squeeze $preset" "$BT" --preset "$preset" --rows "${QLORA_ROWS:-qlora:8}" --seq "${QLORA_SEQ:-2048}" "${steps[@]}" --eval-seqs 4 "${corpus[@]}" \
    ${QLORA_TABLE_ARGS:-} --out "$OUT/qlora-table.jsonl" --csv "$TMP/qlora-table-$preset.csv"
  bounded "peer $preset" python3 "$ROOT/bench/qlora/qlora_peer.py" --preset "$preset" --batch "${QLORA_BATCH:-8}" --seq "${QLORA_SEQ:-2048}" "${steps[@]}" "${corpus[@]}" \
    ${QLORA_PEER_ARGS:-} --out "$OUT/qlora-peer.jsonl"
  if [ "${QLORA_LIGER:-1}" = 1 ] && python3 -c 'import liger_kernel' 2>/dev/null; then
    bounded "peer + Liger $preset" python3 "$ROOT/bench/qlora/qlora_peer.py" --preset "$preset" --batch "${QLORA_BATCH:-8}" --seq "${QLORA_SEQ:-2048}" "${steps[@]}" "${corpus[@]}" \
      ${QLORA_PEER_ARGS:-} --liger --out "$OUT/qlora-peer.jsonl"
  fi
  echo "   $preset done at $(( $(date +%s) - t0 )) s"
done
python3 "$ROOT/bench/qlora/compare.py" "$OUT/qlora-table.jsonl" "$OUT/qlora-peer.jsonl" --jsonl "$OUT/qlora-compare.jsonl" | tee "$OUT/qlora-compare.txt"
