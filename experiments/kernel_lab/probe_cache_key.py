"""Kernel-study probe: is a layer step's lowering the same in two processes? (The persistent
compilation cache keys `jit__group_step` by it; a second process that lowers other bytes misses.)

Lowers `_group_step` of a one-group 27B-geometry model (decode and prefill shapes, `auto`
attention) and writes each lowering's text and sha256 under $OUT/<tag>/. Run it twice with two
tags, then diff:  python -m experiments.kernel_lab.probe_cache_key a; ... b; diff -r $OUT/a $OUT/b
"""

import hashlib
import os
import sys

import jax.numpy as jnp

from kvjax import config, engine, weights
from kvjax.config import gguf_tensor_shapes
from kvjax.model import AttentionOptions
from kvjax_pallas.page_layout import PageLayout


def main(tag: str) -> None:
  out = os.path.join(os.environ.get("OUT", "runs"), "probe_cache_key", tag)
  os.makedirs(out, exist_ok=True)
  cfg = config.qwen38_27b(num_layers=4)
  model = engine.build_model(cfg, weights.iter_random_device_tensors(cfg, 0, "bfloat16"), dtype=jnp.bfloat16,
                             names=gguf_tensor_shapes(cfg).keys())
  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, "q8_0", "q4_0", page_tokens=256)
  runner = engine.Runner(model, layout, AttentionOptions(implementation="auto"))
  gd, gs = runner.groups[0]
  st = runner.zero_states()[0]
  pages = layout.pages_for(32768)
  for rows in (1, 256):
    low = engine._group_step.lower(   # pylint: disable=protected-access
        gd, gs, engine.on_device(jnp.zeros((rows, cfg.hidden_size), jnp.bfloat16)), st,
        engine.on_device(jnp.zeros((64, layout.page_bytes), jnp.uint8)), engine.on_device(jnp.zeros((pages,), jnp.int32)),
        engine.on_device(jnp.int32(0)), engine.on_device(jnp.int32(rows)), layout=layout, opts=runner.opts,
        chunked=rows > 1, capture=False)
    text = low.as_text()
    with open(os.path.join(out, f"group_step_{rows}.mlir"), "w") as f:
      f.write(text)
    print(tag, rows, hashlib.sha256(text.encode()).hexdigest()[:16], len(text), flush=True)


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "a")
