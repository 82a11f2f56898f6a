"""Times span-attention prefill chunks at the 27B geometry (contiguous pages, dispatch timing):
the Mosaic GPU prefill kernel (`kernel_mosaic_prefill.span_attention_mosaic_prefill`, the
kernel "mosaic2" and "auto" run for these calls) against the Triton kernel's prefill path
(`api.span_attention(implementation="triton")`), the same inputs.

  python3 experiments/gpu/time_prefill.py 32768,131072 256,64 [variants: auto,47,47+overlap=0]

A variant: the prefill kernel's block_pages ("auto": `api.resolve_block_pages`, or an int)
and its options as k=v (0 / 1 for flags), joined by "+".

Prints one line per context, query tokens and variant: microseconds a call (median of 5 rounds
of 20 queued calls), TFLOP/s (4 x
query rows x keys x head dim: QK^T and PV; causal keys counted), GB/s on the quantized pages,
the first call's seconds (trace + compile + run), and the two outputs' relative difference.
"""
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvjax_pallas.page_layout import PageLayout  # noqa: E402
from kvjax_pallas.span_attention import api  # noqa: E402
from kvjax_pallas.span_attention import kernel_mosaic_prefill as kp  # noqa: E402
from time_mosaic2 import synthetic_pool, timed  # noqa: E402  (this script's folder is on sys.path)


def variant(text: str, num_pages: int, s: int, lay: PageLayout):
  """"47+overlap=0" -> (block_pages 47, dict(overlap=False)); "auto" -> the API's choice."""
  bp, kw = "auto", {}
  for item in text.split("+"):
    if "=" in item:
      k, v = item.split("=")
      kw[k] = bool(int(v))
    else:
      bp = item
  if bp == "auto":
    bp = api.resolve_block_pages("auto", num_pages, s, 24, lay, implementation="mosaic2")
  return int(bp), kw


def main():
  contexts = [int(x) for x in sys.argv[1].split(",")]
  tokens = [int(x) for x in sys.argv[2].split(",")]
  bps = (sys.argv[3] if len(sys.argv) > 3 else "auto").split(",")
  lay = PageLayout(4, 256, "q8_0", "q4_0", 256)
  print(f"{'ctx':>7} {'S':>4} {'variant':>14} {'impl':>8} | {'call us':>9} {'TFLOP/s':>7} {'GB/s':>6} | "
        f"{'first s':>7} | rel diff vs triton")
  for ctx in contexts:
    n_pages = ctx // lay.page_tokens
    pool, table = synthetic_pool(lay, n_pages)
    for s in tokens:
      q = jax.random.normal(jax.random.PRNGKey(s), (s, 24, 256), jnp.float32)
      q_pos = jnp.arange(ctx - s, ctx, dtype=jnp.int32)
      keys = float(np.sum(np.asarray(q_pos) + 1))       # causal keys of the query tokens
      flops = 4.0 * 24 * keys * 256
      base = None
      for impl, bp in [("triton", "auto")] + [("mosaic2", b) for b in bps]:
        if impl == "triton":
          fn = functools.partial(api.span_attention, layout=lay, block_pages="auto",
                                 implementation="triton")
        else:
          bpv, kw = variant(bp, n_pages, s, lay)
          fn = functools.partial(kp.span_attention_mosaic_prefill, layout=lay, block_pages=bpv,
                                 **kw)
        call = jax.jit(lambda q, pool, table, fn=fn, q_pos=q_pos, ctx=ctx: fn(
            q, pool, table, ctx, q_pos))
        try:
          t_first = time.perf_counter()
          out = np.asarray(call(q, pool, table))
          t_first = time.perf_counter() - t_first
        except Exception as e:  # pylint: disable=broad-except
          print(f"{ctx:>7} {s:>4} {bp:>14} {impl:>8} | failed: {str(e)[:400]}", flush=True)
          continue
        if base is None:
          base = out
        diff = float(np.linalg.norm(out - base) / np.linalg.norm(base))
        us = timed(call, q, pool, table, iters=20)
        print(f"{ctx:>7} {s:>4} {bp:>14} {impl:>8} | {us:9.1f} {flops / us / 1e6:7.1f} "
              f"{ctx * lay.token_bytes / us / 1e3:6.0f} | {t_first:7.1f} | {diff:.3g}"
              f"{'' if np.isfinite(out).all() else ' NOT FINITE'}", flush=True)


if __name__ == "__main__":
  main()
