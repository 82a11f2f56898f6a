"""Kernel-study probe: which persistent-cache key component differs between two processes' runs?

Reads two logs written by `python -m experiments.bench_generate --cache_key_log=FILE` (jax's
cache-key component hashes, then each program's hit or miss line) and prints, for every program
the second run compiled again (a MISS), the first key component whose hash differs from the first
run's same program (matched by name and occurrence):

  python -m experiments.kernel_lab.cache_key_diff a.log b.log
"""

import collections
import re
import sys

_RESULT = re.compile(r"(PERSISTENT COMPILATION CACHE MISS|Persistent compilation cache hit) for '([^']+)'")
_COMPONENT = re.compile(r"get_cache_key hash of serialized (.+?): ([0-9a-f]+)$")


def programs(path):
  """-> [(name, hit, [(component, hash)])] in the log's order."""
  out, comps = [], []
  with open(path, errors="replace") as f:
    for line in f:
      m = _COMPONENT.search(line.strip())
      if m:
        comps.append((m.group(1), m.group(2)))
        continue
      m = _RESULT.search(line)
      if m:
        out.append((m.group(2), m.group(1).startswith("Persistent"), comps))
        comps = []
  return out


def main(argv):
  if len(argv) != 3:
    raise SystemExit(__doc__)
  a, b = programs(argv[1]), programs(argv[2])
  seen = collections.Counter()
  first = {}
  for name, _, comps in a:
    first[(name, seen[name])] = comps
    seen[name] += 1
  seen.clear()
  hits = sum(h for _, h, _ in b)
  print(f"{argv[2]}: {len(b)} programs, {hits} hits, {len(b) - hits} misses")
  for name, hit, comps in b:
    i = seen[name]
    seen[name] += 1
    if hit:
      continue
    ref = first.get((name, i))
    if ref is None:
      print(f"  MISS {name} #{i}: not compiled in the first run")
      continue
    diff = next((ca for ca, cb in zip(ref, comps) if ca != cb), None)
    what = f"first differing component: {diff[0]}" if diff else "same components (evicted or not written?)"
    print(f"  MISS {name} #{i}: {what}")


if __name__ == "__main__":
  main(sys.argv)
