"""`python -m kvjax.env_report`: versions, devices and which span-attention implementations compile
on this machine, and which Gated DeltaNet prefill forms (on a CPU "reference" compiles and runs, the
kernels report their one-line error)."""

import json
import subprocess
import sys

import jax

from kvjax import env_report
from kvjax_pallas.span_attention import IMPLEMENTATIONS


def test_report(capsys):
  assert env_report.main(["--json"]) == 0
  r = json.loads(capsys.readouterr().out)
  assert r["versions"]["jax"] and r["versions"]["jaxlib"] and r["versions"]["flax"]
  assert r["backend"] == jax.default_backend() and r["devices"]
  checks = {(x["call"], x["implementation"]): x for x in r["kernels"]}
  assert set(checks) == {(c, name) for c, _ in env_report.CALLS for name in IMPLEMENTATIONS}
  for call, _ in env_report.CALLS:
    assert checks[call, "reference"]["status"] == "ok"
    assert all("\n" not in x["status"] for x in r["kernels"])
    if r["backend"] == "cpu":   # compiled kernels need a GPU: one line of why
      assert checks[call, "reference"]["auto"] == "reference"
      assert all(checks[call, name]["status"] != "ok" for name in set(IMPLEMENTATIONS) - {"reference"})
  gdn = {x["implementation"]: x for x in r["gdn_kernels"]}
  assert set(gdn) == {"reference", "triton"} and gdn["reference"]["status"] == "ok"
  if r["backend"] == "cpu":
    assert gdn["triton"]["auto"] == "reference" and gdn["triton"]["status"] != "ok"
    assert "\n" not in gdn["triton"]["status"]
  text = env_report.format_report(r)
  assert "Gated DeltaNet prefill (48 heads of 128, 64 rows; auto -> " in text
  assert "versions: python" in text and f"device 0: {r['devices'][0]['platform']}" in text
  assert "decode (1 query token; auto -> " in text and "    reference  ok" in text


def test_runs_as_a_module():
  p = subprocess.run([sys.executable, "-m", "kvjax.env_report", "--no-kernels"], capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.startswith("versions: python") and "backend: " in p.stdout
  assert "span attention" not in p.stdout and "Gated DeltaNet" not in p.stdout
