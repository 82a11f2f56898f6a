"""The planar GEMV with int8 activations: x's rows quantized to int8 a block of 32 values, the
weights' integer values met by 4-way byte dot products (PTX `dp4a`), as ggml's CUDA mat-vec does.

`planar_q8_gemv(x_sk, values, scales, fmt, k, config=..., interpret=...)` computes x [S, K] @
W[N, K].T -> [S, N] float32 for S <= Q8_MAX_ROWS, W the planes' matrix (`planar.dequantize_planes`),
with x replaced by its int8 blocks (`quantize_x`): each block of 32 values b has d_b = max|x| / 127
and q_b = round(x / d_b) in [-127, 127]. The float32 sums of `planar_gemv.py` cost ~4 operations a
weight value (its decode to an exact float, then a multiply-add a row); here a 32-bit word of
weights (4 or 8 values) is masked once and meets a row's 4 int8 values in one `dp4a`, exact in
int32. A group's integer sum then meets the scales once:

  q8_0  d_w * (d_b * sum q_w q_b)
  q4_0  d_w * (d_b * (sum q_w q_b - 8 * sum q_b))                          (value d_w (q - 8))
  q4_k  s * (d_b * sum q_w q_b) - o * sum_b x       per 32 values          (value s q - o, ggml's s, o)
  q6_k  (d sc) * (d_b * (sum q_w q_b - 32 * sum q_b)) per 16 values         (value d sc (q - 32))

(sum_b x: the block's float32 sum of x itself, so the offsets meet x exactly). The numbers differ
from the float32-weights product by x's rounding to 8 bits (a relative error of ~2^-8 a value,
averaging out over a row); a row's sums never depend on the call's other rows, so a decode row and
the same row among verify rows agree bit for bit, and S rows cost little more than one (a word's
mask is shared, a row adds one `dp4a` a word).

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

try:   # the Triton lowering's inline assembly (absent: the GPU path cannot lower, interpret still runs)
  from jax.experimental.pallas import triton as _pltriton
except ImportError:   # pragma: no cover
  _pltriton = None

Q8_BLOCK = 32       # x values a block (one d_b)
Q8_MAX_ROWS = 8     # rows of x a call
_WORDS = {"q8_0": 8, "q4_0": 4, "q4_k": 8, "q6_k": 24}   # 32-bit words of the values plane a group
DEFAULT_CONFIG = _gemv.PlanarGemvConfig(block_n=16, block_groups=8)


def quantize_x(x_sk):
  """x [S, K] -> (words int32 [S, K/4]: q_b's bytes in value order, little-endian; d float32 [S, K/32];
  sums of x float32 [S, K/32]; sums of q int32 [S, K/16])."""
  s, k = x_sk.shape
  xb = x_sk.astype(jnp.float32).reshape(s, k // Q8_BLOCK, Q8_BLOCK)
  amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
  d = amax / 127.0
  q = jnp.where(amax > 0, jnp.round(xb / jnp.where(amax > 0, d, 1.0)), 0.0).astype(jnp.int32)   # [-127, 127]
  b = (q & 255).reshape(s, k // 4, 4)
  words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
  return words, d[..., 0], jnp.sum(xb, axis=-1), jnp.sum(q.reshape(s, k // 16, 16), axis=-1)


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


def _kernel_body(xw_ref, xd_ref, xs_ref, xq_ref, w_ref, s_ref, o_ref, *, fmt: str, tiles, rows: int, interpret: bool):
  # xw_ref [S, G, group/4] int32, xd_ref / xs_ref [S, G, group/32] float32, xq_ref [S, G, group/16] int32
  # (this K range's groups), w_ref [BN, G, words] int32, s_ref [BN, G] f16 (q4_k, q6_k [BN, G, words] uint32),
  # o_ref [1, S, BN] float32
  t = tiles
  f32 = jnp.float32

  def body(i, acc):
    g0 = pl.multiple_of(i * t.cb, t.cb)
    gs = pl.ds(g0, t.cb)
    if fmt == "q8_0":
      wv, d = w_ref[:, gs, :], s_ref[:, gs].astype(f32)
      return tuple(a + d * (xd_ref[r, gs, 0][None] * _isum(wv, xw_ref[r, gs, :], True, interpret).astype(f32))
                   for r, a in enumerate(acc))
    if fmt == "q4_0":
      wv, d = w_ref[:, gs, :], s_ref[:, gs].astype(f32)
      lo, hi = wv & 0x0F0F0F0F, (wv >> 4) & 0x0F0F0F0F
      out = []
      for r, a in enumerate(acc):
        isum = _isum(lo, xw_ref[r, gs, pl.ds(0, 4)], False, interpret) + \
            _isum(hi, xw_ref[r, gs, pl.ds(4, 4)], False, interpret) - 8 * (xq_ref[r, gs, 0] + xq_ref[r, gs, 1])[None]
        out.append(a + d * (xd_ref[r, gs, 0][None] * isum.astype(f32)))
      return tuple(out)
    if fmt == "q4_k":
      wv = w_ref[:, gs, :]
      lo, hi = wv & 0x0F0F0F0F, (wv >> 4) & 0x0F0F0F0F
      s_lo, s_hi, o_lo, o_hi = _planar.k_scale_products(s_ref[:, gs, 0], s_ref[:, gs, 1],
                                                        lambda q: _gemv._exact_float(q, 0.0))   # pylint: disable=protected-access
      out = []
      for r, a in enumerate(acc):
        ia = _isum(lo, xw_ref[r, gs, pl.ds(0, 8)], False, interpret).astype(f32)
        ib = _isum(hi, xw_ref[r, gs, pl.ds(8, 8)], False, interpret).astype(f32)
        out.append(a + (s_lo * (xd_ref[r, gs, 0][None] * ia) - o_lo * xs_ref[r, gs, 0][None])
                   + (s_hi * (xd_ref[r, gs, 1][None] * ib) - o_hi * xs_ref[r, gs, 1][None]))
      return tuple(out)
    # q6_k: a chunk of 128 values, words 0-15 its low nibbles (ql), 16-23 its 2-bit highs (qh); part p = 2j + h
    # is values 32j + 16h .. + 16: ql words 8 (j & 1) + 4h .. + 4, nibble j >> 1; qh words 16 + 4h .. + 4, bits 2j
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
    for r, a in enumerate(acc):
      for j in range(4):
        for h in (0, 1):
          qw, sc = parts[2 * j + h]
          isum = _isum(qw, xw_ref[r, gs, pl.ds(8 * j + 4 * h, 4)], False, interpret) - 32 * xq_ref[r, gs, 2 * j + h][None]
          a = a + sc * (xd_ref[r, gs, j][None] * isum.astype(f32))
      out.append(a)
    return tuple(out)

  acc = lax.fori_loop(0, t.steps, body, tuple(jnp.zeros((o_ref.shape[2], t.cb), f32) for _ in range(rows)))
  for r in range(rows):
    o_ref[0, r, :] = jnp.sum(acc[r], axis=1)


@functools.partial(jax.jit, static_argnames=("fmt", "k", "cfg", "tiles", "interpret"))
def _call(x_sk, values, scales, *, fmt: str, k: int, cfg, tiles, interpret: bool):
  return _quantized_call(quantize_x(x_sk), values, scales, fmt=fmt, k=k, cfg=cfg, tiles=tiles, interpret=interpret)


def _quantized_call(xq8, values, scales, *, fmt: str, k: int, cfg, tiles, interpret: bool):
  """The kernel on x already quantized (`quantize_x`'s four arrays)."""
  gv = _gemv._GROUPS[fmt][0]   # pylint: disable=protected-access
  xw, xd, xs, xq = xq8
  n, s, t = values.shape[0], xw.shape[0], tiles
  g, gs = k // gv, k // gv // t.split
  wv = lax.bitcast_convert_type(values.reshape(n, g, _WORDS[fmt], 4), jnp.int32)   # little-endian words
  xspec = lambda m: pl.BlockSpec((s, gs, m), lambda ni, si: (0, si, 0))
  if fmt in ("q4_k", "q6_k"):
    sspec = pl.BlockSpec((t.bn, gs) + scales.shape[2:], lambda ni, si: (ni, si, 0))
  else:
    sspec = pl.BlockSpec((t.bn, gs), lambda ni, si: (ni, si))
  part = pl.pallas_call(
      functools.partial(_kernel_body, fmt=fmt, tiles=t, rows=s, interpret=interpret),
      grid=(n // t.bn, t.split),
      in_specs=[xspec(gv // 4), xspec(gv // 32), xspec(gv // 32), xspec(gv // 16),
                pl.BlockSpec((t.bn, gs, _WORDS[fmt]), lambda ni, si: (ni, si, 0)), sspec],
      out_specs=pl.BlockSpec((1, s, t.bn), lambda ni, si: (si, 0, ni)),
      out_shape=jax.ShapeDtypeStruct((t.split, s, n), jnp.float32),
      compiler_params=_kernel._compiler_params(cfg, interpret),   # pylint: disable=protected-access
      interpret=interpret,
      name="kvjax_planar_q8",
  )(xw.reshape(s, g, gv // 4), xd.reshape(s, g, gv // 32), xs.reshape(s, g, gv // 32), xq.reshape(s, g, gv // 16),
    wv, scales)
  return _gemv.sum_ranges(part)             # the K ranges' sums, in a fixed order


def planar_q8_gemv(x_sk, values, scales, fmt: str, k: int, *, config: Optional[_gemv.PlanarGemvConfig] = None,
                   interpret: bool = False):
  """x [S, K] (quantized to int8 blocks, `quantize_x`) @ W[N, K].T -> [S, N] float32, S <= Q8_MAX_ROWS."""
  cfg = DEFAULT_CONFIG if config is None else config
  if isinstance(cfg, _gemv.PlanarGemvConfig) and cfg.dot:
    raise ValueError(f"planar q8 GEMV: config.dot must be 0 (the dp4a products have no dot form), got {cfg.dot}")
  n, s, tiles = _gemv.checked_call("planar q8 GEMV", x_sk, values, scales, fmt, k, cfg, Q8_MAX_ROWS, interpret)
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
