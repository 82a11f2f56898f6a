"""The notebooks run the way README.md says, `jupyter nbconvert --to notebook --execute
--output-dir=DIR notebooks/NAME.ipynb` from the repository root (nbconvert starts each kernel,
`python3`, in the notebook's own folder; here on the CPU), leave no file in the tree, and show what
they claim:

* quickstart.ipynb: plain and streamed tokens equal, streaming counters, the 27B memory/policy table;
* acceptance.ipynb: code-tiny generates, MTP / ngram speculative decoding reproduces greedy decoding;
* streamed_decode.ipynb: bench_generate's ms per token for an all-resident and a streamed cache.

Skipped without the dev extras that run them (nbformat, nbconvert, ipykernel)."""

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# caches that any Python run leaves (and the environments a checkout may hold): not the notebooks'
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".venv", "venv", ".whl", ".gl"}


def _tree():
  files = set()
  for d, dirs, names in os.walk(REPO):
    dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")]
    files.update(os.path.relpath(os.path.join(d, n), REPO) for n in names)
  return files


def _text(cell) -> str:
  out = []
  for o in cell.get("outputs", []):
    if o.get("output_type") == "stream":
      out.append(o.get("text", ""))
    elif "data" in o:
      out.append(o["data"].get("text/plain", ""))
  return "".join(out)


def execute(name: str, tmp_path):
  """Run notebooks/<name>.ipynb with README.md's command -> (executed notebook, its code cells' text)."""
  nbformat = pytest.importorskip("nbformat")
  pytest.importorskip("nbconvert")
  pytest.importorskip("ipykernel")
  before = _tree()
  env = dict(os.environ)
  env.setdefault("JAX_PLATFORMS", "cpu")
  p = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                      f"--output-dir={tmp_path}", f"notebooks/{name}.ipynb"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-6000:]
  assert _tree() - before == set(), "the notebook left files in the tree"
  nb = nbformat.read(os.path.join(tmp_path, f"{name}.ipynb"), as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(not any(o.get("output_type") == "error" for o in c.get("outputs", [])) for c in code)
  return nb, "\n".join(_text(c) for c in code)


def test_quickstart_runs(tmp_path):
  _, text = execute("quickstart", tmp_path)
  assert "tokens match: True" in text
  plain = next(l for l in text.splitlines() if l.startswith("plain:"))
  streamed = next(l for l in text.splitlines() if l.startswith("streamed:"))
  assert plain.split(":", 1)[1].strip() == streamed.split(":", 1)[1].strip()
  assert len(eval(plain.split(":", 1)[1])) == 32  # pylint: disable=eval-used
  # streaming really streamed: a positive H2D byte count in the streamed column
  h2d = next(l for l in text.splitlines() if l.startswith("h2d_bytes")).split()
  assert h2d[1] == "0" and int(h2d[2]) > 0
  resident = next(l for l in text.splitlines() if l.startswith("all_pages_resident")).split()
  assert resident[1:] == ["False"]   # only the streamed column has it, and that pool streams
  # the memory/policy table has one row per context, with the pool pages of memory_report
  from kvjax import config as config_lib, memory_report
  want = memory_report.memory_report(config_lib.qwen38_27b(), 131072, arena_mib=2240.0, mtp_depth=3,
                                     decode_workspace_mib=12.0)["decode_kv_pool_pages"]
  row = next(l for l in text.splitlines() if l.strip().startswith("131072"))
  assert int(row.split()[3]) == want


def test_acceptance_runs(tmp_path):
  """code-tiny generates text, and MTP / ngram speculative decoding on a held-out prompt reproduces
  greedy decoding, with an acceptance table (`experiments` imported from the notebook's folder)."""
  _, text = execute("acceptance", tmp_path)
  assert "all match greedy: True" in text
  rows = [l.split() for l in text.splitlines() if l.startswith(("mtp ", "ngram "))]
  assert {r[0] for r in rows} == {"mtp", "ngram"} and all(r[2] == "32" for r in rows)
  assert 0.0 <= float(rows[0][3]) <= 1.0


def test_streamed_decode_runs(tmp_path):
  """bench_generate twice (tiny model, 16-token pages, 48 decoded tokens): the all-resident cache
  uploads nothing in its decode, the streamed one streams every forward; ms per token of both over
  a decode that starts three pages, plotted where matplotlib is installed."""
  nb, text = execute("streamed_decode", tmp_path)
  lines = text.splitlines()
  header = next(i for i, l in enumerate(lines) if l.startswith("cache "))
  table = {}
  for l in lines[header + 1:header + 3]:
    pool, ring, _median, _p90, _max, mib, waves = l[20:].split()
    table[l[:20].strip()] = dict(pool=int(pool), ring=int(ring), mib=float(mib), waves=int(waves))
  assert set(table) == {"all pages resident", "streamed"}
  assert table["all pages resident"]["mib"] == 0 and table["all pages resident"]["waves"] == 0
  s = table["streamed"]
  assert s["mib"] > 0 and s["waves"] > 0 and s["ring"] < s["pool"] < table["all pages resident"]["pool"]
  assert text.count(": 47 decode forwards timed") == 2
  assert "new pages at decoded tokens [1, 17, 33]" in text
  if importlib.util.find_spec("matplotlib") is None:
    return
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert any("image/png" in o.get("data", {}) for o in outputs)
