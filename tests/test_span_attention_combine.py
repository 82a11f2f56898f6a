"""The combine (`kvjax_pallas/span_attention/combine.py`): the in-order fold of a kernel's
per-partition partials into the carry, interpreted on the CPU.

Its tiling changes no value (on the GPU no bit; the interpreter's XLA CPU code may contract
multiply-adds differently for other tiles: the last bit or two); it reads the Triton kernel's layout (m, l apart, acc [.., rows,
columns]) and the Mosaic GPU kernels' (m and l packed, O^T [.., columns, rows]) alike; it agrees
with the left fold in jnp (`reference.merge_partials`); tiles a shape cannot take are refused by
name.
"""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from kvjax_pallas.span_attention import combine
from kvjax_pallas.span_attention import magic_ptx
from kvjax_pallas.span_attention import mosaic_common
from kvjax_pallas.span_attention import reference as ref

G, PARTS, ROWS_PAD, ROWS, D = 2, 32, 8, 6, 256   # PARTS: a whole number of load groups


def _partials(seed: int):
  """Random partials [G, PARTS, ROWS_PAD(, D)] with an empty partition (m = -inf, l = 0,
  acc = 0) and a row no partition saw, and a random carry over the real rows."""
  rng = np.random.default_rng(seed)
  m_p = rng.normal(0, 3, (G, PARTS, ROWS_PAD)).astype(np.float32)
  m_p[:, 3] = -np.inf
  m_p[:, :, 5] = -np.inf
  l_p = np.where(np.isfinite(m_p), rng.uniform(0.5, 4, m_p.shape), 0).astype(np.float32)
  acc_p = (rng.normal(size=(G, PARTS, ROWS_PAD, D)) * np.isfinite(m_p)[..., None]).astype(
      np.float32)
  carry = ref.Carry(jnp.asarray(rng.normal(0, 3, (G, ROWS)), jnp.float32),
                    jnp.asarray(rng.uniform(0.5, 4, (G, ROWS)), jnp.float32),
                    jnp.asarray(rng.normal(size=(G, ROWS, D)), jnp.float32))
  return m_p, l_p, acc_p, carry


def _call(m_p, l_p, acc_p, carry, tiles, transposed: bool, v_cols=None):
  """combine_call on the Triton layout or (transposed) the Mosaic GPU kernels' layout."""
  v_cols = np.arange(D) if v_cols is None else v_cols
  acc_cols = acc_p[..., v_cols]                        # column c holds dim v_cols[c]
  kw = dict(rows=ROWS, tiles=tiles, v_cols=v_cols, head_dim=D, interpret=True)
  if transposed:
    return combine.combine_call(jnp.asarray(np.stack([m_p, l_p], axis=2)), None,
                                jnp.asarray(np.swapaxes(acc_cols, 2, 3)), carry,
                                acc_transposed=True, **kw)
  return combine.combine_call(jnp.asarray(m_p), jnp.asarray(l_p), jnp.asarray(acc_cols), carry,
                              **kw)


@pytest.mark.parametrize("with_carry", [False, True])
def test_combine_reads_the_kernels_layouts(with_carry):
  """The Mosaic GPU kernels' layout (m and l packed [G, parts, 2, rows], O^T [G, parts, columns,
  rows] in `magic_ptx.vt_dims` order, folded as [columns, rows] blocks) gives what the Triton
  kernel's layout gives: m bit for bit, l and acc to the last bit or two (the same operations;
  the compiler may contract a * b + c * d into FMAs differently for the two layouts), with and
  without a carry; both agree with the left fold in jnp."""
  m_p, l_p, acc_p, carry = _partials(5)
  carry = carry if with_carry else None
  tiles = combine.CombineTiles(rows=8, cols=32, warps=4, unroll=8)
  want = _call(m_p, l_p, acc_p, carry, tiles, False, magic_ptx.vt_dims(D))
  got = _call(m_p, l_p, acc_p, carry, tiles, True, magic_ptx.vt_dims(D))
  np.testing.assert_array_equal(np.asarray(got.m_gm), np.asarray(want.m_gm))
  for a, b in zip(got[1:], want[1:]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  state = ((carry.m_gm, carry.l_gm, carry.acc_gmd) if with_carry else
           (jnp.full((G, ROWS), -jnp.inf), jnp.zeros((G, ROWS)), jnp.zeros((G, ROWS, D))))
  for j in range(PARTS):
    state = ref.merge_partials(state, (m_p[:, j, :ROWS], l_p[:, j, :ROWS], acc_p[:, j, :ROWS]))
  for a, b in zip(got, state):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert np.isfinite(np.asarray(got.l_gm)).all()


@pytest.mark.parametrize("transposed", [False, True])
def test_tilings_same_bits(transposed):
  """Other tiles (rows, columns, warps a program) and load groups (8, 16, 32 partitions) fold
  the same values: the fold is elementwise per row, in logical order whatever is loaded at once
  (to the last bit or two here: see the module docstring)."""
  m_p, l_p, acc_p, carry = _partials(7)
  base = _call(m_p, l_p, acc_p, carry, combine.default_tiles(8, 32, PARTS), transposed)
  for tiles in (combine.CombineTiles(8, 16, 1, 8), combine.CombineTiles(8, 64, 4, 16),
                combine.CombineTiles(1, 32, 1, 8), combine.CombineTiles(2, 8, 1, 32),
                combine.CombineTiles(4, 256, 4, 16)):
    got = _call(m_p, l_p, acc_p, carry, tiles, transposed)
    np.testing.assert_array_equal(np.asarray(got.m_gm), np.asarray(base.m_gm))
    for a, b in zip(got[1:], base[1:]):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                 err_msg=str(tiles))


def test_default_tiles_and_unroll():
  """Load groups of 16 partitions for the decode row blocks (32 compiled much longer on the H200
  and ran no faster), fewer where the row block is larger, never more than the partitions need;
  one warp a 64 elements of the tile; the Mosaic GPU kernels' 8 x 8 tiles cover the real rows of
  N only; the partition count padded to whole groups."""
  assert combine.combine_unroll_for(8, 32, 128) == 16       # S=1: 6 rows -> block 8
  assert combine.combine_unroll_for(8, 8, 128) == 16        # the Mosaic GPU kernels' 8 x 8 tiles
  assert combine.combine_unroll_for(32, 32, 128) == 16      # S=4: 24 rows -> block 32
  assert combine.combine_unroll_for(64, 32, 128) == 8       # S=6 / prefill
  assert combine.combine_unroll_for(8, 32, 4) == 8
  assert combine.combine_unroll_for(8, 32, 12) == 16
  assert combine.default_tiles(64, 32, 100) == combine.CombineTiles(64, 32, 4, 8)
  assert combine.default_tiles(2, 8, 100).warps == 1
  tiles = mosaic_common.combine_tiles(8, 128)
  assert tiles == combine.CombineTiles(8, 8, 1, 16)
  assert tiles.padded_parts(128) == 128 and tiles.padded_parts(129) == 144
  assert mosaic_common.combine_tiles(32, 128).rows == 8   # S=4: the real 24 rows of N=32 only
  assert mosaic_common.combine_tiles(128 * 3, 5).rows == 8


def test_check_tiles_refuses_by_name():
  ok = combine.CombineTiles(8, 8, 1, 16)
  combine.check_tiles(ok, 8, 256)
  for tiles, msg in ((combine.CombineTiles(16, 8, 1, 16), "rows must be a power of two dividing "
                                                          "the 8 padded rows, got 16"),
                     (combine.CombineTiles(3, 8, 1, 16), "got 3"),
                     (combine.CombineTiles(8, 24, 1, 16), "cols must be a power of two dividing "
                                                          "256, got 24"),
                     (combine.CombineTiles(8, 8, 3, 16), "warps must be 1, 2, 4 or 8, got 3"),
                     (combine.CombineTiles(8, 8, 1, 12), "unroll must be a multiple of 8")):
    with pytest.raises(ValueError, match=msg):
      combine.check_tiles(tiles, 8, 256)
