"""GGUF weight block formats: values a block, bytes a block, row sizes and argument checks.

A weight matrix is stored as ggml stores it: N rows (output features), each row the K input
values encoded as consecutive blocks, so a matrix is uint8 [N, row_bytes(fmt, K)]; the same bytes
seen as little-endian halfwords, uint16 [N, row_bytes / 2], are taken too (every block size here
is even). The layouts are ggml's (`block_q8_0` ... `block_q6_K` of ggml-common.h):

  q8_0   32 values,  34 B: f16 d, 32 int8 qs                        value = d * q
  q4_0   32 values,  18 B: f16 d, 16 B of nibbles (byte j: elements j (low nibble), j + 16 (high))
                                                                      value = d * (q - 8)
  q4_k  256 values, 144 B: f16 d, f16 dmin, 12 B of 6-bit scales / mins of 8 sub-blocks of 32,
                           128 B of nibbles                           value = d*sc * q - dmin*m
  q5_k  256 values, 176 B: as q4_k plus 32 B of high bits (qh) before the nibbles
  q6_k  256 values, 210 B: 128 B of low nibbles (ql), 64 B of 2-bit highs (qh), 16 int8 scales
                           (one a 16 values), f16 d last          value = d * sc * (q - 32)

This module imports nothing from `kvjax`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BlockFormat:
  """One ggml block format: `block_values` weights in `block_bytes` bytes."""
  name: str
  block_values: int
  block_bytes: int

  @property
  def block_halfwords(self) -> int:
    return self.block_bytes // 2


FORMATS = {f.name: f for f in (
    BlockFormat("q8_0", 32, 34),
    BlockFormat("q4_0", 32, 18),
    BlockFormat("q4_k", 256, 144),
    BlockFormat("q5_k", 256, 176),
    BlockFormat("q6_k", 256, 210),
)}
FORMAT_NAMES = tuple(FORMATS)


def get_format(fmt: str) -> BlockFormat:
  """The `BlockFormat` named `fmt` (one of FORMAT_NAMES); ValueError for another name."""
  if fmt not in FORMATS:
    raise ValueError(f"unknown quant format {fmt!r}; supported: {', '.join(FORMAT_NAMES)}")
  return FORMATS[fmt]


def check_k(fmt: str, k: int) -> BlockFormat:
  """The format, after checking that `k` (values a row) is a positive multiple of its block."""
  f = get_format(fmt)
  if int(k) != k or k < 1 or k % f.block_values:
    raise ValueError(f"{fmt}: k={k} is not a positive multiple of the block size "
                     f"{f.block_values}")
  return f


def blocks_per_row(fmt: str, k: int) -> int:
  """Blocks in one row of `k` values."""
  return k // check_k(fmt, k).block_values


def row_bytes(fmt: str, k: int) -> int:
  """Bytes of one row of `k` values encoded as `fmt`."""
  f = check_k(fmt, k)
  return k // f.block_values * f.block_bytes


def check_weight(w_nb, fmt: str, k: int) -> int:
  """Check a weight matrix: uint8 [N, row_bytes(fmt, k)] or its uint16 halfword view
  [N, row_bytes / 2]. Returns N."""
  nbytes = row_bytes(fmt, k)
  dtype = str(w_nb.dtype)
  shape = tuple(w_nb.shape)
  if dtype == "uint8" and len(shape) == 2 and shape[1] == nbytes:
    return shape[0]
  if dtype == "uint16" and len(shape) == 2 and shape[1] * 2 == nbytes:
    return shape[0]
  raise ValueError(f"{fmt} weights of k={k} must be uint8 [N, {nbytes}] (or uint16 "
                   f"[N, {nbytes // 2}]), got {dtype} {list(shape)}")


def check_x(x_sk, k: int) -> int:
  """Check activations x [S, K] with K == k. Returns S."""
  if len(x_sk.shape) != 2 or x_sk.shape[1] != k:
    raise ValueError(f"x must be [S, {k}] (k={k}), got shape {list(x_sk.shape)}")
  if x_sk.shape[0] < 1:
    raise ValueError("x must have at least one row")
  if not jnp.issubdtype(x_sk.dtype, jnp.floating):
    raise ValueError(f"x must be floating point (bfloat16; other floating dtypes compute as float32), got {x_sk.dtype}")
  return x_sk.shape[0]
