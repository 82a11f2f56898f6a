"""The combine: the in-order fold of a span kernel's per-partition partials into the carry.

Every kernel (Triton, Mosaic GPU decode, Mosaic GPU prefill) writes one un-normalised
(m, l, acc) per logical partition; `combine_call` folds them into the carry strictly left to right
in logical order with `reference.merge_partials` (a Pallas Triton kernel, `_combine_kernel`), so
one call equals any sequence of waves whose boundaries are multiples of `block_pages` pages, bit
for bit. An empty partition (m=-inf, l=0, acc=0) is an exact no-op of the fold.

The combine's tiling (`CombineTiles`: rows x columns a program, warps, partitions loaded at once)
changes no bit: the fold is elementwise per row, in logical order. Each kernel picks its tiles
(`default_tiles` with its row and column block); `check_tiles` refuses tiles a shape cannot take.

Columns: a kernel's accumulator columns may hold the head dims in a permuted order (`v_cols[c]`
is the head dim of column c, -1 for a junk column); `to_columns` / `from_columns` convert.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax_pallas.span_attention import reference as _ref
from kvjax_pallas.span_attention.common import triton_params

# unroll: the most partitions (16 or 8) the combine loads at once whose tiles hold at most
# COMBINE_TILE_FLOATS floats (unroll x row block x column block). Larger groups hide more of the
# load latency of the fold's serial chain but compile superlinearly longer; 16 is the most
# (docs/PERFORMANCE.md, 'Span attention kernels').
COMBINE_TILE_FLOATS = 16384
COMBINE_UNROLL_MAX = 16


def combine_unroll_for(block_rows: int, block_cols: int, num_parts: int) -> int:
  """Partitions loaded at once: the largest of 16 (COMBINE_UNROLL_MAX) and 8 whose group of
  partition tiles holds at most COMBINE_TILE_FLOATS floats (8 at least), and no larger than
  `num_parts` rounded up to a multiple of 8 (the partitions are padded to a whole number of
  groups with empty ones)."""
  need = max(8, -(-int(num_parts) // 8) * 8)
  for unroll in (32, 16):
    if unroll > COMBINE_UNROLL_MAX:
      continue
    if unroll * block_rows * block_cols <= COMBINE_TILE_FLOATS:
      return min(unroll, need)
  return 8



@dataclasses.dataclass(frozen=True)
class CombineTiles:
  """The combine's tiling (no bit depends on it): a program folds `rows` rows x `cols` V columns
  with `warps` warps, loading `unroll` partitions at once, one group ahead of the fold."""
  rows: int
  cols: int
  warps: int
  unroll: int

  def padded_parts(self, num_parts: int) -> int:
    """The partition count padded (with empty partitions) to a whole number of load groups."""
    return -(-max(1, int(num_parts)) // self.unroll) * self.unroll


def default_tiles(rows: int, cols: int, num_parts: int) -> CombineTiles:
  """Tiles of rows x cols: one warp a 64 elements of the tile (1-4), `combine_unroll_for`."""
  warps = int(min(4, max(1, rows * cols // 64)))
  return CombineTiles(rows, cols, warps, combine_unroll_for(rows, cols, num_parts))


def check_tiles(tiles: CombineTiles, rows_pad: int, num_cols: int):
  """Raise ValueError for tiles the partials [.., rows_pad, num_cols] cannot take."""
  if tiles.rows < 1 or tiles.rows & (tiles.rows - 1) or rows_pad % tiles.rows:
    raise ValueError(f"combine rows must be a power of two dividing the {rows_pad} padded rows, "
                     f"got {tiles.rows}")
  if tiles.cols < 1 or tiles.cols & (tiles.cols - 1) or num_cols % tiles.cols:
    raise ValueError(f"combine cols must be a power of two dividing {num_cols}, got {tiles.cols}")
  if tiles.warps not in (1, 2, 4, 8):
    raise ValueError(f"combine warps must be 1, 2, 4 or 8, got {tiles.warps}")
  if tiles.unroll < 8 or tiles.unroll % 8:
    raise ValueError(f"combine unroll must be a multiple of 8, got {tiles.unroll}")


def to_columns(x_gmd, col_dims: np.ndarray):
  """[..., D] -> [..., columns]: each kernel column takes its dim; junk columns are zero."""
  if np.array_equal(col_dims, np.arange(x_gmd.shape[-1])):
    return x_gmd
  take = x_gmd[..., np.maximum(col_dims, 0)]
  return jnp.where(jnp.asarray(col_dims >= 0), take, jnp.zeros((), x_gmd.dtype))


def from_columns(x_gmc, col_dims: np.ndarray, head_dim: int):
  """[..., columns] -> [..., D]: dim d from the one non-junk column that holds it."""
  if np.array_equal(col_dims, np.arange(head_dim)):
    return x_gmc
  first = np.full(head_dim, -1)
  for c in range(col_dims.shape[0] - 1, -1, -1):
    if col_dims[c] >= 0:
      first[col_dims[c]] = c
  assert (first >= 0).all()
  return x_gmc[..., first]


def _combine_kernel(*refs, block_rows: int, block_cols: int, num_parts: int, unroll: int,
                    has_carry: bool = True, ml_packed: bool = False,
                    acc_transposed: bool = False):
  """Left fold of the partitions (logical order) into the carry; grid (g, row block, column block).

  Partials: m_parts, l_parts [G, parts, rows] and acc_parts [G, parts, rows, columns]; or
  (ml_packed) m and l in one ref [G, parts, 2, rows] (l_parts unused: the same ref); or
  (acc_transposed) acc_parts [G, parts, columns, rows], and then acc_in / acc_out [G, columns,
  rows] too: the fold runs on [columns, rows] blocks as loaded (`merge_partials(...,
  acc_transposed=True)`: the same operations; the bits can differ from the other layout's where
  the compiler contracts into FMAs differently), no transpose in the kernel.

  Software-pipelined: the loads of group j+1 are issued before group j is
  folded (a plain loop let the compiler sink each load next to its fold: one
  memory round trip per partition).
  """
  if has_carry:
    m_parts, l_parts, acc_parts, m_in, l_in, acc_in, m_out, l_out, acc_out = refs
  else:   # a fresh call: the carry starts empty (-inf, 0, 0), the same bits as one passed in
    m_parts, l_parts, acc_parts, m_out, l_out, acc_out = refs
  g = pl.program_id(0)
  mb = pl.program_id(1)
  c = pl.program_id(2)
  rows = pl.ds(mb * block_rows, block_rows)
  cols = pl.ds(c * block_cols, block_cols)

  def load_group(j):
    j = jnp.minimum(j, num_parts // unroll - 1)   # the prefetch past the end re-reads the last
    parts = []
    for u in range(unroll):
      q = j * unroll + u
      if ml_packed:
        m, l = m_parts[g, q, 0, rows], m_parts[g, q, 1, rows]
      else:
        m, l = m_parts[g, q, rows], l_parts[g, q, rows]
      acc = acc_parts[g, q, cols, rows] if acc_transposed else acc_parts[g, q, rows, cols]
      parts.append((m, l, acc))
    return tuple(parts)

  def body(j, carry):
    state, parts = carry
    nxt = load_group(j + 1)
    for part in parts:
      state = _ref.merge_partials(state, part, acc_transposed)
    return state, nxt

  acc_block = (cols, rows) if acc_transposed else (rows, cols)
  if has_carry:
    state = (m_in[g, rows], l_in[g, rows], acc_in[(g,) + acc_block])
  else:
    state = (jnp.full((block_rows,), -jnp.inf, jnp.float32), jnp.zeros((block_rows,), jnp.float32),
             jnp.zeros((block_cols, block_rows) if acc_transposed else (block_rows, block_cols),
                       jnp.float32))
  (m_c, l_c, a_c), _ = lax.fori_loop(0, num_parts // unroll, body, (state, load_group(0)))
  m_out[g, rows, c] = m_c
  l_out[g, rows, c] = l_c
  acc_out[(g,) + acc_block] = a_c


def combine_call(m_p, l_p, acc_p, carry, *, rows: int, tiles: CombineTiles, v_cols: np.ndarray,
                 head_dim: int, interpret: bool, acc_transposed: bool = False) -> _ref.Carry:
  """The pipelined in-order combine (`_combine_kernel`) of a span kernel's partitions:
  m_p, l_p [G, parts, rows_pad], acc_p [G, parts, rows_pad, V columns] (column c holds head dim
  v_cols[c]; parts a multiple of `tiles.unroll`), the carry (or None: the empty one) -> the
  folded carry, rows [:rows], dims in order. The grid: KV heads x row blocks of `tiles.rows`
  (covering the real rows) x column blocks of `tiles.cols`.
  l_p None: m_p is m and l packed [G, parts, 2, rows_pad]; acc_transposed: acc_p is [G, parts,
  V columns, rows_pad] (the kernel's O^T as it wrote it: no transpose in XLA between)."""
  ml_packed = l_p is None
  g, n_parts, rows_pad = (m_p.shape[0], m_p.shape[1], m_p.shape[-1])
  vc = v_cols.shape[0]
  d = head_dim
  carry_inputs = ()
  if carry is not None:
    pad_m = ((0, 0), (0, rows_pad - rows))
    m_in = jnp.pad(carry.m_gm, pad_m, constant_values=-jnp.inf)
    l_in = jnp.pad(carry.l_gm, pad_m)
    acc_in = to_columns(jnp.pad(carry.acc_gmd, pad_m + ((0, 0),)), v_cols)  # [G, Mp, Vc]
    if acc_transposed:
      acc_in = jnp.swapaxes(acc_in, 1, 2)                                    # [G, Vc, Mp]
    carry_inputs = (m_in, l_in, acc_in)
  # the combine grid runs over row blocks of the real rows (not the span tile's padding) and
  # column blocks; m/l come back once per column block. Its tiling changes no bit (elementwise).
  n_cb = vc // tiles.cols
  n_cm = -(-rows // tiles.rows)
  m_c, l_c, acc_c = pl.pallas_call(
      functools.partial(_combine_kernel, block_rows=tiles.rows, block_cols=tiles.cols,
                        num_parts=n_parts, unroll=tiles.unroll, has_carry=carry is not None,
                        ml_packed=ml_packed, acc_transposed=acc_transposed),
      grid=(g, n_cm, n_cb),
      out_shape=(jax.ShapeDtypeStruct((g, rows_pad, n_cb), jnp.float32),
                 jax.ShapeDtypeStruct((g, rows_pad, n_cb), jnp.float32),
                 jax.ShapeDtypeStruct((g, vc, rows_pad) if acc_transposed else (g, rows_pad, vc),
                                      jnp.float32)),
      compiler_params=triton_params(tiles.warps, 1, interpret),
      interpret=interpret,
      name="kvjax_span_combine",
  )(m_p, m_p if ml_packed else l_p, acc_p, *carry_inputs)
  if acc_transposed:
    acc_c = jnp.swapaxes(acc_c, 1, 2)                      # (fused into the columns' gather)
  acc = from_columns(acc_c[:, :rows], v_cols, d)          # kernel columns -> dims
  return _ref.Carry(m_c[:, :rows, 0], l_c[:, :rows, 0], acc)
