"""ggml KV block formats in plain jnp: encode and decode along the last axis.

`encode(x_f32[..., n], kind) -> uint8[..., row_bytes(kind, n)]` and
`decode(bytes_u8[..., nbytes], kind) -> f32[..., n]` are jit-able and
bit-exact with ggml's C reference quantizers (`quantize_row_q8_0_ref`,
`quantize_row_q4_0_ref`):

* Q8_0 (34 B / 32 values): fp16 `d = amax / 127`, `q = roundf(x * (1/d))`.
* Q4_0 (18 B / 32 values): `d = m / -8` where `m` is the first value of
  largest magnitude, `q = min(15, (int8)(x * (1/d) + 8.5f))`, packed as
  `byte[j] = q[j] | q[j + 16] << 4`.
* F32 / F16 / BF16: little-endian scalars (BF16 rounded like ggml's
  `ggml_compute_fp32_to_bf16`: integer round-to-nearest-even, quiet NaN).

Exactness notes: XLA flushes float32 denormals to zero, C does not; blocks
with a denormal scale or denormal values are computed on integer bit patterns
so the bytes still equal the C reference. Q4_0 counts thresholds instead of
evaluating `x*id + 8.5f`, so no backend can contract it into an FMA (one
rounding instead of C's two). Where C is undefined (1/d overflows to inf for
|max| < ~2^-125: `(int8_t)` of +-inf/NaN) we emit quant 0, as x86 C and
numpy do.

Both the KV writer (device) and the attention kernels' reference use this one
definition. Imports nothing from `kvjax`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kvjax_pallas.page_layout import BLOCK_FORMATS, QK, check_kind, row_bytes

_FLOAT_DTYPES = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}


def _f16_bytes(d_f32):
  """float32 [...] -> uint8 [..., 2]: fp16 (round to nearest even), little-endian."""
  return lax.bitcast_convert_type(d_f32.astype(jnp.float16), jnp.uint8)


def _f16_from_bytes(b2):
  """uint8 [..., 2] -> float32 [...] via fp16."""
  return lax.bitcast_convert_type(b2, jnp.float16).astype(jnp.float32)


def _bf16_bytes(x):
  """float32 [...] -> uint8 [..., 2]: ggml's fp32 -> bf16 (integer RNE, NaN
  made quiet), done on the bit pattern so denormals survive a flushing backend."""
  u = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  c = lambda v: jnp.uint32(v)  # noqa: E731  (uint32 literals above int32 range)
  nan = (u & c(0x7FFFFFFF)) > c(0x7F800000)
  u = jnp.where(nan, (u & c(0xFFFF0000)) | c(0x00400000), u)
  r = (u + (c(0x7FFF) + ((u >> 16) & c(1)))) >> 16
  return lax.bitcast_convert_type(r.astype(jnp.uint16), jnp.uint8)


def _bf16_from_bytes(b2):
  """uint8 [..., 2] -> float32 [...]: bf16 bits in the high half of a float32."""
  u = lax.bitcast_convert_type(b2, jnp.uint16).astype(jnp.uint32) << 16
  return lax.bitcast_convert_type(u, jnp.float32)


def _roundf_exact(x):
  """C `roundf` (half away from zero). floor(|x| + 0.5) is wrong for
  |x| = 0.49999997 (the add rounds up), so split integer and fraction."""
  a = jnp.abs(x)
  fl = jnp.floor(a)
  r = fl + jnp.floor(2.0 * (a - fl))
  return jnp.sign(x) * r


# --- IEEE-exact helpers ------------------------------------------------------
# XLA's CPU (and GPU) backends flush float32 denormals to zero, while ggml's C
# reference (and numpy) compute with IEEE denormals. Blocks whose scale `d` is
# denormal (|max| < ~2^-119) or whose values are denormal are therefore handled
# on integer bit patterns: a float32 below 2^-119 is u * 2^-149 for an integer
# u < 2^30, so the rounding of `m / 8` (Q4_0) and `amax / 127` (Q8_0) to the
# denormal grid is exact integer arithmetic.


def _ldexp(x, k: int):
  """x * 2^k for normal (or zero) float32 x, on the bit pattern: inf when the
  exponent overflows, signed 0 when it would leave the normal range. (Chained
  constant multiplies such as `(x * 2^100) * 2^49` are folded by XLA into one
  out-of-range constant, so scaling is done on the exponent field.)"""
  u = lax.bitcast_convert_type(x, jnp.int32)
  sign = u & jnp.int32(-2**31)
  e = ((u >> 23) & 0xFF) + k
  mag = (u & 0x7FFFFF) | (jnp.clip(e, 0, 255) << 23)
  mag = jnp.where(e >= 255, 0x7F800000, jnp.where(e <= 0, 0, mag))
  mag = jnp.where((u & 0x7FFFFFFF) == 0, 0, mag)
  return lax.bitcast_convert_type(sign | mag, jnp.float32)


def _abs_bits(x):
  """float32 -> int32 |x| bit pattern (monotone in |x|, denormals included)."""
  return lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF


def _sign_neg(x):
  """float32 -> bool: the sign bit (also for -0 and denormals)."""
  return lax.bitcast_convert_type(x, jnp.int32) < 0


def _tiny_units(abs_bits):
  """|x| bit pattern -> integer u with |x| = u * 2^-149; valid for |x| < 2^-118."""
  e = abs_bits >> 23
  m = abs_bits & 0x7FFFFF
  shift = jnp.clip(e - 1, 0, 7)
  return jnp.where(e == 0, m, (m | 0x800000) << shift)


def _inv_units(units, negative):
  """1 / (units * 2^-149) as float32 (IEEE: RNE, inf on overflow); 0 if units == 0."""
  r = jnp.float32(1.0) / jnp.maximum(units, 1).astype(jnp.float32)
  inv = _ldexp(r, 149)
  inv = jnp.where(negative, -inv, inv)
  return jnp.where(units == 0, jnp.float32(0.0), inv)


def _scaled(x, inv):
  """RNE(x * inv) as IEEE float32 computes it, also for denormal x (only
  results of magnitude >= 2^-126 are exact; smaller ones cannot change a
  quantized value)."""
  bits = _abs_bits(x)
  den = (bits >> 23) == 0
  m = jnp.where(_sign_neg(x), -(bits & 0x7FFFFF), bits & 0x7FFFFF).astype(jnp.float32)
  den_prod = m * _ldexp(inv, -149)
  return jnp.where(den, den_prod, x * inv)


def _q4_thresholds():
  """t[k-1] = smallest float32 p with fl32(p + 8.5) >= k, k = 1..15.

  C's Q4_0 quant is trunc(fl32(fl32(x * id) + 8.5f)); counting thresholds
  instead of adding keeps a backend from contracting the multiply-add into
  one FMA (a single rounding that differs from C's two)."""
  import numpy as np  # local: only at import time
  out = []
  for k in range(1, 16):
    lo, hi = np.float32(-16.0), np.float32(16.0)  # lo fails, hi passes
    while True:
      mid = np.float32((lo.astype(np.float64) + hi.astype(np.float64)) / 2)
      if mid == lo or mid == hi:
        nxt = np.nextafter(lo, hi)
        if nxt == hi:
          break
        mid = nxt
      if np.float32(mid + np.float32(8.5)) >= k:
        hi = mid
      else:
        lo = mid
    out.append(float(hi))
  return tuple(out)


_Q4_T = _q4_thresholds()


def _encode_q8_0(blocks):  # [..., nb, 32] f32 -> [..., nb, 34] u8
  abits = _abs_bits(blocks)
  amax_bits = jnp.max(abits, axis=-1, keepdims=True)
  amax = lax.bitcast_convert_type(amax_bits, jnp.float32)
  # Normal path: d = amax / 127 is a normal float32 (amax >= 2^-119).
  normal = amax_bits >= 0x04000000  # 2^-119
  d_n = amax / jnp.float32(127.0)
  inv_n = jnp.float32(1.0) / jnp.where(normal, d_n, 1.0)
  # Tiny path: d = RNE(A / 127) * 2^-149 (denormal or just normal), fp16(d) = 0.
  units = (_tiny_units(amax_bits) + 63) // 127
  inv_t = _inv_units(units, False)
  inv = jnp.where(normal, inv_n, inv_t)
  d = jnp.where(normal, d_n, 0.0)
  q = _roundf_exact(_scaled(blocks, inv))
  # 1/d overflowed (C: undefined (int8_t) of +-inf/NaN; x86 and numpy give 0).
  q = jnp.where(jnp.isinf(inv), 0.0, q).astype(jnp.int8)
  return jnp.concatenate([_f16_bytes(d[..., 0]), lax.bitcast_convert_type(q, jnp.uint8)], axis=-1)


def _decode_q8_0(b):  # [..., nb, 34] u8 -> [..., nb, 32] f32
  d = _f16_from_bytes(b[..., 0:2])
  q = lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
  return q * d[..., None]


def _encode_q4_0(blocks):  # [..., nb, 32] f32 -> [..., nb, 18] u8
  abits = _abs_bits(blocks)
  idx = jnp.argmax(abits, axis=-1)  # first occurrence of the largest |x|
  m = jnp.take_along_axis(blocks, idx[..., None], axis=-1)
  m_bits = jnp.take_along_axis(abits, idx[..., None], axis=-1)
  m_neg = _sign_neg(m)
  # Normal path: d = m / -8 is a normal float32 (|m| > 2^-123).
  normal = m_bits > 0x02000000  # 2^-123
  d_n = m / jnp.float32(-8.0)
  inv_n = jnp.float32(1.0) / jnp.where(normal, d_n, 1.0)
  # Tiny path: |d| = RNE(M / 8) * 2^-149 (ties to even), sign opposite to m.
  mu = _tiny_units(m_bits)
  qd, rd = mu >> 3, mu & 7
  units = qd + ((rd > 4) | ((rd == 4) & ((qd & 1) == 1))).astype(jnp.int32)
  inv_t = _inv_units(units, ~m_neg)
  inv = jnp.where(normal, inv_n, inv_t)
  d_bytes_n = _f16_bytes(d_n[..., 0])
  # fp16 of a denormal-float32 d is a signed zero.
  sign_hi = jnp.where(m_neg[..., 0], 0, 0x80).astype(jnp.uint8)
  d_bytes_t = jnp.stack([jnp.zeros_like(sign_hi), sign_hi], axis=-1)
  d_bytes = jnp.where(normal, d_bytes_n, d_bytes_t)
  p = _scaled(blocks, inv)
  q = jnp.zeros(p.shape, jnp.int32)
  for t in _Q4_T:
    q = q + (p >= jnp.float32(t)).astype(jnp.int32)
  q = jnp.where(jnp.isinf(inv), 0, q).astype(jnp.uint8)
  lo, hi = q[..., :16], q[..., 16:]
  packed = lo | (hi << 4)
  return jnp.concatenate([d_bytes, packed.astype(jnp.uint8)], axis=-1)


def _decode_q4_0(b):  # [..., nb, 18] u8 -> [..., nb, 32] f32
  d = _f16_from_bytes(b[..., 0:2])
  qs = b[..., 2:].astype(jnp.int32)
  lo = (qs & 0x0F) - 8
  hi = (qs >> 4) - 8
  q = jnp.concatenate([lo, hi], axis=-1).astype(jnp.float32)
  return q * d[..., None]


def encode(x, kind: str):
  """Encode the last axis of `x` as ggml `kind` blocks -> uint8."""
  check_kind(kind)
  n = x.shape[-1]
  nbytes = row_bytes(kind, n)  # validates divisibility
  if kind == "bf16":
    return _bf16_bytes(x.astype(jnp.float32)).reshape(*x.shape[:-1], nbytes)
  if kind in _FLOAT_DTYPES:
    y = lax.bitcast_convert_type(x.astype(_FLOAT_DTYPES[kind]), jnp.uint8)
    return y.reshape(*x.shape[:-1], nbytes)
  blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], n // QK, QK)
  enc = _encode_q8_0 if kind == "q8_0" else _encode_q4_0
  return enc(blocks).reshape(*x.shape[:-1], nbytes)


def decode(b, kind: str, dtype=jnp.float32):
  """Decode uint8 ggml `kind` bytes along the last axis -> values of `dtype`."""
  check_kind(kind)
  per_block, block_bytes = BLOCK_FORMATS[kind]
  nbytes = b.shape[-1]
  if nbytes % block_bytes:
    raise ValueError(f"{kind}: {nbytes} bytes is not a whole number of {block_bytes}-byte blocks")
  b = b.astype(jnp.uint8)
  if kind == "bf16":
    vals = _bf16_from_bytes(b.reshape(*b.shape[:-1], nbytes // 2, 2))
    return vals.astype(dtype)
  if kind in _FLOAT_DTYPES:
    width = block_bytes
    vals = lax.bitcast_convert_type(b.reshape(*b.shape[:-1], nbytes // width, width),
                                    _FLOAT_DTYPES[kind])
    return vals.astype(dtype)
  blocks = b.reshape(*b.shape[:-1], nbytes // block_bytes, block_bytes)
  dec = _decode_q8_0 if kind == "q8_0" else _decode_q4_0
  out = dec(blocks)
  return out.reshape(*b.shape[:-1], nbytes // block_bytes * per_block).astype(dtype)


def encode_rows(x, kind: str):
  """`[..., heads, head_dim]` -> `[..., heads * head_bytes]`: one KV row per token."""
  y = encode(x, kind)
  return y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1])


def decode_rows(b, kind: str, num_heads: int, dtype=jnp.float32):
  """`[..., heads * head_bytes]` -> `[..., heads, head_dim]`."""
  b = b.reshape(*b.shape[:-1], num_heads, b.shape[-1] // num_heads)
  return decode(b, kind, dtype)


encode_jit = jax.jit(encode, static_argnames="kind")
decode_jit = jax.jit(decode, static_argnames=("kind", "dtype"))
