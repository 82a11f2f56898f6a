#!/bin/bash
# SASS opcode mix of the span kernel of one call (ncu: sass__inst_executed_per_opcode, one launch).
# Usage (device machine, repo root):
#   bash experiments/gpu/opcode_mix.sh "<config k=v;k=v>" <context> <rows>
# Prints the executed warp-level instructions by opcode, largest first, and their total.
set -u
source "$(dirname "$0")/profile_args.sh" opcodes "$@"
timeout 200 ncu --clock-control none --csv --kernel-name regex:span_attention --launch-skip 1 \
  --launch-count 1 --print-metric-instances details \
  --metrics sass__inst_executed_per_opcode,smsp__inst_executed.sum,gpu__time_duration.sum \
  python3 experiments/bench_span_attention.py --profile_config="$cfg" --check=false --sweep=false \
  --sweep_contexts=$ctx --rows=$rows --out_dir=/tmp/ncu_unused --profile_calls=2 > $OUT/$name.csv 2>&1
python3 - "$OUT/$name.csv" "$cfg" <<'PY'
import csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
  print("opcode_mix: no ncu rows; see", sys.argv[1]); sys.exit(0)
head = rows[0]
m, v = head.index("Metric Name"), head.index("Metric Value")
for r in rows[1:]:
  if r[m] != "sass__inst_executed_per_opcode":
    print(f"  {sys.argv[2]}: {r[m]} = {r[v]}")
    continue
  # "details": opcode names with their counts (the "values" form has the counts only)
  pairs = re.findall(r"([A-Z][A-Z0-9_.]+)\s*[:=]?\s*\(?([\d][\d,]*)", r[v])
  counts = sorted(((float(n.replace(",", "")), op) for op, n in pairs), reverse=True)
  total = sum(c for c, _ in counts)
  print(f"  {sys.argv[2]}: {total / 1e6:.2f} M warp instructions by opcode")
  print("   " + ", ".join(f"{op} {c / 1e6:.2f}M" for c, op in counts[:18]))
  print("   raw:", r[v][:1200])
PY
