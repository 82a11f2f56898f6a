"""The planar GEMV with int8 activations: x's rows quantized to int8 a block of 32 values, the
weights' integer values met by 4-way byte dot products (PTX `dp4a`), as ggml's CUDA mat-vec does.

`planar_q8_gemv(x_sk, values, scales, fmt, k, config=..., interpret=...)` computes x [S, K] @
W[N, K].T -> [S, N] float32 for S <= Q8_MAX_ROWS, W the planes' matrix (`planar.dequantize_planes`),
with x replaced by its int8 blocks: each block of 32 values b has d_b = max|x| / 127 and q_b =
round(x * 127 / max|x|) (half to even) in [-127, 127]. Who makes the blocks (`x_blocks` of the
config): 1 (the default) a small Pallas kernel, `quantize_x_blocks`, once a call, before the GEMV
(one launch, ~1.4 us on an H100: XLA's 2-3 ops a call had cost ~15 us); 0 each program of the
GEMV, a step's groups at a time (each row's x quantized again for every 16 columns: four rows
cost 2.2x one). Both run the same arithmetic, so they give the same bits (checked on an H100 for
q8_0, q4_0 and q4_k); `quantize_x` is that arithmetic in XLA, for the reference.

The float32 sums of `planar_gemv.py` cost ~4 operations a weight value (its decode to an exact
float, then a multiply-add a row); here a 32-bit word of weights (4 or 8 values) is masked once
and meets a row's 4 int8 values in one `dp4a`, exact in int32. A group's integer sum then meets
the scales once:

  q8_0  d_w * (d_b * sum q_w q_b)
  q4_0  d_w * (d_b * (sum q_w q_b - 8 * sum q_b))                          (value d_w (q - 8))
  q4_k  s * (d_b * sum q_w q_b) - o * sum_b x       per 32 values          (value s q - o, ggml's s, o)
  q6_k  (d sc) * (d_b * (sum q_w q_b - 32 * sum q_b)) per 16 values         (value d sc (q - 32))

(sum_b x: the block's float32 sum of x itself, so the offsets meet x exactly). The numbers differ
from the float32-weights product by x's rounding to 8 bits (on random matrices 5e-3 of the largest
output; code-tiny's logits 5.4e-3 of the largest, the same top-1 on 32 of 32 rows); a row's sums
never depend on the call's other rows, so a decode row and the same row among verify rows agree
bit for bit (checked on an H100, and the kernel there equals its interpretation bit for bit).

Measured (H100, 2026-12-06; docs/PERFORMANCE.md, "int8 activations"): not the bandwidth. Blocks
made first against blocks made by each program, one card: the one-row GEMV 0.87-1.10x the time,
four rows 0.77-0.82x; the 27B's plain decoding at 32K 54.7 -> 66.0 tok/s, speculation 64.6 ->
77.9. Under ncu (blocks made by each program, one row) half of the stall cycles are shared memory
and barriers (the kernel's layout changes and cross-thread sums), DRAM 53% busy. The default
since: 32 columns a program with `prefetch=1` (a step's loads issued one step ahead): the four-row
GEMV 0.61-0.82x again, and end to end on one H100 speculation at 32K 79.8 -> 93.2 tok/s.

GPU lowering: Pallas Triton with `dp4a` as inline PTX; `interpret=True` runs the same integer
arithmetic in XLA (the tests on the CPU). Imports nothing from `kvjax`.

Shapes: x_sk [S, K] floating; values, scales as `planar.plane_shapes`; out [S, N] float32.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax_pallas.quant_matmul import kernel as _kernel
from kvjax_pallas.quant_matmul import planar as _planar
from kvjax_pallas.quant_matmul import planar_gemv as _gemv
from kvjax_pallas.quant_matmul import reference as _ref

try:   # the Triton lowering's inline assembly (absent: the GPU path cannot lower, interpret still runs)
  from jax.experimental.pallas import triton as _pltriton
except ImportError:   # pragma: no cover
  _pltriton = None

Q8_BLOCK = 32       # x values a block (one d_b)
Q8_MAX_ROWS = 8     # rows of x a call
_WORDS = {"q8_0": 8, "q4_0": 4, "q4_k": 8, "q6_k": 24}   # 32-bit words of the values plane a group
# x's blocks made first by their own kernel, 32 columns a program, a loop step's loads issued one step
# ahead (measured end to end on one H100, 2026-12-06: speculation at 32K 79.8 -> 93.2 tok/s, plain
# 74.4 -> 77.1 against 16 columns without prefetch: docs/PERFORMANCE.md, "int8 activations")
DEFAULT_CONFIG = _gemv.PlanarGemvConfig(block_n=32, block_groups=8, x_blocks=1, prefetch=1)
NARROW_CONFIG = _gemv.PlanarGemvConfig(block_n=16, block_groups=8, x_blocks=1)   # the previous default
IN_KERNEL_CONFIG = _gemv.PlanarGemvConfig(block_n=16, block_groups=8)   # the first form: each program quantizes x
                                                                        # (NARROW's tiles: the same bits)
_ROUND = 12582912.0   # 1.5 * 2^23: x + _ROUND rounds x (|x| < 2^22) to an integer, its low bits that integer's


def _x_units(xu, inv):
  """A row's 16-value units of x, float32 [CB, 4, 4] (value 4m + i at [m, i]), and its block's
  127 / max|x| [CB] -> (int8 words int32 [CB, 4]: word m the bytes of q at 4m .. 4m + 3, little-endian;
  sum of q int32 [CB]). q = round(x * inv), half to even, in [-127, 127]."""
  bits = lax.bitcast_convert_type(xu * inv[:, None, None] + _ROUND, jnp.int32)   # 0x4B400000 + q
  shift = 8 * lax.broadcasted_iota(jnp.int32, xu.shape, 2)
  words = jnp.sum((bits & 255) << shift, axis=2)                                  # disjoint bytes: a sum is an or
  return words, jnp.sum(jnp.sum((bits << 24) >> 24, axis=2), axis=1)


def _block_scale(units):
  """A block's two units [CB, 4, 4] float32 -> (127 / max|x| (0 where x is 0), d = max|x| / 127) [CB]."""
  amax = jnp.maximum(*(jnp.max(jnp.max(jnp.abs(u), axis=2), axis=1) for u in units))
  return jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0), amax / 127.0


def quantize_x(x_sk):
  """x [S, K] -> its int8 blocks as the kernel makes them: (words int32 [S, K/4]: q's bytes in value
  order, little-endian; d float32 [S, K/32]; sums of x float32 [S, K/32]; sums of q int32 [S, K/16])."""
  s, k = x_sk.shape
  xb = x_sk.astype(jnp.float32).reshape(s * k // Q8_BLOCK, 2, 4, 4)
  inv, d = _block_scale((xb[:, 0], xb[:, 1]))
  parts = [_x_units(xb[:, h], inv) for h in (0, 1)]
  words = jnp.stack([w for w, _ in parts], 1).reshape(s, k // 4)
  qsums = jnp.stack([q for _, q in parts], 1).reshape(s, k // 16)
  return words, d.reshape(s, k // 32), jnp.sum(xb.reshape(s, k // 32, 32), axis=-1), qsums


def _dp4a(a, b, signed_a: bool, interpret: bool):
  """sum over the 4 bytes of int32 a and b of a_i * b_i, int32; b's bytes signed, a's as `signed_a`."""
  if not interpret:
    asm = f"dp4a.{'s32' if signed_a else 'u32'}.s32 $0, $1, $2, $3;"
    return _pltriton.elementwise_inline_asm(asm, args=[a, b, jnp.zeros_like(a)], constraints="=r,r,r,r", pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])[0]
  out = None
  for i in range(4):
    ai = (a << (24 - 8 * i)) >> 24 if signed_a else (a >> (8 * i)) & 255
    t = ai * ((b << (24 - 8 * i)) >> 24)
    out = t if out is None else out + t
  return out


def _isum(w, xw, signed_w: bool, interpret: bool):
  """int32 words w [BN, CB, M] against a row's words xw [CB, M] -> int32 [BN, CB]."""
  return jnp.sum(_dp4a(w, jnp.broadcast_to(xw[None], w.shape), signed_w, interpret), axis=2)


def _weight_loads(fmt: str, w_ref, s_ref, gs):
  """A loop step's loads of the values plane's words and the scale plane's columns, as `_step_sums`
  takes them."""
  if fmt == "q8_0":
    return tuple(w_ref[:, gs, pl.ds(4 * u, 4)] for u in (0, 1)), (s_ref[:, gs],)
  if fmt == "q4_0":
    return (w_ref[:, gs, :],), (s_ref[:, gs],)
  if fmt == "q4_k":
    return tuple(w_ref[:, gs, pl.ds(4 * u, 4)] for u in (0, 1)), (s_ref[:, gs, 0], s_ref[:, gs, 1])
  # q6_k: words 0-15 a chunk's low nibbles (ql), 16-23 its 2-bit highs (qh)
  return (tuple(w_ref[:, gs, pl.ds(4 * m, 4)] for m in range(4))
          + tuple(w_ref[:, gs, pl.ds(16 + 4 * h, 4)] for h in (0, 1)),
          tuple(s_ref[:, gs, i] for i in range(3)))


def _row_x(units_raw, n_units: int):
  """A row's step (its units [CB, 4, 4] in x's dtype) -> its units' (words [CB, 4], sum of q [CB],
  sum of x [CB]) and each block's d [CB]."""
  units = [u.astype(jnp.float32) for u in units_raw]
  out, ds = [], []
  for b in range(n_units // 2):
    inv, d = _block_scale(units[2 * b:2 * b + 2])
    ds.append(d)
    for u in units[2 * b:2 * b + 2]:
      out.append(_x_units(u, inv) + (jnp.sum(jnp.sum(u, axis=2), axis=1),))
  return out, ds


def _step_sums(fmt: str, loaded, acc, interpret: bool):
  """One loop step: (x's blocks a row: (a unit's (words [CB, 4], sum of q [CB], sum of x [CB]) each,
  a block's d [CB] each), the weights' loads of `_weight_loads`) -> acc (a row's sums [BN, CB]
  float32, a tuple) + the step's."""
  f32 = jnp.float32
  xs, (wl, sl) = loaded
  if fmt in ("q8_0", "q4_0"):
    d = sl[0].astype(f32)
    if fmt == "q8_0":
      ws = [(w, True) for w in wl]
    else:
      ws = [(wl[0] & 0x0F0F0F0F, False), ((wl[0] >> 4) & 0x0F0F0F0F, False)]
    out = []
    for a, (units, (db,)) in zip(acc, xs):
      isum = sum(_isum(w, xw, sg, interpret) for (w, sg), (xw, _, _) in zip(ws, units))
      if fmt == "q4_0":
        isum = isum - 8 * (units[0][1] + units[1][1])[None]
      out.append(a + d * (db[None] * isum.astype(f32)))
    return tuple(out)
  if fmt == "q4_k":
    ws = [h & 0x0F0F0F0F for h in wl] + [(h >> 4) & 0x0F0F0F0F for h in wl]   # units 0-3
    s_lo, s_hi, o_lo, o_hi = _planar.k_scale_products(sl[0], sl[1],
                                                      lambda q: _gemv._exact_float(q, 0.0))   # pylint: disable=protected-access
    out = []
    for a, (units, ds) in zip(acc, xs):
      isums = [_isum(w, xw, False, interpret).astype(f32) for w, (xw, _, _) in zip(ws, units)]
      for b, (sc, off) in enumerate(((s_lo, o_lo), (s_hi, o_hi))):
        a = a + (sc * (ds[b][None] * (isums[2 * b] + isums[2 * b + 1]))
                 - off * (units[2 * b][2] + units[2 * b + 1][2])[None])
      out.append(a)
    return tuple(out)
  # q6_k: part p = 2j + h (unit p) is values 32j + 16h .. + 16: ql words 8 (j & 1) + 4h .. + 4,
  # nibble j >> 1; qh words 16 + 4h .. + 4, bits 2j
  ql, qh = wl[:4], wl[4:]
  scales = _gemv.q6_scales(sl)
  parts = []
  for j in range(4):
    for h in (0, 1):
      qw = ((ql[2 * (j & 1) + h] >> (4 * (j >> 1))) & 0x0F0F0F0F) | (((qh[h] >> (2 * j)) & 0x03030303) << 4)
      parts.append((qw, scales[2 * j + h]))
  out = []
  for a, (units, ds) in zip(acc, xs):
    for p, ((qw, sc), (xw, qsum, _)) in enumerate(zip(parts, units)):
      isum = _isum(qw, xw, False, interpret) - 32 * qsum[None]
      a = a + sc * (ds[p // 2][None] * isum.astype(f32))
    out.append(a)
  return tuple(out)


def _run_steps(loads, step_sums, o_ref, tiles, rows: int, prefetch: bool):
  """The K loop of a program (`planar_gemv.run_steps`), then a row's sums to o_ref."""
  acc0 = tuple(jnp.zeros((o_ref.shape[2], tiles.cb), jnp.float32) for _ in range(rows))
  acc = _gemv.run_steps(loads, step_sums, acc0, tiles.steps, prefetch)
  for r in range(rows):
    o_ref[0, r, :] = jnp.sum(acc[r], axis=1)


def _kernel_body(x_ref, w_ref, s_ref, o_ref, *, fmt: str, tiles, rows: int, prefetch: bool, interpret: bool):
  # x_ref [S, G, group/4, 4] (x's dtype; this K range's groups: value 4m + i of a group at [m, i]),
  # w_ref [BN, G, words] int32, s_ref [BN, G] f16 (q4_k, q6_k [BN, G, words] uint32), o_ref [1, S, BN] float32
  n_units = _gemv._GROUPS[fmt][0] // 16   # pylint: disable=protected-access

  def loads(i):
    gs = pl.ds(_gemv.step_start(i, tiles.cb), tiles.cb)
    x = tuple(tuple(x_ref[r, gs, pl.ds(4 * u, 4), :] for u in range(n_units)) for r in range(rows))
    return x, _weight_loads(fmt, w_ref, s_ref, gs)

  def step_sums(loaded, acc):    # each row's x quantized here, then the sums
    x, wl = loaded
    return _step_sums(fmt, ([_row_x(units, n_units) for units in x], wl), acc, interpret)

  _run_steps(loads, step_sums, o_ref, tiles, rows, prefetch)


def _blocks_kernel_body(xw_ref, xd_ref, xs_ref, xq_ref, w_ref, s_ref, o_ref, *, fmt: str, tiles, rows: int,
                        prefetch: bool, interpret: bool):
  # x's blocks (`quantize_x_blocks`, this K range's groups): xw_ref [S, G, group/4] int32, xd_ref
  # [S, G, group/32] float32, xs_ref [S, G, group/16] float32, xq_ref [S, G, group/16] int32;
  # w_ref, s_ref, o_ref as `_kernel_body`'s
  n_units = _gemv._GROUPS[fmt][0] // 16   # pylint: disable=protected-access

  def loads(i):
    gs = pl.ds(_gemv.step_start(i, tiles.cb), tiles.cb)
    x = tuple(([(xw_ref[r, gs, pl.ds(4 * u, 4)], xq_ref[r, gs, u], xs_ref[r, gs, u]) for u in range(n_units)],
               [xd_ref[r, gs, b] for b in range(n_units // 2)]) for r in range(rows))
    return x, _weight_loads(fmt, w_ref, s_ref, gs)

  _run_steps(loads, lambda loaded, acc: _step_sums(fmt, loaded, acc, interpret), o_ref, tiles, rows, prefetch)


def write_blocks(units, w_ref, d_ref, xs_ref, xq_ref):
  """A program's blocks of x from its two 16-value units [B, 4, 4] float32 (value 16h + 4m + i of a
  block at units[h][:, m, i]): w_ref [1, B, 2, 4] int32 (a unit's words), d_ref [1, B] float32,
  xs_ref / xq_ref [1, B, 2] (a unit's sums of x / q). The kernels that make x first end here too
  (`prologue`)."""
  inv, d = _block_scale(units)
  d_ref[0, :] = d
  for h, u in enumerate(units):
    words, qsum = _x_units(u, inv)
    w_ref[0, :, h, :] = words
    xq_ref[0, :, h] = qsum
    xs_ref[0, :, h] = jnp.sum(jnp.sum(u, axis=2), axis=1)


def _quantize_kernel(x_ref, w_ref, d_ref, xs_ref, xq_ref):
  # x_ref [1, B, 8, 4] (x's dtype: B blocks of 32 values, value 4m + i at [m, i]); the rest `write_blocks`'
  write_blocks([x_ref[0, :, pl.ds(4 * h, 4), :].astype(jnp.float32) for h in (0, 1)], w_ref, d_ref, xs_ref, xq_ref)


@functools.partial(jax.jit, static_argnames=("interpret",))
def quantize_x_blocks(x_sk, *, interpret: bool = False):
  """x [S, K] -> its int8 blocks by a Pallas kernel (the arithmetic of `quantize_x`, a unit of 16
  values' sums apart): (words int32 [S, K/4], d float32 [S, K/32], sums of x float32 [S, K/16], sums
  of q int32 [S, K/16])."""
  s, k = x_sk.shape
  nb = k // Q8_BLOCK
  per = _kernel._pow2_divisor(nb, 32)   # pylint: disable=protected-access   # blocks a program
  if _ref.compute_dtype(x_sk.dtype) != x_sk.dtype:
    x_sk = x_sk.astype(jnp.float32)
  return blocks_call(_quantize_kernel, [pl.BlockSpec((1, per, 8, 4), lambda r, j: (r, j, 0, 0))], s, k, per,
                     "kvjax_quantize_x", interpret)(x_sk.reshape(s, nb, 8, 4))


def blocks_call(body, in_specs, s: int, k: int, per: int, name: str, interpret: bool):
  """The pallas_call of a kernel that ends in `write_blocks`: grid (rows, blocks / per) -> a function
  of its inputs returning x's blocks as `quantize_x_blocks` does."""
  nb = k // Q8_BLOCK
  spec3 = pl.BlockSpec((1, per, 2), lambda r, j: (r, j, 0))
  call = pl.pallas_call(
      body,
      grid=(s, nb // per),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((1, per, 2, 4), lambda r, j: (r, j, 0, 0)), pl.BlockSpec((1, per), lambda r, j: (r, j)),
                 spec3, spec3],
      out_shape=[jax.ShapeDtypeStruct((s, nb, 2, 4), jnp.int32), jax.ShapeDtypeStruct((s, nb), jnp.float32),
                 jax.ShapeDtypeStruct((s, nb, 2), jnp.float32), jax.ShapeDtypeStruct((s, nb, 2), jnp.int32)],
      compiler_params=_kernel._compiler_params(_gemv.PlanarGemvConfig(), interpret),   # pylint: disable=protected-access
      interpret=interpret,
      name=name,
  )

  def run(*args):
    words, d, xs, xq = call(*args)
    return words.reshape(s, k // 4), d, xs.reshape(s, k // 16), xq.reshape(s, k // 16)
  return run


@functools.partial(jax.jit, static_argnames=("fmt", "k", "cfg", "tiles", "interpret"))
def _call(x_sk, values, scales, *, fmt: str, k: int, cfg, tiles, interpret: bool):
  # x_sk: x [S, K], or (x_blocks configs) its blocks as `quantize_x_blocks` returns them
  gv = _gemv._GROUPS[fmt][0]   # pylint: disable=protected-access
  n, s, t = values.shape[0], (x_sk[1] if isinstance(x_sk, tuple) else x_sk).shape[0], tiles
  g, gs = k // gv, k // gv // t.split
  wv = lax.bitcast_convert_type(values.reshape(n, g, _WORDS[fmt], 4), jnp.int32)   # little-endian words
  if fmt in ("q4_k", "q6_k"):
    sspec = pl.BlockSpec((t.bn, gs) + scales.shape[2:], lambda ni, si: (ni, si, 0))
  else:
    sspec = pl.BlockSpec((t.bn, gs), lambda ni, si: (ni, si))
  wspecs = [pl.BlockSpec((t.bn, gs, _WORDS[fmt]), lambda ni, si: (ni, si, 0)), sspec]
  kw = dict(fmt=fmt, tiles=t, rows=s, prefetch=bool(cfg.prefetch), interpret=interpret)
  if cfg.x_blocks:          # x's blocks made once, by their own kernel, before the GEMV
    xw, xd, xs, xq = x_sk if isinstance(x_sk, tuple) else quantize_x_blocks(x_sk, interpret=interpret)
    xspec = lambda m: pl.BlockSpec((s, gs, m), lambda ni, si: (0, si, 0))
    body = functools.partial(_blocks_kernel_body, **kw)
    in_specs = [xspec(gv // 4), xspec(gv // 32), xspec(gv // 16), xspec(gv // 16)] + wspecs
    args = (xw.reshape(s, g, gv // 4), xd.reshape(s, g, gv // 32), xs.reshape(s, g, gv // 16),
            xq.reshape(s, g, gv // 16))
  else:                     # each program quantizes x's rows itself
    if _ref.compute_dtype(x_sk.dtype) != x_sk.dtype:
      x_sk = x_sk.astype(jnp.float32)
    body = functools.partial(_kernel_body, **kw)
    in_specs = [pl.BlockSpec((s, gs, gv // 4, 4), lambda ni, si: (0, si, 0, 0))] + wspecs
    args = (x_sk.reshape(s, g, gv // 4, 4),)
  part = pl.pallas_call(
      body,
      grid=(n // t.bn, t.split),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((1, s, t.bn), lambda ni, si: (si, 0, ni)),
      out_shape=jax.ShapeDtypeStruct((t.split, s, n), jnp.float32),
      compiler_params=_kernel._compiler_params(cfg, interpret),   # pylint: disable=protected-access
      interpret=interpret,
      name="kvjax_planar_q8",
  )(*args, wv, scales)
  return _gemv.sum_ranges(part)             # the K ranges' sums, in a fixed order


def planar_q8_gemv(x_sk, values, scales, fmt: str, k: int, *, config: Optional[_gemv.PlanarGemvConfig] = None,
                   interpret: bool = False):
  """x [S, K] (quantized to int8 blocks, `quantize_x`) @ W[N, K].T -> [S, N] float32, S <= Q8_MAX_ROWS."""
  cfg = DEFAULT_CONFIG if config is None else config
  if isinstance(cfg, _gemv.PlanarGemvConfig) and cfg.dot:
    raise ValueError(f"planar q8 GEMV: config.dot must be 0 (the dp4a products have no dot form), got {cfg.dot}")
  n, s, tiles = _gemv.checked_call("planar q8 GEMV", x_sk, values, scales, fmt, k, cfg, lambda n: Q8_MAX_ROWS,
                                    interpret)
  if n == 0:
    return jnp.zeros((s, 0), jnp.float32)
  return _call(x_sk, values, scales, fmt=fmt, k=k, cfg=cfg, tiles=tiles, interpret=interpret)


def planar_q8_reference(x_sk, values, scales, fmt: str, k: int):
  """The same product in plain jnp (float32, its own order of sums): x's int8 blocks dequantized
  (d_b * q_b) against the planes' float32 weights; q4_k's offsets against x itself."""
  s, f32 = x_sk.shape[0], jnp.float32
  xw, xd, _, _ = quantize_x(x_sk)
  b = jnp.stack([(xw << (24 - 8 * i)) >> 24 for i in range(4)], -1).reshape(s, k // Q8_BLOCK, Q8_BLOCK)
  xdq = b.astype(f32) * xd[..., None]                                          # [S, K/32, 32]
  hi = lax.Precision.HIGHEST
  if fmt != "q4_k":
    return jnp.einsum("sk,nk->sn", xdq.reshape(s, k), _planar.dequantize_planes(values, scales, fmt, k), precision=hi)
  n, c = values.shape[:2]
  lo_q, hi_q = _planar._nibbles(values)                                        # pylint: disable=protected-access
  s_lo, s_hi, o_lo, o_hi = _planar._k_scales_of(scales)                        # pylint: disable=protected-access
  xq = xdq.reshape(s, c, 2, 32)
  xs = jnp.sum(x_sk.astype(f32).reshape(s, c, 2, 32), -1)                     # [S, C, 2]
  t = (jnp.einsum("ncl,scl->snc", lo_q, xq[:, :, 0], precision=hi) * s_lo[None] - o_lo[None] * xs[:, None, :, 0]
       + jnp.einsum("ncl,scl->snc", hi_q, xq[:, :, 1], precision=hi) * s_hi[None] - o_hi[None] * xs[:, None, :, 1])
  return jnp.sum(t, -1)
