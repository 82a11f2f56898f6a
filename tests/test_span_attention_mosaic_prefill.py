"""Span attention for prefill chunks, Pallas Mosaic GPU (`mosaic_prefill.py`).

CPU (default): the Pallas -> Mosaic GPU lowering at the 27B shape (inline PTX and MLIR of the
conversions and the mask included); the whole kernel in the Mosaic GPU interpreter (page walk,
TMA copies, barriers, masks, outputs; the tile math in jnp in the compiled path's orders)
against `reference.span_attention_reference` and a float64 oracle; placement invariance and
waves == one call, bit for bit; junk past kv_len; the plan, the API routing and the errors.

GPU: `KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu pytest tests/test_span_attention_mosaic_prefill.py`
also runs the compiled kernel at real shapes against the reference, and placement invariance and
waves bit for bit on the GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import jax.numpy as jnp

from kvjax_pallas.span_attention import api
from kvjax_pallas.span_attention import mosaic_common as mc
from kvjax_pallas.span_attention import mosaic_prefill as kp
from kvjax_pallas.span_attention import reference as ref
from span_history import (REAL_SHAPE, SMALL_SHAPE, History, check_against_reference,
                          kernel_placement_and_waves, lowered_at_real_shape, random_query,
                          rel_error, shape_layout)

ON_GPU = os.environ.get("KVJAX_TEST_GPU", "0") == "1"

REAL, SMALL = REAL_SHAPE, SMALL_SHAPE   # the 27B attention geometry; interpreter sizes
_layout = shape_layout


def _query(seed, s, h, d, kv_len):
  return random_query(seed + 2000, s, h, d, kv_len)


# ----------------------------------------------------------------------------- plain functions


def test_plan_and_row_limits():
  """SMEM of a CTA under the limit at the 27B shape; partitions that fill whole waves of CTAs (KV
  heads x row blocks x partitions); each folded row's key limit min(kv_len, q_pos + 1), padding
  rows -1."""
  lay = _layout(REAL)
  assert kp.smem_bytes(lay) <= mc.SMEM_LIMIT
  assert [kp.row_blocks(r) for r in (1, 128, 129, 1536)] == [1, 1, 2, 12]
  # 256 tokens x 6 heads = 12 row blocks x 4 heads = 48 CTAs a partition: 11 partitions of 47
  # pages are 528 CTAs, 4 whole waves of 132 (2 partitions: one wave 73 % full)
  assert kp.choose_block_pages(512, 1536, 4, 132) == 47
  assert kp.choose_block_pages(512, 60, 4, 132) == 16           # 4 CTAs: 32 partitions, 97 %
  assert kp.choose_block_pages(3, 60, 4, 132) == 1
  assert kp.choose_block_pages(8, 1536, 4, 132) == 1            # 384 CTAs: 3 waves, 97 %
  # 48 CTAs on 40 SMs: 3 partitions (144 CTAs, 4 waves 90 % full) before 5+ waves
  assert kp.choose_block_pages(512, 1536, 4, 40) == 171
  lim = np.asarray(kp.row_limits(jnp.asarray([5, 9, 30], jnp.int32), 20, 9, 3, 16))
  np.testing.assert_array_equal(lim, [6] * 3 + [10] * 3 + [20] * 3 + [-1] * 7)


def test_rejects_unsupported_arguments():
  lay = _layout(REAL)
  pool = jnp.zeros((3, lay.page_bytes), jnp.uint8)
  table = jnp.arange(2, dtype=jnp.int32)
  with pytest.raises(ValueError, match="1-256 query tokens a call, got 257"):
    kp.span_attention_mosaic_prefill(jnp.zeros((257, 24, 256)), pool, table, 300,
                                     jnp.arange(257, dtype=jnp.int32), layout=lay)
  bad = _layout(REAL, ("q8_0", "q8_0"))
  with pytest.raises(ValueError, match="unsupported K/V pair Q8_0/Q8_0"):
    kp.span_attention_mosaic_prefill(jnp.zeros((16, 24, 256)), jnp.zeros((3, bad.page_bytes),
                                                                          jnp.uint8),
                                     table, 300, jnp.arange(16, dtype=jnp.int32), layout=bad)


# ----------------------------------------------------------------------------- lowering (CPU)


@pytest.mark.parametrize("s_tok", [7, 41, 256])
def test_lowers_for_cuda_at_real_shape(s_tok):
  """The Pallas -> Mosaic GPU lowering accepts the kernel: the magic conversions stored to
  swizzled f16 tiles, wgmma with Q from SMEM and K^T / V through transposed views, P from
  registers, the inline mask, 1 / 2 / 12 row blocks."""
  assert "mosaic_gpu" in lowered_at_real_shape(kp.span_attention_mosaic_prefill, s_tok, 1300)


# ----------------------------------------------------------------------------- interpreter


@pytest.mark.parametrize("s_tok,tokens,block_pages", [
    (20, 5 * 64 - 9, 2), (50, 4 * 64 + 1, 1), (9, 3 * 64, 3)])
def test_interpret_matches_reference(s_tok, tokens, block_pages):
  """1 and 2 row blocks (60 / 150 folded rows), kv_len mid-tile, partitions of 1-3 pages."""
  layout = _layout(SMALL)
  hist = History(layout, tokens, seed=tokens)
  pool, table = hist.shuffled(seed=s_tok)
  q, q_pos = _query(tokens, s_tok, SMALL["q_heads"], SMALL["head_dim"], tokens)
  out = kp.span_attention_mosaic_prefill(q, pool, table, tokens, q_pos, layout=layout,
                                         block_pages=block_pages, interpret=True)
  check_against_reference(out, hist, q, pool, table, q_pos, block_pages=block_pages, tol=2e-3)


def test_interpret_masks_positions_and_junk_past_the_end():
  """Query positions out of order and far before kv_len (a row that sees half a page), and
  NaN-making junk (0xFF bytes: f16 NaN scales) in every row past kv_len."""
  layout = _layout(SMALL)
  hist = History(layout, 4 * 64, seed=3)
  pool, table = hist.contiguous()
  kv_len = 3 * 64 - 5
  pool = np.asarray(pool).copy()
  page, row = kv_len // 64, kv_len % 64
  for off, nbytes, width in ((0, layout.k_plane_bytes, layout.k_row_bytes),
                             (layout.v_offset, layout.v_plane_bytes, layout.v_row_bytes)):
    rows = pool[page, off:off + nbytes].reshape(64, width)
    rows[row:] = 0xFF
    pool[page, off:off + nbytes] = rows.reshape(-1)
  q, _ = _query(3, 12, SMALL["q_heads"], SMALL["head_dim"], kv_len)
  q_pos = jnp.asarray([32, kv_len - 1, 100, 5] + list(range(kv_len - 8, kv_len)), jnp.int32)
  out = np.asarray(kp.span_attention_mosaic_prefill(q, jnp.asarray(pool), table, kv_len, q_pos,
                                                    layout=layout, block_pages=2, interpret=True))
  assert np.isfinite(out).all()
  oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, np.asarray(q_pos), kv_len)
  assert rel_error(out, oracle) <= 2e-3, rel_error(out, oracle)


def _placement_and_waves(interpret: bool, shape, tokens: int, bp: int, s_tok: int):
  """One call over three placements and three waves: the same bits (`kernel_placement_and_waves`),
  and within the reference's rounding."""
  one, hist, q, q_pos = kernel_placement_and_waves(
      kp.span_attention_mosaic_prefill, kp.span_attention_partial_mosaic_prefill, shape, tokens,
      bp, s_tok, interpret, query_seed=11 + 2000)
  pool, table = hist.contiguous()
  check_against_reference(jnp.asarray(one), hist, q, pool, table, q_pos, block_pages=bp,
                          tol=2e-3)


def test_interpret_placement_invariance_and_waves_bit_exact():
  _placement_and_waves(True, SMALL, 5 * 64 - 9, 2, 16)


def test_api_routes_prefill_chunks():
  """implementation="mosaic" with more than the decode kernel's 40 folded rows is the prefill
  kernel, bit for bit, with its own "auto" partitions; "auto" gives prefill chunks to it only
  with AUTO_MOSAIC_PREFILL (`mosaic_takes(prefill=True)`)."""
  layout = _layout(SMALL)
  tokens = 3 * 64 - 7
  hist = History(layout, tokens, seed=17)
  pool, table = hist.shuffled(seed=2)
  q, q_pos = _query(17, 14, SMALL["q_heads"], SMALL["head_dim"], tokens)    # 42 rows
  bp = api.resolve_block_pages("auto", table.shape[0], 14, 6, layout, implementation="mosaic")
  assert bp == kp.choose_block_pages(table.shape[0], 42, 2, api.num_sms())
  direct = kp.span_attention_mosaic_prefill(q, pool, table, tokens, q_pos, layout=layout,
                                            block_pages=bp, interpret=True)
  routed = api.span_attention(q, pool, table, tokens, q_pos, layout=layout, block_pages="auto",
                              implementation="mosaic", interpret=True)
  np.testing.assert_array_equal(np.asarray(direct), np.asarray(routed))
  real = _layout(REAL)
  assert api.mosaic_takes(real, 256, 6) and api.mosaic_takes(real, 256, 40)
  assert api.mosaic_takes(real, 256, 1536, num_tokens=256, prefill=True)
  assert not api.mosaic_takes(real, 256, 1536, num_tokens=256, prefill=False)
  assert not api.mosaic_takes(real, 256, 1542, num_tokens=257, prefill=True)
  assert api.uses_mosaic_prefill(real, 41) and not api.uses_mosaic_prefill(real, 40)


# ----------------------------------------------------------------------------- GPU only

# compiled on the GPU: named test_gpu_*, skipped without KVJAX_TEST_GPU=1 (tests/conftest.py)

@pytest.mark.parametrize("s_tok", [7, 37, 256])
def test_gpu_compiled_matches_reference(s_tok):
  """The compiled kernel at the real shape against the jnp reference and the float64 oracle:
  1, 2 and 12 row blocks."""
  layout = _layout(REAL)
  tokens = 9 * 256 - 37
  hist = History(layout, tokens, seed=21)
  pool, table = hist.shuffled(seed=4)
  q, q_pos = _query(21, s_tok, REAL["q_heads"], REAL["head_dim"], tokens)
  out = kp.span_attention_mosaic_prefill(q, pool, table, tokens, q_pos, layout=layout,
                                         block_pages=4)
  check_against_reference(out, hist, q, pool, table, q_pos, block_pages=4, tol=2e-3)

def test_gpu_placement_invariance_and_waves_bit_exact():
  _placement_and_waves(False, REAL, 7 * 256 - 11, 2, 64)
