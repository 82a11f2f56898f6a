"""A Pallas GEMV over planar weights (`planar.py`'s planes) for decode and verify rows.

`planar_gemv(x_sk, values, scales, fmt, k, config=..., interpret=...)` computes x [S, K] @ W[N, K].T
-> [S, N] float32 for S <= GEMV_MAX_ROWS rows, W the planes' matrix (`planar.dequantize_planes`),
without a dot: each program reads a tile of the values plane [BN, CB, W] (BN output columns, CB
groups of W values a loop step), its scales, and multiplies and sums against x's same columns.

* **Groups.** Every format is seen as [N, groups, W] with one scale (Q4_K: a scale and an offset)
  per group and part: q8_0 one part, int8 [N, K/32, 32]; q4_0 two parts (low and high nibbles)
  of uint8 [N, K/32, 16]; q4_k two parts of uint8 [N, K/64, 32]; q6_k eight parts of 16 values a
  128-value chunk, each from its ql and qh bytes of uint8 [N, K/128, 96]. x is read as it is, [S, groups,
  parts * W] (a reshape, no XLA op before the call), part p's columns at p * W of a group.
* **No int -> float convert.** A value q in [0, 256) becomes float32 as the bits
  0x4B000000 | q (2^23 + q exactly) minus 2^23 + bias: a logic op and an add, the exact number
  (Hopper's I2F runs at a quarter of the FMA rate).
* **Grouped sums** (`grouped=1`, the default): the weights are the planes' float32 numbers; a group's
  values q meet x first (sum q * x), then its scale (q8_0, q4_0: d * sum; q4_k: s * sum(q x) - o *
  sum(x)). `grouped=0`: each weight made as ggml makes it (d * q; (d * sc) * q - dmin * m), rounded
  to bfloat16 for bfloat16 x (the products of `reference.quant_matmul_reference`, whose dot meets
  bfloat16 weights), then multiplied by x; ~1.3-1.5x the time of grouped on an H100 (ALU-bound).
  Both sum in float32, in another order than the reference.
* **Rows don't change a row's sums.** The tiles depend on the format, N and K, never on S, and a
  row's sums run in the same order whatever other rows the call has: a decode row and the same
  row among verify rows give the same bits.
* **Split over K** (`split_k`; 0: enough ranges that the grid has `min_programs`): each range
  writes its partial sums [S, BN]; the ranges are added in a fixed order after the call.

GPU lowering: the Pallas Triton lowering (power-of-two loads with `pl.ds`, int32 bit operations,
equal-width bitcasts, sums); `interpret=True` anywhere (the CPU tests). Imports nothing from
`kvjax`.

Shapes: x_sk [S, K] float32 / bfloat16 (other floating dtypes as float32); values, scales as
`planar.plane_shapes`; out [S, N] float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax_pallas.quant_matmul import formats as _formats
from kvjax_pallas.quant_matmul import kernel as _kernel
from kvjax_pallas.quant_matmul import planar as _planar
from kvjax_pallas.quant_matmul import reference as _ref

GEMV_MAX_ROWS = 8
_MAGIC = 0x4B000000          # float32 bits of 2^23
_TWO23 = 8388608.0
# format -> (values a group, values a part's group (W), parts)
_GROUPS = {"q8_0": (32, 32, 1), "q4_0": (32, 16, 2), "q4_k": (64, 32, 2), "q6_k": (128, 16, 8)}
_VALUE_BYTES = {"q8_0": 32, "q4_0": 16, "q4_k": 32, "q6_k": 96}   # the values plane's bytes a group


@dataclasses.dataclass(frozen=True)
class PlanarGemvConfig:
  """Tiles of the planar GEMV (defaults: the best of an H100 sweep for Q4_K at one row, 2026-12-06:
  docs/PERFORMANCE.md, "Quantized weights")."""
  block_n: int = 8          # output columns a program: upper bound, a power of two
  block_groups: int = 16    # groups a loop step: upper bound, a power of two
  split_k: int = 0          # K ranges, a power of two; 0: as many as `min_programs` asks (<= 16)
  min_programs: int = 512   # split K until the grid has this many programs (split_k 0)
  sum_each_step: int = 1    # 1: a row's sums [BN, CB] (summed over W every step); 0: its products
                            # [BN, CB, W] accumulated, summed after the loop (more registers)
  grouped: int = 1          # 1: float32 weights, each group's scale applied to its sum; 0: each
                            # weight made as ggml makes it, rounded to bf16 for bf16 x (the dot's products)
  num_warps: int = 4
  num_stages: int = 3


DEFAULT_CONFIG = PlanarGemvConfig()


@dataclasses.dataclass(frozen=True)
class PlanarTiles:
  bn: int       # output columns a program
  cb: int       # groups a loop step
  split: int    # K ranges
  steps: int    # loop steps a K range


def check_config(cfg: PlanarGemvConfig) -> PlanarGemvConfig:
  _kernel.check_fields(cfg, PlanarGemvConfig, ("block_n", "block_groups"), ("min_programs", "num_warps", "num_stages"))
  for name in ("sum_each_step", "grouped"):
    if getattr(cfg, name) not in (0, 1):
      raise ValueError(f"{name} must be 0 or 1, got {getattr(cfg, name)!r}")
  if not isinstance(cfg.split_k, int) or isinstance(cfg.split_k, bool) or cfg.split_k < 0 or \
      (cfg.split_k and cfg.split_k & (cfg.split_k - 1)):
    raise ValueError(f"split_k must be 0 (automatic) or a power of two, got {cfg.split_k!r}")
  return cfg


def resolve_tiles(cfg: PlanarGemvConfig, fmt: str, n: int, k: int) -> PlanarTiles:
  """The tiles of an [N, K] matrix of `fmt` (not of S: a row's sums are the same in any call)."""
  check_config(cfg)
  groups = k // _GROUPS[fmt][0]
  pow2 = _kernel._pow2_divisor   # pylint: disable=protected-access
  bn = pow2(n, cfg.block_n)
  split = cfg.split_k or 1
  if not cfg.split_k:
    while (n // bn) * split < cfg.min_programs and split < 16 and groups % (2 * split) == 0 \
        and groups // (2 * split) >= cfg.block_groups:
      split *= 2
  if groups % split:
    raise ValueError(f"split_k={split} must divide the {groups} groups of a {fmt} row of {k} values")
  cb = pow2(groups // split, cfg.block_groups)
  return PlanarTiles(bn=bn, cb=cb, split=split, steps=groups // split // cb)


def _exact_float(q_i32, bias: float):
  """int32 q in [0, 2^23) -> float32 q - bias, by the bits of 2^23 + q (no int -> float convert)."""
  return lax.bitcast_convert_type(q_i32 | _MAGIC, jnp.float32) - (_TWO23 + bias)


def _to_bf16(w, interpret: bool):
  """float32 -> the nearest bfloat16, as float32. Interpreted, `reduce_precision` (XLA may drop a
  f32 -> bf16 -> f32 pair of converts); Triton keeps the converts (and has no reduce_precision)."""
  if interpret:
    return lax.reduce_precision(w, exponent_bits=8, mantissa_bits=7)
  return w.astype(jnp.bfloat16).astype(jnp.float32)


def _k_scales(s_ref, g0, cb: int):
  """q4_k scale words [BN, chunks, 2] uint32 -> float32 (s_lo, s_hi, o_lo, o_hi) [BN, CB] each: ggml's
  d * sc and dmin * m."""
  w0, w1 = (s_ref[:, pl.ds(g0, cb), j] for j in (0, 1))
  return _planar.k_scale_products(w0, w1, lambda q: _exact_float(q, 0.0))


def _q6_parts(w_ref, s_ref, g0, cb: int):
  """q6_k: a step's 8 parts (p = 2j + h: a chunk's values 32j + 16h .. + 16), each (q - 32 float32
  [BN, CB, 16], its scale d * sc float32 [BN, CB]), loaded from the values plane's ql and qh bytes."""
  ql = [[w_ref[:, pl.ds(g0, cb), pl.ds(32 * a + 16 * h, 16)].astype(jnp.int32) for h in (0, 1)] for a in (0, 1)]
  qh = [w_ref[:, pl.ds(g0, cb), pl.ds(64 + 16 * h, 16)].astype(jnp.int32) for h in (0, 1)]
  w0, w1, w2 = (s_ref[:, pl.ds(g0, cb), i] for i in range(3))
  d = lax.bitcast_convert_type((w2 & 0xFFFF).astype(jnp.uint16), jnp.float16).astype(jnp.float32)
  parts = []
  for j in range(4):
    for h in (0, 1):
      p = 2 * j + h
      q = ((ql[j & 1][h] >> (4 * (j >> 1))) & 15) | (((qh[h] >> (2 * j)) & 3) << 4)
      byte = (((w0, w1)[p // 4] >> (8 * (p % 4))) & 0xFF).astype(jnp.int32)
      parts.append((_exact_float(q, 32.0), d * _exact_float(byte ^ 128, 128.0)))
  return parts


def _weights(fmt: str, w_ref, s_ref, g0, cb: int):
  """A step's tile of the values plane -> its parts' float32 weights [BN, CB, W] each."""
  if fmt == "q6_k":
    return [sc[:, :, None] * q for q, sc in _q6_parts(w_ref, s_ref, g0, cb)]    # ggml: (d * sc) * q
  vi = w_ref[:, pl.ds(g0, cb), :].astype(jnp.int32)
  if fmt == "q8_0":
    d = s_ref[:, pl.ds(g0, cb)].astype(jnp.float32)[:, :, None]
    return [d * _exact_float((vi & 255) ^ 128, 128.0)]
  if fmt == "q4_0":
    d = s_ref[:, pl.ds(g0, cb)].astype(jnp.float32)[:, :, None]
    return [_exact_float(vi & 15, 8.0) * d, _exact_float(vi >> 4, 8.0) * d]
  s_lo, s_hi, o_lo, o_hi = (a[:, :, None] for a in _k_scales(s_ref, g0, cb))
  return [s_lo * _exact_float(vi & 15, 0.0) - o_lo, s_hi * _exact_float(vi >> 4, 0.0) - o_hi]


def _grouped_sums(fmt: str, w_ref, s_ref, g0, cb: int, x_parts):
  """The float32-weights product of a step's tile, the scale applied once a group: [BN, CB] sums of
  one row (x_parts: its parts' columns [CB, W] float32)."""
  if fmt == "q6_k":
    return sum(sc * jnp.sum(q * xp[None], axis=2) for (q, sc), xp in zip(_q6_parts(w_ref, s_ref, g0, cb), x_parts))
  vi = w_ref[:, pl.ds(g0, cb), :].astype(jnp.int32)
  if fmt == "q8_0":
    d = s_ref[:, pl.ds(g0, cb)].astype(jnp.float32)
    return d * jnp.sum(_exact_float((vi & 255) ^ 128, 128.0) * x_parts[0][None], axis=2)
  if fmt == "q4_0":
    d = s_ref[:, pl.ds(g0, cb)].astype(jnp.float32)
    return d * (jnp.sum(_exact_float(vi & 15, 8.0) * x_parts[0][None], axis=2)
                + jnp.sum(_exact_float(vi >> 4, 8.0) * x_parts[1][None], axis=2))
  s_lo, s_hi, o_lo, o_hi = _k_scales(s_ref, g0, cb)
  q_lo = jnp.sum(_exact_float(vi & 15, 0.0) * x_parts[0][None], axis=2)
  q_hi = jnp.sum(_exact_float(vi >> 4, 0.0) * x_parts[1][None], axis=2)
  return (s_lo * q_lo - o_lo * jnp.sum(x_parts[0], axis=1)[None]) + (s_hi * q_hi - o_hi * jnp.sum(x_parts[1], axis=1)[None])


def _gemv_kernel(x_ref, w_ref, s_ref, o_ref, *, fmt: str, tiles: PlanarTiles, rows: int, dtype, interpret: bool,
                 sum_each_step: bool, grouped: bool):
  # x_ref [S, groups / split, parts * W] (x's dtype; this K range's columns), w_ref [BN, groups / split, W],
  # s_ref [BN, groups / split] (q4_k, q6_k [BN, chunks / split, words] uint32), o_ref [1, S, BN] float32 (this K range's sums)
  t, w = tiles, _GROUPS[fmt][1]

  def body(i, acc):                         # acc: a row's sums [BN, CB] (or products [BN, CB, W]), one a row
    g0 = pl.multiple_of(i * t.cb, t.cb)
    if grouped:
      return tuple(a + _grouped_sums(fmt, w_ref, s_ref, g0, t.cb, [x_ref[r, pl.ds(g0, t.cb), pl.ds(p * w, w)].astype(
          jnp.float32) for p in range(_GROUPS[fmt][2])]) for r, a in enumerate(acc))
    ws = _weights(fmt, w_ref, s_ref, g0, t.cb)
    if dtype == jnp.bfloat16:               # the dot's weights (bfloat16), its exact products
      ws = [_to_bf16(wt, interpret) for wt in ws]
    acc = list(acc)
    for r in range(rows):
      for p, wp in enumerate(ws):
        prod = wp * x_ref[r, pl.ds(g0, t.cb), pl.ds(p * w, w)].astype(jnp.float32)[None]
        acc[r] = acc[r] + (jnp.sum(prod, axis=2) if sum_each_step else prod)
    return tuple(acc)

  sum_each_step = sum_each_step or grouped
  shape = (o_ref.shape[2], t.cb) + (() if sum_each_step else (w,))
  acc = lax.fori_loop(0, t.steps, body, tuple(jnp.zeros(shape, jnp.float32) for _ in range(rows)))
  for r in range(rows):
    o_ref[0, r, :] = jnp.sum(acc[r], axis=1) if sum_each_step else jnp.sum(jnp.sum(acc[r], axis=2), axis=1)


@functools.partial(jax.jit, static_argnames=("fmt", "k", "cfg", "tiles", "interpret"))
def _call(x_sk, values, scales, *, fmt: str, k: int, cfg: PlanarGemvConfig, tiles: PlanarTiles, interpret: bool):
  gv, w, _ = _GROUPS[fmt]
  n, s, t = values.shape[0], x_sk.shape[0], tiles
  gs = k // gv // t.split                                     # groups a K range
  if fmt in ("q4_k", "q6_k"):
    s_spec = pl.BlockSpec((t.bn, gs) + scales.shape[2:], lambda ni, si: (ni, si, 0))
  else:
    s_spec = pl.BlockSpec((t.bn, gs), lambda ni, si: (ni, si))
  part = pl.pallas_call(
      functools.partial(_gemv_kernel, fmt=fmt, tiles=t, rows=s, dtype=_ref.compute_dtype(x_sk.dtype),
                        interpret=interpret, sum_each_step=bool(cfg.sum_each_step),
                        grouped=bool(cfg.grouped)),
      grid=(n // t.bn, t.split),
      in_specs=[pl.BlockSpec((s, gs, gv), lambda ni, si: (0, si, 0)),
                pl.BlockSpec((t.bn, gs, _VALUE_BYTES[fmt]), lambda ni, si: (ni, si, 0)), s_spec],
      out_specs=pl.BlockSpec((1, s, t.bn), lambda ni, si: (si, 0, ni)),
      out_shape=jax.ShapeDtypeStruct((t.split, s, n), jnp.float32),
      compiler_params=_kernel._compiler_params(cfg, interpret),   # pylint: disable=protected-access
      interpret=interpret,
      name="kvjax_planar_gemv",
  )(x_sk.reshape(s, k // gv, gv), values.reshape(n, k // gv, _VALUE_BYTES[fmt]), scales)
  out = part[0]
  for j in range(1, t.split):               # the K ranges' sums, in a fixed order
    out = out + part[j]
  return out


def planar_gemv(x_sk, values, scales, fmt: str, k: int, *, config: Optional[PlanarGemvConfig] = None,
                interpret: bool = False):
  """x [S, K] @ W[N, K].T -> [S, N] float32 for S <= GEMV_MAX_ROWS, W in planes (`planar.to_planes`)."""
  if not hasattr(x_sk, "shape") or not hasattr(x_sk, "dtype"):
    raise ValueError(f"planar GEMV: x must be an array [S, {k}], got {type(x_sk).__name__}")
  n = _planar.check_planes(values, scales, fmt, k)
  s = _formats.check_x(x_sk, k)
  if s > GEMV_MAX_ROWS:
    raise ValueError(f"planar GEMV: takes 1 to {GEMV_MAX_ROWS} rows of x, got {s}")
  cfg = DEFAULT_CONFIG if config is None else config
  tiles = resolve_tiles(cfg, fmt, max(n, 1), k)
  if not interpret and jax.default_backend() != "gpu":
    raise ValueError(f"planar GEMV: the kernel compiles for a GPU; on {jax.default_backend()} pass interpret=True")
  if n == 0:
    return jnp.zeros((s, 0), jnp.float32)
  return _call(x_sk, values, scales, fmt=fmt, k=k, cfg=cfg, tiles=tiles, interpret=interpret)
