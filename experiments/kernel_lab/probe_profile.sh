#!/bin/bash
# Stalls, occupancy and SASS opcode mix of one launch of a probe's kernel (any command), for the
# probes of experiments/kernel_lab (their kernels are not the bench's). Usage (device machine, repo root):
#   bash experiments/kernel_lab/probe_profile.sh <name> <kernel regex> <launches to skip> <command...>
#   e.g. bash experiments/kernel_lab/probe_profile.sh packed mosaic 2 \
#          python3 -m experiments.kernel_lab.probe_packed_decode --contexts=131072 --stages=1 --rounds=1
# Writes $OUT/<name>.csv (ncu) and prints the ncu_report.py "stalls" summary.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
name="$1"; kernel="$2"; skip="$3"; shift 3
timeout 200 ncu --clock-control none --csv --kernel-name "regex:$kernel" --launch-skip "$skip" \
  --launch-count 1 --print-metric-instances details --section LaunchStats --section Occupancy \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sass__inst_executed_per_opcode" \
  "$@" > "$OUT/$name.csv" 2>&1
python3 -m experiments.kernel_lab.ncu_report stalls "$OUT/$name.csv" "$name" "$kernel"
