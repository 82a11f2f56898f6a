"""GGUF weight blocks repacked into planes at load, read by XLA's own fused reductions.

A ggml row interleaves each block's scales with its quantized values. Repacked once at load (on the device),
the values become one plane and the scales another, so that XLA's reduction for a decode row
(x [1, K] against W [N, K]) reads the plane at close to the bytes' speed with no Pallas kernel
(`experiments/kernel_lab/probe_planar_gemv.py`: on an H100 Q4_K planes at 0.95-1.27 TB/s, faster
than the bf16 dot on the 27B's FFN matrices, where a decode of ggml's rows inside the same
reduction ran at 0.28-0.45 TB/s).

Planes (`to_planes`, made on the device at load), per format (values a row K, N rows):

  q8_0  values int8 [N, K] (value order); d float16 [N, K/32]           value = d * q
  q4_0  nibbles uint8 [N, K/32, 16] (byte j: value j low, j + 16 high); d float16 [N, K/32]
                                                                        value = d * (q - 8)
  q4_k  nibbles uint8 [N, K/64, 32] (byte l of chunk c: value 64c + l low, 64c + 32 + l high);
        s, o float32 [N, 2, K/32] (s = d * sc, o = dmin * m of each 32 values, ggml's products)
                                                                        value = s * q - o

The planes hold the same numbers as the blocks: `dequantize_planes` equals
`reference.dequantize` of the ggml rows bit for bit (the same float32 products). Bytes against
ggml's: q8_0 and q4_0 the same; q4_k 6 bits a value against 4.5 (its scale products need float32).

The product (`planar_matmul`): up to `REDUCE_ROWS` rows of x as one multiply-and-sum over the
planes in float32 (the row's sums in XLA's order; for bfloat16 x the weights rounded to bfloat16
first, the dot's products); more rows dequantize the planes to
`reference.compute_dtype(x.dtype)` and run the reference's dot (the "xla" product's bits).

Shapes: x_sk [S, K] -> [S, N] float32. Imports nothing from `kvjax`.
"""

from __future__ import annotations

import functools
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax_pallas.quant_matmul import formats as _formats
from kvjax_pallas.quant_matmul import reference as _ref

PLANAR_FORMATS = ("q8_0", "q4_0", "q4_k")
REDUCE_ROWS = 1   # rows of x the multiply-and-sum takes; more: dequantize, then the dot


def _check(fmt: str, k: int) -> None:
  if fmt not in PLANAR_FORMATS:
    raise ValueError(f"planar weights: format {fmt!r} is not repacked (planar formats: {', '.join(PLANAR_FORMATS)})")
  if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
    raise ValueError(f"planar weights: k (values a row) must be an int, got {k!r}")
  _formats.check_k(fmt, k)


def plane_shapes(fmt: str, n: int, k: int):
  """-> ((values shape, dtype), (scales shape, dtype)) of an [N, K] matrix's planes."""
  _check(fmt, k)
  if fmt == "q8_0":
    return ((n, k), jnp.int8), ((n, k // 32), jnp.float16)
  if fmt == "q4_0":
    return ((n, k // 32, 16), jnp.uint8), ((n, k // 32), jnp.float16)
  return ((n, k // 64, 32), jnp.uint8), ((n, 2, k // 32), jnp.float32)


def check_planes(values, scales, fmt: str, k: int) -> int:
  """One-line ValueErrors unless `values` and `scales` are the planes of a `fmt` matrix of rows of
  `k` values (`to_planes`'s). Returns N."""
  _check(fmt, k)
  for name, a in (("values", values), ("scales", scales)):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
      raise ValueError(f"planar weights: {name} must be an array (to_planes'), got {type(a).__name__}")
  n = values.shape[0] if len(values.shape) else 0
  for name, a, (shape, dtype) in zip(("values", "scales"), (values, scales), plane_shapes(fmt, n, k)):
    if tuple(a.shape) != shape or jnp.dtype(a.dtype) != jnp.dtype(dtype):
      raise ValueError(f"planar weights: {fmt} {name} for rows of {k} values must be {jnp.dtype(dtype).name} "
                       f"{list(shape)}, got {jnp.dtype(a.dtype).name} {list(a.shape)}")
  return n


def to_planes(w_nb, fmt: str, k: int) -> Tuple[jax.Array, jax.Array]:
  """ggml rows uint8 [N, row_bytes(fmt, k)] or their uint16 view (numpy or jax) -> (values, scales), the planes,
  made on the default device (one jitted program a format and shape)."""
  _check(fmt, k)
  if getattr(w_nb, "dtype", None) == np.uint16 and len(w_nb.shape) == 2:   # the halfword view quant_matmul takes
    w_nb = _ref.byte_view(jnp.asarray(w_nb))
  if getattr(w_nb, "dtype", None) != np.uint8 or len(w_nb.shape) != 2 or w_nb.shape[1] != _formats.row_bytes(fmt, k):
    raise ValueError(f"planar weights: {fmt} rows of {k} values need uint8 [N, {_formats.row_bytes(fmt, k)}], "
                     f"got {getattr(w_nb, 'dtype', type(w_nb).__name__)} {tuple(np.shape(w_nb))}")
  return _to_planes(jnp.asarray(w_nb), fmt, k)


@functools.partial(jax.jit, static_argnames=("fmt", "k"))
def _to_planes(w_nb, fmt: str, k: int):
  f = _formats.FORMATS[fmt]
  n = w_nb.shape[0]
  blk = w_nb.reshape(n, k // f.block_values, f.block_bytes)
  d = lax.bitcast_convert_type(blk[..., 0:2], jnp.float16)                 # [N, blocks]
  if fmt == "q8_0":
    return lax.bitcast_convert_type(blk[..., 2:], jnp.int8).reshape(n, k), d
  if fmt == "q4_0":
    return blk[..., 2:], d
  dmin = lax.bitcast_convert_type(blk[..., 2:4], jnp.float16).astype(jnp.float32)
  sc, mn = _ref._k_scales(blk[..., 4:16].astype(jnp.int32))                  # [N, K/256, 8]
  so = jnp.stack([d.astype(jnp.float32)[..., None] * sc.astype(jnp.float32),
                  dmin[..., None] * mn.astype(jnp.float32)], axis=1)          # [N, 2, K/256, 8]
  return blk[..., 16:].reshape(n, k // 64, 32), so.reshape(n, 2, k // 32)


def _nibbles(p):
  return (p & 15).astype(jnp.float32), (p >> 4).astype(jnp.float32)


def dequantize_planes(values, scales, fmt: str, k: int, dtype=jnp.float32):
  """The planes -> [N, K] of `dtype` (float32 values, cast once): ggml's dequantization."""
  n = check_planes(values, scales, fmt, k)
  if fmt == "q8_0":
    out = values.astype(jnp.float32).reshape(n, k // 32, 32) * scales.astype(jnp.float32)[..., None]
  elif fmt == "q4_0":
    lo, hi = _nibbles(values)                                               # [N, K/32, 16]
    out = jnp.concatenate([lo - 8.0, hi - 8.0], axis=-1) * scales.astype(jnp.float32)[..., None]
  else:
    lo, hi = _nibbles(values)                                               # [N, K/64, 32]
    sc, off = (scales[:, i].reshape(n, k // 64, 2, 1) for i in (0, 1))      # [N, chunk, half, 1]
    out = jnp.stack([lo, hi], axis=2) * sc - off                            # [N, chunk, half, 32]
  return out.reshape(n, k).astype(dtype)


def _reduce(x_sk, values, scales, fmt: str, k: int):
  """sum_k W[n, k] x[s, k] as one multiply-and-sum over the planes, float32. bfloat16 x: the
  weights rounded to bfloat16 first, the products of the dequantize-then-dot (its bits up to the
  order of the sums: a decode row then agrees with the verify rows' dot as float32 x does)."""
  s, n, f32 = x_sk.shape[0], values.shape[0], jnp.float32
  x = x_sk.astype(f32)
  if _ref.compute_dtype(x_sk.dtype) == jnp.bfloat16:   # explicit: XLA may drop a f32 -> bf16 -> f32 pair
    w_nk = lax.reduce_precision(dequantize_planes(values, scales, fmt, k), exponent_bits=8, mantissa_bits=7)
    return jnp.sum(w_nk[None] * x[:, None], axis=-1)
  if fmt == "q8_0":
    xs = x.reshape(s, k // 32, 32)
    part = jnp.sum(values.astype(f32).reshape(n, k // 32, 32)[None] * xs[:, None], axis=-1)   # [S, N, K/32]
    return jnp.sum(part * scales.astype(f32)[None], axis=-1)
  if fmt == "q4_0":
    xs = x.reshape(s, k // 32, 2, 16)
    lo, hi = _nibbles(values)
    part = jnp.sum((lo - 8.0)[None] * xs[:, None, :, 0] + (hi - 8.0)[None] * xs[:, None, :, 1], axis=-1)
    return jnp.sum(part * scales.astype(f32)[None], axis=-1)
  xs = x.reshape(s, k // 64, 2, 32)                                                    # [S, chunk, half, 32]
  lo, hi = _nibbles(values)
  sc, off = (scales[:, i].reshape(n, k // 64, 2) for i in (0, 1))                   # [N, chunk, half]
  t = lo[None] * sc[None, ..., 0:1] * xs[:, None, :, 0] + hi[None] * sc[None, ..., 1:2] * xs[:, None, :, 1]
  return jnp.sum(t, axis=(2, 3)) - jnp.einsum("nch,sch->sn", off, jnp.sum(xs, -1), precision=lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnames=("fmt", "k"))
def planar_matmul(x_sk, values, scales, fmt: str, k: int):
  """x [S, K] @ W[N, K].T -> [S, N] float32, W in planes (`to_planes`)."""
  if not hasattr(x_sk, "shape") or not hasattr(x_sk, "dtype"):
    raise ValueError(f"planar weights: x must be an array [S, {k}], got {type(x_sk).__name__}")
  check_planes(values, scales, fmt, k)
  _formats.check_x(x_sk, k)
  if x_sk.shape[0] <= REDUCE_ROWS:
    return _reduce(x_sk, values, scales, fmt, k)
  dtype = _ref.compute_dtype(x_sk.dtype)
  w_nk = dequantize_planes(values, scales, fmt, k, dtype)
  return lax.dot_general(x_sk.astype(dtype), w_nk, (((1,), (1,)), ((), ())),
                         precision=_ref.dot_precision(dtype), preferred_element_type=jnp.float32)


def planes_nbytes(fmt: str, n: int, k: int) -> int:
  """Bytes of the planes of an [N, K] matrix."""
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
    raise ValueError(f"planar weights: n (rows) must be an int >= 0, got {n!r}")
  return sum(int(np.prod(shape)) * jnp.dtype(dtype).itemsize for shape, dtype in plane_shapes(fmt, n, k))
