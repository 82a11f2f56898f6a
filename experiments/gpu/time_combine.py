"""Times the combine of the Mosaic GPU v2 span kernel alone, on synthetic partials of the kernel's
layout (m, l packed [G, parts, 2, N]; O^T [G, parts, 256, N]), per combine plan.

  python3 experiments/gpu/time_combine.py 128 1,4,6 default,cols=32,cols=8+unroll=8

A variant is `kernel_mosaic_v2.combine_plan` arguments (cols, warps, unroll, rows) joined by "+".
Rows per KV head = 6 x S (the 27B's 24 query heads over 4 KV heads), N = `rows_padded`. Each
variant's output is compared with the default's (max |diff| of the folded acc; 0: same bits).
Timing: one jitted program runs the combine on REPS different sets of partials back to back;
time = median over 5 rounds of 10 such calls / (10 x REPS). (Session 13's first version timed one
combine per dispatched call and measured 49-110 us a combine where the same kernel costs ~15 us
inside a whole call: per-call host cost, not GPU time.) Without a GPU the Triton combine runs
interpreted (a smoke run; the times mean nothing).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvjax_pallas.span_attention import kernel_mosaic_v2 as km2  # noqa: E402
from kvjax_pallas.span_attention import kernel_triton as kt  # noqa: E402
from kvjax_pallas.span_attention import magic_ptx  # noqa: E402
from time_mosaic2 import timed  # noqa: E402  (same folder)

PLAN_KEYS = {"cols": "cols", "warps": "warps", "unroll": "unroll", "rows": "rows_block"}


def parse_variant(variant: str) -> dict:
  """"default" -> {}; "cols=8+unroll=8" -> combine_plan keyword arguments."""
  if variant == "default":
    return {}
  out = {}
  for item in variant.split("+"):
    k, v = item.split("=")
    if k not in PLAN_KEYS:
      raise ValueError(f"unknown combine option {k!r} in {variant!r}; use {sorted(PLAN_KEYS)}")
    out[PLAN_KEYS[k]] = int(v)
  return out


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
    n = km2.rows_padded(rows)
    base = None
    for variant in variants:
      try:
        plan = km2.combine_plan(n, parts, d, **parse_variant(variant))
        n_parts = plan.pop("parts")
        sets = [partials(g, n_parts, n, rows, d, seed=i) for i in range(REPS)]
        ml = jnp.stack([x[0] for x in sets])
        ot = jnp.stack([x[1] for x in sets])
        if n_parts > parts:   # the group padding: empty partitions past the real ones
          ml = ml.at[:, :, parts:, 0].set(-jnp.inf).at[:, :, parts:, 1].set(0.0)
          ot = ot.at[:, :, parts:].set(0.0)
        one = lambda ml, ot, plan=plan, rows=rows: kt.combine_call(
            ml, None, ot, None, rows=rows, acc_transposed=True, v_cols=magic_ptx.vt_dims(d),
            head_dim=d, interpret=interpret, **plan).acc_gmd
        fn = jax.jit(lambda ml, ot: [one(ml[i], ot[i]) for i in range(REPS)])
        acc = np.asarray(fn(ml, ot)[0])
        if base is None:
          base = acc
        diff = float(np.max(np.abs(acc - base))) if acc.shape == base.shape else float("nan")
        us = timed(fn, ml, ot, iters=10) / REPS
        desc = (f"r{plan['c_rows']} c{plan['combine_cols']} w{plan['combine_warps']} "
                f"u{plan['unroll']} p{n_parts}")
        print(f"{parts:>5} {s:>3} {n:>3} {variant:>26} | {desc:>34} | {us:7.2f} | {diff:.3g}",
              flush=True)
      except Exception as e:  # record and go on
        print(f"{parts:>5} {s:>3} {n:>3} {variant:>26} | failed: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
  main()
