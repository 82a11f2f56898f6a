"""Span attention for decode and verify, Pallas Mosaic GPU (`mosaic_decode.py`).

CPU (default):
* the real Pallas -> Mosaic GPU lowering (inline PTX and MLIR included) at the 27B shape
  (4 KV heads, 24 query heads, D=256, 256-token pages): decode (N=8, 2 K slots) and verify
  (N=16 / 24 / 32 / 40: S=2 / 4 / 5 / 6, 1 K slot from N=24);
* the whole kernel in the Mosaic GPU interpreter (page walk, TMA ring, barriers of several
  warpgroups, masks, outputs; the tile math in jnp in the compiled path's orders) against
  `reference.span_attention_reference` and a float64 oracle; placement invariance and waves ==
  one call, bit for bit;
* the permutations, the SMEM plan, the partition choice and the errors.

GPU: `KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu pytest tests/test_span_attention_mosaic_decode.py`
also defines the compiled tests (real shapes against the reference; placement invariance and waves
bit for bit on the GPU).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import jax.numpy as jnp

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import magic_ptx
from kvjax_pallas.span_attention import mosaic_common as mc
from kvjax_pallas.span_attention import mosaic_decode as km
from kvjax_pallas.span_attention import reference as ref
from span_history import (REAL_SHAPE, SMALL_SHAPE, History, check_against_reference,
                          kernel_placement_and_waves, lowered_at_real_shape, random_query,
                          rel_error, shape_layout)

ON_GPU = os.environ.get("KVJAX_TEST_GPU", "0") == "1"

REAL, SMALL = REAL_SHAPE, SMALL_SHAPE   # the 27B attention geometry; interpreter sizes
_layout = shape_layout


def _query(seed, s, h, d, kv_len):
  return random_query(seed + 1000, s, h, d, kv_len)


# ----------------------------------------------------------------------------- plain functions


def test_jnp_orders_are_the_conversions_orders():
  """The interpreter's reshape permutations put the head dims where the PTX conversions do."""
  d = jnp.arange(256)
  np.testing.assert_array_equal(np.asarray(mc.k_in_ggml_order(d)),
                                magic_ptx.ggml_dims("q8_0", 256))
  np.testing.assert_array_equal(np.asarray(mc.vt_in_magic_order(d)), magic_ptx.vt_dims(256))


def test_smem_plan_and_partitions():
  """K slots: the most that fit beside the V slot (2 for decode, 1 for verify at N >= 24); a call
  that cannot fit even 1 is refused with the shortfall; one wave of partitions; N by rows."""
  lay = _layout(REAL)
  for n, slots in ((8, 2), (16, 2), (24, 1), (32, 1), (40, 1)):
    assert km.choose_k_slots(lay, n) == slots, n
    assert km.smem_bytes(lay, n, slots) <= mc.SMEM_LIMIT
    assert slots == 2 or km.smem_bytes(lay, n, 2) > mc.SMEM_LIMIT
  over = km.smem_bytes(lay, 200, 1) - mc.SMEM_LIMIT
  with pytest.raises(ValueError, match=f"at N=200 with 4 KV heads, {over:,} B more than"):
    km.choose_k_slots(lay, 200)
  assert [km.choose_block_pages(p, 132) for p in (1, 132, 133, 512, 640, 1024)] == [
      1, 1, 2, 4, 5, 8]
  assert [km.rows_padded(r) for r in (1, 6, 8, 9, 16, 17, 24, 30, 36, 40)] == [
      8, 8, 8, 16, 16, 32, 32, 32, 40, 40]


def test_rejects_unsupported_arguments():
  q = jnp.zeros((1, 24, 256), jnp.float32)
  table = jnp.arange(2, dtype=jnp.int32)
  for pair in (("q8_0", "q8_0"), ("f16", "f16"), ("bf16", "bf16")):
    lay = _layout(REAL, pair)
    with pytest.raises(ValueError, match="unsupported K/V pair"):
      km.span_attention_mosaic_decode(q, jnp.zeros((2, lay.page_bytes), jnp.uint8), table, 10,
                                      jnp.asarray([9]), layout=lay)
  lay128 = PageLayout(4, 128, "q8_0", "q4_0", 256)
  with pytest.raises(ValueError, match="head_dim 256 only"):
    km.span_attention_mosaic_decode(jnp.zeros((1, 24, 128)), jnp.zeros((2, lay128.page_bytes),
                                                                         jnp.uint8),
                                    table, 10, jnp.asarray([9]), layout=lay128)
  lay = _layout(REAL)
  pool = jnp.zeros((2, lay.page_bytes), jnp.uint8)
  with pytest.raises(ValueError, match="too many folded query rows.*42 > 40"):
    km.span_attention_mosaic_decode(jnp.zeros((7, 24, 256)), pool, table, 10,
                                    jnp.arange(7, dtype=jnp.int32), layout=lay)
  lay8 = PageLayout(8, 256, "q8_0", "q4_0", 256)
  with pytest.raises(ValueError, match="1-4 KV heads"):
    km.span_attention_mosaic_decode(jnp.zeros((1, 8, 256)),
                                    jnp.zeros((2, lay8.page_bytes), jnp.uint8), table, 10,
                                    jnp.asarray([9]), layout=lay8)
  lay96 = PageLayout(4, 256, "q8_0", "q4_0", 96)
  with pytest.raises(ValueError, match="page_tokens 96"):
    km.span_attention_mosaic_decode(q, jnp.zeros((2, lay96.page_bytes), jnp.uint8), table, 10,
                                    jnp.asarray([9]), layout=lay96)


# ----------------------------------------------------------------------------- lowering (CPU)


@pytest.mark.parametrize("s_tok", [1, 2, 4, 5, 6])
def test_lowers_for_cuda_at_real_shape(s_tok):
  """The Pallas -> Mosaic GPU lowering accepts the kernel: inline PTX / MLIR of the conversions
  and the softmax, TMA boxes, the K ring (2 slots at N=8 / 16, 1 from N=24), wgmma shapes with
  the N-major Q and P read transposed, the transposed P store."""
  assert "mosaic_gpu" in lowered_at_real_shape(km.span_attention_mosaic_decode, s_tok, 1100)


# ----------------------------------------------------------------------------- interpreter


@pytest.mark.parametrize("s_tok,tokens,block_pages", [
    (1, 5 * 64 - 23, 2), (2, 4 * 64 + 1, 1), (1, 3 * 64, 3), (4, 3 * 64 + 7, 2)])
def test_interpret_matches_reference(s_tok, tokens, block_pages):
  layout = _layout(SMALL)
  hist = History(layout, tokens, seed=tokens)
  pool, table = hist.shuffled(seed=s_tok)
  q, q_pos = _query(tokens, s_tok, SMALL["q_heads"], SMALL["head_dim"], tokens)
  out = km.span_attention_mosaic_decode(q, pool, table, tokens, q_pos, layout=layout,
                                        block_pages=block_pages, interpret=True)
  check_against_reference(out, hist, q, pool, table, q_pos, block_pages=block_pages, tol=2e-3)


def test_token_order():
  """`token_perm` swaps tokens 2 and 3 of every 4 and is its own inverse."""
  i = np.arange(64)
  np.testing.assert_array_equal(mc.token_perm(mc.token_perm(i)), i)
  np.testing.assert_array_equal(mc.token_perm(i)[:8], [0, 1, 3, 2, 4, 5, 7, 6])


def test_interpret_masks_kv_len_positions_and_junk_past_the_end():
  """kv_len ending mid-tile, a query that sees half a page, and NaN-making junk (0xFF bytes:
  f16 NaN scales) in every row past kv_len: V's scales there are zeroed, K's scores masked."""
  layout = _layout(SMALL)
  hist = History(layout, 4 * 64, seed=3)
  pool, table = hist.contiguous()
  kv_len = 3 * 64 - 5
  pool = np.asarray(pool).copy()
  page, row = kv_len // 64, kv_len % 64
  k_rows = pool[page, :layout.k_plane_bytes].reshape(64, layout.k_row_bytes)
  v_rows = pool[page, layout.v_offset:layout.v_offset + layout.v_plane_bytes].reshape(
      64, layout.v_row_bytes)
  k_rows[row:] = 0xFF
  v_rows[row:] = 0xFF
  pool[page, :layout.k_plane_bytes] = k_rows.reshape(-1)
  pool[page, layout.v_offset:layout.v_offset + layout.v_plane_bytes] = v_rows.reshape(-1)
  q, _ = _query(3, 2, SMALL["q_heads"], SMALL["head_dim"], kv_len)
  q_pos = jnp.asarray([32, kv_len - 1], jnp.int32)
  out = np.asarray(km.span_attention_mosaic_decode(q, jnp.asarray(pool), table, kv_len, q_pos,
                                                   layout=layout, block_pages=2, interpret=True))
  assert np.isfinite(out).all()
  oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, np.asarray(q_pos), kv_len)
  assert rel_error(out, oracle) <= 2e-3, rel_error(out, oracle)


def _placement_and_waves(interpret: bool, shape, tokens: int, bp: int, s_tok: int):
  """One call over three placements and three waves: the same bits
  (`kernel_placement_and_waves`)."""
  return kernel_placement_and_waves(km.span_attention_mosaic_decode,
                                    km.span_attention_partial_mosaic_decode, shape, tokens, bp,
                                    s_tok, interpret, query_seed=11 + 1000)


def test_interpret_placement_invariance_and_waves_bit_exact():
  _placement_and_waves(True, SMALL, 5 * 64 - 9, 2, 2)


def test_pages_are_whole_k_rows():
  """The page layout pads each page to whole K rows (the Mosaic GPU kernels' K-row view of the
  pool); the 27B page is 392 K rows (425,984 B of planes + 512 B); the V lines are 256 B there and
  as long as the small test layout allows (64 B) elsewhere."""
  for shape in (REAL, SMALL, dict(REAL, kv_heads=1), dict(REAL, kv_heads=3)):
    lay = _layout(shape)
    assert lay.page_bytes % lay.k_row_bytes == 0
    assert 0 <= lay.page_bytes - (lay.v_offset + lay.v_plane_bytes) < lay.k_row_bytes
    mc.check_layout(lay, 256)
  real = _layout(REAL)
  assert (real.page_bytes, real.k_rows_per_page) == (426_496, 392)
  assert mc.line_bytes(real) == 256 and mc.line_bytes(_layout(SMALL)) == 64


def test_api_routes_to_the_decode_kernel():
  """api.span_attention(implementation="mosaic") with at most 40 folded rows is the decode
  kernel, bit for bit; "auto" block_pages resolves to its own one-wave size; the f16-only
  refusal; a bad page table entry refused."""
  from kvjax_pallas.span_attention import api  # pylint: disable=import-outside-toplevel
  layout = _layout(SMALL)
  tokens = 3 * 64 - 7
  hist = History(layout, tokens, seed=17)
  pool, table = hist.shuffled(seed=2)
  q, q_pos = _query(17, 1, SMALL["q_heads"], SMALL["head_dim"], tokens)
  direct = km.span_attention_mosaic_decode(q, pool, table, tokens, q_pos, layout=layout,
                                           block_pages=1, interpret=True)
  routed = api.span_attention(q, pool, table, tokens, q_pos, layout=layout, block_pages="auto",
                              implementation="mosaic", interpret=True)
  np.testing.assert_array_equal(np.asarray(direct), np.asarray(routed))
  assert api.resolve_block_pages("auto", 640, 1, 24, _layout(REAL),
                                 implementation="mosaic") == 5
  assert "mosaic" in api.IMPLEMENTATIONS and "mosaic" not in api.FULL_IMPLEMENTATIONS
  with pytest.raises(ValueError, match="f16 operands only.*f16x3"):
    api.span_attention(q, pool, table, tokens, q_pos, layout=layout, implementation="mosaic",
                       precision="f16x3", interpret=True)
  bad = np.asarray(table).copy()
  bad[1] = pool.shape[0]
  with pytest.raises(ValueError, match="page table entry 1"):
    api.span_attention(q, pool, jnp.asarray(bad), tokens, q_pos, layout=layout,
                       implementation="mosaic", interpret=True)


# ----------------------------------------------------------------------------- GPU only

# compiled on the GPU: named test_gpu_*, skipped without KVJAX_TEST_GPU=1 (tests/conftest.py)

@pytest.mark.parametrize("s_tok", [1, 2, 4, 5, 6])
def test_gpu_compiled_matches_reference(s_tok):
  """The compiled kernel at the real shape against the jnp reference and the float64 oracle:
  decode (N=8, 2 K slots), verify (N=16 .. 40)."""
  layout = _layout(REAL)
  tokens = 9 * 256 - 37
  hist = History(layout, tokens, seed=21)
  pool, table = hist.shuffled(seed=4)
  q, q_pos = _query(21, s_tok, REAL["q_heads"], REAL["head_dim"], tokens)
  out = km.span_attention_mosaic_decode(q, pool, table, tokens, q_pos, layout=layout,
                                        block_pages=4)
  check_against_reference(out, hist, q, pool, table, q_pos, block_pages=4, tol=2e-3)

@pytest.mark.parametrize("s_tok", [1, 4])
def test_gpu_placement_invariance_and_waves_bit_exact(s_tok):
  _placement_and_waves(False, REAL, 7 * 256 - 11, 2, s_tok)
