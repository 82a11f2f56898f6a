#!/bin/bash
# One GPU round for the span kernels: sweep + check + baselines, then ncu.
# Usage (device machine, repo root):
#   bash experiments/kernel_lab/kernel_round.sh "<sweep configs>" "<ncu config>" [bench flags...]
# ncu: (1) every kernel of --profile_calls calls with its duration (the call's breakdown),
#      (2) the span kernel's detailed sections.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
SWEEP="$1"; NCU_CFG="$2"; shift 2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee $OUT/gpu.txt
python3 -m experiments.bench_span_attention --out_dir=$OUT --sweep_configs="$SWEEP" "$@" 2>&1 | tee $OUT/bench.log | grep -v "^W0\|^I0"
if [ -n "$NCU_CFG" ] && command -v ncu >/dev/null; then
  PROFILE="python3 -m experiments.bench_span_attention --profile_config=$NCU_CFG --check=false --sweep=false --out_dir=/tmp/ncu_unused $@ --rows=1"
  timeout 150 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
    $PROFILE --profile_calls=2 > $OUT/ncu_calls.txt 2>&1
  echo "--- kernels of 2 calls (name, duration) ---"
  grep -E "^  [A-Za-z_]|gpu__time_duration" $OUT/ncu_calls.txt | paste - - | awk '{print $1, $(NF)}' | head -40
  timeout 150 ncu --clock-control none --kernel-name regex:span_attention --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section InstructionStats \
    $PROFILE > $OUT/ncu.txt 2>&1
  grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issued Instructions  |Local Memory Spilling Req|Grid Size|Waves Per SM|Eligible Warps|Active Warps Per Sch" $OUT/ncu.txt | head -30
fi
