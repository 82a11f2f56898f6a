"""experiments.fuzz_gguf / experiments.lib.gguf_fuzz: seeded GGUF mutations, every one refused in
one escaped line naming the file, or accepted as a valid model (the same one where it must be)."""

import collections
import contextlib
import io

from experiments import fuzz_gguf
from kvjax import cli


def run_main(path):
  """`kvjax generate --model path` in this process -> (exit status, stderr)."""
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    rc = cli.main(["generate", "--model", path, "--prompt-tokens", "1,2,3", "--n-predict", "2"])
  return rc, err.getvalue()


def test_fuzz_cases_refused_or_valid(tmp_path):
  counts, records = fuzz_gguf.run(1200, seed=1, cli_every=0, work_dir=str(tmp_path))
  fails = [r for r in records if r["outcome"].startswith("FAIL")]
  assert not fails, fails[:10]
  by_class = collections.Counter(r["class"] for r in records)
  assert len(by_class) >= 20 and min(by_class.values()) >= 10, by_class
  # every case that had to be refused was; the ones accepted were the same model where required
  assert all(r["outcome"] == "refused" for r in records if r["expect"] == "refuse")
  assert all(r["outcome"] in ("refused", "accepted_same") for r in records if r["expect"] == "same")
  assert counts[("alignment_ok", "accepted_same")] > 0 and counts[("flip_data", "accepted_changed")] > 0


def test_fuzz_refusals_through_the_command_line(tmp_path):
  from experiments.lib import gguf_fuzz
  from kvjax import tiny
  data = open(tiny.write_tiny_gguf(tmp_path / "t.gguf"), "rb").read()
  picked = {}
  for case in gguf_fuzz.mutations(data, 5, 300):
    if case.expect == "refuse":
      picked.setdefault(case.cls, case)
  assert len(picked) >= 15
  for i, case in enumerate(picked.values()):
    path = str(tmp_path / f"c{i}.gguf")
    open(path, "wb").write(case.data)
    rc, err = run_main(path)
    assert fuzz_gguf.check_cli(path, "refused", rc, err) == "refused", (case.cls, case.what)
