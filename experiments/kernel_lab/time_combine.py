"""Times the combine of the Mosaic GPU decode kernel alone, on synthetic partials of the
kernel's layout (m, l packed [G, parts, 2, N]; O^T [G, parts, 256, N]), per combine tiling.

  python3 -m experiments.kernel_lab.time_combine 128 1,4,6 default,cols=32,cols=8+unroll=8

A variant changes fields of the kernel's tiles (`mosaic_common.combine_tiles`: rows, cols, warps,
unroll) joined by "+"; tiles the shape cannot take are reported (`combine.check_tiles`) and the
run goes on. Rows per KV head = 6 x S (the 27B's 24 query heads over 4 KV heads), N =
`mosaic_decode.rows_padded`. Each variant's output is compared with the default's (max |diff| of
the folded acc; 0: same bits). Timing: one jitted program runs the combine on REPS different sets
of partials back to back; time = median over 5 rounds of 10 such calls / (10 x REPS) (one
combine per dispatched call would time the host, not the GPU). Without a GPU the Triton combine
runs interpreted (a smoke run; the times mean nothing).
"""
import dataclasses
import os
import sys

import numpy as np
import jax
import jax.numpy as jnp

from experiments.kernel_lab.common import time_us
from kvjax_pallas.span_attention import combine
from kvjax_pallas.span_attention import magic_ptx
from kvjax_pallas.span_attention import mosaic_common
from kvjax_pallas.span_attention import mosaic_decode

FIELDS = ("rows", "cols", "warps", "unroll")


def tiles_of(variant: str, n: int, parts: int) -> combine.CombineTiles:
  """"default" -> the kernel's tiles for N = n; "cols=8+unroll=8" -> those fields changed
  (warps and unroll follow a changed tile unless given), checked against the shape."""
  tiles = mosaic_common.combine_tiles(n, parts)
  if variant == "default":
    return tiles
  kw = {}
  for item in variant.split("+"):
    k, v = item.split("=")
    if k not in FIELDS:
      raise ValueError(f"unknown combine field {k!r} in {variant!r}; use {FIELDS}")
    kw[k] = int(v)
  tiles = combine.default_tiles(kw.get("rows", tiles.rows), kw.get("cols", tiles.cols), parts)
  tiles = dataclasses.replace(tiles, **kw)
  combine.check_tiles(tiles, n, 256)
  return tiles


def partials(g: int, parts: int, n: int, rows: int, d: int = 256, seed: int = 0):
  """Kernel-layout partials: m in the natural-log domain with a spread like real scores, l > 0,
  O^T of the size l gives; padding columns (>= rows) empty (m = -inf, l = 0, O^T = 0)."""
  rng = np.random.default_rng(seed)
  m = rng.normal(2.0, 1.5, (g, parts, n)).astype(np.float32)
  l = rng.uniform(1.0, 60.0, (g, parts, n)).astype(np.float32)
  ot = (rng.normal(size=(g, parts, d, n)) * l[:, :, None, :] * 0.1).astype(np.float32)
  m[..., rows:], l[..., rows:], ot[..., rows:] = -np.inf, 0.0, 0.0
  return jnp.asarray(np.stack([m, l], axis=2)), jnp.asarray(ot)


REPS = int(os.environ.get("TIME_COMBINE_REPS", "8"))


def main():
  parts = int(sys.argv[1])
  s_list = [int(x) for x in sys.argv[2].split(",")]
  variants = (sys.argv[3] if len(sys.argv) > 3 else "default").split(",")
  g, d, group = 4, 256, 6
  interpret = jax.default_backend() != "gpu"      # a CPU smoke run: the Triton kernel interpreted
  print(f"{'parts':>5} {'S':>3} {'N':>3} {'variant':>26} | {'plan':>34} | {'us':>7} | "
        f"max|diff| vs default", flush=True)
  for s in s_list:
    rows = s * group
    n = mosaic_decode.rows_padded(rows)
    base = None
    for variant in variants:
      try:
        tiles = tiles_of(variant, n, parts)
        n_parts = tiles.padded_parts(parts)
        sets = [partials(g, n_parts, n, rows, d, seed=i) for i in range(REPS)]
        ml = jnp.stack([x[0] for x in sets])
        ot = jnp.stack([x[1] for x in sets])
        if n_parts > parts:   # the group padding: empty partitions past the real ones
          ml = ml.at[:, :, parts:, 0].set(-jnp.inf).at[:, :, parts:, 1].set(0.0)
          ot = ot.at[:, :, parts:].set(0.0)
        one = lambda ml, ot, tiles=tiles, rows=rows: combine.combine_call(
            ml, None, ot, None, rows=rows, tiles=tiles, acc_transposed=True,
            v_cols=magic_ptx.vt_dims(d), head_dim=d, interpret=interpret).acc_gmd
        fn = jax.jit(lambda ml, ot: [one(ml[i], ot[i]) for i in range(REPS)])
        acc = np.asarray(fn(ml, ot)[0])
        if base is None:
          base = acc
        diff = float(np.max(np.abs(acc - base))) if acc.shape == base.shape else float("nan")
        us = time_us(fn, ml, ot, iters=10) / REPS
        desc = f"r{tiles.rows} c{tiles.cols} w{tiles.warps} u{tiles.unroll} p{n_parts}"
        print(f"{parts:>5} {s:>3} {n:>3} {variant:>26} | {desc:>34} | {us:7.2f} | {diff:.3g}",
              flush=True)
      except Exception as e:  # record and go on
        print(f"{parts:>5} {s:>3} {n:>3} {variant:>26} | failed: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
  main()
