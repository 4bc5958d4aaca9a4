#!/usr/bin/env bash
# One call on the GPU machine: build with libtorch's CUDA side, run the GPU tests (ctest -L cuda) and the
# benchmarks, write full results under $OUT (default ./gpu-results) and print a short table last.
#   usage: bash bench/run_gpu.sh [bench-name ...]    (no names: all benchmarks but the 7B rows;
#          names: adamw adamw8_shapes fused gemm4 gemm4_probe dequant wgmma_rate gptq zero table table7b table7b_offload table7b_stream table7b_hostckpt table7b_qlora_hostckpt table13b_stream long8b long8b_peer table70b table175b table_fp8 graphed table7b_fp8 fp8_bound diag7b ncu_gemm ncu_sm90 llama_gptq quantize7b scale scale7b scale7b_w1 peers peers_fp8 qlora profile)
#   env: TARGETS="t1 t2" builds only those targets (default: everything); GPU_TESTS=0 skips ctest -L cuda;
#        GPU_TESTS_REGEX="Quant|Zero" runs only the cuda-labelled tests whose names match (ctest -R);
#        BENCH_ARGS_<name>="..." extra arguments for one benchmark (e.g. BENCH_ARGS_table="--rows bf16,ckpt");
#        BENCH_TIMEOUT=S stops a benchmark after S seconds (default 3600).
#        CUDA_ARCHS=90 builds without the sm_90a-only kernels (default 90a).
#        SCALE_WORLDS="1 2" the GPU counts of the scale section (default 1 2 4 8; those above the GPUs here are skipped).
# From the development machine, snapshot the committed tree and send it with the device tool:
#   rm -rf .snap && mkdir .snap && git archive HEAD | tar -x -C .snap && git rev-parse --short HEAD > .snap/COMMIT
#   device run (carry .snap): bash .snap/bench/run_gpu.sh
# Results: $OUT/<bench>.jsonl (one JSON object per case, fields as docs/architecture.md says), $OUT/ctest.log;
# committed as bench/results/<device>/<bench>.* (the latest file of each benchmark; its README names the command).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build-gpu}
export SQUEEZE_COMMIT=$(cat "$ROOT/COMMIT" 2>/dev/null || git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
export SQUEEZE_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
export SQUEEZE_DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo unknown)
TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
want=("$@")

t0=$(date +%s)
# 90a: Hopper's arch-specific features (wgmma, used by kernels/quant/gemm/sm90.cuh); such code runs on sm_90 only.
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
  -DSQUEEZE_TORCH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90a} >"$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; exit 1; }
# Keep going past a failing target (-k 0): everything else still builds, tests and benchmarks.
targets=()
for t in ${TARGETS:-}; do targets+=(--target "$t"); done
if ! cmake --build "$BUILD" -j16 "${targets[@]}" -- -k 0 >"$OUT/build.log" 2>&1; then
  echo "BUILD FAILURES (the rest was built):"; grep -E "FAILED:|error" "$OUT/build.log" | head -40
fi
echo "build: $(( $(date +%s) - t0 )) s"

if [ "${GPU_TESTS:-1}" != 0 ]; then
  (cd "$BUILD" && ctest -L cuda ${GPU_TESTS_REGEX:+-R "$GPU_TESTS_REGEX"} --output-on-failure --timeout 300) >"$OUT/ctest.log" 2>&1
  echo "GPU tests: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log")"
fi

# Each benchmark: an executable under $BUILD/bench that writes JSON lines to the file named by --out.
named() { [[ " ${want[*]} " =~ " $1 " ]]; }
run_bench() {  # run_bench <name> <executable> [args...]
  local name=$1; shift
  if [ ${#want[@]} -gt 0 ] && ! named "$name"; then return; fi
  if [ ! -x "$1" ]; then echo "bench $name: $1 not built"; return; fi
  local extra_var="BENCH_ARGS_$name"
  echo "== $name"; timeout "${BENCH_TIMEOUT:-3600}" "$@" ${!extra_var:-} --out "$OUT/$name.jsonl" 2>&1 | tee "$OUT/$name.log" | tail -30
}
run_bench adamw "$BUILD/bench/kernels/bench_adamw"
# every shape of the 8-bit AdamW kernel against the copy bound, no libtorch (TARGETS=bench_adamw8_shapes; exits 1 when a
# shape's bytes differ from the default shape's)
run_bench adamw8_shapes "$BUILD/bench/kernels/bench_adamw8_shapes"
# fused RMSNorm / add + RMSNorm / RoPE / SwiGLU against eager torch, GB/s vs the copy bandwidth (TARGETS=bench_fused)
run_bench fused "$BUILD/bench/fused/bench_fused"
run_bench gemm4 "$BUILD/bench/quant/bench_quant_gemm"
# the same shapes without libtorch (builds in ~30 s: TARGETS=bench_qgemm_sm90): dispatch, mma.sync, every wgmma
# configuration, cuBLAS bf16
run_bench gemm4_probe "$BUILD/bench/quant/bench_qgemm_sm90"
# GPTQ dequantize (tiled against the per-element kernel, the copy bandwidth) and the fused GEMM / dequantize + cuBLAS
# crossover (TARGETS=bench_dequant)
run_bench dequant "$BUILD/bench/quant/bench_dequant"
# cycles per wgmma on one SM (A from registers or shared memory, N 16 / 128): only when named (TARGETS=bench_wgmma_rate)
if named wgmma_rate; then run_bench wgmma_rate "$BUILD/bench/quant/bench_wgmma_rate"; fi
run_bench gptq "$BUILD/bench/quant/bench_gptq"
run_bench zero "$BUILD/bench/zero/bench_zero"
corpus=(); [ -f "$ROOT/kjv.txt" ] && corpus=(--corpus "$ROOT/kjv.txt")
run_bench table "$BUILD/bench/table/bench_table" "${corpus[@]}"
# The LM head's loss: torch's unfused ops against the chunked and the fused loss (TinyLlama-1.1B head, 16k tokens)
run_bench loss "$BUILD/bench/loss/bench_loss"
# The LLaMA-7B geometry rows, only when named: a few minutes each. The offload row keeps Adam's
# state and the fp32 master weights in host memory (~100 GB for 7B); --clip 0 selects the eager pipeline;
# lr 5e-6 warmed up over the 5 steps: at 7B, 3e-4 and 3e-5 diverged within them (fp32 and bf16 alike), 1e-5 at B=8
# falls and climbs back, 5e-6 trains (diag7b: B=8, 12 steps, 11.17 -> 4.39 at a988d0d; 2 layers at 3e-5: 11.4 -> 3.1).
if named table7b; then
  run_bench table7b "$BUILD/bench/table/bench_table" --preset llama-7b --rows bf16-ckpt:8,bf16-ckpt:1 --clip 0 --lr 5e-6 --lr-warmup 5 "${corpus[@]}"
fi
if named table7b_offload; then
  run_bench table7b_offload "$BUILD/bench/table/bench_table" --preset llama-7b --rows zero3-offload-bf16-ckpt:8,zero3-offload-bf16-ckpt-adam8:8 --clip 0 --lr 5e-6 --lr-warmup 5 "${corpus[@]}"
fi
# Offload<Host, Streamed> beside the row it builds on, one call: the parameters in host memory, each block copied in for
# its forward and its backward (the GPU peak, host peak, copy counters and tokens/s side by side).
if named table7b_stream; then
  run_bench table7b_stream "$BUILD/bench/table/bench_table" --preset llama-7b --rows zero3-offload-bf16-ckpt:8,zero3-stream-bf16-ckpt:8 --clip 0 --lr 5e-6 --lr-warmup 5 "${corpus[@]}"
fi
# CheckpointOffload<Host> beside the row it builds on, one call: the checkpointed block inputs in host memory, untiled and
# with each MLP in tiles of 4096 tokens (planned 30.77 and 29.69 GB against the row's 34.79: a tile's intermediates are a
# quarter of the untiled ones, and a tiled block recomputed in backward runs its tiles once, in their own backward).
if named table7b_hostckpt; then
  run_bench table7b_hostckpt "$BUILD/bench/table/bench_table" --preset llama-7b --rows zero3-offload-bf16-ckpt:8,zero3-offload-bf16-hostckpt:8 --clip 0 --lr 5e-6 --lr-warmup 5 "${corpus[@]}"
  "$BUILD/bench/table/bench_table" --preset llama-7b --rows zero3-offload-bf16-hostckpt:8 --mlp-tile 4096 --clip 0 --lr 5e-6 --lr-warmup 5 "${corpus[@]}" \
    --out "$OUT/table7b_hostckpt.jsonl" --csv "$OUT/table7b_hostckpt-tiled.csv" 2>&1 | tee -a "$OUT/table7b_hostckpt.log" | tail -4
fi
# QLoRA at LLaMA-7B in the least GPU memory: the qlora row, the same with the checkpointed block inputs in host memory,
# and with the NF4 blocks streamed from host memory too (planned 4.3 GB), untiled (tiling the MLP costs one more forward
# of it; at tiles of 4096 both rows ran at 1.01x the peer, 30c4cb6), the loss in chunks of 1024, beside
# transformers + bitsandbytes + PEFT in the same call (bench/qlora: its wheels).
if named table7b_qlora_hostckpt; then
  QLORA_PRESETS=llama-7b QLORA_ROWS=qlora:8,qlora-hostckpt:8,qlora-stream-hostckpt:8 QLORA_TABLE_ARGS="--mlp-tile 0 --loss-chunk 1024" \
    bash "$ROOT/bench/qlora/run_h200.sh" "$BUILD/bench/table/bench_table"
fi
# The longest context (only when named): LLaMA-3-8B QLoRA (r=16 on all linears, 8-bit checkpoints in host memory, MLP tiles
# the planner picks for the GPU), B=1, one timed step at each of LONG_SEQS tokens (default 400000: about 400 s a step on
# an H100, the attention growing with T^2; 131,072 took 50 s at 30c4cb6). long8b_peer: the peer (transformers +
# bitsandbytes + PEFT, r=16 on all linears, gradient checkpointing; bench/qlora's wheels) at each of LONG_PEER_SEQS
# until it runs out of memory, its longest context; a call of its own beside the 400k row (each fits one 10-minute call).
# On a larger card both act as an 80 GB one (--gpu-gb): ours within the target's 80 GB, the peer within an H100 80GB's
# 81,559 MiB (85.5 GB).
if named long8b; then
  for T in ${LONG_SEQS:-400000}; do
    run_bench long8b "$BUILD/bench/table/bench_table" --preset llama3-8b --rows qlora-all16-hostckpt8:1 --seq "$T" --steps 1 --warmup 0 \
      --eval-seqs 0 --mlp-tile auto --gpu-gb 80 "${corpus[@]}"
  done
fi
if named long8b_peer; then
  echo "== long8b peer"
  timeout "${BENCH_TIMEOUT:-3600}" python3 "$ROOT/bench/qlora/qlora_peer.py" --preset llama3-8b --batch 1 --seqs "${LONG_PEER_SEQS:-16384,24576,32768,49152,65536}" \
    --rank 16 --alpha 32 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --gpu-gb 85.5 "${corpus[@]}" --out "$OUT/long8b-peer.jsonl" 2>&1 |
    tee "$OUT/long8b-peer.log" | grep -E "trained|out of memory|Error" | tail -8
fi
# LLaMA-2-70B on one GPU (only when named): NF4 and GPTQ-format 4- and 3-bit bases, r=16 adapters on all linears with
# 8-bit moments, the checkpointed block inputs in host memory, B=TABLE70B_BATCH (2), T=2048; then the NF4 blocks streamed
# from host memory (qlora-all16-stream, 8-bit checkpoints) at B=TABLE70B_STREAM_BATCH (8); each model built block by
# block, drawn on the GPU.
if named table70b; then
  run_bench table70b "$BUILD/bench/table/bench_table" --preset llama-70b \
    --rows "qlora-all16-hostckpt-adam8:${TABLE70B_BATCH:-2},gptq4-all16-hostckpt-adam8:${TABLE70B_BATCH:-2},gptq3-all16-hostckpt-adam8:${TABLE70B_BATCH:-2},qlora-all16-stream:${TABLE70B_STREAM_BATCH:-8}" --steps 2 --warmup 1 \
    --eval-seqs 0 --lr 5e-6 "${corpus[@]}"
fi
# The survey's 175B on one GPU (only when named): preset llama-175b (GPT-3's width and depth), QLoRA r=16 on all linears
# with 8-bit moments, the NF4 blocks in pinned host memory streamed through the GPU (Offload<Host, Streamed>), the
# checkpointed block inputs in host memory in 8 bits, B=TABLE175B_BATCH (8: 16k tokens of compute a step to hide the
# copies), T=2048, MLP tiles the planner picks; built block by block on the GPU, each block's packed bytes moved to the
# host as soon as it is packed (each block drawn on the GPU: drawn on one host thread a block took 10 s, 16 minutes for 96).
if named table175b; then
  run_bench table175b "$BUILD/bench/table/bench_table" --preset llama-175b --rows "qlora-all16-stream:${TABLE175B_BATCH:-8}" --steps 1 \
    --warmup 1 --eval-seqs 0 --lr 5e-6 --mlp-tile auto --loss-chunk 1024 "${corpus[@]}"
fi
# FP8 GEMMs beside their bf16 twins, one call (only when named): TinyLlama-1.1B, B=8, T=2048, bf16 / fp8, bf16-ckpt /
# fp8-ckpt and zero3-bf16-ckpt / zero3-fp8-ckpt (table_fp8; FP8_ROWS to choose); LLaMA-7B with the optimizer on the host
# (it fits one 80 GB GPU that way), zero3-offload-bf16-ckpt / zero3-offload-fp8-ckpt (table7b_fp8, lr and clipping as table7b).
if named table_fp8; then
  run_bench table_fp8 "$BUILD/bench/table/bench_table" --preset tinyllama-1.1b \
    --rows "${FP8_ROWS:-bf16:8,fp8:8,bf16-ckpt:8,fp8-ckpt:8,zero3-bf16-ckpt:8,zero3-fp8-ckpt:8}" "${corpus[@]}"
fi
if named table7b_fp8; then
  run_bench table7b_fp8 "$BUILD/bench/table/bench_table" --preset llama-7b --rows zero3-offload-bf16-ckpt:8,zero3-offload-fp8-ckpt:8 \
    --clip 0 --lr 5e-6 --lr-warmup 5 "${corpus[@]}"
fi
# The FP8 step-time bound (only when named; after table_fp8 / table7b_fp8 in the same call, whose bf16 rows give the step
# times): the block linears' GEMMs in bf16 and FP8 and the least cast traffic at the copy bandwidth (bench/fp8).
if named fp8_bound; then
  step_of() {  # step_of <table.jsonl> <case>: the row's milliseconds a step, if it ran
    python3 -c 'import json,sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if d.get("case") == sys.argv[2] and d.get("iters_per_s"): print(1000.0 / d["iters_per_s"])' "$1" "$2" 2>/dev/null | tail -1
  }
  for spec in "tinyllama-1.1b bf16 table_fp8" "tinyllama-1.1b bf16-ckpt table_fp8" "llama-7b zero3-offload-bf16-ckpt table7b_fp8"; do
    read -r preset row table <<<"$spec"
    ck=(); [[ $row == *ckpt ]] && ck=(--ckpt)
    step=$(step_of "$OUT/$table.jsonl" "$row")
    run_bench fp8_bound "$BUILD/bench/fp8/bench_fp8_bound" --preset "$preset" "${ck[@]}" ${step:+--step-ms "$step"}
  done
fi
# The compact host state (Precision<bf16, bf16> + 8-bit moments: 6 bytes a parameter) at the 13B geometry: ~80 GB of
# host state where fp32 masters and moments would need 208 GB.
if named table13b_stream; then
  run_bench table13b_stream "$BUILD/bench/table/bench_table" --preset llama-13b --rows zero3-stream-compact-ckpt:8 --clip 0 --lr 5e-6 --lr-warmup 5 "${corpus[@]}"
fi

# The 7B learning rate (only when named): bf16 + checkpointing, T=2048, 12 optimizer steps each, the loss of every
# step in `losses`. At B=1 (e8d7c8e) the 7B width at 2 layers trains at 3e-5, 32 layers diverge at 3e-5 and train
# unsteadily at 1e-5; at B=8 (338a3d7, table7b) 1e-5 falls to 5.4 by step 3, then climbs back to 11.2 as the warm-up
# reaches 6e-6 .. 1e-5. So: B=8 at 5e-6 and 3e-6 (warmed up over 5 steps). At a988d0d 5e-6 trains: 11.17 -> 4.39 in
# 12 steps (val ppl 97.7; 3e-6 did not finish in its 150 s), so table7b and table7b_offload use 5e-6.
if named diag7b; then
  echo "== diag7b"
  for args in "--lr 5e-6" "--lr 3e-6"; do
    timeout "${BENCH_TIMEOUT:-3600}" "$BUILD/bench/table/bench_table" --preset llama-7b $args --rows bf16-ckpt:8 --steps 10 --warmup 2 --lr-warmup 5 \
      --clip 0 --eval-seqs 2 "${corpus[@]}" --out "$OUT/diag7b.jsonl" >>"$OUT/diag7b.log" 2>&1 || echo "   failed: $args"
    python3 -c 'import json,sys; d=[json.loads(l) for l in open(sys.argv[1])][-1]; print("   %-15s B=%d layers %2d lr %.0e: val ppl %10.1f losses %s" % (d["preset"], d["batch"], d["layers"], d["lr"], d.get("val_ppl", 0), " ".join("%.2f" % x for x in d.get("losses", []))))' "$OUT/diag7b.jsonl"
  done
fi

# Several GPUs (only when named). scale: ZeRO-3 + bf16 without and with checkpointing, and with
# Offload<Host> + checkpointing, at TinyLlama-1.1B, B=8 per GPU, T=2048, at world 1 and 2 (only worlds <= the GPUs
# here), beside PyTorch FSDP2 in the same configurations (bench/fsdp2/fsdp2_llama.py); scale7b: LLaMA-7B at world 2
# (scale7b_w1: at world 1).
# One torchrun launch per row (a row that fails at world > 1 ends its launch); bench_table appends to
# $OUT/scale.jsonl, FSDP2 to $OUT/fsdp2.jsonl; bench/fsdp2/compare.py prints them side by side. torchrun hosts
# its own TCP store on MASTER_PORT, so TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (rank 0's NcclComm hosts ours there);
# torchrun would set OMP_NUM_THREADS=1 per rank, which starves the offload rows' CPU AdamW: the cores are split.
# ~5 min for scale on 2 H200s; scale7b ~6 min (each rank builds the 7B model in float on the host first). A launch is
# stopped after SCALE_TIMEOUT s (180; 7B 450), a collective after SCALE_COMM_TIMEOUT s (120; 7B 300).
scale_launch() {  # scale_launch <world> <timeout s> <torchrun arguments...>; full output appended to $OUT/scale-launch.log
  local w=$1 t=$2 rc; shift 2
  echo "### world $w: $*" >>"$OUT/scale-launch.log"
  OMP_NUM_THREADS=$(( $(nproc) / w )) TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 NCCL_NVLS_ENABLE=0 \
    timeout "$t" python3 -m torch.distributed.run --standalone --nproc_per_node "$w" "$@" >"$OUT/scale-last.log" 2>&1
  rc=$?
  cat "$OUT/scale-last.log" >>"$OUT/scale-launch.log"
  grep -E "^(zero|fsdp2|bench_table)|failed|Error" "$OUT/scale-last.log" | grep -vE "ChildFailedError|elastic|^\[" | head -6
  [ $rc -eq 0 ] || echo "   exit $rc (124: timeout): world $w ${*:1:4} ... (full output: scale-launch.log)"
}
scale_rows() {  # scale_rows <preset> <worlds> <extra args> <rows...>: rows "ours-case|fsdp2 flags" ("-": no FSDP2 run)
  local preset=$1 worlds=$2 extra=$3; shift 3
  local ngpu w row name flags; ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  for w in $worlds; do
    if [ "$w" -gt "$ngpu" ]; then echo "   world $w skipped: $ngpu GPU(s) here"; continue; fi
    for row in "$@"; do
      name=${row%%|*}; flags=${row#*|}
      scale_launch "$w" "${SCALE_TIMEOUT:-180}" --no-python "$BUILD/bench/table/bench_table" --preset "$preset" --rows "$name:8" --seq 2048 \
        --eval-seqs 4 --comm-timeout "${SCALE_COMM_TIMEOUT:-120}" $extra "${corpus[@]}" --out "$OUT/scale.jsonl"
      [ "$flags" = "-" ] && continue
      scale_launch "$w" "${SCALE_TIMEOUT:-180}" "$ROOT/bench/fsdp2/fsdp2_llama.py" --preset "$preset" --batch 8 --seq 2048 $flags \
        --comm-timeout "${SCALE_COMM_TIMEOUT:-120}" $extra "${corpus[@]}" --out "$OUT/fsdp2.jsonl"
    done
  done
}
if named scale; then
  echo "== scale (TinyLlama-1.1B, B=8 per GPU, T=2048, worlds ${SCALE_WORLDS:-1 2 4 8} up to the GPUs here; ours vs FSDP2 per row)"
  scale_rows tinyllama-1.1b "${SCALE_WORLDS:-1 2 4 8}" "" "zero3-bf16|" "zero3-bf16-ckpt|--ckpt" "zero3-offload-bf16-ckpt|--ckpt --offload" | tee "$OUT/scale.log"
fi
if named scale7b; then
  echo "== scale7b (LLaMA-7B, B=8 per GPU, T=2048, world 2; lr 1e-5 as table7b; FSDP2 with checkpointing only)"
  SCALE_TIMEOUT=${SCALE_TIMEOUT:-450} SCALE_COMM_TIMEOUT=${SCALE_COMM_TIMEOUT:-300} scale_rows llama-7b "2" "--lr 1e-5" "zero3-bf16-ckpt|--ckpt" "zero3-offload-bf16-ckpt|-" |
    tee "$OUT/scale7b.log"
fi
if named scale7b_w1; then  # the same at world 1 (planned 119 GB; the offload row at world 1 is table7b_offload's)
  echo "== scale7b_w1 (LLaMA-7B, B=8, T=2048, world 1)"
  SCALE_TIMEOUT=${SCALE_TIMEOUT:-450} SCALE_COMM_TIMEOUT=${SCALE_COMM_TIMEOUT:-300} scale_rows llama-7b "1" "--lr 1e-5" "zero3-bf16-ckpt|--ckpt" |
    tee "$OUT/scale7b_w1.log"
fi
# The compiled peers (only when named): on one GPU, each of PEER_ROWS (zero3-bf16-ckpt zero3-bf16) at TinyLlama-1.1B, B=8,
# T=2048, beside FSDP2 eager, with compiled blocks (torchtitan's recipe), with Liger-Kernel, and both (bench/fsdp2:
# the liger-kernel wheel must be importable); compare.py takes the fastest peer variant of each row.
# PEER_VARIANTS: the FSDP2 configurations (default all four); DEFERRED_LOSS=1: both sides read the timed steps' losses
# after the clock (--deferred-loss), compared only with each other.
if named peers; then
  echo "== peers (TinyLlama-1.1B, B=8, T=2048, one GPU: ours beside FSDP2 eager, compiled, Liger, compiled + Liger)"
  deferred=(); [ "${DEFERRED_LOSS:-0}" = 1 ] && deferred=(--deferred-loss)
  IFS=',' read -r -a variants <<< "${PEER_VARIANTS:-,--compile,--liger,--compile --liger}"
  for row in ${PEER_ROWS:-zero3-bf16-ckpt zero3-bf16}; do
    scale_launch 1 "${SCALE_TIMEOUT:-180}" --no-python "$BUILD/bench/table/bench_table" --preset tinyllama-1.1b --rows "$row:8" --seq 2048 \
      --eval-seqs 4 "${corpus[@]}" "${deferred[@]}" --out "$OUT/scale.jsonl"
    ckpt=(); [[ $row == *ckpt* ]] && ckpt=(--ckpt)
    for variant in "${variants[@]}"; do
      scale_launch 1 "${PEER_TIMEOUT:-300}" "$ROOT/bench/fsdp2/fsdp2_llama.py" --preset tinyllama-1.1b --batch 8 --seq 2048 "${ckpt[@]}" $variant \
        "${corpus[@]}" "${deferred[@]}" --out "$OUT/fsdp2.jsonl"
    done
  done
fi
# The float8 peers (only when named): on one GPU at TinyLlama-1.1B, B=8, T=2048, bench_table's bf16-ckpt, fp8-ckpt, bf16 and
# fp8 beside FSDP2 with compiled blocks (torchtitan's recipe) in bf16 and with torchao's float8 linears (--compile --float8:
# tensorwise dynamic scaling; bench/fsdp2: the torchao wheel must be importable), --ckpt as the row. compare.py pairs each
# row with the FSDP2 run of its zero3- twin at world 1: bf16* with the bf16 peer, fp8* with the float8 one.
# PEER_FP8_MODES="ckpt" runs the checkpointed rows only ("plain" the others only; default both).
if named peers_fp8; then
  echo "== peers_fp8 (TinyLlama-1.1B, B=8, T=2048, one GPU: bf16 / fp8 rows beside FSDP2 compiled, compiled + torchao float8)"
  for mode in ${PEER_FP8_MODES:-ckpt plain}; do
    ck=""; [ "$mode" = ckpt ] && ck=-ckpt
    for row in "bf16$ck" "fp8$ck"; do
      scale_launch 1 "${SCALE_TIMEOUT:-180}" --no-python "$BUILD/bench/table/bench_table" --preset tinyllama-1.1b --rows "$row:8" --seq 2048 \
        --eval-seqs 4 "${corpus[@]}" --out "$OUT/scale.jsonl"
    done
    ckpt=(); [ -n "$ck" ] && ckpt=(--ckpt)
    for variant in "--compile" "--compile --float8"; do
      scale_launch 1 "${PEER_TIMEOUT:-300}" "$ROOT/bench/fsdp2/fsdp2_llama.py" --preset tinyllama-1.1b --batch 8 --seq 2048 "${ckpt[@]}" $variant \
        "${corpus[@]}" --out "$OUT/fsdp2.jsonl"
    done
  done
fi
if named scale || named scale7b || named scale7b_w1 || named peers || named peers_fp8; then
  python3 "$ROOT/bench/fsdp2/compare.py" "$OUT/scale.jsonl" "$OUT/fsdp2.jsonl" | tee "$OUT/scale-table.txt"
fi

# Where the time goes (only when named): at TinyLlama-1.1B, T=2048, each row measured as usual and then 2 more steps under
# the profiler (--profile-steps), beside its peers profiled the same way: zero3-bf16 and zero3-bf16-ckpt beside FSDP2
# compiled and compiled + Liger, qlora (B=8, and B=2 at T=512) beside transformers + bitsandbytes + PEFT, plain and with
# Liger's kernels; then
# bench/profile_table.py: milliseconds per step by kind (profile.txt, profile.jsonl). Needs the liger-kernel, bitsandbytes
# and peft wheels importable (bench/qlora/README.md).
if named profile; then
  echo "== profile (TinyLlama-1.1B: ours and the peers, 2 steps each under the profiler)"
  prof=(--profile-steps 2 "${corpus[@]}")
  for row in zero3-bf16 zero3-bf16-ckpt; do
    scale_launch 1 "${SCALE_TIMEOUT:-180}" --no-python "$BUILD/bench/table/bench_table" --preset tinyllama-1.1b --rows "$row:8" --seq 2048 \
      --eval-seqs 0 "${prof[@]}" --out "$OUT/profile-ours.jsonl"
    ckpt=(); [[ $row == *ckpt* ]] && ckpt=(--ckpt)
    for variant in "--compile" "--compile --liger"; do
      scale_launch 1 "${PEER_TIMEOUT:-300}" "$ROOT/bench/fsdp2/fsdp2_llama.py" --preset tinyllama-1.1b --batch 8 --seq 2048 "${ckpt[@]}" $variant \
        "${prof[@]}" --out "$OUT/profile-peers.jsonl"
    done
  done
  for bt in "8 2048" "2 512"; do
    read -r b t <<<"$bt"
    timeout "${PEER_TIMEOUT:-300}" "$BUILD/bench/table/bench_table" --preset tinyllama-1.1b --rows "qlora:$b" --seq "$t" --eval-seqs 0 \
      "${prof[@]}" --out "$OUT/profile-ours.jsonl" 2>&1 | grep -E "^qlora" | head -2
    for variant in "" "--liger"; do
      timeout "${PEER_TIMEOUT:-300}" python3 "$ROOT/bench/qlora/qlora_peer.py" --preset tinyllama-1.1b --batch "$b" --seq "$t" "${prof[@]}" \
        $variant --out "$OUT/profile-peers.jsonl" 2>&1 | grep -E "^hf-bnb|Error" | head -2
    done
  done
  python3 "$ROOT/bench/profile_table.py" "$OUT/profile-ours.jsonl" "$OUT/profile-peers.jsonl" --top 5 --jsonl "$OUT/profile.jsonl" |
    tee "$OUT/profile.txt"
fi

# QLoRA against transformers + bitsandbytes + PEFT (only when named): bench_table's qlora row and bench/qlora/qlora_peer.py
# at TinyLlama-1.1B and LLaMA-7B, B=8, T=2048, then bench/qlora/compare.py ($OUT/qlora-*.jsonl, qlora-compare.txt);
# about 5 minutes. bitsandbytes and peft must be importable first (bench/qlora/README.md: the carried wheels).
if named qlora; then bash "$ROOT/bench/qlora/run_h200.sh" "$BUILD/bench/table/bench_table"; fi
# Graphed (CUDA graphs) on short samples, only when named: TinyLlama-1.1B QLoRA at B=2, T=512, the qlora row eager and
# graphed (three eager micro-batches, then one capture, inside the warm-up) beside transformers + bitsandbytes + PEFT
# (bench/qlora's wheels; with Liger's kernels too where they import), 20 timed steps each. Ours takes its loss in chunks
# of 256 tokens: at 1,024 tokens a step the batch's fp32 logits at once (0.39 GB) would be its largest transient.
# DEFERRED_LOSS=1: both sides read the timed steps' losses after the clock (--deferred-loss; ours then decides the
# optimizer step on the device, no host sync a step); compare.py pairs such rows only with such peers.
if named graphed; then
  deferred=""; [ "${DEFERRED_LOSS:-0}" = 1 ] && deferred=--deferred-loss
  QLORA_PRESETS=tinyllama-1.1b QLORA_ROWS=qlora:2,qlora-graphed:2 QLORA_BATCH=2 QLORA_SEQ=512 QLORA_STEPS=20 QLORA_WARMUP=5 \
    QLORA_TABLE_ARGS="--loss-chunk 256 $deferred" QLORA_PEER_ARGS="$deferred" \
    bash "$ROOT/bench/qlora/run_h200.sh" "$BUILD/bench/table/bench_table"
fi

# Nsight Compute on the library's 4-bit GEMM at batch 1 and 16 on the largest shape (only when named): speed
# of light, occupancy, launch statistics and warp stall reasons of the first launches of each case.
if named ncu_gemm; then
  echo "== ncu_gemm"
  for m in M1 M16; do
    timeout "${BENCH_TIMEOUT:-3600}" ncu --clock-control none --kernel-name regex:qgemm_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      "$BUILD/bench/quant/bench_quant_gemm" --only "K8192_N28672_$m" --no-checks --no-variants --reps 3 \
      >"$OUT/ncu-qgemm-K8192_N28672_$m.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Issued Warp" "$OUT/ncu-qgemm-K8192_N28672_$m.txt" | head -20
  done
fi

# Nsight Compute on one wgmma configuration (only when named; NCU_CASE / NCU_CFG choose it).
if named ncu_sm90; then
  echo "== ncu_sm90"
  bash "$ROOT/bench/quant/ncu_sm90.sh" "$BUILD/bench/quant/bench_qgemm_sm90" "${NCU_CASE:-K11008_N4096_M64}" "${NCU_CFG:-wg_b64m1s6x2w}" \
    "$OUT/ncu-sm90-${NCU_CASE:-K11008_N4096_M64}-${NCU_CFG:-wg_b64m1s6x2w}.txt"
fi

# GPTQ vs RTN perplexity: train the 125m preset for 1000 bf16 steps, then quantize it at 2/3/4/8 bits.
# The KJV text comes from $ROOT/kjv.txt when the snapshot carries it (the GPU machine has no `bible` program).
if [ ${#want[@]} -eq 0 ] || named llama_gptq; then
  echo "== llama_gptq"
  "$BUILD/bin/llama_train" --preset 125m --device cuda --strategy bf16 --steps 1000 --batch 32 --seq 256 --lr 1e-3 --eval-every 250 \
    --eval-batches 8 --sample 0 "${corpus[@]}" --save "$BUILD/kjv-125m.pt" >"$OUT/llama_gptq-train.log" 2>&1 && tail -2 "$OUT/llama_gptq-train.log" &&
  "$BUILD/bin/llama_gptq" --preset 125m --device cuda --checkpoint "$BUILD/kjv-125m.pt" "${corpus[@]}" --seq 256 --bits 4,3,2,8 \
    --group 128,channel --calib-tokens 65536 --eval-batch 32 --kl --out "$OUT/llama_gptq.jsonl" 2>&1 | tail -20
fi

# The LLaMA-7B geometry quantized from the command line (only when named; TARGETS=llama_gptq): a random bf16 Hugging Face
# directory written once under $WORK (13.5 GB, ${TMPDIR:-/tmp}/squeeze-quant7b), random token shards, then
# llama_gptq --hf --data --bits 4 --group 128 --act-order --export-hf, timed by phase against 120 s (quantize7b.jsonl).
if named quantize7b; then
  echo "== quantize7b"
  OUT="$OUT" BUILD="$BUILD" bash "$ROOT/bench/quant/quantize_7b.sh" || echo "   quantize7b failed (exit $?; $OUT/quantize7b.log)"
fi

echo "== summary (bench, case, ratio vs peer (>1: ours faster/smaller), roofline fraction, time)"
python3 "$ROOT/bench/summary.py" "$OUT"/*.jsonl
