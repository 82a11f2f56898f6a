"""notebooks/quickstart.ipynb executes top to bottom the way `jupyter nbconvert --to notebook
--execute` runs it (nbconvert's ExecutePreprocessor, kernel `python3`, CPU) and shows what it claims:
plain and streamed tokens equal, streaming counters, and the 27B memory/policy table."""

import os

import nbformat
from nbconvert.preprocessors import ExecutePreprocessor  # the dev extra: nbconvert, nbformat, ipykernel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _text(cell) -> str:
  out = []
  for o in cell.get("outputs", []):
    if o.get("output_type") == "stream":
      out.append(o.get("text", ""))
    elif "data" in o:
      out.append(o["data"].get("text/plain", ""))
  return "".join(out)


def test_quickstart_runs():
  path = os.path.join(REPO, "notebooks", "quickstart.ipynb")
  nb = nbformat.read(path, as_version=4)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the kernel inherits it
  ExecutePreprocessor(timeout=180, kernel_name="python3").preprocess(nb, {"metadata": {"path": REPO}})
  # (raises CellExecutionError on any failing cell)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(not any(o.get("output_type") == "error" for o in c.get("outputs", [])) for c in code)
  text = "\n".join(_text(c) for c in code)
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


def test_acceptance_runs():
  """notebooks/acceptance.ipynb: code-tiny generates text, and MTP / ngram speculative decoding on a
  held-out prompt reproduces greedy decoding, with an acceptance table."""
  path = os.path.join(REPO, "notebooks", "acceptance.ipynb")
  nb = nbformat.read(path, as_version=4)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  ExecutePreprocessor(timeout=300, kernel_name="python3").preprocess(nb, {"metadata": {"path": REPO}})
  text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
  assert "all match greedy: True" in text
  rows = [l.split() for l in text.splitlines() if l.startswith(("mtp ", "ngram "))]
  assert {r[0] for r in rows} == {"mtp", "ngram"} and all(r[2] == "256" for r in rows)
  assert 0.0 <= float(rows[0][3]) <= 1.0
