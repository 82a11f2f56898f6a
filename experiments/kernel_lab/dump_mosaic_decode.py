"""Compiles and runs the Mosaic GPU decode kernel (`mosaic_decode.decode_partials`) once per
query-row count, so Mosaic GPU's dump switches print what ptxas made of it (the 27B geometry; the
context only changes constants). Run on the GPU machine, e.g.

  MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 \
      python3 -m experiments.kernel_lab.dump_mosaic_decode 1,5 > d.txt

then assemble the PTX with `ptxas -arch=sm_90a -v` and read the SASS with nvdisasm (from PyPI's
`nvidia-cuda-nvdisasm` wheel where the device machine has none). Prints one line per kernel:
rows, N, output checksum.

A third argument "call" runs the whole call (query prep, kernel, combine, finalize) 3 times
instead, for a per-kernel breakdown under ncu ("kernel", the default, the kernel alone):

  ncu --metrics gpu__time_duration.sum \
      python3 -m experiments.kernel_lab.dump_mosaic_decode 1 131072 call
"""
import functools
import sys

import jax
import jax.numpy as jnp

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import mosaic_decode


def main():
  rows = [int(x) for x in sys.argv[1].split(",")]
  ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
  whole_call = len(sys.argv) > 3 and sys.argv[3] == "call"
  lay = PageLayout(4, 256, "q8_0", "q4_0", 256)
  n_pages = ctx // lay.page_tokens
  pool = (jax.random.randint(jax.random.PRNGKey(0), (n_pages, lay.page_bytes), 0, 256, jnp.int32)
          .astype(jnp.uint8) & jnp.uint8(0x3B))
  table = jnp.arange(n_pages, dtype=jnp.int32)
  bp = mosaic_decode.choose_block_pages(n_pages)
  for s in rows:
    q = jax.random.normal(jax.random.PRNGKey(s), (s, 24, 256), jnp.float32)
    q_pos = jnp.arange(ctx - s, ctx, dtype=jnp.int32)
    n = mosaic_decode.rows_padded(s * 6)
    if whole_call:
      call = jax.jit(functools.partial(mosaic_decode.span_attention_mosaic_decode, layout=lay,
                                       block_pages=bp))
      for _ in range(3):
        o = jax.block_until_ready(call(q, pool, table, ctx, q_pos))
      print(f"=== rows {s * 6} N {n}: sum |o| {float(jnp.abs(o).sum()):.6g}")
      continue
    kern = jax.jit(functools.partial(mosaic_decode.decode_partials, layout=lay, block_pages=bp,
                                     n_parts=-(-n_pages // bp), sm_scale=1 / 16,
                                     interpret=False))
    ml, ot = kern(q, pool, table, ctx, 0, n_pages, q_pos)
    print(f"=== rows {s * 6} N {n}: sum |O^T| {float(jnp.abs(ot).sum()):.6g}, "
          f"sum l {float(ml[:, :, 1].sum()):.6g}", flush=True)


if __name__ == "__main__":
  main()
