#!/bin/bash
# Where the warps of the longest kernel of one call wait: ncu stall reasons (warps stalled per
# issued instruction, by reason), issue rate, occupancy, registers, duration, executed instructions.
# Works for any implementation, the Mosaic GPU kernel included: a first ncu pass times every kernel
# of the bench's profile mode and takes the longest one's name; a second pass profiles one launch
# of it. Usage (device machine, repo root):
#   bash experiments/gpu/stall_profile.sh "<config k=v;k=v>" <context> <rows> [<kernel regex>]
#   e.g. "clamp_rows=1" 131072 1 kvjax_span_attention   or   "mosaic=1" 131072 1
# (without a regex the longest kernel of the run is taken, which may be a setup kernel)
set -u
source "$(dirname "$0")/profile_args.sh" stalls "$@"
kernel="${4:-}"
bench=(python3 experiments/bench_span_attention.py --profile_config="$cfg" --check=false
       --sweep=false --sweep_contexts=$ctx --rows=$rows --out_dir=/tmp/ncu_unused --profile_calls=2)
[ -n "$kernel" ] || timeout 150 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
  "${bench[@]}" > $OUT/${name}_all.csv 2>&1
[ -n "$kernel" ] || kernel=$(python3 - "$OUT/${name}_all.csv" <<'PY'
import csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if len(rows) < 2:
  sys.exit(0)
head = rows[0]
k, v = head.index("Kernel Name"), head.index("Metric Value")
dur = lambda r: float(r[v].replace(",", ""))
for r in sorted(rows[1:], key=dur, reverse=True)[:4]:
  print(f"  longest: {dur(r):,.0f} {r[head.index('Metric Unit')]} {r[k][:70]}", file=sys.stderr)
best = max(rows[1:], key=dur)
print(re.escape(best[k].split("(")[0][:60]))
PY
)
[ -n "$kernel" ] || { echo "stall_profile: no kernels timed; see $OUT/${name}_all.csv"; exit 0; }
timeout 200 ncu --clock-control none --csv --kernel-name "regex:$kernel" --launch-skip 1 \
  --launch-count 1 --print-metric-instances details --section LaunchStats --section Occupancy --section SpeedOfLight \
  --section WarpStateStats --section SchedulerStats \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sass__inst_executed_per_opcode" \
  "${bench[@]}" > $OUT/$name.csv 2>&1
python3 - "$OUT/$name.csv" "$cfg" "$kernel" <<'PY'
import csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if len(rows) < 2:
  print("stall_profile: no ncu rows; see", sys.argv[1]); sys.exit(0)
head = rows[0]
m, v, u = head.index("Metric Name"), head.index("Metric Value"), head.index("Metric Unit")
keep = ("Duration", "Registers Per Thread", "Theoretical Occupancy", "Achieved Occupancy",
        "Block Size", "Grid Size", "Shared Memory Configuration Size", "Dynamic Shared Memory Per Block",
        "Issued Warp Per Scheduler", "No Eligible", "Active Warps Per Scheduler",
        "Eligible Warps Per Scheduler", "Warp Cycles Per Issued Instruction", "DRAM Throughput",
        "Memory Throughput", "Compute (SM) Throughput", "smsp__inst_executed.sum")
stalls = []
print(f"  {sys.argv[2]} ({sys.argv[3][:40]}):")
for r in rows[1:]:
  name = r[m]
  if name.startswith("smsp__average_warps_issue_stalled_"):
    reason = name[len("smsp__average_warps_issue_stalled_"):].replace("_per_issue_active.ratio", "")
    try:
      stalls.append((float(r[v].replace(",", "")), reason))
    except ValueError:
      pass
  elif name == "sass__inst_executed_per_opcode":
    pairs = re.findall(r"([A-Z][A-Z0-9_.]+)\s*[:=]?\s*\(?([\d][\d,]*)", r[v])
    counts = sorted(((float(n.replace(",", "")), op) for op, n in pairs), reverse=True)
    print(f"    opcodes ({sum(c for c, _ in counts) / 1e6:.2f} M): "
          + ", ".join(f"{op} {c / 1e6:.2f}M" for c, op in counts[:14]))
  elif name in keep:
    print(f"    {name} = {r[v]} {r[u]}")
stalls.sort(reverse=True)
total = sum(s for s, _ in stalls)
print(f"    stalls (warps a issued instruction, total {total:.2f}): "
      + ", ".join(f"{reason} {s:.2f}" for s, reason in stalls[:10]))
PY
