"""Kernel-study probe: is a layer step's persistent-cache key the same in two processes? (The
persistent compilation cache keys `jit__group_step` by its lowering, the backend, the XLA flags and
the compile options; a second process whose key differs compiles again.)

Lowers and compiles `_group_step` of a 27B-geometry layer group (decode and prefill shapes,
`--impl` attention) from abstract arguments (no weights are drawn), with jax's cache-key logger at
DEBUG: each key component's running hash is logged. Writes each lowering's text, the log and a
summary under $OUT/probe_cache_key/<tag>/. Run it twice with two tags, then diff:

  python -m experiments.kernel_lab.probe_cache_key a; python -m experiments.kernel_lab.probe_cache_key b
  diff -r $OUT/probe_cache_key/a $OUT/probe_cache_key/b

Each attention kernel's payload inside the module (a Triton call's `ir` or compressed `opaque`
proto, a Mosaic GPU call's `module` bytecode) is written apart too, as `payload_<rows>_<i>.bin` and
its printable strings `payload_<rows>_<i>.txt` (`payloads.txt`: one hash each), so a diff names the
kernel whose bytes differ and shows where (PTX, kernel names, locations).

The first component whose hash differs names the cause ("computation": the module's bytes;
"compile_options", "XLA flags", "accelerator_config": the process's settings). `--context=N` sizes the page
table (default 32768); `--lower_for=cuda` lowers for a GPU from any machine (no compile): the module text alone, for a CPU check.
"""

import hashlib
import logging
import os
import re
import sys
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax import config, engine
from kvjax.model import AttentionOptions, Qwen38, zero_recurrent_state
from kvjax_pallas.page_layout import PageLayout


def _args(tag_argv):
  args = dict(a.lstrip("-").split("=", 1) for a in tag_argv[1:] if "=" in a)
  tag = next((a for a in tag_argv[1:] if "=" not in a), "a")
  return tag, args.get("impl", "auto"), args.get("lower_for", ""), int(args.get("context", 32768))


_PAYLOAD = re.compile(r'\b(ir|module|opaque) = "((?:[^"\\]|\\.)*)"')


def _unescape(body: str) -> bytes:
  """An MLIR string attribute's printed body -> its bytes (\\XX hex escapes, \\\\, \\")."""
  out, i = bytearray(), 0
  while i < len(body):
    c = body[i]
    if c == "\\" and re.fullmatch(r"[0-9A-Fa-f]{2}", body[i + 1:i + 3] or ""):
      out.append(int(body[i + 1:i + 3], 16))
      i += 3
    elif c == "\\":
      out.extend(body[i + 1].encode())
      i += 2
    else:
      out.extend(c.encode())
      i += 1
  return bytes(out)


def write_payloads(text: str, out: str, prefix: str):
  """The kernels' payloads of a lowered module's text, each to a .bin and its printable strings to a
  .txt (a compressed `opaque` decompressed first) -> ['<name> <sha16> <bytes>', ...]."""
  lines = []
  for i, m in enumerate(_PAYLOAD.finditer(text)):
    data = _unescape(m.group(2))
    if m.group(1) == "opaque":
      try:
        data = zlib.decompress(data)
      except zlib.error:
        pass
    name = f"payload_{prefix}_{i}"
    with open(os.path.join(out, name + ".bin"), "wb") as f:
      f.write(data)
    with open(os.path.join(out, name + ".txt"), "w") as f:
      f.write("\n".join(w.decode() for w in re.findall(rb"[\x20-\x7e\t]{6,}", data)) + "\n")
    lines.append(f"{name} {m.group(1)} {hashlib.sha256(data).hexdigest()[:16]} {len(data)}")
  return lines


def main(argv) -> None:
  tag, impl, lower_for, context = _args(argv)
  out = os.path.join(os.environ.get("OUT", "runs"), "probe_cache_key", tag)
  os.makedirs(out, exist_ok=True)
  handler = logging.FileHandler(os.path.join(out, "cache_key.log"), mode="w")
  handler.setFormatter(logging.Formatter("%(message)s"))
  key_log = logging.getLogger("jax._src.cache_key")
  key_log.setLevel(logging.DEBUG)
  key_log.addHandler(handler)
  if not lower_for:
    # one folder for both tags: its path is part of every key (the per-fusion autotune cache's)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(os.path.join(out, "..", "cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  cfg = config.qwen38_27b(num_layers=4)
  abstract = nnx.eval_shape(lambda: Qwen38(cfg, jnp.bfloat16))
  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, "q8_0", "q4_0", page_tokens=256)
  opts = AttentionOptions(implementation=impl)
  gd, gs = engine.split_static(abstract.groups[0])
  gs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in gs]
  st = jax.eval_shape(lambda: tuple(zero_recurrent_state(cfg) for _ in range(3)))
  pages = layout.pages_for(context)
  s = jax.ShapeDtypeStruct
  summary = []
  for rows in (1, 256):
    traced = engine._group_step.trace(   # pylint: disable=protected-access
        gd, gs, s((rows, cfg.hidden_size), jnp.bfloat16), st, s((64, layout.page_bytes), jnp.uint8),
        s((pages,), jnp.int32), s((), jnp.int32), s((), jnp.int32), layout=layout, opts=opts,
        chunked=rows > 1, capture=False)
    lowered = traced.lower(lowering_platforms=(lower_for,)) if lower_for else traced.lower()
    text = lowered.as_text()
    with open(os.path.join(out, f"group_step_{rows}.mlir"), "w") as f:
      f.write(text)
    line = f"{tag} rows={rows} text_sha={hashlib.sha256(text.encode()).hexdigest()[:16]} chars={len(text)}"
    with open(os.path.join(out, "payloads.txt"), "a" if rows > 1 else "w") as f:
      f.write("\n".join(write_payloads(text, out, str(rows))) + "\n")
    if not lower_for:
      key_log.debug("== compile rows=%d", rows)
      lowered.compile()
    summary.append(line)
    print(line, flush=True)
  with open(os.path.join(out, "summary.txt"), "w") as f:
    f.write("\n".join(summary) + "\n")


if __name__ == "__main__":
  main(sys.argv)
