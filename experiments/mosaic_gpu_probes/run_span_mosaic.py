"""Run the Mosaic GPU span kernel once at the 27B shape and compare with the jnp reference.

A small target for `compute-sanitizer` and `ncu` on the GPU machine:

  PYTHONPATH=$PWD:$PWD/tests JAX_PLATFORMS=cuda compute-sanitizer --tool memcheck \
      python3 experiments/mosaic_gpu_probes/run_span_mosaic.py --pages=9 --rows=1
"""

from __future__ import annotations

import argparse

import numpy as np
import jax.numpy as jnp

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import kernel_mosaic as km
from kvjax_pallas.span_attention import reference as ref
from span_history import History


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--pages", type=int, default=9)
  ap.add_argument("--rows", type=int, default=1)
  ap.add_argument("--v_type", default="q4_0")
  ap.add_argument("--block_pages", type=int, default=4)
  args = ap.parse_args()
  layout = PageLayout(4, 256, "q8_0", args.v_type, 256)
  tokens = args.pages * 256 - 37
  pool, table = History(layout, tokens, seed=21).shuffled(seed=4)
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((args.rows, 24, 256)).astype(np.float32))
  q_pos = jnp.asarray(np.arange(tokens - args.rows, tokens, dtype=np.int32))
  out = np.asarray(km.span_attention_mosaic(q, pool, table, tokens, q_pos, layout=layout,
                                            block_pages=args.block_pages), np.float64)
  want = np.asarray(ref.span_attention_reference(q, pool, table, tokens, q_pos, layout=layout,
                                                 block_pages=args.block_pages), np.float64)
  err = np.linalg.norm(out - want) / np.linalg.norm(want)
  print(f"mosaic pages={args.pages} rows={args.rows} finite={np.isfinite(out).all()} rel_err={err:.3e}")


if __name__ == "__main__":
  main()
