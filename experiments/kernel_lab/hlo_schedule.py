"""Where XLA scheduled the asynchronous copies of a compiled step: the entry computation of an
after-optimizations HLO dump, one line per copy-start / copy-done with the number of kernels
(fusions, custom calls) scheduled before it.

  XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*group_step.*" python -m experiments.bench_decode ...
  python -m experiments.kernel_lab.hlo_schedule /tmp/dump
"""

import glob
import os
import re
import sys


def schedule(text: str):
  entry = text[text.index("\nENTRY "):]
  entry = entry[:entry.index("\n}\n")] if "\n}\n" in entry else entry
  out, kernels = [], 0
  for line in entry.splitlines()[1:]:
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? (copy-start|copy-done|fusion|custom-call)\(", line)
    if not m:
      continue
    name, op = m.groups()
    if op in ("fusion", "custom-call"):
      kernels += 1
    else:
      out.append((kernels, op, name))
  return out, kernels


def main(folder: str) -> None:
  paths = sorted(glob.glob(os.path.join(folder, "*group_step*after_optimizations.txt")))
  for path in paths:
    text = open(path).read()
    if "copy-start" not in text:
      continue
    events, total = schedule(text)
    print(f"{os.path.basename(path)}: {total} kernels; async copies (kernels before each):")
    print("  " + ", ".join(f"{op.split('-')[1]}@{k}" for k, op, _ in events))


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dump")
