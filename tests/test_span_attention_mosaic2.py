"""Span attention v2, Pallas Mosaic GPU (`kernel_mosaic_v2.py`).

CPU (default):
* the real Pallas -> Mosaic GPU lowering (inline PTX and MLIR included) at the 27B shape
  (4 KV heads, 24 query heads, D=256, 256-token pages): decode (N=16, 2 K slots) and verify
  (N=32, 1 K slot);
* the whole kernel in the Mosaic GPU interpreter (page walk, TMA ring, barriers of several
  warpgroups, masks, outputs; the tile math in jnp in the compiled path's orders) against
  `reference.span_attention_reference` and a float64 oracle; placement invariance and waves ==
  one call, bit for bit;
* the permutations, the SMEM plan, the partition choice and the errors.

GPU: `KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu pytest tests/test_span_attention_mosaic2.py` also
defines the compiled tests (real shapes against the reference; placement invariance and waves
bit for bit on the GPU).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import kernel_mosaic_v2 as km2
from kvjax_pallas.span_attention import magic_ptx
from kvjax_pallas.span_attention import reference as ref
from span_history import History

ON_GPU = os.environ.get("KVJAX_TEST_GPU", "0") == "1"

REAL = dict(kv_heads=4, q_heads=24, head_dim=256, page_tokens=256)
SMALL = dict(kv_heads=2, q_heads=6, head_dim=256, page_tokens=64)   # interpreter sizes


def _layout(shape, pair=("q8_0", "q4_0")) -> PageLayout:
  return PageLayout(shape["kv_heads"], shape["head_dim"], pair[0], pair[1], shape["page_tokens"])


def _query(seed, s, h, d, kv_len):
  rng = np.random.default_rng(seed + 1000)
  q = rng.standard_normal((s, h, d)).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(np.arange(kv_len - s, kv_len, dtype=np.int32))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ----------------------------------------------------------------------------- plain functions


def test_jnp_orders_are_the_conversions_orders():
  """The interpreter's reshape permutations put the head dims where the PTX conversions do."""
  d = jnp.arange(256)
  np.testing.assert_array_equal(np.asarray(km2.k_in_ggml_order(d)),
                                magic_ptx.ggml_dims("q8_0", 256))
  np.testing.assert_array_equal(np.asarray(km2.vt_in_magic_order(d)), magic_ptx.vt_dims(256))


def test_smem_plan_and_partitions():
  lay = _layout(REAL)
  assert km2.choose_k_slots(lay, 16) == 2 and km2.smem_bytes(lay, 16, 2) <= km2.SMEM_LIMIT
  assert km2.choose_k_slots(lay, 32) == 1 and km2.smem_bytes(lay, 32, 2) > km2.SMEM_LIMIT
  assert [km2.choose_block_pages(p, 132) for p in (1, 132, 133, 512, 640, 1024)] == [
      1, 1, 2, 4, 5, 8]
  assert [km2.rows_padded(r) for r in (1, 6, 16, 17, 24, 32)] == [16, 16, 16, 32, 32, 32]


def test_rejects_unsupported_arguments():
  q = jnp.zeros((1, 24, 256), jnp.float32)
  table = jnp.arange(2, dtype=jnp.int32)
  for pair in (("q8_0", "q8_0"), ("f16", "f16"), ("bf16", "bf16")):
    lay = _layout(REAL, pair)
    with pytest.raises(ValueError, match="unsupported K/V pair"):
      km2.span_attention_mosaic2(q, jnp.zeros((2, lay.page_bytes), jnp.uint8), table, 10,
                                 jnp.asarray([9]), layout=lay)
  lay128 = PageLayout(4, 128, "q8_0", "q4_0", 256)
  with pytest.raises(ValueError, match="head_dim 256 only"):
    km2.span_attention_mosaic2(jnp.zeros((1, 24, 128)), jnp.zeros((2, lay128.page_bytes),
                                                                    jnp.uint8),
                               table, 10, jnp.asarray([9]), layout=lay128)
  lay = _layout(REAL)
  pool = jnp.zeros((2, lay.page_bytes), jnp.uint8)
  with pytest.raises(ValueError, match="too many folded query rows.*36 > 32"):
    km2.span_attention_mosaic2(jnp.zeros((6, 24, 256)), pool, table, 10,
                               jnp.arange(6, dtype=jnp.int32), layout=lay)
  lay8 = PageLayout(8, 256, "q8_0", "q4_0", 256)
  with pytest.raises(ValueError, match="1-4 KV heads"):
    km2.span_attention_mosaic2(jnp.zeros((1, 8, 256)), jnp.zeros((2, lay8.page_bytes), jnp.uint8),
                               table, 10, jnp.asarray([9]), layout=lay8)
  lay96 = PageLayout(4, 256, "q8_0", "q4_0", 96)
  with pytest.raises(ValueError, match="page_tokens 96"):
    km2.span_attention_mosaic2(q, jnp.zeros((2, lay96.page_bytes), jnp.uint8), table, 10,
                               jnp.asarray([9]), layout=lay96)


# ----------------------------------------------------------------------------- lowering (CPU)


@pytest.mark.parametrize("s_tok", [1, 2, 4, 5])
def test_lowers_for_cuda_at_real_shape(s_tok):
  """The Pallas -> Mosaic GPU lowering accepts the kernel: inline PTX / MLIR of the conversions
  and the softmax, TMA boxes, the K ring (2 slots at N=16, 1 at N=32), wgmma shapes."""
  layout = _layout(REAL)
  q = jnp.zeros((s_tok, REAL["q_heads"], REAL["head_dim"]), jnp.float32)
  pool = jnp.zeros((7, layout.page_bytes), jnp.uint8)
  table = jnp.arange(5, dtype=jnp.int32)
  q_pos = jnp.arange(s_tok, dtype=jnp.int32) + 1000

  def f(q, pool, table, kv_len, q_pos):
    return km2.span_attention_mosaic2(q, pool, table, kv_len, q_pos, layout=layout, block_pages=2)

  lowered = jax.jit(f).trace(q, pool, table, jnp.int32(1100), q_pos).lower(
      lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


# ----------------------------------------------------------------------------- interpreter


@pytest.mark.parametrize("s_tok,tokens,block_pages", [
    (1, 5 * 64 - 23, 2), (2, 4 * 64 + 1, 1), (1, 3 * 64, 3), (4, 3 * 64 + 7, 2)])
def test_interpret_matches_reference(s_tok, tokens, block_pages):
  layout = _layout(SMALL)
  hist = History(layout, tokens, seed=tokens)
  pool, table = hist.shuffled(seed=s_tok)
  q, q_pos = _query(tokens, s_tok, SMALL["q_heads"], SMALL["head_dim"], tokens)
  out = np.asarray(km2.span_attention_mosaic2(q, pool, table, tokens, q_pos, layout=layout,
                                              block_pages=block_pages, interpret=True))
  want = np.asarray(ref.span_attention_reference(q, pool, table, tokens, q_pos, layout=layout,
                                                 block_pages=block_pages))
  assert out.shape == want.shape and np.isfinite(out).all()
  assert _rel(out, want) <= 2e-3, _rel(out, want)
  oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, np.asarray(q_pos), tokens)
  assert _rel(out, oracle) <= 2e-3, _rel(out, oracle)


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
  out = np.asarray(km2.span_attention_mosaic2(q, jnp.asarray(pool), table, kv_len, q_pos,
                                              layout=layout, block_pages=2, interpret=True))
  assert np.isfinite(out).all()
  oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, np.asarray(q_pos), kv_len)
  assert _rel(out, oracle) <= 2e-3, _rel(out, oracle)


def _placement_and_waves(interpret: bool, shape, tokens: int, bp: int, s_tok: int):
  layout = _layout(shape)
  h = shape["q_heads"]
  hist = History(layout, tokens, seed=11)
  q, q_pos = _query(11, s_tok, h, shape["head_dim"], tokens)
  kw = dict(layout=layout, block_pages=bp, interpret=interpret)
  pool_a, table_a = hist.contiguous()
  pool_b, table_b = hist.shuffled(seed=5)
  pool_c, table_c = hist.resident_ring(resident=1, ring_base=hist.num_pages + 2, ring_slots=3,
                                       wrap=2)
  one = np.asarray(km2.span_attention_mosaic2(q, pool_a, table_a, tokens, q_pos, **kw))
  for pool, table in ((pool_b, table_b), (pool_c, table_c)):
    np.testing.assert_array_equal(
        one, np.asarray(km2.span_attention_mosaic2(q, pool, table, tokens, q_pos, **kw)))
  carry = ref.init_carry(layout.num_kv_heads, s_tok * h // layout.num_kv_heads, shape["head_dim"])
  for a, b in ((0, bp), (bp, 2 * bp), (2 * bp, table_b.shape[0])):
    carry = km2.span_attention_partial_mosaic2(q, pool_b, table_b, jnp.int32(tokens), q_pos,
                                               carry, jnp.int32(a), jnp.int32(b), num_q_heads=h,
                                               **kw)
  np.testing.assert_array_equal(one, np.asarray(ref.finalize(carry, h)))
  return one, hist, q, q_pos


def test_interpret_placement_invariance_and_waves_bit_exact():
  _placement_and_waves(True, SMALL, 5 * 64 - 9, 2, 2)


def test_api_routes_to_the_v2_kernel():
  """api.span_attention(implementation="mosaic2") is the v2 kernel, bit for bit; "auto"
  block_pages resolves to v2's own one-wave size; the f16-only refusal."""
  from kvjax_pallas.span_attention import api  # pylint: disable=import-outside-toplevel
  layout = _layout(SMALL)
  tokens = 3 * 64 - 7
  hist = History(layout, tokens, seed=17)
  pool, table = hist.shuffled(seed=2)
  q, q_pos = _query(17, 1, SMALL["q_heads"], SMALL["head_dim"], tokens)
  direct = km2.span_attention_mosaic2(q, pool, table, tokens, q_pos, layout=layout,
                                      block_pages=1, interpret=True)
  routed = api.span_attention(q, pool, table, tokens, q_pos, layout=layout, block_pages="auto",
                              implementation="mosaic2", interpret=True)
  np.testing.assert_array_equal(np.asarray(direct), np.asarray(routed))
  assert api.resolve_block_pages("auto", 640, 1, 24, _layout(REAL),
                                 implementation="mosaic2") == 5
  assert "mosaic2" in api.IMPLEMENTATIONS and "mosaic2" not in api.FULL_IMPLEMENTATIONS
  with pytest.raises(ValueError, match="f16 operands only.*f16x3"):
    api.span_attention(q, pool, table, tokens, q_pos, layout=layout, implementation="mosaic2",
                       precision="f16x3", interpret=True)


# ----------------------------------------------------------------------------- GPU only

if ON_GPU:

  @pytest.mark.parametrize("s_tok", [1, 2, 4, 5])
  def test_gpu_compiled_matches_reference(s_tok):
    """The compiled kernel at the real shape against the jnp reference and the float64 oracle:
    decode (N=16, 2 K slots), verify (N=32, 1 K slot)."""
    layout = _layout(REAL)
    tokens = 9 * 256 - 37
    hist = History(layout, tokens, seed=21)
    pool, table = hist.shuffled(seed=4)
    q, q_pos = _query(21, s_tok, REAL["q_heads"], REAL["head_dim"], tokens)
    out = np.asarray(km2.span_attention_mosaic2(q, pool, table, tokens, q_pos, layout=layout,
                                                block_pages=4))
    want = np.asarray(ref.span_attention_reference(q, pool, table, tokens, q_pos, layout=layout,
                                                   block_pages=4))
    assert np.isfinite(out).all()
    assert _rel(out, want) <= 2e-3, _rel(out, want)
    oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, np.asarray(q_pos), tokens)
    assert _rel(out, oracle) <= 2e-3, _rel(out, oracle)

  @pytest.mark.parametrize("s_tok", [1, 4])
  def test_gpu_placement_invariance_and_waves_bit_exact(s_tok):
    _placement_and_waves(False, REAL, 7 * 256 - 11, 2, s_tok)
