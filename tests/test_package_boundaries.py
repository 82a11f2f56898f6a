"""Package boundaries and module sizes, checked on the source (no imports run).

* kvjax_pallas imports nothing from kvjax (the kernels' package stands alone);
* kvjax and kvjax_pallas import nothing from experiments;
* no experiment or notebook imports kvjax.cli: they use the Python API, kvjax.api;
* no module of kvjax/, kvjax_pallas/ or experiments/ is over MAX_LINES lines, except the ones in
  OVER_MAX_LINES, each with its reason (an entry whose module shrank or went away fails too).
"""

import ast
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 700
OVER_MAX_LINES = {
    "kvjax/streaming/arena.py": "the arena's transaction, lease and phase-coordinator protocol as one unit",
}
# experiments that still import kvjax.cli, with what replaces it (each entry must still be needed)
CLI_IMPORT_PENDING = {}


def imported_modules(source: str, filename: str):
  """Absolute module names a source imports anywhere (`from a import b` counts as a and a.b)."""
  names = []
  for node in ast.walk(ast.parse(source, filename=filename)):
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
  return names


def _py_files(*folders):
  return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def _notebook_code(path: pathlib.Path) -> str:
  cells = json.loads(path.read_text())["cells"]
  lines = [l for c in cells if c["cell_type"] == "code" for l in "".join(c["source"]).splitlines()]
  return "\n".join(l for l in lines if not l.lstrip().startswith(("%", "!")))


def _offenders(paths, bad):
  out = []
  for path in paths:
    text = _notebook_code(path) if path.suffix == ".ipynb" else path.read_text()
    out += [f"{path.relative_to(ROOT)}: {n}" for n in imported_modules(text, str(path)) if bad(n)]
  return out


def test_kvjax_pallas_does_not_import_kvjax():
  offenders = _offenders(_py_files("kvjax_pallas"), lambda n: n == "kvjax" or n.startswith("kvjax."))
  assert not offenders, offenders
  assert len(_py_files("kvjax_pallas")) >= 5  # the scan saw the package


def test_packages_do_not_import_experiments():
  offenders = _offenders(_py_files("kvjax", "kvjax_pallas"),
                         lambda n: n == "experiments" or n.startswith("experiments."))
  assert not offenders, offenders
  assert len(_py_files("kvjax")) >= 10


def test_experiments_and_notebooks_use_the_api_not_the_cli():
  notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
  assert notebooks
  paths = _py_files("experiments") + notebooks
  offenders = _offenders(paths, lambda n: n == "kvjax.cli")
  pending = {o.split(":")[0] for o in offenders}
  assert pending <= set(CLI_IMPORT_PENDING), offenders
  assert set(CLI_IMPORT_PENDING) <= pending, "no longer imports kvjax.cli: drop it from CLI_IMPORT_PENDING"
  uses_api = [p.name for p in paths if _offenders([p], lambda n: n == "kvjax.api")]
  assert {"run.py", "sweep_fixed_span.py", "quickstart.ipynb"} <= set(uses_api), uses_api


def test_module_sizes():
  sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
           for p in _py_files("kvjax", "kvjax_pallas", "experiments")}
  over = sorted(f"{p} ({n} lines)" for p, n in sizes.items() if n > MAX_LINES and p not in OVER_MAX_LINES)
  assert not over, f"modules over {MAX_LINES} lines without a reason in OVER_MAX_LINES: {over}"
  stale = sorted(p for p in OVER_MAX_LINES if sizes.get(p, 0) <= MAX_LINES)
  assert not stale, f"OVER_MAX_LINES entries now within {MAX_LINES} lines or gone: {stale}"
  assert all(reason.strip() for reason in OVER_MAX_LINES.values())


def test_no_tpu_only_scalar_prefetch_in_gpu_kernels():
  """PrefetchScalarGridSpec passes in CPU interpret mode but cannot compile on the GPU."""
  hits = [str(p.relative_to(ROOT)) for p in (ROOT / "kvjax_pallas").rglob("*.py")
          if "PrefetchScalarGridSpec" in p.read_text()]
  assert not hits, hits
