"""S^T = K[64, 256] @ Q^T[256, N] with the online-softmax max over axis 0, and a whole Q8_0 tile
decoded into a swizzled f16 [64, 256] SMEM tile: interpreter and lowering, on the CPU.

  python -m experiments.kernel_lab.probe_decode_tile
"""
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from experiments.kernel_lab.common import interp, lower
rng = np.random.default_rng(0)
MODE = {"interp": False}
def LOAD(ref, idx, layout, **kw):   # interpreter can't run plgpu.load / layout_cast
  return ref[idx] if MODE["interp"] else plgpu.load(ref, idx, layout=layout, **kw)
def CAST(x, layout): return x if MODE["interp"] else plgpu.layout_cast(x, layout)
R = mgpu.WGMMA_ROW_LAYOUT
ROW = plgpu.Layout.TILED(R.tiling, warp_dims=R.warp_dims, lane_dims=R.lane_dims, vector_dim=R.vector_dim)
def tr(sw, dtype=jnp.float16):
  return (plgpu.TilingTransform((8, sw // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(sw))
def run(name, build, args, ref):
  MODE["interp"] = True; out, err = interp(build(), *args)
  print(f"[{name}] INTERP", err or ("match" if np.allclose(np.asarray(out, np.float32), ref, atol=2e-2, rtol=2e-2) else "MISMATCH"))
  MODE["interp"] = False; print(f"[{name}]", lower(build(), *args))

for N, sw in ((16, 32), (32, 64), (64, 128)):
  BT, D = 64, 256
  def build():
    def body(k, qt, o, k_s, qt_s, o_s, bar):
      plgpu.copy_gmem_to_smem(k, k_s, bar); plgpu.barrier_wait(bar)
      plgpu.copy_gmem_to_smem(qt, qt_s, bar); plgpu.barrier_wait(bar)
      def mm(acc):
        plgpu.wgmma(acc, k_s, qt_s); plgpu.wgmma_wait(0); return acc[...]
      s = pl.run_scoped(mm, plgpu.ACC((BT, N), jnp.float32))
      m = jnp.max(s, axis=0)
      o_s[...] = jnp.exp(s - lax.broadcast_in_dim(m, (BT, N), (1,)))
      plgpu.commit_smem(); plgpu.copy_smem_to_gmem(o_s, o); plgpu.wait_smem_to_gmem(0)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((BT, N), jnp.float32),
        scratch_types=[plgpu.SMEM((BT, D), jnp.float16, transforms=tr(sw)),
                       plgpu.SMEM((D, N), jnp.float16, transforms=tr(sw)),
                       plgpu.SMEM((BT, N), jnp.float32), plgpu.Barrier(num_arrivals=1)])
  k = jnp.asarray(rng.normal(size=(BT, D)) * .1, jnp.float16); qt = jnp.asarray(rng.normal(size=(D, N)) * .1, jnp.float16)
  s = np.asarray(k, np.float32) @ np.asarray(qt, np.float32)
  run(f"S^T=K@Q^T M=64 K=256 N={N} swizzle={sw}, max over axis0", build, (k, qt), np.exp(s - s.max(0)))

def i8lo(x): return lax.bitcast_convert_type(((x & 0xFF) ^ 0x80) | 0x6400, jnp.float16) - jnp.float16(1152)
def i8hi(x): return lax.bitcast_convert_type(((x >> 8) ^ 0x80) | 0x6400, jnp.float16) - jnp.float16(1152)
raw = rng.integers(0, 65535, (64, 136), dtype=np.uint16)
for b in range(8): raw[:, 17*b] = np.float16(rng.uniform(.01, .1, 64)).view(np.uint16)
ref = np.zeros((64, 256), np.float32)
for b in range(8):
  qs = raw[:, 17*b+1:17*b+17]; sc = raw[:, 17*b].view(np.float16).astype(np.float32)[:, None]
  ref[:, 32*b:32*b+16] = (qs & 0xFF).astype(np.uint8).view(np.int8) * sc
  ref[:, 32*b+16:32*b+32] = (qs >> 8).astype(np.uint8).view(np.int8) * sc
KSW = 32
for variant in ("wgmma_direct", "strided_then_relayout"):
  def build():
    def body(x, o, raw_s, plain_s, k_s, bar):
      plgpu.copy_gmem_to_smem(x, raw_s, bar); plgpu.barrier_wait(bar)
      for b in range(8):
        if variant == "wgmma_direct":
          qs = LOAD(raw_s, (slice(None), pl.ds(17*b+1, 16)), plgpu.Layout.WGMMA)
          sc = lax.bitcast_convert_type(LOAD(raw_s, (slice(None), 17*b), ROW, optimized=False), jnp.float16)  # [64] row-vector layout
          scb = lax.broadcast_in_dim(sc, (64, 16), (0,))
          k_s[:, pl.ds(32*b, 16)] = i8lo(qs) * scb
          k_s[:, pl.ds(32*b+16, 16)] = i8hi(qs) * scb
        else:
          qs = raw_s[:, pl.ds(17*b+1, 16)]                        # WG_STRIDED layout
          plain_s[:, pl.ds(32*b, 16)] = i8lo(qs)
          plain_s[:, pl.ds(32*b+16, 16)] = i8hi(qs)
      if variant != "wgmma_direct":
        k_s[...] = LOAD(plain_s, (), plgpu.Layout.WGMMA, optimized=False)
      plgpu.commit_smem(); plgpu.copy_smem_to_gmem(k_s, o); plgpu.wait_smem_to_gmem(0)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 256), jnp.float16),
        scratch_types=[plgpu.SMEM((64, 136), jnp.uint16), plgpu.SMEM((64, 256), jnp.float16),
                       plgpu.SMEM((64, 256), jnp.float16, transforms=tr(KSW)), plgpu.Barrier(num_arrivals=1)])
  r = ref if variant == "wgmma_direct" else np.concatenate([np.concatenate([(raw[:, 17*b+1:17*b+17] & 0xFF).astype(np.uint8).view(np.int8), (raw[:, 17*b+1:17*b+17] >> 8).astype(np.uint8).view(np.int8)], 1) for b in range(8)], 1)
  run(f"decode Q8_0 {variant}", build, (jnp.asarray(raw),), r)
