"""Times the Mosaic GPU v2 span kernel alone (`kernel_mosaic_v2._span_call`) and the whole call
(kernel + combine + finalize) at the 27B geometry, contiguous pages, dispatch timing.

  python3 experiments/gpu/time_mosaic2.py 131072,262144 1,4 [variants: default,split,acc_refs,n24]

(nXX: the wgmma N forced to XX, `wgmma_n`; any other variant is options of
`span_attention_partial_mosaic2` as k=v joined by "+", e.g. perm_tokens=0+combine_cols=16,
k_heads=0 or combine_cols=32+combine_rows=32; module=NAME runs the variant with
kvjax_pallas/span_attention/NAME.py instead of kernel_mosaic_v2, e.g. a saved copy of an earlier
revision as the control in the same run: `git show REV:kvjax_pallas/span_attention/
kernel_mosaic_v2.py > kvjax_pallas/span_attention/v2_rev.py`, variant module=v2_rev.)

"first s": the call's first run (trace + compile + run; jax's persistent compilation cache, where
set, can shorten it). Each variant's call is also compared with the default's output on the same inputs (max |diff|).
The kernel alone is timed once per set of kernel options (variants that change only the combine
share it: "=" in the kernel column).
"""
import functools
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvjax_pallas.page_layout import PageLayout  # noqa: E402
from kvjax_pallas.span_attention import kernel_mosaic_v2 as km2  # noqa: E402


def timed(fn, *args, iters=50):
  """Median microseconds a call of `iters` calls queued from Python (the GPU runs them in order)."""
  out = fn(*args)
  jax.block_until_ready(out)
  ts = []
  for _ in range(5):
    t = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t) / iters)
  return float(np.median(ts)) * 1e6


def synthetic_pool(lay: PageLayout, n_pages: int):
  """(pool [n_pages + 8, page_bytes] u8 of random bytes with finite f16 scales, the contiguous
  table [n_pages]): every scale's high byte below 0x3c (each byte masked with 0x3B)."""
  pool = jax.random.randint(jax.random.PRNGKey(0), (n_pages + 8, lay.page_bytes), 0, 256,
                            jnp.int32).astype(jnp.uint8)
  return pool & jnp.uint8(0x3B), jnp.arange(n_pages, dtype=jnp.int32)


KERNEL_OPTIONS = ("split", "acc_refs", "wgmma_n", "perm_tokens", "k_heads", "table_smem",
                  "late_k", "own_k", "v_halves", "heads_per_wg", "producer",
                  "rhs_per_tile", "v_tiles")                                       # the rest: the combine's
FLAG_OPTIONS = ("perm_tokens", "split", "acc_refs", "k_heads", "table_smem", "late_k",
                "own_k", "producer", "rhs_per_tile")


def variant_options(variant: str) -> dict:
  """"n24" -> wgmma_n=24; "perm_tokens=0+combine_cols=16" -> those options (ints; 0 / 1 for the
  flags)."""
  if variant[0] == "n" and variant[1:].isdigit():
    return dict(wgmma_n=int(variant[1:]))
  out = {}
  for item in variant.split("+"):
    k, v = item.split("=")
    out[k] = bool(int(v)) if k in FLAG_OPTIONS else int(v) if v.lstrip("-").isdigit() else v
  return out


def main():
  contexts = [int(x) for x in sys.argv[1].split(",")]
  rows = [int(x) for x in sys.argv[2].split(",")]
  variants = (sys.argv[3] if len(sys.argv) > 3 else "default").split(",")
  kws = {"default": {}, "split": dict(split=True), "acc_refs": dict(acc_refs=True),
         "split+acc_refs": dict(split=True, acc_refs=True)}
  lay = PageLayout(4, 256, "q8_0", "q4_0", 256)
  print(f"{'ctx':>7} {'S':>3} {'bp':>3} {'variant':>14} | {'kernel us':>9} {'GB/s':>6} | "
        f"{'call us':>8} {'GB/s':>6} | {'first s':>7} | max|diff| vs default")
  for ctx in contexts:
    n_pages = ctx // lay.page_tokens
    pool, table = synthetic_pool(lay, n_pages)
    bp = km2.choose_block_pages(n_pages)
    base, kernel_us = {}, {}
    for s, variant in [(s, v) for s in rows for v in variants]:
      kw = dict(kws[variant] if variant in kws else variant_options(variant))
      module = kw.pop("module", "kernel_mosaic_v2")
      km = importlib.import_module("kvjax_pallas.span_attention." + module)
      q = jax.random.normal(jax.random.PRNGKey(s), (s, 24, 256), jnp.float32)
      q_pos = jnp.arange(ctx - s, ctx, dtype=jnp.int32)
      parts = -(-n_pages // bp)
      kern_fn = functools.partial(km._span_call, layout=lay, block_pages=bp,  # pylint: disable=protected-access
                                  n_parts=parts, sm_scale=1 / 16, interpret=False,
                                  **{k: v for k, v in kw.items() if k in KERNEL_OPTIONS})
      call_fn = functools.partial(km.span_attention_mosaic2, layout=lay, block_pages=bp, **kw)
      # the scalars and q_pos closed over, the pool and table passed (closed over, jit would embed
      # them as constants): session 11 passed ctx as a Python int each call and measured the
      # call ~30 us slower than the bench, host-bound
      kern = jax.jit(lambda q, pool, table, kern_fn=kern_fn, q_pos=q_pos, ctx=ctx,
                     n_pages=n_pages: kern_fn(q, pool, table, ctx, 0, n_pages, q_pos))
      call = jax.jit(lambda q, pool, table, call_fn=call_fn, q_pos=q_pos, ctx=ctx: call_fn(
          q, pool, table, ctx, q_pos))
      try:
        t_first = time.perf_counter()
        out = np.asarray(call(q, pool, table))
        t_first = time.perf_counter() - t_first
      except Exception as e:  # a variant this shape refuses: say so and go on
        print(f"{ctx:>7} {s:>3} {bp:>3} {variant:>14} | failed: {str(e)[:160]}", flush=True)
        continue
      if variant == "default":
        base[s] = out
      elif s not in base:
        base[s] = np.asarray(jax.jit(functools.partial(
            km2.span_attention_mosaic2, layout=lay, block_pages=bp))(q, pool, table, ctx, q_pos))
      diff = float(np.max(np.abs(out - base[s])))
      kkey = (s, module, tuple(sorted((k, v) for k, v in kw.items() if k in KERNEL_OPTIONS)))
      shared = kkey in kernel_us
      if not shared:
        kernel_us[kkey] = timed(kern, q, pool, table)
      tk = kernel_us[kkey]
      tc = timed(call, q, pool, table)
      nbytes = ctx * lay.token_bytes
      print(f"{ctx:>7} {s:>3} {bp:>3} {variant:>14} | {tk:8.1f}{'=' if shared else ' '} "
            f"{nbytes / tk / 1e3:6.0f} | {tc:8.1f} {nbytes / tc / 1e3:6.0f} | {t_first:7.1f} | "
            f"{diff:.3g}",
            flush=True)


if __name__ == "__main__":
  main()
