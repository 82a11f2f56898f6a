"""GGUF weight blocks repacked into planes at load, read by a Pallas GEMV (or XLA's reductions).

A ggml row interleaves each block's scales with its quantized values. Repacked once at load (on the
device), the values become one plane and the scales another, so that a decode or verify row
(x [S, K] against W [N, K]) reads each at speed: on a GPU the Pallas GEMV of `planar_gemv.py`
(H100, 2026-12-06: the 27B's Q4_K decode 13.4 ms against 23.2 with bf16 weights), elsewhere XLA's
own multiply-and-sum (`experiments/kernel_lab/probe_planar_gemv.py` measured it first: on an H100
Q4_K planes at 0.95-1.27 TB/s where a decode of ggml's rows inside the same reduction ran at
0.28-0.45 TB/s).

Planes (`to_planes`, made on the device at load), per format (values a row K, N rows):

  q8_0  values int8 [N, K] (value order); d float16 [N, K/32]           value = d * q
  q4_0  nibbles uint8 [N, K/32, 16] (byte j: value j low, j + 16 high); d float16 [N, K/32]
                                                                        value = d * (q - 8)
  q4_k  nibbles uint8 [N, K/64, 32] (byte l of chunk c: value 64c + l low, 64c + 32 + l high);
        uint32 [N, K/64, 2], a chunk's two words: sc_lo | sc_hi << 8 | m_lo << 16 | m_hi << 24
        (the 6-bit scales and mins of its low / high 32 values), then its block's f16 d | dmin << 16
                                                value = (d * sc) * q - dmin * m (ggml's float32)
  q6_k  uint8 [N, K/128, 96], a half block (chunk) of 128 values: its 64 bytes of low nibbles (ql)
        then its 32 bytes of 2-bit highs (qh), as ggml stores them; uint32 [N, K/128, 3], a chunk's
        words: its 8 int8 scales (one a 16 values), then its block's f16 d
                                                value = (d * sc) * (q - 32) (ggml's float32)

The planes hold the same numbers as the blocks: `dequantize_planes` equals
`reference.dequantize` of the ggml rows bit for bit (the same float32 products). Bytes against
ggml's: q8_0 and q4_0 the same; q4_k 5 bits a value against 4.5 (d and dmin once a chunk of 64, not a
block of 256); q6_k 6.75 against 6.5625 (d once a chunk of 128).

The product (`planar_matmul(..., implementation=)`):
  "pallas"  up to `KERNEL_ROWS` rows: the Pallas GEMV over the planes (`planar_gemv.py`, its
            `GEMV_MAX_ROWS` rows a call, `DOT_ROWS` with its dots; interpreted off a GPU):
            float32 weights, each group's scale applied to its sum; a row's sums do not depend
            on the call's other rows, so a decode row and the same row among verify rows agree
            bit for bit;
  "pallas_dot" the same kernel with tensor-core dots (`planar_gemv.DOT_CONFIG`, bfloat16 x): the
            same float32 weights, other bits; slower at one row, faster for verify rows (H100:
            1.3-1.8x the sums' time at one row, 0.42-0.85x at four), so for speculative decoding;
  "pallas_q8" up to `KERNEL_ROWS` rows: x's rows quantized to int8 blocks of 32 values (ggml's
            q8_1 idea), the planes' integer values met by byte dot products (`planar_q8.py`,
            `Q8_MAX_ROWS` rows a call): exact integer sums a group, so a decode row and the same
            row among verify rows agree bit for bit; the numbers differ from the float32 weights'
            product by x's rounding (~2^-8 of a block's largest value);
  "xla"     up to `REDUCE_ROWS` rows: one XLA multiply-and-sum over the planes with the dot's
            products (the weights rounded to bfloat16 for bfloat16 x), which the verify rows'
            dot shares;
  "auto"    the environment's `KVJAX_PLANAR_PRODUCT` if set, else "pallas" on a GPU, "xla"
            elsewhere (the default).
More rows dequantize the planes to `reference.compute_dtype(x.dtype)` and run the reference's dot
(the "xla" quant-matmul's bits). So with "pallas", speculative decoding gives plain greedy's
tokens while its verify rows are at most `KERNEL_ROWS` (a wider verify meets bfloat16 weights).

Shapes: x_sk [S, K] -> [S, N] float32. Imports nothing from `kvjax`.
"""

from __future__ import annotations

import functools
import os
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax_pallas.quant_matmul import formats as _formats
from kvjax_pallas.quant_matmul import reference as _ref

PLANAR_FORMATS = ("q8_0", "q4_0", "q4_k", "q6_k")
REDUCE_ROWS = 1   # rows of x the XLA multiply-and-sum takes; more: dequantize, then the dot
KERNEL_ROWS = 32  # rows of x the "pallas" product takes (GEMV calls of planar_gemv.max_rows)
PRODUCTS = ("auto", "pallas", "pallas_dot", "pallas_q8", "xla")   # planar_matmul(implementation=)
PRODUCT_ENV = "KVJAX_PLANAR_PRODUCT"   # "auto"'s choice where set


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
  if fmt == "q6_k":
    return ((n, k // 128, 96), jnp.uint8), ((n, k // 128, 3), jnp.uint32)
  return ((n, k // 64, 32), jnp.uint8), ((n, k // 64, 2), jnp.uint32)


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
  if fmt == "q6_k":   # block: ql [128], qh [64], scales int8 [16], d f16
    vals = jnp.concatenate([blk[..., 0:128].reshape(n, k // 256, 2, 64), blk[..., 128:192].reshape(n, k // 256, 2, 32)], -1)
    dd = jnp.broadcast_to(blk[..., None, 208:210], (n, k // 256, 2, 2))
    chunk = jnp.concatenate([blk[..., 192:208].reshape(n, k // 256, 2, 8), dd, jnp.zeros_like(dd)], -1)   # [.., 2, 12]
    return vals.reshape(n, k // 128, 96), lax.bitcast_convert_type(chunk.reshape(n, k // 128, 3, 4), jnp.uint32)
  sc, mn = _ref._k_scales(blk[..., 4:16].astype(jnp.int32))                  # [N, K/256, 8]: group 2c + h
  dd = jnp.broadcast_to(blk[..., None, 0:4], (n, k // 256, 4, 4))             # d, dmin bytes, each chunk
  chunk = jnp.concatenate([sc.reshape(n, k // 256, 4, 2).astype(jnp.uint8),
                           mn.reshape(n, k // 256, 4, 2).astype(jnp.uint8), dd], axis=-1)   # [N, K/256, 4, 8]
  words = lax.bitcast_convert_type(chunk.reshape(n, k // 64, 2, 4), jnp.uint32)   # little-endian
  return blk[..., 16:].reshape(n, k // 64, 32), words


def k_scale_products(w0, w1, to_float=lambda q: q.astype(jnp.float32)):
  """A q4_k chunk's scale words (uint32, any shape) -> float32 (s_lo, s_hi, o_lo, o_hi): ggml's
  d * sc and dmin * m. `to_float`: int32 bytes -> float32 (the GEMV passes its exact bit trick)."""
  d, dmin = (lax.bitcast_convert_type(((w1 >> sh) & 0xFFFF).astype(jnp.uint16), jnp.float16).astype(jnp.float32)
             for sh in (0, 16))
  q = [to_float(((w0 >> (8 * j)) & 0xFF).astype(jnp.int32)) for j in range(4)]
  return d * q[0], d * q[1], dmin * q[2], dmin * q[3]


def _k_scales_of(scales):
  """A q4_k scales plane uint32 [N, K/64, 2] -> float32 (s_lo, s_hi, o_lo, o_hi), each [N, K/64]."""
  return k_scale_products(scales[..., 0], scales[..., 1])


def _q6_of(values, scales):
  """q6_k planes [N, C, 96] / [N, C, 3] -> (q - 32 float32 [N, C, 8, 16], d * sc float32 [N, C, 8]):
  part p = 2j + h of a chunk is its values 32j + 16h .. + 16, scale p."""
  n, c = values.shape[:2]
  ql = values[..., :64].astype(jnp.int32).reshape(n, c, 1, 2, 32)          # [.., 1, a, l]
  qh = values[..., 64:].astype(jnp.int32).reshape(n, c, 1, 1, 32)
  hi = jnp.arange(2, dtype=jnp.int32)[:, None, None]                       # [hi, 1, 1]
  a = jnp.arange(2, dtype=jnp.int32)[None, :, None]                        # [1, a, 1]
  q = (((ql >> (4 * hi)) & 15) | (((qh >> (2 * a + 4 * hi)) & 3) << 4)) - 32   # value 64 hi + 32 a + l
  w0, w1, w2 = (scales[..., i] for i in range(3))
  sc = jnp.stack([lax.bitcast_convert_type(((w >> (8 * b)) & 0xFF).astype(jnp.uint8), jnp.int8)
                  for w in (w0, w1) for b in range(4)], -1).astype(jnp.float32)
  d = lax.bitcast_convert_type((w2 & 0xFFFF).astype(jnp.uint16), jnp.float16).astype(jnp.float32)
  return q.astype(jnp.float32).reshape(n, c, 8, 16), d[..., None] * sc


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
  elif fmt == "q6_k":
    q, ds = _q6_of(values, scales)
    out = ds[..., None] * q                                                 # ggml: (d * sc) * q
  else:
    lo, hi = _nibbles(values)                                               # [N, K/64, 32]
    s_lo, s_hi, o_lo, o_hi = (a[..., None] for a in _k_scales_of(scales))     # [N, chunk, 1]
    out = jnp.stack([lo * s_lo - o_lo, hi * s_hi - o_hi], axis=2)           # [N, chunk, half, 32]
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
  if fmt == "q6_k":
    return jnp.sum(dequantize_planes(values, scales, fmt, k)[None] * x[:, None], axis=-1)
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
  s_lo, s_hi, o_lo, o_hi = _k_scales_of(scales)
  sc, off = jnp.stack([s_lo, s_hi], -1), jnp.stack([o_lo, o_hi], -1)                 # [N, chunk, half]
  t = lo[None] * sc[None, ..., 0:1] * xs[:, None, :, 0] + hi[None] * sc[None, ..., 1:2] * xs[:, None, :, 1]
  return jnp.sum(t, axis=(2, 3)) - jnp.einsum("nch,sch->sn", off, jnp.sum(xs, -1), precision=lax.Precision.HIGHEST)


def resolve_product(implementation: str) -> str:
  """`implementation` of `planar_matmul` ("auto": $KVJAX_PLANAR_PRODUCT, else "pallas" on a GPU, else "xla")."""
  if implementation not in PRODUCTS:
    raise ValueError(f"planar weights: implementation must be one of {', '.join(PRODUCTS)}, got {implementation!r}")
  if implementation != "auto":
    return implementation
  env = os.environ.get(PRODUCT_ENV) or "auto"     # set but empty: as unset
  if env not in PRODUCTS:
    raise ValueError(f"planar weights: ${PRODUCT_ENV} must be one of {', '.join(PRODUCTS)}, got {env!r}")
  if env != "auto":
    return env
  return "pallas" if jax.default_backend() == "gpu" else "xla"


def planar_matmul(x_sk, values, scales, fmt: str, k: int, *, implementation: str = "auto", config=None,
                  interpret: bool = False):
  """x [S, K] @ W[N, K].T -> [S, N] float32, W in planes (`to_planes`). `config`: the GEMV's
  `planar_gemv.PlanarGemvConfig` (None: its defaults); the kernel runs interpreted where `interpret`
  or the backend is not a GPU. "auto" is resolved at each call (inside a traced step: when it is
  traced)."""
  if not hasattr(x_sk, "shape") or not hasattr(x_sk, "dtype"):
    raise ValueError(f"planar weights: x must be an array [S, {k}], got {type(x_sk).__name__}")
  check_planes(values, scales, fmt, k)
  _formats.check_x(x_sk, k)
  from kvjax_pallas.quant_matmul import planar_gemv   # pylint: disable=import-outside-toplevel (it imports this)
  if config is not None:
    planar_gemv.check_config(config)
  return _planar_matmul(x_sk, values, scales, fmt=fmt, k=k, product=resolve_product(implementation), config=config,
                        interpret=bool(interpret) or jax.default_backend() != "gpu")


@functools.partial(jax.jit, static_argnames=("fmt", "k", "product", "config", "interpret"))
def _planar_matmul(x_sk, values, scales, *, fmt: str, k: int, product: str, config, interpret: bool):
  from kvjax_pallas.quant_matmul import planar_gemv   # pylint: disable=import-outside-toplevel
  s = x_sk.shape[0]
  if product == "pallas_q8" and s <= KERNEL_ROWS:
    from kvjax_pallas.quant_matmul import planar_q8   # pylint: disable=import-outside-toplevel
    outs = [planar_q8.planar_q8_gemv(x_sk[r:r + planar_q8.Q8_MAX_ROWS], values, scales, fmt, k, config=config,
                                     interpret=interpret) for r in range(0, s, planar_q8.Q8_MAX_ROWS)]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
  if product in ("pallas", "pallas_dot") and s <= KERNEL_ROWS:
    if product == "pallas_dot" and config is None:
      config = planar_gemv.DOT_CONFIG
    step = planar_gemv.max_rows(config, fmt, values.shape[0], k, x_sk.dtype)
    outs = [planar_gemv.planar_gemv(x_sk[r:r + step], values, scales, fmt, k, config=config, interpret=interpret)
            for r in range(0, s, step)]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
  if product == "xla" and s <= REDUCE_ROWS:
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
