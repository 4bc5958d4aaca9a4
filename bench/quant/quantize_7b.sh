#!/usr/bin/env bash
# The LLaMA-7B geometry quantized from the command line, end to end, on the GPU machine:
#   1. a random-weight Hugging Face LLaMA-7B directory (bf16, 5 GB shards: tools/make_hf_fixtures.py --llama-7b), written
#      once into $WORK (13.5 GB; kept between runs, never in the repository)
#   2. random token shards (llm.c's uint16 format, ids < 32000) into $WORK/shards
#   3. llama_gptq --hf $WORK/llama-7b --data $WORK/shards --bits 4 --group 128 --act-order --device cuda --export-hf ...
#      timed by phase (load, data, reference, quantize = calibration forwards + GPTQ, export, eval; quantize split into
#      calibration forwards, solves, packing, RTN + output errors: quantize_phases_s)
#   4. one JSON line appended to $OUT/quantize7b.jsonl: llama_gptq's phase seconds and perplexities before and after,
#      the wall time of the whole llama_gptq process against the 120 s target, the export's size
# Random weights and random tokens: the perplexities only show that the quantized model computes what the dense one
# does (their ratio), not a language model's quality.
#   usage: TARGETS=llama_gptq GPU_TESTS=0 bash bench/run_gpu.sh quantize7b    (builds, then runs this)
#          bash bench/quant/quantize_7b.sh                                       (llama_gptq already built in $BUILD)
#   env: OUT (default ./gpu-results), BUILD (default <repo>/build-gpu), WORK (default ${TMPDIR:-/tmp}/squeeze-quant7b),
#        SEQ (2048), CALIB_TOKENS (32768: 16 windows), EVAL_TOKENS (32768), EXTRA_ARGS (more llama_gptq flags)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$PWD/gpu-results}
BUILD=${BUILD:-$ROOT/build-gpu}
WORK=${WORK:-${TMPDIR:-/tmp}/squeeze-quant7b}
SEQ=${SEQ:-2048}
CALIB_TOKENS=${CALIB_TOKENS:-32768}
EVAL_TOKENS=${EVAL_TOKENS:-32768}
TARGET_S=120
mkdir -p "$OUT" "$WORK"
bin=$BUILD/bin/llama_gptq
if [ ! -x "$bin" ]; then
  echo "quantize_7b: $bin is not built (TARGETS=llama_gptq GPU_TESTS=0 bash bench/run_gpu.sh none)"
  exit 1
fi

# 1. The model, once: 13.5 GB of bf16 in $WORK/llama-7b.
model=$WORK/llama-7b
if [ ! -f "$model/model.safetensors.index.json" ]; then
  if ! python3 "$ROOT/tools/make_hf_fixtures.py" --help 2>/dev/null | grep -q -- --llama-7b; then
    echo "quantize_7b: tools/make_hf_fixtures.py has no --llama-7b mode (the random LLaMA-7B directory); it is needed here"
    exit 1
  fi
  rm -rf "$model"
  t0=$(date +%s)
  python3 "$ROOT/tools/make_hf_fixtures.py" "$WORK" --llama-7b >"$OUT/quantize7b-model.log" 2>&1 ||
    { tail -20 "$OUT/quantize7b-model.log"; exit 1; }
  echo "quantize_7b: wrote $model in $(( $(date +%s) - t0 )) s"
fi

# 2. Random token shards: the calibration windows come from train_000000.bin, the perplexity from val_000000.bin.
shards=$WORK/shards
if [ ! -f "$shards/val_000000.bin" ] || [ ! -f "$shards/.tokens-$CALIB_TOKENS-$EVAL_TOKENS-$SEQ" ]; then
  rm -rf "$shards"
  python3 - "$shards" "$(( CALIB_TOKENS * 4 + SEQ + 1 ))" "$(( EVAL_TOKENS + SEQ + 1 ))" <<'PY'
import array, os, random, sys
out, n_train, n_val = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(out, exist_ok=True)
rng = random.Random(7)
for name, n in (("train_000000.bin", n_train), ("val_000000.bin", n_val)):
    header = array.array("i", [20240520, 1, n] + [0] * 253)  # llm.c: magic, version 1 (uint16 ids), count
    ids = array.array("H", (rng.randrange(32000) for _ in range(n)))
    with open(os.path.join(out, name + ".tmp"), "wb") as f:
        header.tofile(f)
        ids.tofile(f)
    os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))
PY
  touch "$shards/.tokens-$CALIB_TOKENS-$EVAL_TOKENS-$SEQ"
fi

# 3. The timed run. Its last --out line holds the phases; the export replaces the previous run's (--force).
export_dir=$WORK/llama-7b-gptq-w4-g128-actorder
rm -f "$WORK/run.jsonl" "$WORK/run.csv"
start=$(date +%s.%N)
set +e
"$bin" --hf "$model" --data "$shards" --bits 4 --group 128 --act-order --device cuda --seq "$SEQ" --calib-tokens "$CALIB_TOKENS" \
  --eval-tokens "$EVAL_TOKENS" --eval-batch 8 --export-hf "$export_dir" --force --out "$WORK/run" ${EXTRA_ARGS:-} >"$OUT/quantize7b.log" 2>&1
rc=$?
set -e
wall=$(python3 -c "import sys, time; print(time.time() - float(sys.argv[1]))" "$start")
{ grep -vE "^\[(gptq|reference)" "$OUT/quantize7b.log" || true; } | tail -12  # the table and the phases, not each layer

# 4. One JSON line: the phases line, with the process' wall time, the target and the export's size.
python3 - "$WORK/run.jsonl" "$OUT/quantize7b.jsonl" "$wall" "$rc" "$export_dir" "$OUT/quantize7b.log" "$TARGET_S" <<'PY'
import json, os, subprocess, sys
run, out, wall, rc, export_dir, log, target = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6], float(sys.argv[7])


def gpu_name():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.split("\n")[0]
    except OSError:
        return "unknown"


lines = [json.loads(l) for l in open(run)] if os.path.exists(run) else []
phases = lines[-1] if lines and "phases_s" in lines[-1] else {}
row = {**phases, "bench": "quantize7b", "case": "llama-7b-geometry gptq-w4-g128-actorder --hf --data --export-hf",
       "time_ms": wall * 1e3, "wall_s": wall, "peer": f"target_{int(target)}s", "peer_time_ms": target * 1e3,
       "ratio_vs_peer": target / wall if wall > 0 else None, "roofline_fraction": None, "within_target": rc == 0 and wall <= target,
       "exit_code": rc, "device": os.environ.get("SQUEEZE_DEVICE") or gpu_name(),
       "date": os.environ.get("SQUEEZE_DATE", ""), "commit": os.environ.get("SQUEEZE_COMMIT", phases.get("commit", ""))}
if os.path.isdir(export_dir):
    row["export_bytes"] = sum(os.path.getsize(os.path.join(export_dir, f)) for f in os.listdir(export_dir))
if rc != 0:
    row["error"] = "".join(open(log).readlines()[-5:])[-2000:]
with open(out, "a") as f:
    f.write(json.dumps(row) + "\n")
ph = phases.get("phases_s", {})
qph = phases.get("quantize_phases_s", {})
print("quantize7b: %.1f s (target %d s, exit %d); phases %s; quantize: %s; ppl %s -> %s" % (
    wall, target, rc, ", ".join(f"{k} {v:.1f}" for k, v in ph.items()), ", ".join(f"{k} {v:.1f}" for k, v in qph.items()),
    phases.get("ppl_reference"), phases.get("ppl_quantized")))
PY
exit "$rc"
