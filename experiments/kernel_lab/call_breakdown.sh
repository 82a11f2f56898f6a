#!/bin/bash
# Per-kernel durations of one span-attention call (the span kernel, the combine and XLA's small
# fusions around them), from ncu's gpu__time_duration of every kernel of the bench's profile
# mode. Usage (device machine, repo root):
#   bash experiments/kernel_lab/call_breakdown.sh "<config k=v;k=v>" <context> <rows>
# Prints the kernels launched from the last span kernel launch to the end (one call + the
# bench's q update), in launch order.
set -u
source "$(dirname "$0")/profile_args.sh" breakdown "$@"
timeout 240 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
  python3 -m experiments.bench_span_attention --profile_config="$cfg" --check=false --sweep=false \
  --sweep_contexts=$ctx --rows=$rows --out_dir=/tmp/ncu_unused --profile_calls=2 > $OUT/$name.csv 2>&1
python3 - "$OUT/$name.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; rows = rows[1:]
k, v, u = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
names = [r[k] for r in rows]
last = max(i for i, n in enumerate(names) if "span_attention" in n)
prev = max([i for i, n in enumerate(names[:last]) if "span_attention" in n] or [last])
seg = rows[prev + 1:] if prev < last else rows[last:]
total = 0.0
for r in seg:
  us = float(r[v].replace(",", "")) * scale[r[u]]
  total += us
  print(f"  {us:8.2f} us  {r[k][:90]}")
print(f"  {total:8.2f} us  total of these kernels")
PY
