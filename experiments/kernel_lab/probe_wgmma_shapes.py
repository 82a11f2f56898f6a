"""The wgmma M / N / K and swizzle limits of Pallas Mosaic GPU, by lowering kernels on the CPU.

  python -m experiments.kernel_lab.probe_wgmma_shapes
"""
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from experiments.kernel_lab.common import check
rng = np.random.default_rng(0)

def tr(sw, dtype=jnp.float16):
  return (plgpu.TilingTransform((8, sw // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(sw))

def attn_kernel(M, D, BT, sw):
  # S = Q @ K^T (A,B in SMEM, B transposed); P = f16(S); O = P @ V (A in registers, B in SMEM)
  def body(q, k, v, o, q_s, k_s, v_s, o_s, bar):
    plgpu.copy_gmem_to_smem(q, q_s, bar); plgpu.barrier_wait(bar)
    plgpu.copy_gmem_to_smem(k, k_s, bar); plgpu.barrier_wait(bar)
    plgpu.copy_gmem_to_smem(v, v_s, bar); plgpu.barrier_wait(bar)
    def qk(acc):
      plgpu.wgmma(acc, q_s, plgpu.transpose_ref(k_s, (1, 0)))
      plgpu.wgmma_wait(0)
      return acc[...]
    s = pl.run_scoped(qk, plgpu.ACC((M, BT), jnp.float32))
    p = s.astype(jnp.float16)
    if RUN_STATE:
      def pv(acc):
        plgpu.wgmma(acc, p, v_s)
      out = pl.run_state(pv)(plgpu.ACC.init(plgpu.layout_cast(jnp.zeros((M, D), jnp.float32), plgpu.Layout.WGMMA)))
      plgpu.wgmma_wait(0)
    else:
      def pv(acc):
        plgpu.wgmma(acc, p, v_s)
        plgpu.wgmma_wait(0)
        return acc[...]
      out = pl.run_scoped(pv, plgpu.ACC((M, D), jnp.float32))
    o_s[...] = out
    plgpu.commit_smem(); plgpu.copy_smem_to_gmem(o_s, o); plgpu.wait_smem_to_gmem(0)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M, D), jnp.float32),
      scratch_types=[plgpu.SMEM((M, D), jnp.float16, transforms=tr(sw)),
                     plgpu.SMEM((BT, D), jnp.float16, transforms=tr(sw)),
                     plgpu.SMEM((BT, D), jnp.float16, transforms=tr(sw)),
                     plgpu.SMEM((M, D), jnp.float32), plgpu.Barrier(num_arrivals=1)])

for RUN_STATE in (False, True):
 for (M, D, BT, sw) in [(64, 256, 64, 128), (64, 256, 32, 128), (64, 32, 64, 64), (64, 256, 64, 32), (64, 256, 64, 16), (16, 256, 64, 128)]:
  q = jnp.asarray(rng.normal(size=(M, D)) * .1, jnp.float16)
  k = jnp.asarray(rng.normal(size=(BT, D)) * .1, jnp.float16)
  v = jnp.asarray(rng.normal(size=(BT, D)), jnp.float16)
  s = (q.astype(jnp.float32) @ k.astype(jnp.float32).T).astype(jnp.float16).astype(jnp.float32)
  ref = s @ v.astype(jnp.float32)
  try:
    f = attn_kernel(M, D, BT, sw)
    check(f"rs={RUN_STATE} wgmma M={M} D(K)={D} BT(N)={BT} swizzle={sw}", f, (q, k, v), ref)
  except Exception as e:
    print(f"[M={M} D={D} BT={BT} sw={sw}] TRACE FAIL {type(e).__name__}: {str(e)[:300]}")
