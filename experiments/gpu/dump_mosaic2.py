"""Compiles and runs the Mosaic GPU v2 span kernel (`kernel_mosaic_v2._span_call`) once per
query-row count, so Mosaic GPU's dump switches print what ptxas made of it (the 27B geometry; the
context only changes constants). Run on the GPU machine, e.g.

  MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 python3 experiments/gpu/dump_mosaic2.py 1,5 > d.txt

then assemble the PTX here with `ptxas -arch=sm_90a -v` and read the SASS with nvdisasm
(the device machine has no nvdisasm). Prints one line per kernel: rows, N, output checksum.

A third argument "call" runs the whole call (query prep, kernel, combine, finalize) 3 times
instead, for a per-kernel breakdown under ncu:

  ncu --metrics gpu__time_duration.sum python3 experiments/gpu/dump_mosaic2.py 1 131072 call

A fourth argument gives options of the kernel / call as in time_mosaic2.py's variants (e.g.
perm_tokens=0); the third is then "call" or "kernel".
"""
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvjax_pallas.page_layout import PageLayout  # noqa: E402
from kvjax_pallas.span_attention import kernel_mosaic_v2 as km2  # noqa: E402
from time_mosaic2 import KERNEL_OPTIONS, variant_options  # noqa: E402  (same folder)


def main():
  rows = [int(x) for x in sys.argv[1].split(",")]
  ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
  whole_call = len(sys.argv) > 3 and sys.argv[3] == "call"
  opts = variant_options(sys.argv[4]) if len(sys.argv) > 4 else {}
  kern_opts = {k: v for k, v in opts.items() if k in KERNEL_OPTIONS}
  lay = PageLayout(4, 256, "q8_0", "q4_0", 256)
  n_pages = ctx // lay.page_tokens
  pool = (jax.random.randint(jax.random.PRNGKey(0), (n_pages, lay.page_bytes), 0, 256, jnp.int32)
          .astype(jnp.uint8) & jnp.uint8(0x3B))
  table = jnp.arange(n_pages, dtype=jnp.int32)
  bp = km2.choose_block_pages(n_pages)
  for s in rows:
    q = jax.random.normal(jax.random.PRNGKey(s), (s, 24, 256), jnp.float32)
    q_pos = jnp.arange(ctx - s, ctx, dtype=jnp.int32)
    if whole_call:
      call = jax.jit(functools.partial(km2.span_attention_mosaic2, layout=lay, block_pages=bp,
                                       **opts))
      for _ in range(3):
        o = jax.block_until_ready(call(q, pool, table, ctx, q_pos))
      print(f"=== rows {s * 6} N {km2.rows_padded(s * 6)}: sum |o| {float(jnp.abs(o).sum()):.6g}")
      continue
    kern = jax.jit(functools.partial(km2._span_call, layout=lay, block_pages=bp,  # pylint: disable=protected-access
                                     n_parts=-(-n_pages // bp), sm_scale=1 / 16, interpret=False,
                                     **kern_opts))
    ml, ot = kern(q, pool, table, ctx, 0, n_pages, q_pos)
    print(f"=== rows {s * 6} N {km2.rows_padded(s * 6)}: sum |O^T| {float(jnp.abs(ot).sum()):.6g}, "
          f"sum l {float(ml[:, :, 1].sum()):.6g}", flush=True)


if __name__ == "__main__":
  main()
