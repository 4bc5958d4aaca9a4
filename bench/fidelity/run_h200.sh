#!/usr/bin/env bash
# The fidelity benchmark on one H200 (bench/fidelity/README.md): build llama_train if it is not built yet, then run
# one part of the runs within a time budget. The runs of earlier calls, committed as bench/results/h200/*-runs.jsonl,
# are carried on: each call adds to them and brings back the whole file and its summary.
#   usage: bash bench/fidelity/run_h200.sh
#   env:   PART=fidelity (default) | finetune | table (bench_table from the fine-tuning base: every row fine-tunes it)
#          BUDGET_S=480    seconds for the whole call, the build included; no run starts that cannot end in it
#          PRESET=125m  STEPS=20 (or TOKENS=N)  SEEDS=1,2,3  STRATEGIES=all (or a,b,c)  BATCH=32  SEQ=256  EVAL_BATCHES=16
#          JOBS=1 (fidelity: runs sharing the GPU at a time; a 125m run leaves most of it idle)
#          LR (default: llama_train's for the preset)   CKPT_ROOT=DIR, SAVE_EVERY=200: checkpoint each run there, so a run
#          stopped at the budget resumes in the next call on the same (still warm) machine
#          finetune: BASE_TOKENS=10000000  FT_TOKENS=2457600  FULL_LR=3e-4  LORA_LR=3e-3  METHODS=full,lora,qlora,gptq4-lora
#          table: TABLE_STEPS=50 TABLE_WARMUP=5, TABLE_FULL_ROWS / TABLE_LORA_ROWS (at FULL_LR / LORA_LR)
#          KJV=$ROOT/kjv.txt (the `bible` program's text, one verse per line; the GPU machine has no `bible`)
# Writes $OUT/fidelity.jsonl + fidelity-runs.jsonl (or finetune.jsonl + finetune-runs.jsonl, or table-ft.jsonl + .csv)
# and the logs of this call.
set -uo pipefail
t0=$(date +%s)
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$ROOT/build-gpu}
RESULTS=${RESULTS:-$ROOT/bench/results/h200}
DRIVER="$ROOT/bench/fidelity/fidelity.py"
PART=${PART:-fidelity}
BUDGET_S=${BUDGET_S:-480}
export SQUEEZE_COMMIT=$(cat "$ROOT/COMMIT" 2>/dev/null || git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
export SQUEEZE_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
export SQUEEZE_DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo unknown)

targets=()
[ -x "$BUILD/bin/llama_train" ] || targets+=(llama_train)
[ "$PART" = table ] && [ ! -x "$BUILD/bench/table/bench_table" ] && targets+=(bench_table)
if [ ${#targets[@]} -gt 0 ]; then
  TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  # As bench/run_gpu.sh configures (90a: the Hopper kernels), but the targets this part runs.
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
    -DSQUEEZE_TORCH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90a} >"$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; exit 1; }
  cmake --build "$BUILD" -j16 --target "${targets[@]}" >"$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -30; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi

KJV=${KJV:-$ROOT/kjv.txt}
corpora="$BUILD/fidelity-corpora"
if [ -f "$KJV" ]; then
  python3 "$DRIVER" corpora --kjv "$KJV" --out "$corpora" >/dev/null || exit 1
elif command -v bible >/dev/null; then
  python3 "$DRIVER" corpora --out "$corpora" >/dev/null || exit 1
else
  echo "no $KJV and no bible program: write it on a machine with bible-kjv (python3 bench/fidelity/fidelity.py corpora --out DIR," \
       "then copy DIR/kjv.txt into the snapshot's root)"
  exit 1
fi

budget=$(( BUDGET_S - ($(date +%s) - t0) - 10 ))  # 10 s for the summary and the copies
if [ "$budget" -lt 30 ]; then
  echo "only ${budget} s of BUDGET_S=$BUDGET_S left after the build: call again (a warm machine keeps $BUILD)"
  exit 0
fi

geometry=(--binary "$BUILD/bin/llama_train" --preset "${PRESET:-125m}" --device cuda --batch "${BATCH:-32}" --seq "${SEQ:-256}"
          --eval-batches "${EVAL_BATCHES:-16}" --budget-s "$budget")
case "$PART" in
  fidelity)
    runs="$OUT/fidelity-runs.jsonl"
    [ -f "$RESULTS/fidelity-runs.jsonl" ] && cp "$RESULTS/fidelity-runs.jsonl" "$runs"
    if [ -n "${TOKENS:-}" ]; then length=(--tokens "$TOKENS"); else length=(--steps "${STEPS:-20}"); fi
    python3 "$DRIVER" run "${geometry[@]}" "${length[@]}" --seeds "${SEEDS:-1,2,3}" --strategies "${STRATEGIES:-all}" \
      --corpus "$corpora/kjv.txt" --jobs "${JOBS:-1}" ${LR:+--lr "$LR"} ${CKPT_ROOT:+--ckpt-root "$CKPT_ROOT" --save-every "${SAVE_EVERY:-200}"} \
      --runs "$runs" --work "$BUILD/fidelity-work"
    rc=$?
    python3 "$DRIVER" summarize --runs "$runs" --out "$OUT/fidelity.jsonl" >/dev/null
    work="$BUILD/fidelity-work"
    ;;
  finetune | table)
    runs="$OUT/finetune-runs.jsonl"
    [ -f "$RESULTS/finetune-runs.jsonl" ] && cp "$RESULTS/finetune-runs.jsonl" "$runs"
    # The exported base (~0.5 GB at 125m) stays in $BUILD on this machine; only the runs' records come back.
    python3 "$DRIVER" finetune "${geometry[@]}" --base-corpus "$corpora/ot.txt" --ft-corpus "$corpora/nt.txt" \
      --base-tokens "${BASE_TOKENS:-10000000}" --tokens "${FT_TOKENS:-2457600}" --seeds "${SEEDS:-1,2,3}" \
      --full-lr "${FULL_LR:-3e-4}" --lora-lr "${LORA_LR:-3e-3}" --methods "${METHODS:-full,lora,qlora,gptq4-lora}" \
      --runs "$runs" --work "$BUILD/finetune-work" --out "$OUT/finetune.jsonl" --base-path "$BUILD/finetune-work/base.path"
    rc=$?
    work="$BUILD/finetune-work"
    if [ "$PART" = table ] && [ $rc -eq 0 ]; then
      # The committed runs are all there, so the call above only trained the base (when this machine lacks it).
      base=$(cat "$BUILD/finetune-work/base.path")
      table=("$BUILD/bench/table/bench_table" --hf "$base" --corpus "$corpora/nt.txt" --batch "${BATCH:-32}" --seq "${SEQ:-256}"
             --steps "${TABLE_STEPS:-50}" --warmup "${TABLE_WARMUP:-5}" --eval-seqs 128 --out "$OUT/table-ft.jsonl")
      "${table[@]}" --lr "${FULL_LR:-3e-4}" --csv "$OUT/table-ft-full.csv" \
        --rows "${TABLE_FULL_ROWS:-libtorch-autocast-bf16,fp32,bf16,fp16,bf16-ckpt,bf16-accum4-ckpt,zero2-bf16,zero3-offload-bf16-ckpt}" || rc=1
      "${table[@]}" --lr "${LORA_LR:-3e-3}" --csv "$OUT/table-ft-lora.csv" \
        --rows "${TABLE_LORA_ROWS:-lora,qlora,qlora-all,qlora-adam8,gptq4-lora}" || rc=1
    fi
    ;;
  *)
    echo "PART=$PART: fidelity, finetune or table"; exit 1 ;;
esac
# This call's logs (a few kB each), for a run that failed or looks odd.
mkdir -p "$OUT/logs"
find "$work/logs" -name '*.log' -newermt "@$t0" -exec cp {} "$OUT/logs/" \; 2>/dev/null
echo "$PART: $(( $(date +%s) - t0 )) s in all"
exit $rc
