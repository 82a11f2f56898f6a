#!/bin/bash
# Where the warps of the longest kernel of one call wait: ncu stall reasons (warps stalled per
# issued instruction, by reason), issue rate, occupancy, registers, duration, executed instructions.
# Works for any implementation, the Mosaic GPU kernels included: a first ncu pass times every kernel
# of the bench's profile mode and takes the longest one's name; a second pass profiles one launch
# of it. Usage (device machine, repo root):
#   bash experiments/kernel_lab/stall_profile.sh "<config k=v;k=v>" <context> <rows> [<kernel regex>]
#   e.g. "decode=asm" 131072 1 kvjax_span_attention   or   "mosaic=1" 131072 1
# (without a regex the longest kernel of the run is taken, which may be a setup kernel)
set -u
source "$(dirname "$0")/profile_args.sh" stalls "$@"
kernel="${4:-}"
bench=(python3 -m experiments.bench_span_attention --profile_config="$cfg" --check=false
       --sweep=false --sweep_contexts=$ctx --rows=$rows --out_dir=/tmp/ncu_unused --profile_calls=2)
[ -n "$kernel" ] || timeout 150 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
  "${bench[@]}" > $OUT/${name}_all.csv 2>&1
[ -n "$kernel" ] || kernel=$(python3 -m experiments.kernel_lab.ncu_report longest "$OUT/${name}_all.csv")
[ -n "$kernel" ] || { echo "stall_profile: no kernels timed; see $OUT/${name}_all.csv"; exit 0; }
timeout 200 ncu --clock-control none --csv --kernel-name "regex:$kernel" --launch-skip 1 \
  --launch-count 1 --print-metric-instances details --section LaunchStats --section Occupancy --section SpeedOfLight \
  --section WarpStateStats --section SchedulerStats \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sass__inst_executed_per_opcode" \
  "${bench[@]}" > $OUT/$name.csv 2>&1
python3 -m experiments.kernel_lab.ncu_report stalls "$OUT/$name.csv" "$cfg" "$kernel"
