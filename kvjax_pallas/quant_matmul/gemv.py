"""A GEMV for decode and verify rows (S <= 16) with GGUF-quantized weights, decoded in registers.

`quant_gemv_pallas(x_sk, w_nb, fmt, k, config=..., interpret=...)` computes what
`reference.quant_matmul_reference` does (x [S, K] @ dequantize(w)[N, K].T -> [S, N] float32) for a
few rows, where the matmul kernel (`kernel.py`) pads x to 16 rows for a dot and interleaves the
decoded planes into ggml's column order: 1,190 GB/s at best on the H200 against the bf16 dot's
2,798 (docs/PERFORMANCE.md, "Quantized weights").

What it does instead:
* **No dot, no interleave.** A format's planes (`kernel._PLANES`: the values that share one bit
  position of the block's halfwords, [BN, kb, w] with one scale per block) meet x's columns of the
  same positions directly: x is laid out plane-major once per call (`plane_order`: within each
  ggml block, plane 0's positions, then plane 1's, ...), so a plane's x columns are one
  power-of-two load [kb, w] a row; the product is a multiply and two sums (CUDA cores), a row of x
  at a time (3-D values only), the decoded plane shared by the rows.
* **Split over K.** The grid is (N / BN column tiles, `split_k` K ranges); each program writes its
  partial sums [S, BN], and the `split_k` partials are added in a fixed order after the call, so
  a matrix of few columns still gives every SM work.
* Rows are padded only to a power of two (1, 2, 4, 8, 16).

The float32 sums run in another order than the reference's dot: results agree within float32
summation rounding (the tests' tolerance), not bit for bit. GPU lowering: the Pallas Triton
lowering, with the matmul kernel's loads and primitives; it has not been compiled on a GPU yet
(lowering checked for a CUDA target on the CPU, tests/test_quant_matmul.py). Imports nothing
from `kvjax`.

Shapes: x_sk [S, K] float32 / bfloat16 (S <= GEMV_MAX_ROWS), w_nb uint8 [N, row_bytes] or its
uint16 halfword view, out [S, N] float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax_pallas.quant_matmul import formats as _formats
from kvjax_pallas.quant_matmul import kernel as _kernel
from kvjax_pallas.quant_matmul import reference as _ref

GEMV_MAX_ROWS = 16
PRODUCT_FLOATS = 8192   # the most floats of one plane's products [S_pad x [BN, kb, w]] (registers)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
  """Tiles of the GEMV (unmeasured defaults)."""
  block_n: int = 16      # output columns a program: upper bound, a power of two
  block_k: int = 1024    # values a K chunk: upper bound (at least one ggml block is taken)
  split_k: int = 4       # K ranges (programs along K): upper bound, a power of two
  num_warps: int = 4
  num_stages: int = 2


DEFAULT_CONFIG = GemvConfig()


@dataclasses.dataclass(frozen=True)
class GemvTiles:
  """The resolved tiles of a call (`resolve_tiles`): a K chunk holds at most `block_k` values and
  keeps each plane's product within PRODUCT_FLOATS (fewer blocks for more rows)."""
  s_pad: int      # rows, padded to a power of two
  bn: int         # output columns a program
  kb: int         # ggml blocks a K chunk
  split: int      # K ranges
  chunks: int     # K chunks a K range


def check_config(cfg: GemvConfig) -> GemvConfig:
  return _kernel.check_fields(cfg, GemvConfig, ("block_n", "split_k"), ("block_k", "num_warps", "num_stages"))


def resolve_tiles(cfg: GemvConfig, fmt: str, s: int, n: int, k: int) -> GemvTiles:
  """The tiles of a call of [S, K] x [N, K] weights of `fmt` under `cfg`."""
  check_config(cfg)
  if not 1 <= s <= GEMV_MAX_ROWS:
    raise ValueError(f"the GEMV takes 1 to {GEMV_MAX_ROWS} rows of x, got {s}")
  f = _formats.check_k(fmt, k)
  nb = k // f.block_values
  pow2 = _kernel._pow2_divisor   # pylint: disable=protected-access
  s_pad, bn = 1 << (s - 1).bit_length(), pow2(n, cfg.block_n)
  w = max(len(p) for p in _planes_of(fmt))
  split = pow2(nb, cfg.split_k)
  kb = pow2(nb // split, max(1, min(cfg.block_k // f.block_values, PRODUCT_FLOATS // (s_pad * bn * w))))
  return GemvTiles(s_pad=s_pad, bn=bn, kb=kb, split=split, chunks=nb // split // kb)


@functools.lru_cache(maxsize=None)
def _planes_of(fmt: str):
  """-> ((positions np [w] of each plane in the ggml block), ...) in the planes' order."""
  f = _formats.get_format(fmt)
  found = []

  def trace(w):
    planes = _kernel._PLANES[fmt](_kernel._ArrayLoader(w))   # pylint: disable=protected-access
    found.append(tuple(np.asarray(p, np.int64) for p, _ in planes))
    return [v for _, v in planes]

  jax.eval_shape(trace, jax.ShapeDtypeStruct((1, 1, f.block_halfwords), jnp.uint16))
  return found[0]


def plane_order(fmt: str) -> np.ndarray:
  """np int [block values]: the ggml block position of each column of a plane-major block."""
  order = np.concatenate(_planes_of(fmt))
  assert sorted(order.tolist()) == list(range(_formats.get_format(fmt).block_values)), fmt
  return order


def _gemv_kernel(x_ref, w_ref, o_ref, *, fmt: str, tiles: GemvTiles, dtype):
  # x_ref [S_pad, blocks, block values] (plane-major blocks, compute dtype),
  # w_ref [BN, blocks, block halfwords] uint16, o_ref [1, S_pad, BN] float32 (this K range's sums)
  t = tiles
  widths = [len(p) for p in _planes_of(fmt)]
  starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).tolist()
  bn = w_ref.shape[0]
  first = pl.program_id(1) * t.chunks

  def body(i, acc):                                   # acc: S_pad sums [BN] float32, one a row
    b0 = (first + i) * t.kb
    planes = _kernel._PLANES[fmt](_kernel._RefLoader(w_ref, b0, t.kb))   # pylint: disable=protected-access
    acc = list(acc)
    for (_, val), c0, w in zip(planes, starts, widths):
      val = val.astype(dtype).astype(jnp.float32)     # [BN, kb, w]: the weights as the dot meets them
      for r in range(t.s_pad):                        # a row of x at a time: [BN, kb, w] products
        x_p = x_ref[r, pl.ds(b0, t.kb), pl.ds(c0, w)].astype(jnp.float32)   # [kb, w]
        acc[r] = acc[r] + jnp.sum(jnp.sum(val * x_p[None], axis=2), axis=1)
    return tuple(acc)

  acc = jax.lax.fori_loop(0, t.chunks, body, tuple(jnp.zeros((bn,), jnp.float32) for _ in range(t.s_pad)))
  for r in range(t.s_pad):
    o_ref[0, r, :] = acc[r]


@functools.partial(jax.jit, static_argnames=("fmt", "cfg", "tiles", "interpret"))
def _call(x_pbv, w_nbh, *, fmt: str, cfg: GemvConfig, tiles: GemvTiles, interpret: bool):
  """x_pbv [S_pad, blocks, block values] (plane-major, compute dtype), w_nbh [N, blocks, block
  halfwords] uint16 -> [S_pad, N] float32."""
  n, nb, hwb = w_nbh.shape
  t = tiles
  bv = x_pbv.shape[2]
  part = pl.pallas_call(
      functools.partial(_gemv_kernel, fmt=fmt, tiles=t, dtype=x_pbv.dtype),
      grid=(n // t.bn, t.split),
      in_specs=[pl.BlockSpec((t.s_pad, nb, bv), lambda ni, si: (0, 0, 0)),
                pl.BlockSpec((t.bn, nb, hwb), lambda ni, si: (ni, 0, 0))],
      out_specs=pl.BlockSpec((1, t.s_pad, t.bn), lambda ni, si: (si, 0, ni)),
      out_shape=jax.ShapeDtypeStruct((t.split, t.s_pad, n), jnp.float32),
      compiler_params=_kernel._compiler_params(cfg, interpret),   # pylint: disable=protected-access
      interpret=interpret,
      name="kvjax_quant_gemv",
  )(x_pbv, w_nbh)
  out = part[0]
  for j in range(1, t.split):                         # the K ranges' sums, in a fixed order
    out = out + part[j]
  return out


def quant_gemv_pallas(x_sk, w_nb, fmt: str, k: int, *, config: Optional[GemvConfig] = None,
                      interpret: bool = False):
  """x [S, K] @ dequantize(w)[N, K].T -> [S, N] float32 for S <= GEMV_MAX_ROWS rows of x."""
  f = _formats.check_k(fmt, k)
  n = _formats.check_weight(w_nb, fmt, k)
  s = _formats.check_x(x_sk, k)
  cfg = DEFAULT_CONFIG if config is None else config
  tiles = resolve_tiles(cfg, fmt, s, n, k)
  nb, bv = k // f.block_values, f.block_values
  dtype = _ref.compute_dtype(x_sk.dtype)
  x = jnp.asarray(x_sk).astype(dtype).reshape(s, nb, bv)
  x = jnp.take(x, jnp.asarray(plane_order(fmt), jnp.int32), axis=2)
  if tiles.s_pad != s:
    x = jnp.pad(x, ((0, tiles.s_pad - s), (0, 0), (0, 0)))
  w = _ref.halfword_view(jnp.asarray(w_nb)).reshape(n, nb, f.block_halfwords)
  out = _call(x, w, fmt=fmt, cfg=cfg, tiles=tiles, interpret=interpret)
  return out[:s] if tiles.s_pad != s else out
