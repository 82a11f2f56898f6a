"""Reads the ncu CSV files of the lab's GPU scripts (opcode_mix.sh, stall_profile.sh) and prints
summaries.

  python3 -m experiments.kernel_lab.ncu_report opcodes <csv> <config>          # opcode mix
  python3 -m experiments.kernel_lab.ncu_report longest <csv>                   # longest kernel
  python3 -m experiments.kernel_lab.ncu_report stalls <csv> <config> <kernel>  # stalls, issue,
                                                                               # occupancy
  python3 -m experiments.kernel_lab.ncu_report metrics <csv>                   # every metric
  python3 -m experiments.kernel_lab.ncu_report sources <csv> [top]             # stall samples by
                                                                               # SASS opcode and
                                                                               # instruction
"""

import csv
import re
import sys

STALL_PREFIX = "smsp__average_warps_issue_stalled_"
KEEP = ("Duration", "Registers Per Thread", "Theoretical Occupancy", "Achieved Occupancy",
        "Block Size", "Grid Size", "Shared Memory Configuration Size",
        "Dynamic Shared Memory Per Block", "Issued Warp Per Scheduler", "No Eligible",
        "Active Warps Per Scheduler", "Eligible Warps Per Scheduler",
        "Warp Cycles Per Issued Instruction", "DRAM Throughput", "Memory Throughput",
        "Compute (SM) Throughput", "smsp__inst_executed.sum")


def read_rows(path):
  """ncu --csv rows (the header first), without the program's own output lines."""
  return [r for r in csv.reader(open(path)) if len(r) > 10]


def _number(text):
  return float(text.replace(",", ""))


def opcode_counts(value):
  """sass__inst_executed_per_opcode printed with --print-metric-instances details -> [(count,
  opcode)], largest first (the "values" form has counts without names)."""
  pairs = re.findall(r"([A-Z][A-Z0-9_.]+)\s*[:=]?\s*\(?([\d][\d,]*)", value)
  return sorted(((_number(n), op) for op, n in pairs), reverse=True)


def opcodes(path, cfg):
  rows = read_rows(path)
  if not rows:
    print("opcode_mix: no ncu rows; see", path)
    return
  head = rows[0]
  m, v = head.index("Metric Name"), head.index("Metric Value")
  for r in rows[1:]:
    if r[m] != "sass__inst_executed_per_opcode":
      print(f"  {cfg}: {r[m]} = {r[v]}")
      continue
    counts = opcode_counts(r[v])
    total = sum(c for c, _ in counts)
    print(f"  {cfg}: {total / 1e6:.2f} M warp instructions by opcode")
    print("   " + ", ".join(f"{op} {c / 1e6:.2f}M" for c, op in counts[:18]))
    print("   raw:", r[v][:1200])


def longest(path):
  rows = read_rows(path)
  if len(rows) < 2:
    return
  head = rows[0]
  k, v, u = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
  ranked = sorted(rows[1:], key=lambda r: _number(r[v]), reverse=True)
  for r in ranked[:4]:
    print(f"  longest: {_number(r[v]):,.0f} {r[u]} {r[k][:70]}", file=sys.stderr)
  print(re.escape(ranked[0][k].split("(")[0][:60]))


def metric_rows(path, who):
  """(rows after the header, metric name / value / unit columns), or None (printed) where the
  file has no ncu rows."""
  rows = read_rows(path)
  if len(rows) < 2:
    print(f"{who}: no ncu rows; see", path)
    return None
  head = rows[0]
  return rows[1:], head.index("Metric Name"), head.index("Metric Value"), head.index("Metric Unit")


def stalls(path, cfg, kernel):
  got = metric_rows(path, "stall_profile")
  if got is None:
    return
  rows, m, v, u = got
  found = []
  print(f"  {cfg} ({kernel[:40]}):")
  for r in rows:
    name = r[m]
    if name.startswith(STALL_PREFIX):
      reason = name[len(STALL_PREFIX):].replace("_per_issue_active.ratio", "")
      try:
        found.append((_number(r[v]), reason))
      except ValueError:
        pass
    elif name == "sass__inst_executed_per_opcode":
      counts = opcode_counts(r[v])
      print(f"    opcodes ({sum(c for c, _ in counts) / 1e6:.2f} M): "
            + ", ".join(f"{op} {c / 1e6:.2f}M" for c, op in counts[:14]))
    elif name in KEEP:
      print(f"    {name} = {r[v]} {r[u]}")
  found.sort(reverse=True)
  total = sum(s for s, _ in found)
  print(f"    stalls (warps a issued instruction, total {total:.2f}): "
        + ", ".join(f"{reason} {s:.2f}" for s, reason in found[:10]))


def metrics(path):
  """Every metric of the profiled launches as `name = value unit`, with the wavefronts per
  shared load instruction where both counts are there."""
  got = metric_rows(path, "  metrics")
  if got is None:
    return
  rows, m, v, u = got
  vals = {}
  for r in rows:
    print(f"    {r[m]} = {r[v]} {r[u]}")
    try:
      vals[r[m]] = _number(r[v])
    except ValueError:
      pass
  waves = vals.get("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum")
  insts = vals.get("smsp__inst_executed_op_shared_ld.sum")
  if waves and insts:
    print(f"    wavefronts per shared load instruction = {waves / insts:.2f}")


def _opcode(sass: str) -> str:
  """"@!P0 LDL.64 R2, [R1+0x8]" -> "LDL" (the mnemonic without predicate and modifiers)."""
  words = [w for w in sass.replace("{", " ").split() if not w.startswith("@")]
  return words[0].split(".")[0] if words else "?"


def source_samples(path):
  """The SASS source page (`ncu --import R --page source --csv --print-source sass`) -> (reason
  names, [(address, sass, samples, {reason: samples})]): samples from the first "Warp Stall
  Sampling (All ...)" column; reasons: every other numeric column whose name has "stall"."""
  rows = [r for r in csv.reader(open(path)) if r]
  head = next((i for i, r in enumerate(rows) if "Source" in r), None)
  if head is None:
    raise ValueError(f"{path}: no header row with a 'Source' column")
  names = rows[head]
  src = names.index("Source")
  addr = next((i for i, n in enumerate(names) if "Address" in n), None)
  total = next((i for i, n in enumerate(names) if "Sampling" in n and "All" in n), None)
  if total is None:
    raise ValueError(f"{path}: no 'Warp Stall Sampling (All Samples)' column in {names}")
  reasons = [i for i, n in enumerate(names) if "stall" in n.lower() and i != total
             and "Sampling" not in n]
  out = []
  for r in rows[head + 1:]:
    if len(r) != len(names):
      continue
    try:
      n = _number(r[total] or "0")
    except ValueError:
      continue
    rs = {}
    for i in reasons:
      try:
        rs[names[i]] = _number(r[i] or "0")
      except ValueError:
        pass
    out.append((r[addr] if addr is not None else "", r[src], n, rs))
  return [names[i] for i in reasons], out


def sources(path, top="30"):
  """Stall samples summed by opcode, then the `top` instructions with the most samples, each
  with its three largest reasons."""
  reasons, rows = source_samples(path)
  total = sum(n for _, _, n, _ in rows) or 1.0
  print(f"  {len(rows)} SASS instructions, {total:.0f} warp samples; reason columns: "
        + (", ".join(reasons) if reasons else "none"))
  by_op = {}
  for _, sass, n, rs in rows:
    acc = by_op.setdefault(_opcode(sass), [0.0, {}])
    acc[0] += n
    for k, v in rs.items():
      acc[1][k] = acc[1].get(k, 0.0) + v
  fmt = lambda rs: ", ".join(f"{k} {v:.0f}" for k, v in sorted(rs.items(), key=lambda x: -x[1])[:3]
                             if v)
  print("  by opcode (share of samples; largest reasons):")
  for op, (n, rs) in sorted(by_op.items(), key=lambda x: -x[1][0])[:15]:
    print(f"    {op:<10} {100 * n / total:5.1f} %  {fmt(rs)}")
  print(f"  top {top} instructions:")
  for a, sass, n, rs in sorted(rows, key=lambda x: -x[2])[:int(top)]:
    print(f"    {a:>8} {100 * n / total:5.1f} %  {sass.strip()[:60]:<60} {fmt(rs)}")


if __name__ == "__main__":
  commands = {"opcodes": opcodes, "longest": longest, "stalls": stalls, "metrics": metrics,
              "sources": sources}
  if len(sys.argv) < 3 or sys.argv[1] not in commands:
    sys.exit(__doc__)
  commands[sys.argv[1]](*sys.argv[2:])
