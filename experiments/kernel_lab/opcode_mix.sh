#!/bin/bash
# SASS opcode mix of the span kernel of one call (ncu: sass__inst_executed_per_opcode, one launch).
# Usage (device machine, repo root):
#   bash experiments/kernel_lab/opcode_mix.sh "<config k=v;k=v>" <context> <rows>
# Prints the executed warp-level instructions by opcode, largest first, and their total.
set -u
source "$(dirname "$0")/profile_args.sh" opcodes "$@"
timeout 200 ncu --clock-control none --csv --kernel-name regex:span_attention --launch-skip 1 \
  --launch-count 1 --print-metric-instances details \
  --metrics sass__inst_executed_per_opcode,smsp__inst_executed.sum,gpu__time_duration.sum \
  python3 -m experiments.bench_span_attention --profile_config="$cfg" --check=false --sweep=false \
  --sweep_contexts=$ctx --rows=$rows --out_dir=/tmp/ncu_unused --profile_calls=2 > $OUT/$name.csv 2>&1
python3 -m experiments.kernel_lab.ncu_report opcodes "$OUT/$name.csv" "$cfg"
