"""Do concurrent axis-0 reductions of several Pallas warpgroups give the right answers?

The Mosaic GPU decode kernel runs one consumer warpgroup a KV head (`num_threads=4`) and reduces
S^T [64 tokens, N] along the tokens for the online softmax. A reduction along axis 0 of the WGMMA layout
crosses the 4 warps of a warpgroup; Pallas's Lane lowering gives it the module's reduction
scratch (`reduction_scratch_bytes`), which the jax 0.10.2 source indexes by warp within the
warpgroup, not by warpgroup. This probe makes every warpgroup reduce its own data `--iters` times
in a loop (max and sum along axis 0 of [64, N] f32 in the WGMMA layout, small integers: exact)
and compares the accumulated results with numpy. A race between warpgroups shows as a mismatch.
Compiled only (the interpreter runs no `plgpu.load` with a layout): run it on the GPU.

  python -m experiments.kernel_lab.probe_wg_reductions --warpgroups=1,2,4 --iters=256

`--axes=1` is the control: the same kernel reducing along the columns (within a warp, no
scratch) must be right for every warpgroup count, or the probe's own indexing is wrong.
"""

import functools

import numpy as np
from absl import app, flags

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

flags.DEFINE_list("warpgroups", ["1", "2", "4"], "Pallas threads (warpgroups) a CTA")
flags.DEFINE_integer("iters", 256, "reductions a warpgroup")
flags.DEFINE_integer("n", 16, "columns")
flags.DEFINE_integer("ctas", 132, "CTAs (each its own data)")
flags.DEFINE_list("axes", ["0", "1"], "0: along the 64 rows (crosses warps: the reduction "
                  "scratch); 1: along the N columns (within a warp: no scratch), the control")
FLAGS = flags.FLAGS
ROWS = 64


def _kernel(x_ref, out_ref, x_s, out_s, bar, *, wgs: int, iters: int, axis: int):
  # x_ref [C, W, 64, N] f32 -> out_ref [C, W, 2, 64, N] f32: per warpgroup the sums over the
  # iterations of max(x + i, axis) and sum(x + i, axis), broadcast back to [64, N]
  wg = lax.axis_index("wg") if wgs > 1 else 0
  c = lax.axis_index("c")
  plgpu.copy_gmem_to_smem(x_ref.at[c, wg], x_s.at[wg], bar.at[wg])
  plgpu.barrier_wait(bar.at[wg])
  x = plgpu.load(x_s.at[wg], (), layout=plgpu.Layout.WGMMA, optimized=False)
  n = x.shape[1]
  keep = 1 - axis                                     # the axis that stays

  def body(i, carry):
    acc_m, acc_s = carry
    y = x + i.astype(jnp.float32)
    return acc_m + jnp.max(y, axis=axis), acc_s + jnp.sum(y, axis=axis)

  zero = plgpu.layout_cast(jnp.zeros((x.shape[keep],), jnp.float32),
                           plgpu.Layout.WGMMA.reduce(axis))
  acc_m, acc_s = lax.fori_loop(0, iters, body, (zero, zero))
  for k, acc in enumerate((acc_m, acc_s)):
    out_s[wg, k] = lax.broadcast_in_dim(acc, (ROWS, n), (keep,))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_s.at[wg], out_ref.at[c, wg])
  plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("iters", "axis"))
def reductions(x, *, iters: int, axis: int = 0):
  """x [C, W, 64, N] f32 -> [C, W, 2, 64, N] f32 (see `_kernel`)."""
  ctas, wgs, _, n = x.shape
  kw = dict(num_threads=wgs, thread_name="wg") if wgs > 1 else {}
  return plgpu.kernel(
      functools.partial(_kernel, wgs=wgs, iters=iters, axis=axis),
      out_type=jax.ShapeDtypeStruct((ctas, wgs, 2, ROWS, n), jnp.float32),
      scratch_types=[plgpu.SMEM((wgs, ROWS, n), jnp.float32),
                     plgpu.SMEM((wgs, 2, ROWS, n), jnp.float32),
                     plgpu.Barrier(num_arrivals=1, num_barriers=wgs)],
      grid=(ctas,), grid_names=("c",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **kw)(x)


def expected(x: np.ndarray, iters: int, axis: int = 0) -> np.ndarray:
  """[C, W, 2, 64, N]: the kernel's sums for x [C, W, 64, N] (float64)."""
  i = np.arange(iters, dtype=np.float64)
  m = x.max(axis=2 + axis)[..., None, :] + i[:, None]           # [C, W, iters, kept]
  s = x.sum(axis=2 + axis)[..., None, :] + x.shape[2 + axis] * i[:, None]
  out = np.stack([m.sum(axis=2), s.sum(axis=2)], axis=2)        # [C, W, 2, kept]
  out = out[:, :, :, None, :] if axis == 0 else out[..., None]
  return np.broadcast_to(out, x.shape[:2] + (2,) + x.shape[2:])


def main(argv):
  del argv
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}", flush=True)
  for axis, wgs in ((int(a), int(w)) for a in FLAGS.axes for w in FLAGS.warpgroups):
    rng = np.random.default_rng(wgs)
    x = rng.integers(-20, 21, (FLAGS.ctas, wgs, ROWS, FLAGS.n)).astype(np.float32)
    got = np.asarray(reductions(jnp.asarray(x), iters=FLAGS.iters, axis=axis)).astype(np.float64)
    want = expected(x.astype(np.float64), FLAGS.iters, axis)
    bad = got != want
    print(f"axis={axis} warpgroups={wgs} iters={FLAGS.iters}: "
          + ("all reductions equal numpy" if not bad.any() else
             f"MISMATCH in {bad.mean():.1%} of the values (max {bad[:, :, 0].mean():.1%}, "
             f"sum {bad[:, :, 1].mean():.1%})"), flush=True)


if __name__ == "__main__":
  app.run(main)
