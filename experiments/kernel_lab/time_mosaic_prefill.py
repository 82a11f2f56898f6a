"""Times span-attention prefill chunks at the 27B geometry (contiguous pages, dispatch timing):
the Mosaic GPU prefill kernel (`mosaic_prefill.span_attention_mosaic_prefill`, what "mosaic" and
"auto" run for these calls) against the Triton kernel's prefill path
(`api.span_attention(implementation="triton")`), the same inputs.

  python3 -m experiments.kernel_lab.time_mosaic_prefill 32768,131072 256,64 [block pages: auto,47]

A variant is the prefill kernel's block_pages: "auto" (`api.resolve_block_pages`) or an int.

Prints one line per context, query tokens and variant: microseconds a call (median of 5 rounds
of 20 queued calls), TFLOP/s (4 x query rows x keys x head dim: QK^T and PV; causal keys
counted), GB/s on the quantized pages, the first call's seconds (trace + compile + run), and the
two outputs' relative difference.
"""
import functools

import numpy as np
import jax

from experiments.kernel_lab.common import (LAYOUT_27B, first_run, harness_args, last_queries,
                                           synthetic_pools, time_us)
from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import api
from kvjax_pallas.span_attention import mosaic_prefill


def block_pages(text: str, num_pages: int, s: int, lay: PageLayout) -> int:
  """"auto" -> the API's choice for the call; else the int."""
  if text == "auto":
    return api.resolve_block_pages("auto", num_pages, s, 24, lay, implementation="mosaic")
  return int(text)


def main():
  contexts, tokens, bps = harness_args("auto")
  lay = LAYOUT_27B
  print(f"{'ctx':>7} {'S':>4} {'variant':>14} {'impl':>8} | {'call us':>9} {'TFLOP/s':>7} "
        f"{'GB/s':>6} | {'first s':>7} | rel diff vs triton")
  for ctx, n_pages, pool, table in synthetic_pools(contexts, lay):
    for s in tokens:
      q, q_pos = last_queries(ctx, s)
      keys = float(np.sum(np.asarray(q_pos) + 1))       # causal keys of the query tokens
      flops = 4.0 * 24 * keys * 256
      base = None
      for impl, bp in [("triton", "auto")] + [("mosaic", b) for b in bps]:
        if impl == "triton":
          fn = functools.partial(api.span_attention, layout=lay, block_pages="auto",
                                 implementation="triton")
        else:
          fn = functools.partial(mosaic_prefill.span_attention_mosaic_prefill, layout=lay,
                                 block_pages=block_pages(bp, n_pages, s, lay))
        call = jax.jit(lambda q, pool, table, fn=fn, q_pos=q_pos, ctx=ctx: fn(
            q, pool, table, ctx, q_pos))
        first = first_run(call, q, pool, table, label=f"{ctx:>7} {s:>4} {bp:>14} {impl:>8}")
        if first is None:
          continue
        out, t_first = first
        if base is None:
          base = out
        diff = float(np.linalg.norm(out - base) / np.linalg.norm(base))
        us = time_us(call, q, pool, table, iters=20)
        print(f"{ctx:>7} {s:>4} {bp:>14} {impl:>8} | {us:9.1f} {flops / us / 1e6:7.1f} "
              f"{ctx * lay.token_bytes / us / 1e3:6.0f} | {t_first:7.1f} | {diff:.3g}"
              f"{'' if np.isfinite(out).all() else ' NOT FINITE'}", flush=True)


if __name__ == "__main__":
  main()
