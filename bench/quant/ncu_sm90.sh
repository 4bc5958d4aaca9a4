#!/usr/bin/env bash
# Nsight Compute on one wgmma configuration of bench_qgemm_sm90 (GPU machine): speed of light, scheduler and warp
# stall statistics, and the per-SASS-line stall samples (<out>.sass.csv: sort by the sampling columns).
#   usage: bash bench/quant/ncu_sm90.sh <bench_qgemm_sm90> <case> <cfg-substring> <out-file>
set -uo pipefail
bin=$1 case=$2 cfg=$3 out=$4
m=${case##*_M}
rep=$(mktemp -d)/ncu
ncu --clock-control none --kernel-name regex:qgemm_sm90_kernel --launch-skip 3 --launch-count 1 --import-source no \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section SourceCounters --section ComputeWorkloadAnalysis --section InstructionStats \
  --metrics sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active \
  -o "$rep" \
  "$bin" --only "$case" --m "$m" --cfg "$cfg" --reps 3 >"$out.run.log" 2>&1
ncu --import "$rep.ncu-rep" >"$out" 2>&1
ncu --import "$rep.ncu-rep" --page source --print-source sass --csv >"$out.sass.csv" 2>&1
grep -E "Duration|DRAM Throughput|Compute \(SM\)|Issued Warp|No Eligible|Eligible Warps|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|pipe_|Pipe" "$out" | head -40
