"""Times the Mosaic GPU decode kernel alone (`mosaic_decode.decode_partials`) and the whole call
(kernel + combine + finalize) at the 27B geometry, contiguous pages, dispatch timing.

  python3 -m experiments.kernel_lab.time_mosaic_decode 131072,262144 1,4 [variants: default,module=NAME]

A variant "module=NAME" runs kvjax_pallas/span_attention/NAME.py instead of mosaic_decode, e.g. a
saved copy of an earlier revision as the control in the same run: `git show
REV:kvjax_pallas/span_attention/mosaic_decode.py > kvjax_pallas/span_attention/decode_rev.py`,
variant module=decode_rev (the copy must have the same entry points).

"first s": the call's first run (trace + compile + run; jax's persistent compilation cache, where
set, can shorten it). Each variant's call is also compared with the default's output on the same
inputs (max |diff|).
"""
import functools
import importlib

import numpy as np
import jax

from experiments.kernel_lab.common import (LAYOUT_27B, first_run, harness_args, last_queries,
                                           synthetic_pools, time_us)
from kvjax_pallas.span_attention import mosaic_decode


def variant_module(variant: str):
  """"default" -> mosaic_decode; "module=NAME" -> kvjax_pallas.span_attention.NAME."""
  if variant == "default":
    return mosaic_decode
  key, _, name = variant.partition("=")
  if key != "module" or not name:
    raise ValueError(f"unknown variant {variant!r}: use default or module=NAME")
  return importlib.import_module("kvjax_pallas.span_attention." + name)


def main():
  contexts, rows, variants = harness_args("default")
  lay = LAYOUT_27B
  print(f"{'ctx':>7} {'S':>3} {'bp':>3} {'variant':>14} | {'kernel us':>9} {'GB/s':>6} | "
        f"{'call us':>8} {'GB/s':>6} | {'first s':>7} | max|diff| vs default")
  for ctx, n_pages, pool, table in synthetic_pools(contexts, lay):
    bp = mosaic_decode.choose_block_pages(n_pages)
    base = {}
    for s, variant in [(s, v) for s in rows for v in variants]:
      km = variant_module(variant)
      q, q_pos = last_queries(ctx, s)
      kern_fn = functools.partial(km.decode_partials, layout=lay, block_pages=bp,
                                  n_parts=-(-n_pages // bp), sm_scale=1 / 16, interpret=False)
      call_fn = functools.partial(km.span_attention_mosaic_decode, layout=lay, block_pages=bp)
      # the scalars and q_pos closed over, the pool and table passed (closed over, jit would embed
      # them as constants); a Python int context passed each call makes the call host-bound
      kern = jax.jit(lambda q, pool, table, kern_fn=kern_fn, q_pos=q_pos, ctx=ctx,
                     n_pages=n_pages: kern_fn(q, pool, table, ctx, 0, n_pages, q_pos))
      call = jax.jit(lambda q, pool, table, call_fn=call_fn, q_pos=q_pos, ctx=ctx: call_fn(
          q, pool, table, ctx, q_pos))
      first = first_run(call, q, pool, table, label=f"{ctx:>7} {s:>3} {bp:>3} {variant:>14}")
      if first is None:
        continue
      out, t_first = first
      if s not in base:
        base[s] = out if variant == "default" else np.asarray(jax.jit(functools.partial(
            mosaic_decode.span_attention_mosaic_decode, layout=lay, block_pages=bp))(
                q, pool, table, ctx, q_pos))
      diff = float(np.max(np.abs(out - base[s])))
      tk = time_us(kern, q, pool, table)
      tc = time_us(call, q, pool, table)
      nbytes = ctx * lay.token_bytes
      print(f"{ctx:>7} {s:>3} {bp:>3} {variant:>14} | {tk:9.1f} {nbytes / tk / 1e3:6.0f} | "
            f"{tc:8.1f} {nbytes / tc / 1e3:6.0f} | {t_first:7.1f} | {diff:.3g}", flush=True)


if __name__ == "__main__":
  main()
