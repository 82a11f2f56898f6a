"""SMEM -> registers at unaligned column offsets (17 b + 1), bit operations, the u16 -> f16 bitcast
and a scale broadcast, in the layouts Mosaic GPU offers: interpreter and lowering, on the CPU.

  python -m experiments.kernel_lab.probe_smem_loads
"""
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from experiments.kernel_lab.common import check
rng = np.random.default_rng(0)

def mk(body, R, C, out_shape, out_dtype):
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
      scratch_types=[plgpu.SMEM((R, C), jnp.uint16), plgpu.SMEM(out_shape, out_dtype), plgpu.Barrier(num_arrivals=1)])

def wrap(compute):
  def body(x, o, smem, osm, bar):
    plgpu.copy_gmem_to_smem(x, smem, bar); plgpu.barrier_wait(bar)
    osm[...] = compute(smem)
    plgpu.commit_smem(); plgpu.copy_smem_to_gmem(osm, o); plgpu.wait_smem_to_gmem(0)
  return body

def i8_to_f16_lo(x):   # x: u16 array; low byte as int8 -> f16, exact via magic number
  m = ((x & 0xFF) ^ 0x80) | 0x6400
  return lax.bitcast_convert_type(m, jnp.float16) - jnp.float16(1152)
def i8_to_f16_hi(x):
  m = ((x >> 8) ^ 0x80) | 0x6400
  return lax.bitcast_convert_type(m, jnp.float16) - jnp.float16(1152)

for R in (32, 64):
  raw = rng.integers(0, 255, (R, 136 * 2), dtype=np.uint8)
  raw16 = raw.view(np.uint16).copy()
  # make scale columns valid f16 small numbers
  for b in range(8): raw16[:, 17 * b] = np.float16(rng.uniform(0.01, 0.1, R)).view(np.uint16)
  X = jnp.asarray(raw16)
  b = 3
  qs = raw16[:, 17*b+1:17*b+17]
  lo_ref = (qs & 0xFF).astype(np.uint8).view(np.int8).astype(np.float16)
  hi_ref = (qs >> 8).astype(np.uint8).view(np.int8).astype(np.float16)
  sc = raw16[:, 17*b].view(np.float16)[:, None]

  # (a) unaligned column slice load, default (strided) layout, bit ops + bitcast
  check(f"R{R} a: slice@{17*b+1} + bitops + bitcast (default layout)",
        mk(wrap(lambda s: i8_to_f16_lo(s[:, pl.ds(17*b+1, 16)])), R, 136, (R, 16), jnp.float16), (X,), lo_ref)
  # (a2) aligned slice
  check(f"R{R} a2: aligned slice@16 (default layout)",
        mk(wrap(lambda s: s[:, pl.ds(16, 16)]), R, 136, (R, 16), jnp.uint16), (X,), raw16[:, 16:32])
  # (b) same with WGMMA layout (plgpu.load)
  check(f"R{R} b: plgpu.load WGMMA slice@{17*b+1}",
        mk(wrap(lambda s: i8_to_f16_hi(plgpu.load(s, (slice(None), pl.ds(17*b+1, 16)), layout=plgpu.Layout.WGMMA))), R, 136, (R, 16), jnp.float16), (X,), hi_ref)
  check(f"R{R} b2: plgpu.load WGMMA aligned slice@16",
        mk(wrap(lambda s: plgpu.load(s, (slice(None), pl.ds(16, 16)), layout=plgpu.Layout.WGMMA)), R, 136, (R, 16), jnp.uint16), (X,), raw16[:, 16:32])
  # (c) per-row scale broadcast [R,1] -> [R,16], default layout
  def c(s):
    q = i8_to_f16_lo(s[:, pl.ds(17*b+1, 16)])
    scale = lax.bitcast_convert_type(s[:, pl.ds(17*b, 1)], jnp.float16)
    return q * scale
  check(f"R{R} c: scale [R,1] bcast (default layout)", mk(wrap(c), R, 136, (R, 16), jnp.float16), (X,), lo_ref * sc)
  # (d) per-row scale in WGMMA layout: load q in WGMMA, scale as [R] vector via load of column then broadcast
  def d(s):
    q = i8_to_f16_lo(plgpu.load(s, (slice(None), pl.ds(17*b+1, 16)), layout=plgpu.Layout.WGMMA))
    scol = plgpu.load(s, (slice(None), 17*b))   # [R]
    scale = lax.bitcast_convert_type(scol, jnp.float16)
    return q * scale[:, None]
  check(f"R{R} d: WGMMA q * scale[:,None]", mk(wrap(d), R, 136, (R, 16), jnp.float16), (X,), lo_ref * sc)
  # (e) jnp.stack/reshape interleave lo/hi -> [R,32]
  def e(s):
    x = s[:, pl.ds(17*b+1, 16)]
    return jnp.stack([i8_to_f16_lo(x), i8_to_f16_hi(x)], axis=-1).reshape(R, 32)
  check(f"R{R} e: stack+reshape interleave", mk(wrap(e), R, 136, (R, 32), jnp.float16), (X,), np.stack([lo_ref, hi_ref], -1).reshape(R, 32))
  # (f) concatenate lo|hi -> [R,32]
  def f_(s):
    x = s[:, pl.ds(17*b+1, 16)]
    return jnp.concatenate([i8_to_f16_lo(x), i8_to_f16_hi(x)], axis=1)
  check(f"R{R} f: concatenate", mk(wrap(f_), R, 136, (R, 32), jnp.float16), (X,), np.concatenate([lo_ref, hi_ref], 1))
  # (g) int16 arithmetic shift + convert_element_type int16->f16
  def g(s):
    x = lax.bitcast_convert_type(s[:, pl.ds(17*b+1, 16)], jnp.int16)
    hi = (x >> 8).astype(jnp.float16)             # arithmetic shift, sign-extends
    lo = ((x << 8) >> 8).astype(jnp.float16)
    return hi + lo * 0
  check(f"R{R} g: int16 >>, <<, astype f16", mk(wrap(g), R, 136, (R, 16), jnp.float16), (X,), hi_ref)
