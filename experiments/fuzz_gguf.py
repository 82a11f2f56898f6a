"""Fuzz the GGUF reader: seeded structural and semantic mutations of the tiny model's file.

  python -m experiments.fuzz_gguf --cases=5000 --seed=0 --out=runs/fuzz

Writes the tiny model as a GGUF (`kvjax.tiny.write_tiny_gguf`), derives `--cases` mutated files
from it (`experiments.lib.gguf_fuzz.mutations`: bit flips per region, truncations, appended bytes,
duplicate keys and tensors, bad offsets / alignment / type ids / dims / counts / lengths, wrong-kind,
non-finite, out-of-range and impossible metadata, non-finite tensor data) and judges each in this
process (`gguf_fuzz.judge`, each under a `--timeout_s` alarm: a hang is a failure). Every
`--cli_every`-th case also runs `kvjax generate --model FILE --prompt-tokens 1,2,3 --n-predict 2`
(a subprocess): a refused file must give exit status 1 and one `kvjax: error:` line naming the file, an
accepted one status 0.

Prints a table of counts per mutation class and outcome, then the failures (none expected); with
`--out`, writes `cases.jsonl` (class, what, expect, outcome of every case).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments.lib.tables import outcome_table


def define_flags():
  """The command line's flags, defined when the module runs as a program (not at import: tests
  import several experiments into one process, and absl refuses a flag name defined twice)."""
  flags.DEFINE_integer("cases", 1000, "mutated files to generate and judge")
  flags.DEFINE_integer("seed", 0, "generator seed (the same cases for the same seed)")
  flags.DEFINE_integer("cli_every", 50, "run every N-th case through `kvjax generate` too (0: never)")
  flags.DEFINE_float("timeout_s", 20.0, "reading a case taking longer is a hang (a failure)")
  flags.DEFINE_float("cli_timeout_s", 600.0, "the same for a `kvjax generate` run (compiles the model)")
  flags.DEFINE_string("out", None, "folder for cases.jsonl")


FLAGS = flags.FLAGS


class _Hang(Exception):
  pass


def _alarm(signum, frame):
  raise _Hang()


def run_cli(path: str):
  """`kvjax generate` on `path` in a subprocess -> (exit status, stderr)."""
  p = subprocess.run([sys.executable, "-m", "kvjax.cli", "generate", "--model", path, "--prompt-tokens", "1,2,3",
                      "--n-predict", "2"], capture_output=True, text=True)
  return p.returncode, p.stderr


def check_cli(path: str, outcome: str, rc: int, err: str) -> str:
  """The command line agrees with the reader: a refused file exits 1 with one `kvjax: error:` line
  naming the file; an accepted one exits 0."""
  lines = [l for l in err.splitlines() if l.startswith("kvjax: error:")]
  if outcome == "refused":
    if rc != 1 or len(lines) != 1 or path not in lines[0] or len(err.strip().splitlines()) != 1:
      return f"FAIL cli: status {rc}, stderr {err.strip()[:120]!r}"
  elif rc != 0:
    return f"FAIL cli: accepted file exits {rc}: {err.strip()[-120:]!r}"
  return outcome


def run(n: int, seed: int, cli_every: int = 0, timeout_s: float = 20.0, cli_timeout_s: float = 600.0,
        work_dir: str = None):
  """Generate and judge `n` cases -> (Counter[(class, outcome)], [case records])."""
  from experiments.lib import gguf_fuzz
  from kvjax import tiny
  work = work_dir or tempfile.mkdtemp(prefix="fuzz_gguf_")
  seed_path = tiny.write_tiny_gguf(os.path.join(work, "tiny.gguf"))
  data = open(seed_path, "rb").read()
  original = gguf_fuzz.load_like_generate(seed_path)
  counts, records = collections.Counter(), []
  old = signal.signal(signal.SIGALRM, _alarm)
  try:
    for i, case in enumerate(gguf_fuzz.mutations(data, seed, n)):
      path = os.path.join(work, f"case{i}.gguf")
      with open(path, "wb") as f:
        f.write(case.data)
      signal.setitimer(signal.ITIMER_REAL, timeout_s)
      try:
        outcome = gguf_fuzz.judge(path, case, original)
        if cli_every and i % cli_every == 0 and not outcome.startswith("FAIL"):
          signal.setitimer(signal.ITIMER_REAL, cli_timeout_s)
          outcome = check_cli(path, outcome, *run_cli(path))
      except _Hang:
        outcome = "FAIL hang (past --timeout_s / --cli_timeout_s)"
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
      os.remove(path)
      counts[(case.cls, outcome if not outcome.startswith("FAIL") else "FAIL")] += 1
      records.append({"i": i, "class": case.cls, "what": case.what, "expect": case.expect, "outcome": outcome})
  finally:
    signal.signal(signal.SIGALRM, old)
  return counts, records


def table(counts) -> str:
  return outcome_table(counts, ["refused", "accepted_same", "accepted_changed", "FAIL"], "class", 18, 18, "total")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.cases < 1:
    raise app.UsageError(f"--cases must be >= 1, got {FLAGS.cases}")
  t0 = time.perf_counter()
  counts, records = run(FLAGS.cases, FLAGS.seed, FLAGS.cli_every, FLAGS.timeout_s, FLAGS.cli_timeout_s)
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
    with open(os.path.join(FLAGS.out, "cases.jsonl"), "w") as f:
      for r in records:
        f.write(json.dumps(r) + "\n")
  fails = [r for r in records if r["outcome"].startswith("FAIL")]
  for r in fails:
    print(f"case {r['i']} [{r['class']}] {r['what']}: {r['outcome']}")
  cli_runs = sum(1 for r in records if FLAGS.cli_every and r["i"] % FLAGS.cli_every == 0)
  print(f"{len(records)} cases (seed {FLAGS.seed}), {cli_runs} also through `kvjax generate`, "
        f"{time.perf_counter() - t0:.0f} s, {len(fails)} failures")
  print(table(counts))


if __name__ == "__main__":
  define_flags()
  app.run(main)
