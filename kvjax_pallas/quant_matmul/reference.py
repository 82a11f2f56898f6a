"""GGUF block formats in plain jnp: dequantize a weight matrix, and the reference matmul.

`dequantize(w_nb, fmt, k)` mirrors ggml-quants.c `dequantize_row_*` (and `gguf.quants`'
numpy dequantizers) bit for bit in float32: every product ggml forms (d * q, (d * sc) * q,
dmin * m) is exact in float32 (at most 11 + 8 + 6 significant bits), so the only rounding is
K-quants' final `d*sc*q - dmin*m`, the same whether or not a backend fuses it into an FMA.

Shapes: w_nb uint8 [N, row_bytes] (or its uint16 halfword view [N, row_bytes / 2]) ->
[N, K]; x_sk [S, K] -> [S, N]. Imports nothing from `kvjax`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kvjax_pallas import ggml_codec
from kvjax_pallas.quant_matmul import formats as _formats


def byte_view(w_nb):
  """uint8 [N, R] (as is) or uint16 [N, R / 2] (little-endian halfwords) -> uint8 [N, R]."""
  if w_nb.dtype == jnp.uint8:
    return w_nb
  n, nhw = w_nb.shape
  return lax.bitcast_convert_type(w_nb, jnp.uint8).reshape(n, 2 * nhw)


def halfword_view(w_nb):
  """uint8 [N, R] -> uint16 [N, R / 2] (uint16 as is). XLA may copy to make the view: keep
  weights that serve many calls as uint16 once."""
  if w_nb.dtype == jnp.uint16:
    return w_nb
  n, nbytes = w_nb.shape
  return lax.bitcast_convert_type(w_nb.reshape(n, nbytes // 2, 2), jnp.uint16)


def _f16(blk, at: int):
  """The little-endian f16 at bytes [at, at + 2) of each block [..., B] -> float32 [...]."""
  return lax.bitcast_convert_type(blk[..., at:at + 2], jnp.float16).astype(jnp.float32)


def _k_scales(sb):
  """The 12 packed bytes of Q4_K / Q5_K, int32 [..., 12] -> (scales, mins) int32 [..., 8]
  (ggml `get_scale_min_k4`: sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7; 4-7 in the
  nibbles of bytes 8-11 with their top 2 bits in bytes 0-3 / 4-7)."""
  lo, mid, hi = sb[..., 0:4], sb[..., 4:8], sb[..., 8:12]
  sc = jnp.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
  mn = jnp.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
  return sc, mn


def _q4_k(blk):  # [..., 144] u8 -> [..., 256] f32
  d, dmin = _f16(blk, 0), _f16(blk, 2)
  sc, mn = _k_scales(blk[..., 4:16].astype(jnp.int32))
  qs = blk[..., 16:144].astype(jnp.int32).reshape(*blk.shape[:-1], 4, 32)    # [.., group j, l]
  q = jnp.stack([qs & 15, qs >> 4], axis=-2).reshape(*blk.shape[:-1], 8, 32)  # sub-block 2j + t
  ds = d[..., None] * sc.astype(jnp.float32)
  dm = dmin[..., None] * mn.astype(jnp.float32)
  out = ds[..., None] * q.astype(jnp.float32) - dm[..., None]
  return out.reshape(*blk.shape[:-1], 256)


def _q5_k(blk):  # [..., 176] u8 -> [..., 256] f32
  d, dmin = _f16(blk, 0), _f16(blk, 2)
  sc, mn = _k_scales(blk[..., 4:16].astype(jnp.int32))
  qh = blk[..., 16:48].astype(jnp.int32)                                      # [.., l]
  qs = blk[..., 48:176].astype(jnp.int32).reshape(*blk.shape[:-1], 4, 32)
  ql = jnp.stack([qs & 15, qs >> 4], axis=-2).reshape(*blk.shape[:-1], 8, 32)
  hbit = (qh[..., None, :] >> jnp.arange(8, dtype=jnp.int32)[:, None]) & 1   # sub-block s: bit s
  q = ql | (hbit << 4)
  ds = d[..., None] * sc.astype(jnp.float32)
  dm = dmin[..., None] * mn.astype(jnp.float32)
  out = ds[..., None] * q.astype(jnp.float32) - dm[..., None]
  return out.reshape(*blk.shape[:-1], 256)


def _q6_k(blk):  # [..., 210] u8 -> [..., 256] f32
  lead = blk.shape[:-1]
  ql = blk[..., 0:128].astype(jnp.int32).reshape(*lead, 2, 1, 2, 32)       # [.., n, 1, a, l]
  qh = blk[..., 128:192].astype(jnp.int32).reshape(*lead, 2, 1, 1, 32)     # [.., n, 1, 1, l]
  sc = lax.bitcast_convert_type(blk[..., 192:208], jnp.int8).astype(jnp.float32)   # [.., 16]
  d = _f16(blk, 208)
  hi = jnp.arange(2, dtype=jnp.int32)[:, None, None]                        # [hi, 1, 1]
  a = jnp.arange(2, dtype=jnp.int32)[None, :, None]                         # [1, a, 1]
  low = (ql >> (4 * hi)) & 15                                               # [.., n, hi, a, l]
  high = (qh >> (2 * a + 4 * hi)) & 3
  q = ((low | (high << 4)) - 32).astype(jnp.float32)        # element 128 n + 64 hi + 32 a + l
  ds = d[..., None] * sc                                    # one scale a 16 values
  out = ds[..., None] * q.reshape(*lead, 16, 16)
  return out.reshape(*lead, 256)


_DECODERS = {"q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


def dequantize(w_nb, fmt: str, k: int, dtype=jnp.float32):
  """w_nb uint8 [N, row_bytes(fmt, k)] (or the uint16 view) -> [N, K] of `dtype` (computed in
  float32, then cast once)."""
  f = _formats.check_k(fmt, k)
  n = _formats.check_weight(w_nb, fmt, k)
  b = byte_view(w_nb)
  if fmt in ("q8_0", "q4_0"):      # the KV cache's codec: the same ggml blocks
    return ggml_codec.decode(b, fmt, jnp.float32).astype(dtype)
  blocks = b.reshape(n, k // f.block_values, f.block_bytes)
  return _DECODERS[fmt](blocks).reshape(n, k).astype(dtype)


dequantize_jit = jax.jit(dequantize, static_argnames=("fmt", "k", "dtype"))


def compute_dtype(x_dtype):
  """The dtype x and the dequantized weights meet in: bfloat16 for bfloat16 x, else float32."""
  return jnp.bfloat16 if jnp.dtype(x_dtype) == jnp.bfloat16 else jnp.float32


def dot_precision(dtype):
  """float32 operands: HIGHEST (no TF32 on GPUs); 16-bit operands: DEFAULT."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


@functools.partial(jax.jit, static_argnames=("fmt", "k"))
def quant_matmul_reference(x_sk, w_nb, fmt: str, k: int):
  """x [S, K] @ dequantize(w)[N, K].T -> [S, N] float32 (x and w in `compute_dtype(x.dtype)`,
  float32 accumulation)."""
  _formats.check_x(x_sk, k)
  dtype = compute_dtype(x_sk.dtype)
  w_nk = dequantize(w_nb, fmt, k, dtype)
  return lax.dot_general(x_sk.astype(dtype), w_nk, (((1,), (1,)), ((), ())),
                         precision=dot_precision(dtype), preferred_element_type=jnp.float32)


FUSED_MAX_ROWS = 16   # quant_matvec_fused: up to this many rows of x; more go to the dot


@functools.partial(jax.jit, static_argnames=("fmt", "k"))
def quant_matvec_fused(x_sk, w_nb, fmt: str, k: int):
  """The reference's product for few rows (decode, verify) as one multiply-and-sum instead of a
  dequantize-then-dot: the decode of the blocks is an elementwise producer of the reduction, so
  XLA can fuse it into the one pass that reads the stored bytes (a dot's operand it would write
  out dequantized first). The weights are rounded to `compute_dtype(x.dtype)` as the reference's
  (the same products), the sums float32 in XLA's reduction order. More than `FUSED_MAX_ROWS`
  rows: the reference."""
  _formats.check_x(x_sk, k)
  if x_sk.shape[0] > FUSED_MAX_ROWS:
    return quant_matmul_reference(x_sk, w_nb, fmt, k)
  w_nk, x = dequantize(w_nb, fmt, k), x_sk.astype(jnp.float32)
  if compute_dtype(x_sk.dtype) == jnp.bfloat16:   # explicit: XLA may drop a f32 -> bf16 -> f32 pair
    w_nk = lax.reduce_precision(w_nk, exponent_bits=8, mantissa_bits=7)
  return jnp.sum(w_nk[None, :, :] * x[:, None, :], axis=-1)
