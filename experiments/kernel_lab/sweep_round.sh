#!/bin/bash
# One GPU round of kernel-option sweeps (each config checked against the jnp reference), then
# registers / occupancy / duration / executed instructions of chosen configs from ncu (one launch each).
# Usage (device machine, repo root):
#   bash experiments/kernel_lab/sweep_round.sh "<ncu configs, space separated>" -- <bench flags> [-- <bench flags> ...]
# Each "--"-separated group of bench flags is one bench_span_attention.py run (its own log).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
NCU_CFGS="$1"; shift
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee $OUT/gpu.txt
i=0; args=()
run_bench() {
  i=$((i + 1))
  python3 -m experiments.bench_span_attention --out_dir=$OUT/run$i "${args[@]}" 2>&1 \
    | tee $OUT/bench$i.log | grep --line-buffered -E "^kind=(sweep|main|copy)|failed|budget" | sed -u "s/^kind=//"
  args=()
}
[ "${1:-}" == "--" ] && shift
for a in "$@"; do
  if [ "$a" == "--" ]; then run_bench; else args+=("$a"); fi
done
[ ${#args[@]} -gt 0 ] && run_bench
if command -v ncu >/dev/null; then
  for cfg in $NCU_CFGS; do
    timeout 90 ncu --clock-control none --kernel-name regex:span_attention --launch-skip 1 --launch-count 1 \
      --section LaunchStats --section Occupancy --section SpeedOfLight --section InstructionStats \
      python3 -m experiments.bench_span_attention --profile_config="$cfg" --check=false --sweep=false \
      --out_dir=/tmp/ncu_unused --rows=1 --profile_calls=2 > $OUT/ncu_$(echo $cfg | tr ';=' '_-').txt 2>&1
    echo "ncu $cfg: $(grep -E 'Registers Per Thread|Theoretical Occupancy|Duration|Executed Instructions  ' $OUT/ncu_$(echo $cfg | tr ';=' '_-').txt | awk '{print $1,$2,$3,$NF}' | tr '\n' ' ')"
  done
fi
