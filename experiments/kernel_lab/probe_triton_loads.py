"""Probe: how fast a Pallas (Triton) loop only reads a uint8 plane (the Q4_K values plane of the
27B's ffn_gate / ffn_down, 44.6 MB), whatever the tiles: the ceiling of the planar GEMV's loads.

Each variant sums the bytes as float32 (nothing else), one call a dispatch, 60 calls a round,
the median of 5 rounds, cycling through 4 copies (no L2 reuse):

  3d          the GEMV's own walk: [BN, K/64, 32] blocks, a [BN, CB, 32] tile a step
  2d_u8       [BN, K/2] rows, a [BN, W] tile a step
  2d_u32      the same bytes as uint32 words (a nibble each)
  2d_reshape  2d_u8 with the tile reshaped to [BN, W/32, 32] before its sums
  flat        the plane as one flat array, 64 KiB a program, W bytes a step

  python -m experiments.kernel_lab.probe_triton_loads     # GPU (CPU: one small shape, interpreted)

Measured (H100, 2026-12-06): every variant ~0.029 ms, ~1.5 TB/s (docs/log/performance-log.md).
"""
import functools, time
import numpy as np, jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
INTERP = jax.default_backend() != "gpu"

def cp(w, st):
  return None if INTERP else pltriton.CompilerParams(num_warps=w, num_stages=st)

def k3d(v_ref, o_ref, *, cb, steps):
  def body(i, acc):
    g0 = pl.multiple_of(i * cb, cb)
    return acc + jnp.sum(v_ref[:, pl.ds(g0, cb), :].astype(jnp.float32), axis=2)
  acc = lax.fori_loop(0, steps, body, jnp.zeros((v_ref.shape[0], cb), jnp.float32))
  o_ref[...] = jnp.sum(acc, axis=1)

def k2d(v_ref, o_ref, *, width, steps, mode):
  bn = v_ref.shape[0]
  def body(i, acc):
    c0 = pl.multiple_of(i * width, width)
    v = v_ref[:, pl.ds(c0, width)]
    if mode == "u32":
      f = (v & 15).astype(jnp.float32)
    elif mode == "reshape":
      return acc + jnp.sum(v.astype(jnp.float32).reshape(bn, width // 32, 32), axis=2).sum(axis=1)[:, None]
    else:
      f = v.astype(jnp.float32)
    return acc + jnp.sum(f, axis=1)[:, None]
  acc = lax.fori_loop(0, steps, body, jnp.zeros((bn, 1), jnp.float32))
  o_ref[...] = acc[:, 0]

def kflat(v_ref, o_ref, *, width, steps):
  def body(i, acc):
    c0 = pl.multiple_of(i * width, width)
    return acc + v_ref[0, pl.ds(c0, width)].astype(jnp.float32)
  acc = lax.fori_loop(0, steps, body, jnp.zeros((width,), jnp.float32))
  o_ref[0, :] = acc

def run(v, variant, bn, cw, warps, stages):
  n, kb = v.shape                     # bytes a row
  if variant == "3d":
    v3 = v.reshape(n, kb // 32, 32)
    return pl.pallas_call(functools.partial(k3d, cb=cw, steps=kb // 32 // cw), grid=(n // bn,),
        in_specs=[pl.BlockSpec((bn, kb // 32, 32), lambda i: (i, 0, 0))], out_specs=pl.BlockSpec((bn,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), compiler_params=cp(warps, stages), interpret=INTERP)(v3)
  if variant == "flat":
    total = n * kb; per = min(1 << 16, total)       # bytes a program
    vf = v.reshape(total // per, per)
    return pl.pallas_call(functools.partial(kflat, width=cw, steps=per // cw), grid=(total // per,),
        in_specs=[pl.BlockSpec((1, per), lambda i: (i, 0))], out_specs=pl.BlockSpec((1, cw), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((total // per, cw), jnp.float32), compiler_params=cp(warps, stages), interpret=INTERP)(vf)
  mode = variant.split("_")[1]
  vv = lax.bitcast_convert_type(v.reshape(n, kb // 4, 4), jnp.uint32) if mode == "u32" else v
  w = cw if mode != "u32" else cw // 4
  cols = vv.shape[1]
  return pl.pallas_call(functools.partial(k2d, width=w, steps=cols // w, mode=mode), grid=(n // bn,),
      in_specs=[pl.BlockSpec((bn, cols), lambda i: (i, 0))], out_specs=pl.BlockSpec((bn,), lambda i: (i,)),
      out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), compiler_params=cp(warps, stages), interpret=INTERP)(vv)

def tm(f, copies):
  jax.block_until_ready(f(copies[0])); r = []
  for _ in range(5):
    t = time.perf_counter(); o = [f(copies[i % len(copies)]) for i in range(60)]; jax.block_until_ready(o); r.append((time.perf_counter() - t) / 60)
  return sorted(r)[2] * 1e3

def main():
  shapes = {"ffn_gate": (17408, 2560), "ffn_down": (5120, 8704)} if not INTERP else {"small": (64, 512)}
  for name, (n, kb) in shapes.items():
    v = jnp.asarray(np.random.default_rng(0).integers(0, 256, (n, kb), dtype=np.uint8))
    copies = [v + i for i in range(4)]
    ref = np.asarray(v, np.float64).sum()
    ref_u32 = float((np.asarray(v).reshape(n, kb // 4, 4)[..., 0] & 15).sum())   # a nibble a word
    cfgs = [("3d", 8, 8, 4, 2), ("3d", 8, 8, 4, 3)]
    for var in ("2d_u8", "2d_u32", "2d_reshape"):
      cfgs += [(var, bn, cw, w, st) for bn, cw, w, st in [(8, 256, 4, 3), (8, 512, 4, 3), (4, 512, 4, 3), (16, 256, 4, 3), (16, 512, 8, 3), (2, 1024, 4, 3), (8, 1024, 8, 4)]]
    cfgs += [("flat", 0, cw, w, st) for cw, w, st in [(1024, 4, 3), (2048, 4, 3), (4096, 8, 3), (8192, 8, 4)]]
    for var, bn, cw, w, st in cfgs:
      if INTERP and cw > (1024 if var == "flat" else 256): continue
      if var != "flat" and (kb % cw or n % max(bn, 1)): continue
      fn = jax.jit(functools.partial(run, variant=var, bn=bn, cw=cw, warps=w, stages=st))
      try:
        want = ref_u32 if var == "2d_u32" else ref
        out = np.asarray(fn(v)); ok = abs(out.astype(np.float64).sum() - want) / want < 1e-4
        ms = tm(fn, copies)
        print(f"{name} {var:10} bn{bn:<3} w{cw:<5} warps{w} st{st} {ms:.4f} ms {n*kb/ms/1e9:6.3f} TB/s ok={ok}", flush=True)
      except Exception as e:
        print(f"{name} {var} {bn} {cw} {w} {st} ERROR {str(e).splitlines()[0][:160]}", flush=True)


if __name__ == "__main__":
  import sys
  if len(sys.argv) > 1:
    sys.exit(f"probe_triton_loads: takes no arguments, got {' '.join(sys.argv[1:])!r}")
  main()
