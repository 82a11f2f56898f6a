"""Prints every kernel of an `ncu --csv --metrics gpu__time_duration.sum` log in launch order
with its duration (the last `tail` launches, default 12): a call's per-kernel breakdown.

  ncu --csv --metrics gpu__time_duration.sum <command> > d.csv
  python3 -m experiments.kernel_lab.ncu_durations d.csv [tail]
"""
import csv
import sys

SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def main():
  rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
  tail = int(sys.argv[2]) if len(sys.argv) > 2 else 12
  if not rows:
    print("no ncu rows in", sys.argv[1])
    return
  head, rows = rows[0], rows[1:]
  k, v, u = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
  total = 0.0
  for r in rows[-tail:]:
    us = float(r[v].replace(",", "")) * SCALE[r[u]]
    total += us
    print(f"  {us:8.2f} us  {r[k][:100]}")
  print(f"  {total:8.2f} us  total of these {min(tail, len(rows))} kernels")


if __name__ == "__main__":
  main()
