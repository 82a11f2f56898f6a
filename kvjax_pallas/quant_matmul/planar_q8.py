"""The planar GEMV with int8 activations: x's rows quantized to int8 a block of 32 values, the
weights' integer values met by 4-way byte dot products (PTX `dp4a`), as ggml's CUDA mat-vec does.

`planar_q8_gemv(x_sk, values, scales, fmt, k, config=..., interpret=...)` computes x [S, K] @
W[N, K].T -> [S, N] float32 for S <= Q8_MAX_ROWS, W the planes' matrix (`planar.dequantize_planes`),
with x replaced by its int8 blocks: each block of 32 values b has d_b = max|x| / 127 and q_b =
round(x * 127 / max|x|) (half to even) in [-127, 127]. The kernel quantizes x itself, a step's
groups at a time, in each program (no XLA op before the call; `quantize_x` is the same arithmetic
in XLA, for the reference). The float32 sums of `planar_gemv.py` cost ~4 operations a weight value
(its decode to an exact float, then a multiply-add a row); here a 32-bit word of weights (4 or 8
values) is masked once and meets a row's 4 int8 values in one `dp4a`, exact in int32. A group's
integer sum then meets the scales once:

  q8_0  d_w * (d_b * sum q_w q_b)
  q4_0  d_w * (d_b * (sum q_w q_b - 8 * sum q_b))                          (value d_w (q - 8))
  q4_k  s * (d_b * sum q_w q_b) - o * sum_b x       per 32 values          (value s q - o, ggml's s, o)
  q6_k  (d sc) * (d_b * (sum q_w q_b - 32 * sum q_b)) per 16 values         (value d sc (q - 32))

(sum_b x: the block's float32 sum of x itself, so the offsets meet x exactly). The numbers differ
from the float32-weights product by x's rounding to 8 bits (on random matrices 5e-3 of the largest
output; code-tiny's logits 5.4e-3 of the largest, the same top-1 on 32 of 32 rows); a row's sums
never depend on the call's other rows, so a decode row and the same row among verify rows agree
bit for bit (checked on an H100, and the kernel there equals its interpretation bit for bit).

Measured (H100, 2026-12-06; docs/PERFORMANCE.md, "int8 activations"): not the bandwidth either. At
one row 0.81-1.16x the sums' time (the loads, not the operations, bound both), at four 0.57-0.88x;
with x quantized by XLA before each call instead, the GEMV alone was faster at four rows but the
27B's decode paid ~4 ms for the extra XLA ops (two or three a call), so the kernel quantizes.

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
DEFAULT_CONFIG = _gemv.PlanarGemvConfig(block_n=16, block_groups=8)   # not swept yet (the sums' best was 8 x 16)
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


def _kernel_body(x_ref, w_ref, s_ref, o_ref, *, fmt: str, tiles, rows: int, interpret: bool):
  # x_ref [S, G, group/4, 4] (x's dtype; this K range's groups: value 4m + i of a group at [m, i]),
  # w_ref [BN, G, words] int32, s_ref [BN, G] f16 (q4_k, q6_k [BN, G, words] uint32), o_ref [1, S, BN] float32
  t = tiles
  f32 = jnp.float32
  n_units = _gemv._GROUPS[fmt][0] // 16   # pylint: disable=protected-access

  def row_x(r, gs):
    """Row r's step: its units' (words [CB, 4], sum of q [CB], sum of x [CB]) and each block's d [CB]."""
    units = [x_ref[r, gs, pl.ds(4 * u, 4), :].astype(f32) for u in range(n_units)]
    out, ds = [], []
    for b in range(n_units // 2):
      inv, d = _block_scale(units[2 * b:2 * b + 2])
      ds.append(d)
      for u in units[2 * b:2 * b + 2]:
        out.append(_x_units(u, inv) + (jnp.sum(jnp.sum(u, axis=2), axis=1),))
    return out, ds

  def body(i, acc):
    g0 = pl.multiple_of(i * t.cb, t.cb)
    gs = pl.ds(g0, t.cb)
    xs = [row_x(r, gs) for r in range(rows)]
    if fmt in ("q8_0", "q4_0"):
      d = s_ref[:, gs].astype(f32)
      if fmt == "q8_0":
        ws = [(w_ref[:, gs, pl.ds(4 * u, 4)], True) for u in (0, 1)]
      else:
        wv = w_ref[:, gs, :]
        ws = [(wv & 0x0F0F0F0F, False), ((wv >> 4) & 0x0F0F0F0F, False)]
      out = []
      for a, (units, (db,)) in zip(acc, xs):
        isum = sum(_isum(w, xw, sg, interpret) for (w, sg), (xw, _, _) in zip(ws, units))
        if fmt == "q4_0":
          isum = isum - 8 * (units[0][1] + units[1][1])[None]
        out.append(a + d * (db[None] * isum.astype(f32)))
      return tuple(out)
    if fmt == "q4_k":
      halves = [w_ref[:, gs, pl.ds(4 * u, 4)] for u in (0, 1)]
      ws = [h & 0x0F0F0F0F for h in halves] + [(h >> 4) & 0x0F0F0F0F for h in halves]   # units 0-3
      s_lo, s_hi, o_lo, o_hi = _planar.k_scale_products(s_ref[:, gs, 0], s_ref[:, gs, 1],
                                                        lambda q: _gemv._exact_float(q, 0.0))   # pylint: disable=protected-access
      out = []
      for a, (units, ds) in zip(acc, xs):
        isums = [_isum(w, xw, False, interpret).astype(f32) for w, (xw, _, _) in zip(ws, units)]
        for b, (sc, off) in enumerate(((s_lo, o_lo), (s_hi, o_hi))):
          a = a + (sc * (ds[b][None] * (isums[2 * b] + isums[2 * b + 1]))
                   - off * (units[2 * b][2] + units[2 * b + 1][2])[None])
        out.append(a)
      return tuple(out)
    # q6_k: a chunk of 128 values, words 0-15 its low nibbles (ql), 16-23 its 2-bit highs (qh); part p = 2j + h
    # (unit p) is values 32j + 16h .. + 16: ql words 8 (j & 1) + 4h .. + 4, nibble j >> 1; qh words 16 + 4h .. + 4, bits 2j
    ql = [w_ref[:, gs, pl.ds(4 * m, 4)] for m in range(4)]
    qh = [w_ref[:, gs, pl.ds(16 + 4 * h, 4)] for h in (0, 1)]
    w0, w1, w2 = (s_ref[:, gs, i] for i in range(3))
    dw = lax.bitcast_convert_type((w2 & 0xFFFF).astype(jnp.uint16), jnp.float16).astype(f32)
    parts = []
    for j in range(4):
      for h in (0, 1):
        p = 2 * j + h
        qw = ((ql[2 * (j & 1) + h] >> (4 * (j >> 1))) & 0x0F0F0F0F) | (((qh[h] >> (2 * j)) & 0x03030303) << 4)
        byte = (((w0, w1)[p // 4] >> (8 * (p % 4))) & 0xFF).astype(jnp.int32)
        parts.append((qw, dw * _gemv._exact_float(byte ^ 128, 128.0)))   # pylint: disable=protected-access
    out = []
    for a, (units, ds) in zip(acc, xs):
      for p, ((qw, sc), (xw, qsum, _)) in enumerate(zip(parts, units)):
        isum = _isum(qw, xw, False, interpret) - 32 * qsum[None]
        a = a + sc * (ds[p // 2][None] * isum.astype(f32))
      out.append(a)
    return tuple(out)

  acc = lax.fori_loop(0, t.steps, body, tuple(jnp.zeros((o_ref.shape[2], t.cb), f32) for _ in range(rows)))
  for r in range(rows):
    o_ref[0, r, :] = jnp.sum(acc[r], axis=1)


@functools.partial(jax.jit, static_argnames=("fmt", "k", "cfg", "tiles", "interpret"))
def _call(x_sk, values, scales, *, fmt: str, k: int, cfg, tiles, interpret: bool):
  gv = _gemv._GROUPS[fmt][0]   # pylint: disable=protected-access
  n, s, t = values.shape[0], x_sk.shape[0], tiles
  g, gs = k // gv, k // gv // t.split
  wv = lax.bitcast_convert_type(values.reshape(n, g, _WORDS[fmt], 4), jnp.int32)   # little-endian words
  if fmt in ("q4_k", "q6_k"):
    sspec = pl.BlockSpec((t.bn, gs) + scales.shape[2:], lambda ni, si: (ni, si, 0))
  else:
    sspec = pl.BlockSpec((t.bn, gs), lambda ni, si: (ni, si))
  if _ref.compute_dtype(x_sk.dtype) != x_sk.dtype:
    x_sk = x_sk.astype(jnp.float32)
  part = pl.pallas_call(
      functools.partial(_kernel_body, fmt=fmt, tiles=t, rows=s, interpret=interpret),
      grid=(n // t.bn, t.split),
      in_specs=[pl.BlockSpec((s, gs, gv // 4, 4), lambda ni, si: (0, si, 0, 0)),
                pl.BlockSpec((t.bn, gs, _WORDS[fmt]), lambda ni, si: (ni, si, 0)), sspec],
      out_specs=pl.BlockSpec((1, s, t.bn), lambda ni, si: (si, 0, ni)),
      out_shape=jax.ShapeDtypeStruct((t.split, s, n), jnp.float32),
      compiler_params=_kernel._compiler_params(cfg, interpret),   # pylint: disable=protected-access
      interpret=interpret,
      name="kvjax_planar_q8",
  )(x_sk.reshape(s, g, gv // 4, 4), wv, scales)
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
