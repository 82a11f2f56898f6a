"""What this machine gives kvjax, in one command: `python -m kvjax.env_report [--json]`.

Prints the versions (Python, jax, jaxlib, jax's CUDA plugin, flax, kvjax), the devices (platform,
kind, compute capability of an NVIDIA GPU, memory where jax reports it), the CUDA runtime and
driver versions where jax has a CUDA plugin (and the NVIDIA driver from `nvidia-smi` where it is
on the path), then whether each span-attention implementation of `kvjax_pallas.span_attention`
(its registry: reference, triton, mosaic) compiles and runs a small call on the default device:
"ok" or the first line of the error. Two calls at the 27B attention geometry (Q8_0 K / Q4_0 V
pages of 256 tokens, 4 KV heads, 24 query heads, head_dim 256, a 4-page history): a decode step
(1 query token: the Mosaic GPU decode kernel) and a prefill chunk (64 query tokens: the Mosaic
GPU prefill kernel), with what `implementation="auto"` picks for each. The kernels are compiled,
not interpreted: on a CPU only "reference" compiles (the test suite runs the kernels there with
`interpret=True`); "mosaic" needs a Hopper GPU (compute capability 9.0), "triton" an NVIDIA GPU.
The same for the Gated DeltaNet's prefill form (`kvjax_pallas.delta_rule`: "reference", "triton",
`load_model(gdn_impl=)`) at the 27B's heads (48 value heads of 128) over 64 rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from typing import Any, Dict, List, Optional

# the calls tried: (name, query tokens)
CALLS = (("decode", 1), ("prefill", 64))
# the 27B attention geometry (configs: qwen38_27b)
KV_HEADS, Q_HEADS, HEAD_DIM, PAGE_TOKENS, PAGES, KV_LEN = 4, 24, 256, 256, 4, 900
GDN_HEADS, GDN_HEAD_DIM, GDN_ROWS = 48, 128, 64   # the 27B's Gated DeltaNet value heads


def _version(dist: str) -> Optional[str]:
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


def _first_line(e: BaseException, limit: int = 240) -> str:
  text = str(e).strip().splitlines()
  line = f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
  return line if len(line) <= limit else line[:limit - 3] + "..."


def versions() -> Dict[str, Optional[str]]:
  """Python and the packages kvjax runs on (None: not installed)."""
  out: Dict[str, Optional[str]] = {"python": platform.python_version()}
  for dist in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "numpy", "kvjax"):
    out[dist] = _version(dist)
  return out


def _cuda_version(v: int) -> str:
  return f"{v // 1000}.{v % 1000 // 10}"


def cuda() -> Dict[str, Any]:
  """The CUDA runtime and driver API versions jax's CUDA plugin sees, and the NVIDIA driver
  (`nvidia-smi`), where there are any."""
  out: Dict[str, Any] = {}
  try:
    from jax._src.lib import cuda_versions   # None without a CUDA plugin
  except ImportError:   # pragma: no cover
    cuda_versions = None
  if cuda_versions is not None:
    for key, fn in (("cuda_runtime", "cuda_runtime_get_version"), ("cuda_driver_api", "cuda_driver_get_version"),
                    ("cudnn", "cudnn_get_version")):
      try:
        v = int(getattr(cuda_versions, fn)())
        out[key] = _cuda_version(v) if key != "cudnn" else f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
      except Exception as e:  # pylint: disable=broad-except
        out[key] = _first_line(e)
  smi = shutil.which("nvidia-smi")
  if smi:
    try:
      p = subprocess.run([smi, "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20, check=False)
      out["nvidia_smi"] = [l.strip() for l in p.stdout.splitlines() if l.strip()] or p.stderr.strip()[:240]
    except (OSError, subprocess.SubprocessError) as e:
      out["nvidia_smi"] = _first_line(e)
  return out


def devices() -> List[Dict[str, Any]]:
  """Every device jax sees: platform, kind, compute capability (NVIDIA GPUs), memory (bytes)."""
  import jax
  out = []
  for d in jax.devices():
    row: Dict[str, Any] = {"id": d.id, "platform": d.platform, "kind": d.device_kind}
    cc = getattr(d, "compute_capability", None)
    if cc is not None:
      row["compute_capability"] = str(cc)
    try:
      stats = d.memory_stats() or {}
    except Exception:  # pylint: disable=broad-except  (a backend without memory stats)
      stats = {}
    if "bytes_limit" in stats:
      row["memory_bytes"] = int(stats["bytes_limit"])
      row["memory_in_use_bytes"] = int(stats.get("bytes_in_use", 0))
    out.append(row)
  return out


def kernel_checks() -> List[Dict[str, str]]:
  """Each implementation of the span-attention registry on each call of `CALLS`: "ok" (compiled
  and ran on the default device) or the first line of the error; and what "auto" picks."""
  import jax
  import jax.numpy as jnp
  from kvjax_pallas.page_layout import PageLayout
  from kvjax_pallas.span_attention import api as span_api
  layout = PageLayout(KV_HEADS, HEAD_DIM, "q8_0", "q4_0", PAGE_TOKENS)
  pool = jnp.zeros((PAGES, layout.page_bytes), jnp.uint8)
  table = jnp.arange(PAGES, dtype=jnp.int32)
  rows = []
  for call, s in CALLS:
    q = jnp.zeros((s, Q_HEADS, HEAD_DIM), jnp.float32)
    q_pos = jnp.arange(KV_LEN - s, KV_LEN, dtype=jnp.int32)
    try:
      auto = span_api.resolve_implementation("auto", layout=layout, q_shape=q.shape)
    except Exception as e:  # pylint: disable=broad-except
      auto = _first_line(e)
    for name in span_api.IMPLEMENTATIONS:
      def f(q, pool, table, kv_len, q_pos, name=name):
        return span_api.span_attention(q, pool, table, kv_len, q_pos, layout=layout, block_pages="auto",
                                       implementation=name)
      try:
        compiled = jax.jit(f).lower(q, pool, table, jnp.int32(KV_LEN), q_pos).compile()
        jax.block_until_ready(compiled(q, pool, table, jnp.int32(KV_LEN), q_pos))
        status = "ok"
      except Exception as e:  # pylint: disable=broad-except
        status = _first_line(e)
      rows.append({"call": call, "query_tokens": str(s), "implementation": name, "status": status,
                   "auto": auto})
  return rows


def gdn_checks() -> List[Dict[str, str]]:
  """Each implementation of `kvjax_pallas.delta_rule` over `GDN_ROWS` rows: "ok" or the first line
  of the error; and what "auto" picks."""
  import jax
  import jax.numpy as jnp
  from kvjax_pallas.delta_rule import api as dr_api
  h, d, s = GDN_HEADS, GDN_HEAD_DIM, GDN_ROWS
  args = (jnp.zeros((h, d, d), jnp.float32), *(jnp.zeros((s, h, d), jnp.float32) for _ in range(3)),
          jnp.zeros((s, h), jnp.float32), jnp.zeros((s, h), jnp.float32))
  auto = dr_api.resolve_implementation("auto")
  rows = []
  for name in dr_api.IMPLEMENTATIONS:
    try:
      jax.block_until_ready(jax.jit(lambda *a, name=name: dr_api.delta_rule(*a, implementation=name))(*args))
      status = "ok"
    except Exception as e:  # pylint: disable=broad-except
      status = _first_line(e)
    rows.append({"implementation": name, "status": status, "auto": auto})
  return rows


def report(kernels: bool = True) -> Dict[str, Any]:
  """Everything `main` prints, as a dict."""
  import jax
  out: Dict[str, Any] = {"versions": versions(), "backend": jax.default_backend(), "devices": devices(),
                         "cuda": cuda()}
  if kernels:
    out["kernels"] = kernel_checks()
    out["gdn_kernels"] = gdn_checks()
  return out


def _mib(n: int) -> str:
  return f"{n / 2**20:,.0f} MiB"


def format_report(r: Dict[str, Any]) -> str:
  v = r["versions"]
  lines = ["versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val is not None)]
  lines.append(f"backend: {r['backend']}")
  for d in r["devices"]:
    extra = [f"compute capability {d['compute_capability']}"] if "compute_capability" in d else []
    if "memory_bytes" in d:
      extra.append(f"memory {_mib(d['memory_bytes'])} ({_mib(d['memory_in_use_bytes'])} in use)")
    else:
      extra.append("memory not reported by jax")
    lines.append(f"device {d['id']}: {d['platform']} {d['kind']}" + (f" ({', '.join(extra)})" if extra else ""))
  for k, val in r["cuda"].items():
    lines.append(f"{k}: {'; '.join(val) if isinstance(val, list) else val}")
  if "kernels" in r:
    lines.append(f"span attention (27B geometry: {KV_HEADS} KV heads, {Q_HEADS} query heads, head_dim "
                 f"{HEAD_DIM}, Q8_0 K / Q4_0 V pages of {PAGE_TOKENS} tokens), compiled on the default device:")
    width = max(len(x["implementation"]) for x in r["kernels"])
    last = None
    for x in r["kernels"]:
      if x["call"] != last:
        tokens = f"{x['query_tokens']} query token{'' if x['query_tokens'] == '1' else 's'}"
        lines.append(f"  {x['call']} ({tokens}; auto -> {x['auto']}):")
        last = x["call"]
      lines.append(f"    {x['implementation']:<{width}}  {x['status']}")
  if "gdn_kernels" in r:
    lines.append(f"Gated DeltaNet prefill ({GDN_HEADS} heads of {GDN_HEAD_DIM}, {GDN_ROWS} rows; auto -> "
                 f"{r['gdn_kernels'][0]['auto']}), compiled on the default device:")
    width = max(len(x["implementation"]) for x in r["gdn_kernels"])
    lines += [f"    {x['implementation']:<{width}}  {x['status']}" for x in r["gdn_kernels"]]
  return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m kvjax.env_report", description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
  parser.add_argument("--no-kernels", dest="kernels", action="store_false",
                      help="skip compiling the span-attention and Gated DeltaNet implementations")
  args = parser.parse_args(argv)
  r = report(kernels=args.kernels)
  print(json.dumps(r) if args.json else format_report(r), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
