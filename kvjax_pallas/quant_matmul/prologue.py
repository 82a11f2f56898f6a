"""x made inside the kernel that quantizes it for the q8 GEMV: a norm or a gate, then x's int8 blocks.

A decode forward is paced by the host's launches (docs/PERFORMANCE.md: ~7 us of host a kernel),
and every product of the q8 GEMV (`planar_q8`) read x from XLA's kernels before its own
quantizing kernel: the RMS norm before a block's projections, SwiGLU's silu(gate) * up before the
FFN's down product, the Gated DeltaNet's gated per-head norm before its output product. Here the
quantizing kernel computes x itself from the arrays it comes from, so those XLA kernels go:

  "rms"        x = rms_norm(a) * w over the row                     operands (a [S, K], w [K])
  "swiglu"     x = silu(g) * u                                      operands (g, u: [S, K] or `Cols`)
  "gated_rms"  x = (rms_norm(o per head) * w).astype(o) * silu(z)   operands (o [S, K], z [S, K] or
                                                                    `Cols`, w [head_dim])

then x passes through the casts named (`Prologue.casts`: the model's own, then the weights'
compute dtype; to bfloat16 by integer rounding, `_cast`, as XLA rounds) and is quantized exactly
as `planar_q8.quantize_x_blocks` quantizes an x made before it (`planar_q8.write_blocks`).
`Cols(array, start, width)` names columns of a wider array (a joined product's output,
`kvjax.fused`): the kernel reads them in place, where a slice would have been one more XLA kernel.

`prologue_reference(p, operands)` is x in plain jnp, written as the model writes it (the model's
path for weights of other products, and for more rows than a GEMV call takes); the kernel's sums
of squares run in their own order, so its x may differ from the reference's in the last bit of a
norm, never with the call's other rows: a decode row and the same row among verify rows agree bit
for bit. `planar_q8_gemv_pre(p, operands, values, scales, fmt, k)` is the GEMV on such an x.

Grid: rows x (blocks / per), `per` blocks of 32 values a program (a power of two dividing the
blocks, the column starts' blocks and, for "gated_rms", a multiple of a head's blocks). "rms"
reads its whole row in each program for the sum of squares (K values from L2: no program waits
on another). GPU lowering: Pallas Triton; `interpret=True` anywhere. Imports nothing from `kvjax`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax_pallas.quant_matmul import kernel as _kernel
from kvjax_pallas.quant_matmul import planar_gemv as _gemv
from kvjax_pallas.quant_matmul import planar_q8 as _q8

PROLOGUES = ("rms", "swiglu", "gated_rms")
PROLOGUE_ENV = "KVJAX_Q8_PROLOGUE"   # "0": the model makes x in XLA first, as before (comparisons)


def prologue_enabled() -> bool:
  """Whether a model's q8 products make their x (`$KVJAX_Q8_PROLOGUE`: unset or 1 yes, 0 no; read when a step is
  traced) -> bool, or a one-line ValueError naming the variable."""
  value = os.environ.get(PROLOGUE_ENV, "").strip()
  if value not in ("", "0", "1"):
    raise ValueError(f"${PROLOGUE_ENV} must be 0 or 1 (or unset: 1), got {value!r}")
  return value != "0"
_ARITY = {"rms": 2, "swiglu": 2, "gated_rms": 3}
_BLOCK = _q8.Q8_BLOCK
Q8_MAX_ROWS = _q8.Q8_MAX_ROWS   # rows a GEMV call takes


@dataclasses.dataclass(frozen=True)
class Prologue:
  """What the quantizing kernel computes x as (module docstring). Static: part of a compiled step's key."""
  kind: str
  eps: float = 0.0
  head_dim: int = 0                # "gated_rms": values a head (a power of two, a multiple of 32)
  casts: Tuple[str, ...] = ()      # dtype names x passes through, in order, after the formula

  def __post_init__(self):
    if self.kind not in PROLOGUES:
      raise ValueError(f"prologue: kind must be one of {', '.join(PROLOGUES)}, got {self.kind!r}")
    if self.kind == "gated_rms" and (self.head_dim < _BLOCK or self.head_dim & (self.head_dim - 1)):
      raise ValueError(f"prologue gated_rms: head_dim must be a power of two >= {_BLOCK}, got {self.head_dim}")

  def cast_to(self, dtype) -> "Prologue":
    """The same prologue, x then cast to `dtype` (a weight's compute dtype)."""
    return dataclasses.replace(self, casts=self.casts + (jnp.dtype(dtype).name,))


class Cols(NamedTuple):
  """Columns [start, start + width) of `array` [S, N]."""
  array: Any
  start: int
  width: int

  def value(self):
    return lax.slice_in_dim(self.array, self.start, self.start + self.width, axis=1)


def _check_arity(p: Prologue, operands) -> None:
  if len(operands) != _ARITY[p.kind]:
    raise ValueError(f"prologue {p.kind}: takes {_ARITY[p.kind]} operands, got {len(operands)}")


def _as_cols(a) -> Cols:
  return a if isinstance(a, Cols) else Cols(a, 0, a.shape[-1])


class PrologueInput:
  """x as a prologue of operands (a trace-time value: `value()` is x in jnp, `shape` / `dtype` x's)."""

  def __init__(self, prologue: Prologue, operands: Sequence[Any]):
    _check_arity(prologue, operands)
    self.prologue, self.operands = prologue, tuple(operands)
    first, second = _as_cols(self.operands[0]), self.operands[1]
    if prologue.casts:
      dtype = jnp.dtype(prologue.casts[-1])
    elif prologue.kind == "rms":
      dtype = jnp.dtype(first.array.dtype)
    else:   # the formula's: silu(g) * u, or the norm (o's dtype) times silu(z)
      dtype = jnp.result_type(first.array.dtype, _as_cols(second).array.dtype)
    self.shape, self.dtype = (first.array.shape[0], first.width), dtype

  def cast_to(self, dtype) -> "PrologueInput":
    return PrologueInput(self.prologue.cast_to(dtype), self.operands)

  def value(self):
    return prologue_reference(self.prologue, self.operands)


def _casts(y, casts):
  for c in casts:
    y = y.astype(c)
  return y


def rms_norm(x, w, eps):
  """RMS norm over the last axis, times w, in x's dtype (float32 inside): the model's (`kvjax.model.rms_norm`)."""
  x32 = x.astype(jnp.float32)
  y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * w.astype(jnp.float32)).astype(x.dtype)


def prologue_reference(p: Prologue, operands):
  """x [S, K] in plain jnp (the model's formulas: module docstring), after `p.casts`."""
  if p.kind == "rms":
    y = rms_norm(*operands, p.eps)
  elif p.kind == "swiglu":
    g, u = (_as_cols(a).value() for a in operands)
    y = jax.nn.silu(g) * u
  else:
    o, z, w = operands
    s, k = o.shape
    o3 = o.reshape(s, k // p.head_dim, p.head_dim)
    y = (rms_norm(o3, w, p.eps) * jax.nn.silu(_as_cols(z).value().reshape(o3.shape))).reshape(s, k)
  return _casts(y, p.casts)


def _cast(y, dtype):
  """y -> dtype inside a kernel; float32 to bfloat16 rounded to nearest even by integer operations (NaN kept),
  which no compiler may drop: XLA, running the kernel interpreted on a GPU, may keep a float32 -> bfloat16 ->
  float32 pair at float32 inside a fusion (its excess precision), where the compiled kernel rounds."""
  dtype = jnp.dtype(dtype)
  if dtype != jnp.bfloat16 or y.dtype != jnp.float32:
    return y.astype(dtype)
  bits = lax.bitcast_convert_type(y, jnp.int32)
  bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536          # int32 wraps as the uint32 bits would
  return jnp.where(y == y, lax.bitcast_convert_type(bits, jnp.float32), y).astype(dtype)


def _finish(units, casts):
  out = []
  for u in units:
    for c in casts:
      u = _cast(u, c)
    out.append(u.astype(jnp.float32))
  return out


def _unit(ref, h: int, row=None, start=None, per=None):
  """Unit h ([B, 4, 4] float32) of a block ref [1, B, 8, 4], or of the row `row` at blocks start.. of a whole ref."""
  if row is None:
    return ref[0, :, pl.ds(4 * h, 4), :].astype(jnp.float32)
  return ref[row, pl.ds(start, per), pl.ds(4 * h, 4), :].astype(jnp.float32)


def _rms_kernel(a_ref, w_ref, *out_refs, p: Prologue, k: int, per: int):
  # a_ref [S, K/32, 8, 4] (the whole array: the row's sum of squares), w_ref [per, 8, 4]
  r, j = pl.program_id(0), pl.program_id(1)
  ss = jnp.float32(0)
  for c in range(k // _BLOCK // per):
    v = a_ref[r, pl.ds(c * per, per), :, :].astype(jnp.float32)
    ss = ss + jnp.sum(jnp.sum(jnp.sum(v * v, axis=2), axis=1), axis=0)
  scale = lax.rsqrt(ss / k + p.eps)
  dtype = a_ref.dtype
  units = [_cast(_unit(a_ref, h, r, j * per, per) * scale * w_ref[:, pl.ds(4 * h, 4), :].astype(jnp.float32),
                 dtype) for h in (0, 1)]
  _q8.write_blocks(_finish(units, p.casts), *out_refs)


def _swiglu_kernel(g_ref, u_ref, *out_refs, p: Prologue):
  # g_ref, u_ref [1, per, 8, 4]
  units = [jax.nn.silu(_unit(g_ref, h)) * _unit(u_ref, h) for h in (0, 1)]
  _q8.write_blocks(_finish(units, p.casts), *out_refs)


def _gated_rms_kernel(o_ref, z_ref, w_ref, *out_refs, p: Prologue, per: int):
  # o_ref, z_ref [1, per, 8, 4]; w_ref [head blocks, 8, 4]
  hb = p.head_dim // _BLOCK
  o = [_unit(o_ref, h) for h in (0, 1)]
  sb = sum(jnp.sum(jnp.sum(u * u, axis=2), axis=1) for u in o)                # [per] a block's sum of squares
  heads = jnp.sum(sb.reshape(per // hb, hb), axis=1)                           # [per / hb]
  scale = jnp.broadcast_to(lax.rsqrt(heads / p.head_dim + p.eps)[:, None], (per // hb, hb)).reshape(per)
  units = []
  for h in (0, 1):
    w = jnp.broadcast_to(w_ref[:, pl.ds(4 * h, 4), :].astype(jnp.float32)[None], (per // hb, hb, 4, 4))
    n = _cast(o[h] * scale[:, None, None] * w.reshape(per, 4, 4), o_ref.dtype)
    units.append(n * jax.nn.silu(_unit(z_ref, h)))
  _q8.write_blocks(_finish(units, p.casts), *out_refs)


def _per(p: Prologue, nb: int, starts: Sequence[int]) -> int:
  """Blocks a program: a power of two <= 32 dividing the blocks and every start's blocks."""
  per = _kernel._pow2_divisor(nb, 32)   # pylint: disable=protected-access
  for st in starts:
    if st:
      per = min(per, _kernel._pow2_divisor(st // _BLOCK, 32))   # pylint: disable=protected-access
  if p.kind == "gated_rms" and per % (p.head_dim // _BLOCK):
    raise ValueError(f"prologue gated_rms: the columns' start and count must be whole heads of {p.head_dim} "
                     f"values in blocks of {_BLOCK} (a program's {per} blocks split a head)")
  return per


def check_operands(p: Prologue, operands, rows_most: Optional[int] = None) -> Tuple[int, int]:
  """The operands' shapes for `p`, or a ValueError naming the operand -> (S, K)."""
  _check_arity(p, operands)
  rows = [_as_cols(a) for a in operands[:2 if p.kind != "rms" else 1]]
  s, k = rows[0].array.shape[0], rows[0].width
  for i, c in enumerate(rows):
    if c.array.ndim != 2 or c.array.shape[0] != s or c.width != k or c.start < 0 or \
        c.start + c.width > c.array.shape[1] or c.start % _BLOCK:
      raise ValueError(f"prologue {p.kind}: operand {i} must be [{s}, {k}] columns of a 2-D array at a multiple of "
                       f"{_BLOCK}, got {c.width} columns at {c.start} of {tuple(c.array.shape)}")
  if k % _BLOCK:
    raise ValueError(f"prologue {p.kind}: x's {k} columns must be a multiple of {_BLOCK}")
  w = operands[-1] if p.kind != "swiglu" else None
  want = (k,) if p.kind == "rms" else (p.head_dim,)
  if w is not None and tuple(w.shape) != want:
    raise ValueError(f"prologue {p.kind}: the norm weight must be {want}, got {tuple(w.shape)}")
  if p.kind == "gated_rms" and k % p.head_dim:
    raise ValueError(f"prologue gated_rms: x's {k} columns must be whole heads of {p.head_dim}")
  if rows_most is not None and s > rows_most:
    raise ValueError(f"prologue {p.kind}: takes 1 to {rows_most} rows, got {s}")
  return s, k


def quantize_x_blocks_pre(p: Prologue, operands, *, interpret: bool = False):
  """x (the prologue `p` of `operands`) -> its int8 blocks, as `planar_q8.quantize_x_blocks` returns them."""
  k = check_operands(p, operands)[1]
  rows = 1 if p.kind == "rms" else 2              # the operands that are columns of [S, *] arrays
  cols = [_as_cols(a) for a in operands[:rows]]
  # read in place where the array is whole blocks of 32 values a row (a joined product's output of
  # other widths: its columns cut out first, one XLA slice)
  cols = [c if c.array.shape[1] % _BLOCK == 0 else Cols(c.value(), 0, c.width) for c in cols]
  arrays = tuple(c.array for c in cols) + tuple(operands[rows:])
  return _blocks_pre(arrays, p=p, k=k, starts=tuple(c.start for c in cols), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("p", "k", "starts", "interpret"))
def _blocks_pre(arrays, *, p: Prologue, k: int, starts, interpret: bool):
  s, nb = arrays[0].shape[0], k // _BLOCK
  per = _per(p, nb, starts)
  view = lambda a: a.reshape(a.shape[0], a.shape[1] // _BLOCK, 8, 4)
  chunk = lambda st: pl.BlockSpec((1, per, 8, 4), lambda r, j, o=st // _BLOCK // per: (r, o + j, 0, 0))
  if p.kind == "rms":
    a, w = arrays
    body = functools.partial(_rms_kernel, p=p, k=k, per=per)
    specs = [pl.BlockSpec(), pl.BlockSpec((per, 8, 4), lambda r, j: (j, 0, 0))]   # a: the whole array
    args = (view(a), w.reshape(nb, 8, 4))
  elif p.kind == "swiglu":
    body = functools.partial(_swiglu_kernel, p=p)
    specs = [chunk(starts[0]), chunk(starts[1])]
    args = (view(arrays[0]), view(arrays[1]))
  else:
    o, z, w = arrays
    hb = p.head_dim // _BLOCK
    body = functools.partial(_gated_rms_kernel, p=p, per=per)
    specs = [chunk(starts[0]), chunk(starts[1]), pl.BlockSpec((hb, 8, 4), lambda r, j: (0, 0, 0))]
    args = (view(o), view(z), w.reshape(hb, 8, 4))
  return _q8.blocks_call(body, specs, s, k, per, f"kvjax_quantize_x_{p.kind}", interpret)(*args)


def planar_q8_gemv_pre(p: Prologue, operands, values, scales, fmt: str, k: int, *,
                       config: Optional[_gemv.PlanarGemvConfig] = None, interpret: bool = False):
  """x (the prologue `p` of `operands`) @ W[N, K].T -> [S, N] float32, S <= Q8_MAX_ROWS, W in planes: the
  q8 GEMV (`planar_q8.planar_q8_gemv`) on blocks made by the prologue's kernel. `config` must make x's blocks
  first (`x_blocks` 1, the default)."""
  cfg = _q8.DEFAULT_CONFIG if config is None else config
  if not cfg.x_blocks or cfg.dot:
    raise ValueError(f"prologue GEMV: config must make x's blocks first (x_blocks 1, dot 0), got {cfg}")
  s, kx = check_operands(p, operands, Q8_MAX_ROWS)
  x_like = jax.ShapeDtypeStruct((s, kx), jnp.float32)
  n, s, tiles = _gemv.checked_call("prologue q8 GEMV", x_like, values, scales, fmt, k, cfg,
                                   lambda n: Q8_MAX_ROWS, interpret)
  if n == 0:
    return jnp.zeros((s, 0), jnp.float32)
  blocks = quantize_x_blocks_pre(p, operands, interpret=interpret)
  return _q8._call(blocks, values, scales, fmt=fmt, k=k, cfg=cfg, tiles=tiles,   # pylint: disable=protected-access
                   interpret=interpret)
