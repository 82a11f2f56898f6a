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
* **Tensor-core dots** (`dot`, bfloat16 x, BN >= 16; `DOT_CONFIG`, the "pallas_dot" product of
  `planar.py`): x's rows zero-padded to DOT_ROWS (8) meet the tile in `lax.dot_general`s, so their
  cost hardly grows with S: `dot=1` a step's ggml-made weights rounded to bfloat16 in one dot a
  part; `dot=2` a group's q (exact in bfloat16) in a dot, its scale applied to the dot's sums (the
  float32 weights of `grouped=1`). A row's sums still do not depend on the other rows. On an H100
  (2026-12-06) `DOT_CONFIG` takes 1.3-1.8x the sums' time at one row and 0.42-0.85x at four (Q4_K,
  Q8_0; Q6_K's 8 small dots a group gain nothing).

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

GEMV_MAX_ROWS = 8     # rows a call of the sums (CUDA cores)
DOT_ROWS = 8          # rows a call of the dots (x zero-padded to them: the dot's N; 8 ran faster than 16)
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
  dot: int = 0              # bfloat16 x, x's rows padded to DOT_ROWS, tensor-core dots: 1 a step's
                            # weights made as ggml makes them, rounded to bfloat16, in one dot a
                            # part; 2 a group's q (exact in bfloat16) in a dot, its scale applied
                            # to the dot's sums (the float32 weights of grouped=1)
  prefetch: int = 0         # 1: a loop step's loads (x's columns, the tile, its scales) issued one step
                            # ahead, before the previous step's sums (grouped sums and "pallas_q8")
  x_blocks: int = 0         # "pallas_q8" only: 1 x's int8 blocks made once by their own kernel before
                            # the GEMV (`planar_q8.quantize_x_blocks`); 0 each program quantizes x


DEFAULT_CONFIG = PlanarGemvConfig()
# the "pallas_dot" product's tiles: the best dot=2 row of an H100 sweep (2026-12-06; docs/PERFORMANCE.md)
DOT_CONFIG = PlanarGemvConfig(block_n=64, block_groups=4, grouped=1, dot=2)


@dataclasses.dataclass(frozen=True)
class PlanarTiles:
  bn: int       # output columns a program
  cb: int       # groups a loop step
  split: int    # K ranges
  steps: int    # loop steps a K range


def check_config(cfg: PlanarGemvConfig) -> PlanarGemvConfig:
  _kernel.check_fields(cfg, PlanarGemvConfig, ("block_n", "block_groups"), ("min_programs", "num_warps", "num_stages"))
  for name, most in (("sum_each_step", 1), ("grouped", 1), ("dot", 2)):
    v = getattr(cfg, name)
    if not isinstance(v, int) or isinstance(v, bool) or v not in range(most + 1):
      raise ValueError(f"{name} must be {', '.join(map(str, range(most)))} or {most}, got {getattr(cfg, name)!r}")
  if not isinstance(cfg.split_k, int) or isinstance(cfg.split_k, bool) or cfg.split_k < 0 or \
      (cfg.split_k and cfg.split_k & (cfg.split_k - 1)):
    raise ValueError(f"split_k must be 0 (automatic) or a power of two, got {cfg.split_k!r}")
  for name in ("prefetch", "x_blocks"):
    if getattr(cfg, name) not in (0, 1) or isinstance(getattr(cfg, name), bool):
      raise ValueError(f"{name} must be 0 or 1, got {getattr(cfg, name)!r}")
  if cfg.prefetch and (cfg.dot or not cfg.grouped):
    raise ValueError(f"prefetch=1 needs grouped=1 and dot=0 (the loop it changes), got grouped={cfg.grouped}, "
                     f"dot={cfg.dot}")
  if cfg.dot and cfg.block_n < 16:
    raise ValueError(f"block_n must be >= 16 with dot={cfg.dot} (the dot's least M), got {cfg.block_n}")
  return cfg


def uses_dot(cfg: Optional[PlanarGemvConfig], fmt: str, n: int, k: int, x_dtype) -> bool:
  """Does a call run the dots? `dot` 1 or 2, bfloat16 x and >= 16 output columns a program: fixed by
  the matrix and x's dtype, never by S (a row's sums are those of any call)."""
  cfg = DEFAULT_CONFIG if cfg is None else cfg
  return bool(cfg.dot) and _ref.compute_dtype(x_dtype) == jnp.bfloat16 and resolve_tiles(cfg, fmt, max(n, 1), k).bn >= 16


def max_rows(cfg: Optional[PlanarGemvConfig], fmt: str, n: int, k: int, x_dtype) -> int:
  """Rows of x a call takes."""
  return DOT_ROWS if uses_dot(cfg, fmt, n, k, x_dtype) else GEMV_MAX_ROWS


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


def step_start(i, cb: int):
  """The first group of loop step i (a Python int: the step before the loop), a multiple of cb."""
  return i * cb if isinstance(i, int) else pl.multiple_of(i * cb, cb)


def run_steps(loads, step, acc0, steps: int, prefetch: bool):
  """A program's K loop: acc = step(loads(i), acc) for i < steps. `prefetch`: step i + 1's loads
  issued before step i's sums (carried in the loop; the last step loads itself again)."""
  if not prefetch:
    return lax.fori_loop(0, steps, lambda i, acc: step(loads(i), acc), acc0)

  def body(i, carry):
    acc, loaded = carry
    ahead = loads(jnp.minimum(i + 1, steps - 1))
    return step(loaded, acc), ahead
  return lax.fori_loop(0, steps, body, (acc0, loads(0)))[0]


def _exact_float(q_i32, bias: float):
  """int32 q in [0, 2^23) -> float32 q - bias, by the bits of 2^23 + q (no int -> float convert)."""
  return lax.bitcast_convert_type(q_i32 | _MAGIC, jnp.float32) - (_TWO23 + bias)


def _to_bf16(w, interpret: bool):
  """float32 -> the nearest bfloat16, as float32. Interpreted, `reduce_precision` (XLA may drop a
  f32 -> bf16 -> f32 pair of converts); Triton keeps the converts (and has no reduce_precision)."""
  if interpret:
    return lax.reduce_precision(w, exponent_bits=8, mantissa_bits=7)
  return w.astype(jnp.bfloat16).astype(jnp.float32)


def _q6_loads(w_ref, s_ref, g0, cb: int):
  """q6_k: a step's loads: (ql bytes [[a0h0, a0h1], [a1h0, a1h1]], qh bytes [h0, h1] int32 [BN, CB, 16]
  each; scale words (w0, w1, w2) [BN, CB])."""
  ql = [[w_ref[:, pl.ds(g0, cb), pl.ds(32 * a + 16 * h, 16)].astype(jnp.int32) for h in (0, 1)] for a in (0, 1)]
  qh = [w_ref[:, pl.ds(g0, cb), pl.ds(64 + 16 * h, 16)].astype(jnp.int32) for h in (0, 1)]
  return ql, qh, tuple(s_ref[:, pl.ds(g0, cb), i] for i in range(3))


def _q6_parts(loaded):
  """q6_k: a step's 8 parts (p = 2j + h: a chunk's values 32j + 16h .. + 16), each (q - 32 float32
  [BN, CB, 16], its scale d * sc float32 [BN, CB]), from its ql and qh bytes (`_q6_loads`)."""
  ql, qh, words = loaded
  scales = q6_scales(words)
  parts = []
  for j in range(4):
    for h in (0, 1):
      q = ((ql[j & 1][h] >> (4 * (j >> 1))) & 15) | (((qh[h] >> (2 * j)) & 3) << 4)
      parts.append((_exact_float(q, 32.0), scales[2 * j + h]))
  return parts


def q6_scales(words):
  """q6_k: a step's 8 parts' scales d * sc float32 [BN, CB] from its scale words (w0, w1: the int8
  sc bytes of parts 0-3 and 4-7; w2: d, float16, in the low half)."""
  w0, w1, w2 = words
  d = lax.bitcast_convert_type((w2 & 0xFFFF).astype(jnp.uint16), jnp.float16).astype(jnp.float32)
  return [d * _exact_float(((((w0, w1)[p // 4] >> (8 * (p % 4))) & 0xFF).astype(jnp.int32)) ^ 128, 128.0)
          for p in range(8)]


def _weights(fmt: str, w_ref, s_ref, g0, cb: int):
  """A step's tile of the values plane -> its parts' float32 weights [BN, CB, W] each, as ggml makes
  them (scale * q - offset)."""
  out = []
  for q, sc, off in _grouped_values(fmt, _grouped_loads(fmt, w_ref, s_ref, g0, cb)):
    w = sc[:, :, None] * q
    out.append(w if off is None else w - off[:, :, None])
  return out


def _grouped_loads(fmt: str, w_ref, s_ref, g0, cb: int):
  """A step's loads of the tile and its scales, as `_grouped_values` takes them."""
  if fmt == "q6_k":
    return _q6_loads(w_ref, s_ref, g0, cb)
  vi = w_ref[:, pl.ds(g0, cb), :].astype(jnp.int32)
  if fmt == "q4_k":
    return vi, tuple(s_ref[:, pl.ds(g0, cb), j] for j in (0, 1))
  return vi, s_ref[:, pl.ds(g0, cb)]


def _grouped_values(fmt: str, loaded):
  """A step's tile (`_grouped_loads`) decoded once for all rows -> (q, scale, offset) a part: q
  float32 [BN, CB, W] exact, scale [BN, CB], offset [BN, CB] or None (the part's weights: scale * q
  - offset)."""
  if fmt == "q6_k":
    return [(q, sc, None) for q, sc in _q6_parts(loaded)]
  vi, sc = loaded
  if fmt == "q8_0":
    return [(_exact_float((vi & 255) ^ 128, 128.0), sc.astype(jnp.float32), None)]
  if fmt == "q4_0":
    d = sc.astype(jnp.float32)
    return [(_exact_float(vi & 15, 8.0), d, None), (_exact_float(vi >> 4, 8.0), d, None)]
  s_lo, s_hi, o_lo, o_hi = _planar.k_scale_products(sc[0], sc[1], lambda q: _exact_float(q, 0.0))
  return [(_exact_float(vi & 15, 0.0), s_lo, o_lo), (_exact_float(vi >> 4, 0.0), s_hi, o_hi)]


def _grouped_sums(values, x_parts):
  """The float32-weights product of a step's tile (`_grouped_values`), the scale applied once a
  group: [BN, CB] sums of one row (x_parts: its parts' columns [CB, W] float32)."""
  if values[0][2] is None and all(sc is values[0][1] for _, sc, _ in values):   # q8_0, q4_0: one scale a group
    return values[0][1] * sum(jnp.sum(q * xp[None], axis=2) for (q, _, _), xp in zip(values, x_parts))
  out = None
  for (q, sc, off), xp in zip(values, x_parts):
    t = sc * jnp.sum(q * xp[None], axis=2)
    if off is not None:
      t = t - off * jnp.sum(xp, axis=1)[None]
    out = t if out is None else out + t
  return out


def _gemv_kernel(x_ref, w_ref, s_ref, o_ref, *, fmt: str, tiles: PlanarTiles, rows: int, dtype, interpret: bool,
                 sum_each_step: bool, grouped: bool, prefetch: bool = False):
  # x_ref [S, groups / split, parts * W] (x's dtype; this K range's columns), w_ref [BN, groups / split, W],
  # s_ref [BN, groups / split] (q4_k, q6_k [BN, chunks / split, words] uint32), o_ref [1, S, BN] float32 (this K range's sums)
  t, w = tiles, _GROUPS[fmt][1]
  parts = _GROUPS[fmt][2]

  def grouped_loads(i):                     # (a row's parts' columns [CB, W], a tuple a row; the tile's loads)
    g0 = step_start(i, t.cb)
    xs = tuple(tuple(x_ref[r, pl.ds(g0, t.cb), pl.ds(p * w, w)] for p in range(parts)) for r in range(rows))
    return xs, _grouped_loads(fmt, w_ref, s_ref, g0, t.cb)

  def grouped_step(loaded, acc):            # the tile decoded once, then each row's sums
    xs, tile = loaded
    values = _grouped_values(fmt, tile)
    return tuple(a + _grouped_sums(values, [xp.astype(jnp.float32) for xp in xr]) for xr, a in zip(xs, acc))

  def body(i, acc):                         # ungrouped: acc a row's sums [BN, CB] (or products [BN, CB, W])
    g0 = step_start(i, t.cb)
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
  acc0 = tuple(jnp.zeros(shape, jnp.float32) for _ in range(rows))
  if grouped:
    acc = run_steps(grouped_loads, grouped_step, acc0, t.steps, prefetch)
  else:
    acc = lax.fori_loop(0, t.steps, body, acc0)
  for r in range(rows):
    o_ref[0, r, :] = jnp.sum(acc[r], axis=1) if sum_each_step else jnp.sum(jnp.sum(acc[r], axis=2), axis=1)


def _dot_kernel(x_ref, w_ref, s_ref, o_ref, *, fmt: str, tiles: PlanarTiles, grouped: bool):
  # x_ref [DOT_ROWS, groups / split, parts * W] bfloat16, w_ref / s_ref as `_gemv_kernel`'s,
  # o_ref [1, BN, DOT_ROWS] float32 (this K range's sums, transposed)
  t, w = tiles, _GROUPS[fmt][1]
  rows = x_ref.shape[0]

  def body(i, acc):                         # acc [BN, DOT_ROWS] float32
    g0 = pl.multiple_of(i * t.cb, t.cb)
    if grouped:                             # dot=2: a dot a group and part, then its scale
      for c in range(t.cb):
        tile = _grouped_loads(fmt, w_ref, s_ref, g0 + c, 1)
        for p, (q, sc, off) in enumerate(_grouped_values(fmt, tile)):   # q [BN, 1, W]
          xp = x_ref[:, pl.ds(g0 + c, 1), pl.ds(p * w, w)].reshape(rows, w)            # [rows, W]
          q = q.reshape(q.shape[0], w).astype(jnp.bfloat16)                             # exact in bfloat16
          acc = acc + sc * lax.dot_general(q, xp, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
          if off is not None:
            acc = acc - off * jnp.sum(xp.astype(jnp.float32), axis=1)[None, :]
      return acc
    for p, wp in enumerate(_weights(fmt, w_ref, s_ref, g0, t.cb)):
      a = wp.astype(jnp.bfloat16).reshape(wp.shape[0], t.cb * w)                        # [BN, CB * W]
      xp = x_ref[:, pl.ds(g0, t.cb), pl.ds(p * w, w)].reshape(rows, t.cb * w)          # [rows, CB * W]
      acc = acc + lax.dot_general(a, xp, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return acc

  o_ref[0] = lax.fori_loop(0, t.steps, body, jnp.zeros((o_ref.shape[1], rows), jnp.float32))


def _scale_spec(fmt: str, t: PlanarTiles, gs: int, scales):
  if fmt in ("q4_k", "q6_k"):
    return pl.BlockSpec((t.bn, gs) + scales.shape[2:], lambda ni, si: (ni, si, 0))
  return pl.BlockSpec((t.bn, gs), lambda ni, si: (ni, si))


@functools.partial(jax.jit, static_argnames=("fmt", "k", "cfg", "tiles", "interpret", "dot"))
def _call(x_sk, values, scales, *, fmt: str, k: int, cfg: PlanarGemvConfig, tiles: PlanarTiles, interpret: bool,
          dot: bool = False):
  gv = _GROUPS[fmt][0]
  n, s, t = values.shape[0], x_sk.shape[0], tiles
  gs = k // gv // t.split                                     # groups a K range
  if dot:          # x zero-padded to DOT_ROWS rows; a program's sums come out [BN, rows]
    rows, x_sk = DOT_ROWS, jnp.pad(x_sk.astype(jnp.bfloat16), ((0, DOT_ROWS - s), (0, 0)))
    kernel = functools.partial(_dot_kernel, fmt=fmt, tiles=t, grouped=cfg.dot == 2)
    out_spec, out_shape = pl.BlockSpec((1, t.bn, rows), lambda ni, si: (si, ni, 0)), (t.split, n, rows)
  else:
    rows = s
    kernel = functools.partial(_gemv_kernel, fmt=fmt, tiles=t, rows=s, dtype=_ref.compute_dtype(x_sk.dtype),
                               interpret=interpret, sum_each_step=bool(cfg.sum_each_step), grouped=bool(cfg.grouped),
                               prefetch=bool(cfg.prefetch))
    out_spec, out_shape = pl.BlockSpec((1, s, t.bn), lambda ni, si: (si, 0, ni)), (t.split, s, n)
  part = pl.pallas_call(
      kernel,
      grid=(n // t.bn, t.split),
      in_specs=[pl.BlockSpec((rows, gs, gv), lambda ni, si: (0, si, 0)),
                pl.BlockSpec((t.bn, gs, _VALUE_BYTES[fmt]), lambda ni, si: (ni, si, 0)), _scale_spec(fmt, t, gs, scales)],
      out_specs=out_spec,
      out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
      compiler_params=_kernel._compiler_params(cfg, interpret),   # pylint: disable=protected-access
      interpret=interpret,
      name="kvjax_planar_dot" if dot else "kvjax_planar_gemv",
  )(x_sk.reshape(rows, k // gv, gv), values.reshape(n, k // gv, _VALUE_BYTES[fmt]), scales)
  out = sum_ranges(part)                    # the K ranges' sums, in a fixed order
  return out[:, :s].T if dot else out


def checked_call(what: str, x_sk, values, scales, fmt: str, k: int, cfg: PlanarGemvConfig, most_rows,
                 interpret: bool):
  """The checks of a planar GEMV call (`what` names it; `most_rows(n)`: the rows it takes), before
  anything runs -> (N, S, tiles)."""
  if not hasattr(x_sk, "shape") or not hasattr(x_sk, "dtype"):
    raise ValueError(f"{what}: x must be an array [S, {k}], got {type(x_sk).__name__}")
  n = _planar.check_planes(values, scales, fmt, k)
  s = _formats.check_x(x_sk, k)
  tiles = resolve_tiles(cfg, fmt, max(n, 1), k)
  if s > most_rows(n):
    raise ValueError(f"{what}: takes 1 to {most_rows(n)} rows of x here, got {s}")
  if not interpret and jax.default_backend() != "gpu":
    raise ValueError(f"{what}: the kernel compiles for a GPU; on {jax.default_backend()} pass interpret=True")
  return n, s, tiles


def sum_ranges(part):
  """[split, ...] partial sums of the K ranges -> their sum, in a fixed order."""
  out = part[0]
  for j in range(1, part.shape[0]):
    out = out + part[j]
  return out


def planar_gemv(x_sk, values, scales, fmt: str, k: int, *, config: Optional[PlanarGemvConfig] = None,
                interpret: bool = False):
  """x [S, K] @ W[N, K].T -> [S, N] float32 for S <= GEMV_MAX_ROWS, W in planes (`planar.to_planes`)."""
  cfg = DEFAULT_CONFIG if config is None else config
  if isinstance(cfg, PlanarGemvConfig) and cfg.x_blocks:
    raise ValueError(f"planar GEMV: x_blocks must be 0 (x's int8 blocks are the q8 GEMV's, planar_q8), got {cfg.x_blocks}")
  n, s, tiles = checked_call("planar GEMV", x_sk, values, scales, fmt, k, cfg,
                             lambda n: max_rows(cfg, fmt, n, k, x_sk.dtype), interpret)
  if n == 0:
    return jnp.zeros((s, 0), jnp.float32)
  return _call(x_sk, values, scales, fmt=fmt, k=k, cfg=cfg, tiles=tiles, interpret=interpret,
               dot=uses_dot(cfg, fmt, n, k, x_sk.dtype))
