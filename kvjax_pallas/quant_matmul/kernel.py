"""Matmul with GGUF-quantized weights: a Pallas kernel that dequantizes weight tiles as it reads them.

`quant_matmul_pallas(x_sk, w_nb, fmt, k, config=..., interpret=...)` computes what
`reference.quant_matmul_reference` does, x [S, K] @ dequantize(w)[N, K].T -> [S, N] float32,
without ever writing the [N, K] weights out: every program decodes its weight tile chunk by
chunk in registers and feeds it to a dot with float32 accumulation.

GPU lowering: written for the Pallas **Triton** lowering (`pl.pallas_call` + `BlockSpec`,
Triton compiler params), using only what that lowering takes: loads of power-of-two shapes with
`pl.ds` slices and integer indices, int32 bit operations, equal-width bitcasts, two-operand
stacks along the last axis, order-keeping reshapes, `dot_general`. No scalar prefetch, no
Mosaic-GPU primitive, so it also runs anywhere with `interpret=True` (the CPU tests). It has
NOT been compiled on a GPU yet: on the CPU, Pallas' lowering to Triton IR for a CUDA target
passes for every format (`jax.export`, tests/test_quant_matmul.py), but Triton's own compile,
the bits against the reference and the speed on the H200 are still to be checked. The Triton
lowering is deprecated since jax 0.11 (it still compiles there); a Mosaic GPU version would
follow the span-attention kernels (`plgpu.kernel`, `emit_pipeline`).

Grid (row tile of S, column tile of N), the row tiles of one weight tile next to each other in
launch order (the first axis varies fastest), so prefill tiles re-read a weight tile from L2.
A program loops over K in chunks of `kb` whole ggml blocks (`Tiles`): decode [BN, kb, ...] of
weight halfwords -> [BN, kc] values, dot with x's [BS, kc] chunk, accumulate [BS, BN] in f32.

Decoding: weights are read as little-endian uint16 halfwords (every block size is even), a
matrix [N, row_bytes / 2] seen as [N, blocks, block halfwords]. Each format's `_planes_*` turns
the halfwords of a chunk into planes: [BN, kb, w] float32 values that each share one bit
position of the halfwords (a byte, a nibble, ...) and one scale per block, each with the numpy
[w] of its elements' positions in the ggml block. `_interleave` joins the planes pairwise into
the kernel's column order; `column_order(fmt)` is that order (from the same code, by abstract
evaluation), and the wrapper permutes x's columns to it once per call (one small XLA gather of
x), so the decoded tile meets x without any shuffle of weight values. Values are computed as
ggml does, in float32 (d * q, (d * sc) * q - dmin * m): bit for bit `reference.dequantize`
(`decode_tile` runs the same code on an array for the tests).

x and the weights meet in bfloat16 when x is bfloat16, else in float32 (dot precision HIGHEST:
no TF32), like the reference; only the order of the float32 sums differs.

Tiles (`QuantMatmulConfig`, frozen; None: `default_config`): rows a program (a power of two:
S is zero-padded to a multiple; the Triton dot needs >= 16), output columns a program (the
largest power of two <= block_n dividing N, so on a GPU N needs a divisor 16: every projection
of the 27B geometry has 1024), values a K chunk (rounded down to a power of two of whole blocks
dividing K's blocks), warps and pipeline stages. The defaults are unmeasured guesses; no
split-K yet (a GEMV of N / block_n programs may leave SMs idle for small N).

Shapes: x_sk [S, K] float32 / bfloat16, w_nb uint8 [N, row_bytes] or uint16 [N, row_bytes / 2],
out [S, N] float32. Imports nothing from `kvjax`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, List, Optional, Tuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # jax 0.10 / 0.11: the Triton compiler params (the Triton backend, deprecated in jax 0.11)
  from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover (a jax without the Triton backend: interpret mode only)
  _pltriton = None

from kvjax_pallas.quant_matmul import formats as _formats
from kvjax_pallas.quant_matmul import reference as _ref

# ----------------------------------------------------------------------------- tiles


@dataclasses.dataclass(frozen=True)
class QuantMatmulConfig:
  """Tile sizes of the kernel (unmeasured defaults: `default_config`)."""
  block_s: int = 16      # rows of x a program: a power of two (>= 16 for the GPU's dot)
  block_n: int = 32      # output columns a program: upper bound, a power of two
  block_k: int = 256     # values a K chunk: upper bound (at least one ggml block is taken)
  num_warps: int = 4
  num_stages: int = 2


GEMV_CONFIG = QuantMatmulConfig(block_s=16, block_n=32, block_k=256, num_warps=4, num_stages=2)
GEMM_CONFIG = QuantMatmulConfig(block_s=64, block_n=64, block_k=256, num_warps=8, num_stages=2)
GEMV_MAX_ROWS = 16    # S up to this: decode / verify tiles; above: prefill tiles


def default_config(fmt: str, s: int) -> QuantMatmulConfig:
  """The config of a call with `s` rows: GEMV tiles for decode / verify, GEMM tiles above."""
  _formats.get_format(fmt)
  return GEMV_CONFIG if s <= GEMV_MAX_ROWS else GEMM_CONFIG


@dataclasses.dataclass(frozen=True)
class Tiles:
  """The resolved tiles of a call (`resolve_tiles`)."""
  bs: int         # rows a program
  bn: int         # output columns a program
  kb: int         # ggml blocks a K chunk
  kc: int         # values a K chunk (kb * block values)
  s_pad: int      # S rounded up to a multiple of bs
  n_chunks: int   # K chunks


def _is_pow2(v: int) -> bool:
  return v >= 1 and v & (v - 1) == 0


def _pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two <= cap that divides n (n, cap >= 1)."""
  d = 1
  while d * 2 <= cap and n % (d * 2) == 0:
    d *= 2
  return d


def check_fields(cfg, kind, pow2_fields, positive_fields):
  """`cfg` is a `kind` whose `pow2_fields` are powers of two and `positive_fields` ints >= 1, or a
  ValueError naming the field."""
  if not isinstance(cfg, kind):
    raise ValueError(f"config must be a {kind.__name__}, got {type(cfg).__name__}")
  for name in pow2_fields:
    v = getattr(cfg, name)
    if not isinstance(v, int) or not _is_pow2(v):
      raise ValueError(f"{name} must be a power of two >= 1, got {v!r}")
  for name in positive_fields:
    v = getattr(cfg, name)
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be an int >= 1, got {v!r}")
  return cfg


def check_config(cfg: QuantMatmulConfig) -> QuantMatmulConfig:
  return check_fields(cfg, QuantMatmulConfig, ("block_s", "block_n"), ("block_k", "num_warps", "num_stages"))


def resolve_tiles(cfg: QuantMatmulConfig, fmt: str, s: int, n: int, k: int) -> Tiles:
  """The tiles of a call of [S, K] x [N, K] weights of `fmt` under `cfg`."""
  check_config(cfg)
  f = _formats.check_k(fmt, k)
  nb = k // f.block_values
  kb = _pow2_divisor(nb, max(1, cfg.block_k // f.block_values))
  bs = cfg.block_s
  return Tiles(bs=bs, bn=_pow2_divisor(n, cfg.block_n), kb=kb, kc=kb * f.block_values,
               s_pad=-(-s // bs) * bs, n_chunks=nb // kb)


# ----------------------------------------------------------------------------- decoding
# A loader reads halfwords of the current chunk, int32 (zero-extended):
#   hw(c0, width) -> [R, kb, width]: halfwords c0 .. c0 + width - 1 of each block
#   one(c)        -> [R, kb, 1]:     halfword c of each block
# A plane is (positions in the block: np int [w], values: float32 [R, kb, w]).

Plane = Tuple[np.ndarray, jax.Array]


def _f16(h):
  """int32 halfwords holding f16 bits -> float32 (exact)."""
  return lax.bitcast_convert_type(h.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _byte(ld, b: int):
  """Byte b of each block (the halfwords start at byte 0) -> int32 [R, kb, 1]."""
  return (ld.one(b // 2) >> (8 * (b % 2))) & 0xFF


def _signed_byte(v):
  return (v ^ 0x80) - 0x80


def _planes_q8_0(ld) -> List[Plane]:
  d = _f16(ld.one(0))
  h = ld.hw(1, 16)                                   # bytes 2 + 2i, 3 + 2i: elements 2i, 2i + 1
  i = np.arange(16)
  return [(2 * i + p, d * _signed_byte((h >> (8 * p)) & 0xFF).astype(jnp.float32))
          for p in (0, 1)]


def _planes_q4_0(ld) -> List[Plane]:
  d = _f16(ld.one(0))
  h = ld.hw(1, 8)                                    # byte j: elements j (low), j + 16 (high)
  i = np.arange(8)
  out = []
  for p in (0, 1):                                   # byte 2i + p of the nibbles
    for t in (0, 1):                                 # low / high nibble
      q = ((h >> (8 * p + 4 * t)) & 15) - 8
      out.append((2 * i + p + 16 * t, d * q.astype(jnp.float32)))
  return out


def _k_scale_min(ld, sub: int):
  """Q4_K / Q5_K: (scale, min) int32 [R, kb, 1] of sub-block `sub` (ggml `get_scale_min_k4`;
  the 12 scale bytes start at byte 4)."""
  q = lambda b: _byte(ld, 4 + b)  # noqa: E731
  if sub < 4:
    return q(sub) & 63, q(sub + 4) & 63
  return ((q(sub + 4) & 15) | ((q(sub - 4) >> 6) << 4),
          (q(sub + 4) >> 4) | ((q(sub) >> 6) << 4))


def _planes_k(ld, qs_hw: int, qh_hw: Optional[int]) -> List[Plane]:
  """Q4_K (qh_hw None) and Q5_K: group j of 64 values is 32 nibble bytes at qs_hw + 16 j
  halfwords; byte l's low nibble is element 64 j + l (sub-block 2 j), its high nibble
  64 j + 32 + l (sub-block 2 j + 1); Q5_K's fifth bit of element 32 s + l is bit s of qh[l]."""
  d, dmin = _f16(ld.one(0)), _f16(ld.one(1))
  qh = None if qh_hw is None else ld.hw(qh_hw, 16)   # byte l = 2i + p
  i = np.arange(16)
  out = []
  for j in range(4):
    h = ld.hw(qs_hw + 16 * j, 16)                    # bytes 32 j + 2i + p
    for t in (0, 1):
      sub = 2 * j + t
      sc, mn = _k_scale_min(ld, sub)
      ds = d * sc.astype(jnp.float32)                # exact
      dm = dmin * mn.astype(jnp.float32)             # exact
      for p in (0, 1):
        q = (h >> (8 * p + 4 * t)) & 15
        if qh is not None:
          q = q | (((qh >> (8 * p + sub)) & 1) << 4)
        out.append((64 * j + 32 * t + 2 * i + p, ds * q.astype(jnp.float32) - dm))
  return out


def _planes_q4_k(ld) -> List[Plane]:
  return _planes_k(ld, qs_hw=8, qh_hw=None)


def _planes_q5_k(ld) -> List[Plane]:
  return _planes_k(ld, qs_hw=24, qh_hw=8)


def _planes_q6_k(ld) -> List[Plane]:
  """Half n (128 values): ql bytes 64 n .. + 63, qh bytes 32 n .. + 31. Element
  128 n + 64 hi + 32 a + l (l < 32) = (nibble hi of ql[64 n + 32 a + l]) | (bits 2a + 4hi of
  qh[32 n + l]) << 4, minus 32, times d * scale[element // 16] (int8 scales at byte 192)."""
  d = _f16(ld.one(104))
  i = np.arange(8)
  out = []
  for n in (0, 1):
    for a in (0, 1):
      for lh in (0, 1):                              # l = 16 lh + 2i + p
        ql = ld.hw(32 * n + 16 * a + 8 * lh, 8)
        qh = ld.hw(64 + 16 * n + 8 * lh, 8)
        for hi in (0, 1):
          elem0 = 128 * n + 64 * hi + 32 * a + 16 * lh
          ds = d * _signed_byte(_byte(ld, 192 + elem0 // 16)).astype(jnp.float32)
          for p in (0, 1):
            low = (ql >> (8 * p + 4 * hi)) & 15
            high = (qh >> (8 * p + 2 * a + 4 * hi)) & 3
            q = (low | (high << 4)) - 32
            out.append((elem0 + 2 * i + p, ds * q.astype(jnp.float32)))
  return out


_PLANES = {"q8_0": _planes_q8_0, "q4_0": _planes_q4_0, "q4_k": _planes_q4_k,
           "q5_k": _planes_q5_k, "q6_k": _planes_q6_k}


def _interleave(vals: list, stack: Callable, flatten: Callable):
  """Join a power-of-two list of same-shape planes pairwise (`stack` along a new last axis,
  then `flatten` the last two axes) until one is left."""
  assert _is_pow2(len(vals)), len(vals)
  while len(vals) > 1:
    vals = [flatten(stack([a, b], axis=-1)) for a, b in zip(vals[0::2], vals[1::2])]
  return vals[0]


def _join_planes(planes: List[Plane]):
  """Planes -> (positions np [block values], values [R, kb, block values])."""
  pos = _interleave([p for p, _ in planes], np.stack, lambda a: a.reshape(-1))
  val = _interleave([v for _, v in planes], jnp.stack,
                    lambda a: a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1]))
  return pos, val


class _RefLoader:
  """Reads the chunk's blocks [b0, b0 + kb) of a weight ref [BN, blocks, block halfwords]."""

  def __init__(self, ref, b0, kb: int):
    self.ref, self.b0, self.kb = ref, b0, kb

  def hw(self, c0: int, width: int):
    return self.ref[:, pl.ds(self.b0, self.kb), pl.ds(c0, width)].astype(jnp.int32)

  def one(self, c: int):
    return self.ref[:, pl.ds(self.b0, self.kb), c].astype(jnp.int32)[..., None]


class _ArrayLoader:
  """The same reads from an array [R, kb, block halfwords] (all its blocks)."""

  def __init__(self, w_rbh):
    self.w = w_rbh

  def hw(self, c0: int, width: int):
    return self.w[:, :, c0:c0 + width].astype(jnp.int32)

  def one(self, c: int):
    return self.w[:, :, c:c + 1].astype(jnp.int32)


@functools.lru_cache(maxsize=None)
def block_column_order(fmt: str) -> np.ndarray:
  """np int [block values]: the position in the ggml block of each column of a decoded block."""
  f = _formats.get_format(fmt)
  found = []

  def trace(w):
    pos, val = _join_planes(_PLANES[fmt](_ArrayLoader(w)))
    found.append(pos)
    return val

  jax.eval_shape(trace, jax.ShapeDtypeStruct((1, 1, f.block_halfwords), jnp.uint16))
  pos = np.asarray(found[0], np.int64)
  assert sorted(pos.tolist()) == list(range(f.block_values)), fmt
  return pos


def column_order(fmt: str, k: int) -> np.ndarray:
  """np int [K]: the input column (of x, of a dequantized row) of each kernel column."""
  f = _formats.check_k(fmt, k)
  nb = k // f.block_values
  return (np.arange(nb)[:, None] * f.block_values + block_column_order(fmt)[None]).reshape(-1)


def decode_tile(w_nb, fmt: str, k: int):
  """The kernel's decode of a whole weight matrix, outside a kernel: -> float32 [N, K] in
  kernel column order (`column_order`): `decode_tile(w)[:, j] == dequantize(w)[:, order[j]]`."""
  f = _formats.check_k(fmt, k)
  n = _formats.check_weight(w_nb, fmt, k)
  w = _ref.halfword_view(w_nb).reshape(n, k // f.block_values, f.block_halfwords)
  _, val = _join_planes(_PLANES[fmt](_ArrayLoader(w)))
  return val.reshape(n, k)


# ----------------------------------------------------------------------------- the kernel


def _kernel(x_ref, w_ref, o_ref, *, fmt: str, tiles: Tiles, dtype, precision):
  # x_ref [BS, K] (kernel column order), w_ref [BN, blocks, block halfwords] uint16,
  # o_ref [BS, BN] float32
  t = tiles
  bs, bn = o_ref.shape

  def body(i, acc):
    _, w_tile = _join_planes(_PLANES[fmt](_RefLoader(w_ref, i * t.kb, t.kb)))  # [BN, kb, bv]
    w_tile = w_tile.reshape(bn, t.kc).astype(dtype)                           # [BN, kc]
    x_c = x_ref[:, pl.ds(pl.multiple_of(i * t.kc, t.kc), t.kc)]               # [BS, kc]
    return acc + lax.dot_general(x_c, w_tile, (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)

  o_ref[...] = lax.fori_loop(0, t.n_chunks, body, jnp.zeros((bs, bn), jnp.float32))


def _compiler_params(cfg: QuantMatmulConfig, interpret: bool):
  if interpret or _pltriton is None:
    return None
  return _pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@functools.partial(jax.jit, static_argnames=("fmt", "k", "cfg", "tiles", "interpret"))
def _call(x_pk, w_nbh, *, fmt: str, k: int, cfg: QuantMatmulConfig, tiles: Tiles,
          interpret: bool):
  """x_pk [S_pad, K] (kernel column order, compute dtype), w_nbh [N, blocks, block halfwords]
  uint16 -> [S_pad, N] float32."""
  n, nb, hwb = w_nbh.shape
  t = tiles
  kern = functools.partial(_kernel, fmt=fmt, tiles=t, dtype=x_pk.dtype,
                           precision=_ref.dot_precision(x_pk.dtype))
  return pl.pallas_call(
      kern,
      grid=(t.s_pad // t.bs, n // t.bn),
      in_specs=[pl.BlockSpec((t.bs, k), lambda si, ni: (si, 0)),
                pl.BlockSpec((t.bn, nb, hwb), lambda si, ni: (ni, 0, 0))],
      out_specs=pl.BlockSpec((t.bs, t.bn), lambda si, ni: (si, ni)),
      out_shape=jax.ShapeDtypeStruct((t.s_pad, n), jnp.float32),
      compiler_params=_compiler_params(cfg, interpret),
      interpret=interpret,
      name="kvjax_quant_matmul",
  )(x_pk, w_nbh)


def quant_matmul_pallas(x_sk, w_nb, fmt: str, k: int, *,
                        config: Optional[QuantMatmulConfig] = None, interpret: bool = False):
  """x [S, K] @ dequantize(w)[N, K].T -> [S, N] float32, the weights decoded in the kernel.

  x float32 or bfloat16 (other dtypes compute as float32); w uint8 [N, row_bytes(fmt, k)] or
  its uint16 halfword view (pass that for weights that serve many calls: the uint8 -> uint16
  view may be a copy in XLA). The padding of S and the permutation of x's columns run outside
  the jitted kernel call, so row counts that pad alike share one compiled kernel.
  """
  f = _formats.check_k(fmt, k)
  n = _formats.check_weight(w_nb, fmt, k)
  s = _formats.check_x(x_sk, k)
  cfg = default_config(fmt, s) if config is None else config
  tiles = resolve_tiles(cfg, fmt, s, n, k)
  dtype = _ref.compute_dtype(x_sk.dtype)
  x = jnp.asarray(x_sk).astype(dtype)
  if not np.array_equal(block_column_order(fmt), np.arange(f.block_values)):   # q8_0: in order
    x = jnp.take(x, jnp.asarray(column_order(fmt, k), jnp.int32), axis=1)
  if tiles.s_pad != s:
    x = jnp.pad(x, ((0, tiles.s_pad - s), (0, 0)))
  w = _ref.halfword_view(jnp.asarray(w_nb)).reshape(n, k // f.block_values, f.block_halfwords)
  out = _call(x, w, fmt=fmt, k=k, cfg=cfg, tiles=tiles, interpret=interpret)
  return out[:s] if tiles.s_pad != s else out
