"""kvjax_pallas must not import kvjax (the kernels' package stands alone)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kvjax_pallas_does_not_import_kvjax():
  offenders = []
  for path in sorted((ROOT / "kvjax_pallas").rglob("*.py")):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [node.module]
      offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "kvjax" or n.startswith("kvjax.")]
  assert not offenders, offenders
  assert len(list((ROOT / "kvjax_pallas").rglob("*.py"))) >= 5  # the scan saw the package


def test_no_tpu_only_scalar_prefetch_in_gpu_kernels():
  """PrefetchScalarGridSpec passes in CPU interpret mode but cannot compile on the GPU."""
  hits = [str(p.relative_to(ROOT)) for p in (ROOT / "kvjax_pallas").rglob("*.py")
          if "PrefetchScalarGridSpec" in p.read_text()]
  assert not hits, hits
