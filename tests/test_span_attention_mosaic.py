"""Span attention, Pallas Mosaic GPU kernel (`kernel_mosaic.py`).

CPU (default):
* the real Pallas -> Mosaic GPU lowering (Python side, no GPU) at the 27B shape
  (4 KV heads, 24 query heads, D=256, 256-token pages) for S = 1, 2, 10;
* the kernel's tile code (decode, S^T = K Q^T wgmma, masks, softmax, PV) in the
  Mosaic GPU interpreter against numpy on random valid pages;
* the whole kernel in the interpreter (its interpret path: pre-gathered GMEM
  views, register PV dot) against `reference.span_attention_reference`, plus
  placement invariance and waves == one call, bit for bit.

GPU: `KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu pytest tests/test_span_attention_mosaic.py`
(the interpreter tests need the CPU device) also runs the tile step compiled and
defines `test_gpu_compiled_matches_reference` (compiled kernel, real shapes,
overlap off / on, rel err <= 2e-3). Without KVJAX_TEST_GPU=1 those do not exist.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from kvjax_pallas import ggml_codec
from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import kernel_mosaic as km
from kvjax_pallas.span_attention import reference as ref
from span_history import History, check_against_reference

ON_GPU = os.environ.get("KVJAX_TEST_GPU", "0") == "1"

REAL = dict(kv_heads=4, q_heads=24, head_dim=256, page_tokens=256)
SMALL = dict(kv_heads=2, q_heads=6, head_dim=256, page_tokens=64)   # interpreter sizes
PAIRS = km.SUPPORTED_PAIRS


def _layout(shape, pair=("q8_0", "q4_0")) -> PageLayout:
  return PageLayout(shape["kv_heads"], shape["head_dim"], pair[0], pair[1], shape["page_tokens"])


def _query(seed, s, h, d, kv_len):
  rng = np.random.default_rng(seed + 1000)
  q = rng.standard_normal((s, h, d)).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(np.arange(kv_len - s, kv_len, dtype=np.int32))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ----------------------------------------------------------------------------- lowering (CPU)


@pytest.mark.parametrize("s_tok,overlap", [(1, False), (2, False), (10, False), (1, True)])
@pytest.mark.parametrize("pair", PAIRS)
def test_lowers_for_cuda_at_real_shape(pair, s_tok, overlap):
  """The real Pallas -> Mosaic GPU lowering accepts the kernel (layouts, TMA boxes, wgmma shapes, SMEM)."""
  layout = _layout(REAL, pair)
  num_pages = 5
  q = jnp.zeros((s_tok, REAL["q_heads"], REAL["head_dim"]), jnp.float32)
  pool = jnp.zeros((num_pages + 2, layout.page_bytes), jnp.uint8)
  table = jnp.arange(num_pages, dtype=jnp.int32)
  q_pos = jnp.arange(s_tok, dtype=jnp.int32) + 1000

  def f(q, pool, table, kv_len, q_pos):
    return km.span_attention_mosaic(q, pool, table, kv_len, q_pos, layout=layout, block_pages=2,
                                    overlap=overlap)

  lowered = jax.jit(f).trace(q, pool, table, jnp.int32(1100), q_pos).lower(
      lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def test_overlap_refused_where_it_does_not_fit_in_smem():
  """overlap=True at 64 padded rows (S=6 x 6 query heads) needs 24 B more SMEM than the H200 has
  (measured): the wrapper refuses it by name before lowering; S=5 (30 rows -> 32) still lowers."""
  layout = _layout(REAL)
  pool = jnp.zeros((7, layout.page_bytes), jnp.uint8)
  table = jnp.arange(5, dtype=jnp.int32)

  def lower(s_tok):
    q = jnp.zeros((s_tok, REAL["q_heads"], REAL["head_dim"]), jnp.float32)
    q_pos = jnp.arange(s_tok, dtype=jnp.int32) + 1000
    f = functools.partial(km.span_attention_mosaic, layout=layout, block_pages=2, overlap=True)
    return jax.jit(f).trace(q, pool, table, jnp.int32(1100), q_pos).lower(
        lowering_platforms=("cuda",))

  with pytest.raises(ValueError, match=r"overlap=True .* does not fit at 64 padded query rows "
                                       r"\(36 folded rows\).*use overlap=False"):
    lower(6)
  assert "mosaic_gpu" in lower(5).as_text()


def test_partial_lowers_with_uint8_pool():
  layout = _layout(REAL)
  q = jnp.zeros((1, REAL["q_heads"], REAL["head_dim"]), jnp.float32)
  pool = jnp.zeros((4, layout.page_bytes), jnp.uint8)
  carry = ref.init_carry(4, 6, 256)

  def f(q, pool, table, carry):
    return km.span_attention_partial_mosaic(q, pool, table, jnp.int32(700), jnp.asarray([699]),
                                            carry, jnp.int32(1), jnp.int32(3), layout=layout,
                                            num_q_heads=24, block_pages=1)

  jax.jit(f).trace(q, pool, jnp.arange(3, dtype=jnp.int32), carry).lower(
      lowering_platforms=("cuda",))


@pytest.mark.parametrize("pair", PAIRS)
def test_tile_step_lowers_for_cuda(pair):
  layout = _layout(REAL, pair)
  k = jnp.zeros((64, layout.k_head_bytes), jnp.uint8)
  v = jnp.zeros((64, layout.v_head_bytes), jnp.uint8)
  qt = jnp.zeros((256, 16), jnp.float16)

  def f(k, v, qt):
    return km.tile_step_mosaic(k, v, qt, jnp.asarray([0, 64], jnp.int32), jnp.asarray([70]),
                               k_type=pair[0], v_type=pair[1], group=6, sm_scale=0.0625)

  jax.jit(f).trace(k, v, qt).lower(lowering_platforms=("cuda",))


# ----------------------------------------------------------------------------- interpreter (CPU)


TILE_MODES = ["interpret"] + (["compiled"] if ON_GPU else [])


@pytest.mark.parametrize("mode", TILE_MODES)
@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("s_tok,group,tok_end", [(1, 6, 64), (2, 6, 40), (3, 5, 17)])
def test_tile_step_matches_numpy(pair, s_tok, group, tok_end, mode):
  """Decode + S^T + masks + softmax statistics + PV of one tile, against numpy.

  mode "interpret": the Mosaic GPU interpreter (CPU); "compiled" (GPU only): the real kernel.
  """
  rng = np.random.default_rng(100 * s_tok + tok_end + (pair[1] == "q8_0"))
  kt, vt = pair
  bt, d = 64, 256
  k = rng.standard_normal((bt, 1, d)).astype(np.float32) * 1.5
  v = rng.standard_normal((bt, 1, d)).astype(np.float32)
  kb = np.array(ggml_codec.encode_rows(jnp.asarray(k), kt))
  vb = np.array(ggml_codec.encode_rows(jnp.asarray(v), vt))
  kd = np.asarray(ggml_codec.decode_rows(jnp.asarray(kb), kt, 1))[:, 0]
  vd = np.asarray(ggml_codec.decode_rows(jnp.asarray(vb), vt, 1))[:, 0]
  # rows at or past tok_end hold junk bytes (NaN / inf scales included): they must not leak
  kb[tok_end:] = rng.integers(0, 256, kb[tok_end:].shape, dtype=np.uint8)
  vb[tok_end:] = rng.integers(0, 256, vb[tok_end:].shape, dtype=np.uint8)
  kb[tok_end:, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
  vb[tok_end:, 0:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
  k_rows = jnp.asarray(kb)
  v_rows = jnp.asarray(vb)

  t0 = 128                                   # absolute position of row 0
  rows = s_tok * group
  n = km.rows_padded(rows)
  q = rng.standard_normal((rows, d)).astype(np.float32)
  qt = np.zeros((d, n), np.float16)
  qt[:, :rows] = q.T
  q_pos = np.asarray([t0 + 30 + 9 * i for i in range(s_tok)], np.int32)
  scale = 1.0 / 16
  kf, vf, s, ml, acct = km.tile_step_mosaic(
      k_rows, v_rows, jnp.asarray(qt), jnp.asarray([t0, t0 + tok_end], jnp.int32),
      jnp.asarray(q_pos), k_type=kt, v_type=vt, group=group, sm_scale=scale,
      interpret=mode == "interpret")
  kf, vf, s, ml, acct = map(lambda x: np.asarray(x, np.float32), (kf, vf, s, ml, acct))

  np.testing.assert_allclose(kf[:tok_end], kd[:tok_end].astype(np.float16), rtol=0, atol=0)
  np.testing.assert_allclose(vf[:tok_end], vd[:tok_end].astype(np.float16), rtol=0, atol=0)
  assert not kf[tok_end:].any() and not vf[tok_end:].any()        # zero scale: exact zeros

  k16 = kd.astype(np.float16).astype(np.float64)
  q16 = q.astype(np.float16).astype(np.float64)
  s_ref = k16 @ q16.T * scale                                       # [64, rows]
  key = t0 + np.arange(bt)[:, None]
  qcol = np.repeat(q_pos, group)[None, :]
  ok = (key < t0 + tok_end) & (key <= qcol)
  s_ref = np.where(ok, s_ref, -np.inf)
  np.testing.assert_allclose(s[:, :rows], s_ref, rtol=1e-5, atol=1e-4)
  assert np.all(s[:, rows:] == -np.inf)                             # padding columns see no key
  m_ref = s_ref.max(0)
  p_ref = np.exp(s_ref - m_ref)
  np.testing.assert_allclose(ml[0, :rows], m_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ml[1, :rows], p_ref.sum(0), rtol=1e-4)
  assert np.all(ml[0, rows:] == -np.inf) and np.all(ml[1, rows:] == 0)
  v16 = np.where(np.arange(bt)[:, None] < tok_end, vd, 0).astype(np.float16).astype(np.float64)
  acc_ref = v16.T @ p_ref.astype(np.float16).astype(np.float64)    # [256 dims, rows]
  np.testing.assert_allclose(acct[:, :rows], acc_ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("pair,s_tok,tokens,block_pages", [
    (PAIRS[0], 1, 5 * 64 - 23, 2), (PAIRS[0], 2, 4 * 64 + 1, 1), (PAIRS[1], 2, 3 * 64 - 1, 3),
    (PAIRS[0], 10, 3 * 64 + 7, 2)])
def test_interpret_matches_reference(pair, s_tok, tokens, block_pages):
  layout = _layout(SMALL, pair)
  hist = History(layout, tokens, seed=tokens)
  pool, table = hist.shuffled(seed=s_tok)
  q, q_pos = _query(tokens, s_tok, SMALL["q_heads"], SMALL["head_dim"], tokens)
  out = km.span_attention_mosaic(q, pool, table, tokens, q_pos, layout=layout,
                                 block_pages=block_pages, interpret=True)
  check_against_reference(out, hist, q, pool, table, q_pos, block_pages=block_pages, tol=1e-2)


def test_interpret_masks_kv_len_and_positions():
  """kv_len ending mid-page, a query that sees half a page, and a junk table tail."""
  layout = _layout(SMALL)
  hist = History(layout, 4 * 64, seed=3)
  pool, table = hist.contiguous()
  kv_len = 3 * 64 - 5
  q, _ = _query(3, 2, SMALL["q_heads"], SMALL["head_dim"], kv_len)
  q_pos = jnp.asarray([32, kv_len - 1], jnp.int32)
  out = np.asarray(km.span_attention_mosaic(q, pool, table, kv_len, q_pos, layout=layout,
                                            block_pages=2, interpret=True))
  oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, np.asarray(q_pos), kv_len)
  assert _rel(out, oracle) <= 1e-2, _rel(out, oracle)


def test_interpret_overlap_is_the_same_computation():
  """overlap=True only moves the copies earlier: the same bits as overlap=False."""
  layout = _layout(SMALL)
  tokens = 5 * 64 - 9
  hist = History(layout, tokens, seed=23)
  pool, table = hist.shuffled(seed=6)
  q, q_pos = _query(23, 1, SMALL["q_heads"], SMALL["head_dim"], tokens)
  kw = dict(layout=layout, block_pages=3, interpret=True)
  np.testing.assert_array_equal(
      np.asarray(km.span_attention_mosaic(q, pool, table, tokens, q_pos, overlap=False, **kw)),
      np.asarray(km.span_attention_mosaic(q, pool, table, tokens, q_pos, overlap=True, **kw)))


def test_interpret_placement_invariance_and_waves_bit_exact():
  layout = _layout(SMALL)
  tokens, bp, h = 5 * 64 - 9, 2, SMALL["q_heads"]
  hist = History(layout, tokens, seed=11)
  q, q_pos = _query(11, 2, h, SMALL["head_dim"], tokens)
  kw = dict(layout=layout, block_pages=bp, interpret=True)
  pool_a, table_a = hist.contiguous()
  pool_b, table_b = hist.shuffled(seed=5)
  one = np.asarray(km.span_attention_mosaic(q, pool_a, table_a, tokens, q_pos, **kw))
  np.testing.assert_array_equal(
      one, np.asarray(km.span_attention_mosaic(q, pool_b, table_b, tokens, q_pos, **kw)))
  carry = ref.init_carry(layout.num_kv_heads, 2 * h // layout.num_kv_heads, SMALL["head_dim"])
  for a, b in ((0, bp), (bp, 2 * bp), (2 * bp, table_b.shape[0])):
    carry = km.span_attention_partial_mosaic(q, pool_b, table_b, jnp.int32(tokens), q_pos, carry,
                                             jnp.int32(a), jnp.int32(b), num_q_heads=h, **kw)
  np.testing.assert_array_equal(one, np.asarray(ref.finalize(carry, h)))


# ----------------------------------------------------------------------------- errors


def test_rejects_unsupported_arguments():
  q = jnp.zeros((1, 24, 256), jnp.float32)
  table = jnp.arange(2, dtype=jnp.int32)
  for pair in (("f16", "f16"), ("q4_0", "q4_0"), ("bf16", "bf16")):
    lay = _layout(REAL, pair)
    pool = jnp.zeros((2, lay.page_bytes), jnp.uint8)
    with pytest.raises(ValueError, match="unsupported K/V pair"):
      km.span_attention_mosaic(q, pool, table, 10, jnp.asarray([9]), layout=lay)
  lay128 = PageLayout(4, 128, "q8_0", "q4_0", 256)
  with pytest.raises(ValueError, match="head_dim"):
    km.span_attention_mosaic(jnp.zeros((1, 24, 128)), jnp.zeros((2, lay128.page_bytes), jnp.uint8),
                             table, 10, jnp.asarray([9]), layout=lay128)
  lay = _layout(REAL)
  pool = jnp.zeros((2, lay.page_bytes), jnp.uint8)
  with pytest.raises(ValueError, match="too many folded query rows"):
    km.span_attention_mosaic(jnp.zeros((11, 24, 256)), pool, table, 10,
                             jnp.arange(11, dtype=jnp.int32), layout=lay)
  lay100 = PageLayout(4, 256, "q8_0", "q4_0", 96)
  with pytest.raises(ValueError, match="page_tokens"):
    km.span_attention_mosaic(q, jnp.zeros((2, lay100.page_bytes), jnp.uint8), table, 10,
                             jnp.asarray([9]), layout=lay100)


def test_api_routes_to_the_mosaic_kernel():
  """api.span_attention(implementation="mosaic") is the Mosaic kernel, bit for bit; the api
  refuses the precisions it does not have and a bad page table entry."""
  from kvjax_pallas.span_attention import api
  layout = _layout(SMALL)
  tokens = 3 * 64 - 7
  hist = History(layout, tokens, seed=17)
  pool, table = hist.shuffled(seed=2)
  q, q_pos = _query(17, 1, SMALL["q_heads"], SMALL["head_dim"], tokens)
  direct = km.span_attention_mosaic(q, pool, table, tokens, q_pos, layout=layout, block_pages=2,
                                    interpret=True)
  routed = api.span_attention(q, pool, table, tokens, q_pos, layout=layout, block_pages=2,
                              implementation="mosaic", interpret=True)
  np.testing.assert_array_equal(np.asarray(direct), np.asarray(routed))
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

if ON_GPU:

  @pytest.mark.parametrize("pair", PAIRS)
  @pytest.mark.parametrize("s_tok,overlap", [(1, False), (2, False), (1, True), (2, True)])
  def test_gpu_compiled_matches_reference(pair, s_tok, overlap):
    """The compiled kernel on the GPU at the real shape against the jnp reference."""
    layout = _layout(REAL, pair)
    tokens = 9 * 256 - 37
    hist = History(layout, tokens, seed=21)
    pool, table = hist.shuffled(seed=4)
    q, q_pos = _query(21, s_tok, REAL["q_heads"], REAL["head_dim"], tokens)
    out = np.asarray(km.span_attention_mosaic(q, pool, table, tokens, q_pos, layout=layout,
                                              block_pages=4, overlap=overlap))
    want = np.asarray(ref.span_attention_reference(q, pool, table, tokens, q_pos, layout=layout,
                                                   block_pages=4))
    assert np.isfinite(out).all()
    assert _rel(out, want) <= 2e-3, _rel(out, want)
