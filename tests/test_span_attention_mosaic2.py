"""Span attention v2, Pallas Mosaic GPU (`kernel_mosaic_v2.py`).

CPU (default):
* the real Pallas -> Mosaic GPU lowering (inline PTX and MLIR included) at the 27B shape
  (4 KV heads, 24 query heads, D=256, 256-token pages): decode (N=8, 2 K slots) and verify
  (N=16 / 24 / 32 / 40: S=2 / 4 / 5 / 6, 1 K slot from N=24);
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

import functools
import os

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import kernel_mosaic_v2 as km2
from kvjax_pallas.span_attention import magic_ptx
from kvjax_pallas.span_attention import reference as ref
from span_history import (REAL_SHAPE, SMALL_SHAPE, History, check_against_reference,
                          check_placement_and_waves, random_query, rel_error, shape_layout)

ON_GPU = os.environ.get("KVJAX_TEST_GPU", "0") == "1"

REAL, SMALL = REAL_SHAPE, SMALL_SHAPE   # the 27B attention geometry; interpreter sizes
_layout = shape_layout


def _query(seed, s, h, d, kv_len):
  return random_query(seed + 1000, s, h, d, kv_len)


# ----------------------------------------------------------------------------- plain functions


def test_jnp_orders_are_the_conversions_orders():
  """The interpreter's reshape permutations put the head dims where the PTX conversions do."""
  d = jnp.arange(256)
  np.testing.assert_array_equal(np.asarray(km2.k_in_ggml_order(d)),
                                magic_ptx.ggml_dims("q8_0", 256))
  np.testing.assert_array_equal(np.asarray(km2.vt_in_magic_order(d)), magic_ptx.vt_dims(256))


def test_smem_plan_and_partitions():
  """K slots, the most that fit; the V half-tile slots that fit beside them; a V ring asked for
  past the SMEM limit is refused with the shortfall; whole V tiles (v_tiles) leave K 1 slot."""
  lay = _layout(REAL)
  assert (km2.consumer_regs(2), km2.consumer_regs(4)) == (232, 112)   # beside a producer at 40
  for n, slots, halves in ((8, 2, 3), (16, 2, 2), (24, 1, 3), (32, 1, 3), (40, 1, 2)):
    assert km2.choose_k_slots(lay, n) == slots, n
    assert km2.max_v_halves(lay, n, slots) == halves, n
    assert km2.choose_v_halves(lay, n, slots) == 2          # the default: one whole tile
    assert km2.smem_bytes(lay, n, slots, halves) <= km2.SMEM_LIMIT
    assert slots == 2 or km2.smem_bytes(lay, n, 2) > km2.SMEM_LIMIT
    assert halves == 3 or km2.smem_bytes(lay, n, slots, 3) > km2.SMEM_LIMIT
  over = km2.smem_bytes(lay, 40, 1, 3) - km2.SMEM_LIMIT
  with pytest.raises(ValueError, match=f"v_halves=3 needs .* {over:,} B more than"):
    km2.choose_v_halves(lay, 40, 1, 3)
  # whole V tiles first (v_tiles = half tiles / 2), K the rest: 1 K slot beside 2 or 3 at N = 8
  assert [km2.choose_k_slots(lay, 8, 2 * t) for t in (1, 2, 3)] == [2, 1, 1]
  over = km2.smem_bytes(lay, 32, 1, 4) - km2.SMEM_LIMIT
  with pytest.raises(ValueError, match=f"at N=32 with 4 KV heads and 2 V tiles, {over:,} B more"):
    km2.choose_k_slots(lay, 32, 4)
  assert [km2.choose_block_pages(p, 132) for p in (1, 132, 133, 512, 640, 1024)] == [
      1, 1, 2, 4, 5, 8]
  assert [km2.rows_padded(r) for r in (1, 6, 8, 9, 16, 17, 24, 30, 36, 40)] == [
      8, 8, 8, 16, 16, 32, 32, 32, 40, 40]


def test_rejects_bad_kernel_options():
  """The session-14 options refuse what they cannot do, by name."""
  layout = _layout(REAL)
  q = jnp.zeros((1, 24, 256), jnp.float32)
  pool = jnp.zeros((3, layout.page_bytes), jnp.uint8)
  table = jnp.arange(2, dtype=jnp.int32)
  for kw, msg in ((dict(heads_per_wg=3), "heads_per_wg must be 1 or 2 and divide the 4 KV heads"),
                  (dict(heads_per_wg=2, acc_refs=True), "acc_refs .* needs heads_per_wg=1"),
                  (dict(own_k=True, k_heads=False), "own_k needs k_heads=True"),
                  (dict(v_halves=4), r"v_halves must be one of \(2, 3\)"),
                  (dict(producer=True, own_k=True), "producer issues every copy itself"),
                  (dict(v_tiles=4), r"v_tiles must be one of \(1, 2, 3\)"),
                  (dict(v_tiles=2, v_halves=3), "are two V rings: give one"),
                  (dict(v_tiles=1, v_halves=3), "are two V rings: give one"),
                  (dict(v_tiles=2, producer=True), "producer issues every copy itself")):
    with pytest.raises(ValueError, match=msg):
      km2.span_attention_mosaic2(q, pool, table, 300, jnp.asarray([299], jnp.int32),
                                 layout=layout, block_pages=1, **kw)


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
  with pytest.raises(ValueError, match="too many folded query rows.*42 > 40"):
    km2.span_attention_mosaic2(jnp.zeros((7, 24, 256)), pool, table, 10,
                               jnp.arange(7, dtype=jnp.int32), layout=lay)
  lay8 = PageLayout(8, 256, "q8_0", "q4_0", 256)
  with pytest.raises(ValueError, match="1-4 KV heads"):
    km2.span_attention_mosaic2(jnp.zeros((1, 8, 256)), jnp.zeros((2, lay8.page_bytes), jnp.uint8),
                               table, 10, jnp.asarray([9]), layout=lay8)
  lay96 = PageLayout(4, 256, "q8_0", "q4_0", 96)
  with pytest.raises(ValueError, match="page_tokens 96"):
    km2.span_attention_mosaic2(q, jnp.zeros((2, lay96.page_bytes), jnp.uint8), table, 10,
                               jnp.asarray([9]), layout=lay96)


def test_wgmma_n_choice():
  """wgmma_n overrides the N of rows_padded: a multiple of 8 from the rows up to 256, else a
  clear error naming the rows."""
  assert km2.choose_n(6) == 8 and km2.choose_n(24) == 32 and km2.choose_n(24, 24) == 24
  assert km2.choose_n(6, 16) == 16
  for bad in (12, 4, 264):
    with pytest.raises(ValueError, match=f"wgmma_n={bad} must be a multiple of 8 between the "
                                         r"folded query rows \(6\) and 256"):
      km2.choose_n(6, bad)


# ----------------------------------------------------------------------------- lowering (CPU)


@pytest.mark.parametrize("s_tok,wgmma_n,opts", [
    (1, None, {}), (2, None, {}), (4, None, {}), (5, None, {}), (6, None, {}), (1, 16, {}),
    (4, 24, {}), (1, None, dict(heads_per_wg=2)), (4, None, dict(heads_per_wg=2, own_k=True)),
    (1, None, dict(v_halves=3, table_smem=True, late_k=True)),
    (1, None, dict(heads_per_wg=2, producer=True)), (4, None, dict(producer=True)),
    (1, None, dict(rhs_per_tile=False)), (4, None, dict(rhs_per_tile=False, heads_per_wg=2)),
    (1, None, dict(v_tiles=2)), (1, None, dict(v_tiles=3))])
def test_lowers_for_cuda_at_real_shape(s_tok, wgmma_n, opts):
  """The Pallas -> Mosaic GPU lowering accepts the kernel: inline PTX / MLIR of the conversions
  and the softmax, TMA boxes, the K ring (2 slots at N=8 / 16, 1 from N=24), wgmma shapes with
  the N-major Q and P read transposed, the transposed P store; also a forced wgmma N (N=16 for
  decode, N=24 for S=4: 3 Q / P tiles of 8); and the session-14 options (2 warpgroups of 2
  heads each; own K copies; a V ring of half tiles; the page table in SMEM; late K copies; a
  producer warpgroup with setmaxnreg)."""
  layout = _layout(REAL)
  q = jnp.zeros((s_tok, REAL["q_heads"], REAL["head_dim"]), jnp.float32)
  pool = jnp.zeros((7, layout.page_bytes), jnp.uint8)
  table = jnp.arange(5, dtype=jnp.int32)
  q_pos = jnp.arange(s_tok, dtype=jnp.int32) + 1000

  def f(q, pool, table, kv_len, q_pos):
    return km2.span_attention_mosaic2(q, pool, table, kv_len, q_pos, layout=layout, block_pages=2,
                                      wgmma_n=wgmma_n, **opts)

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
  out = km2.span_attention_mosaic2(q, pool, table, tokens, q_pos, layout=layout,
                                   block_pages=block_pages, interpret=True)
  check_against_reference(out, hist, q, pool, table, q_pos, block_pages=block_pages, tol=2e-3)


def test_token_order_option():
  """`token_perm` swaps tokens 2 and 3 of every 4 (its own inverse); the kernel gives the
  reference's result with the tiles' tokens in order (perm_tokens=False, as before session 12)
  and permuted (the default), and the two orders differ only in rounding."""
  i = np.arange(64)
  np.testing.assert_array_equal(km2.token_perm(km2.token_perm(i)), i)
  np.testing.assert_array_equal(km2.token_perm(i)[:8], [0, 1, 3, 2, 4, 5, 7, 6])
  layout = _layout(SMALL)
  tokens = 3 * 64 - 13
  hist = History(layout, tokens, seed=9)
  pool, table = hist.shuffled(seed=1)
  q, q_pos = _query(9, 2, SMALL["q_heads"], SMALL["head_dim"], tokens)
  want = np.asarray(ref.span_attention_reference(q, pool, table, tokens, q_pos, layout=layout,
                                                 block_pages=2))
  outs = [np.asarray(km2.span_attention_mosaic2(q, pool, table, tokens, q_pos, layout=layout,
                                                block_pages=2, interpret=True, perm_tokens=p))
          for p in (False, True)]
  for out in outs:
    assert rel_error(out, want) <= 2e-3, rel_error(out, want)
  assert rel_error(outs[0], outs[1]) <= 1e-3


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
  assert rel_error(out, oracle) <= 2e-3, rel_error(out, oracle)


def _placement_and_waves(interpret: bool, shape, tokens: int, bp: int, s_tok: int, **opts):
  """One call over three placements (contiguous, shuffled, resident + ring with wraps) and three
  waves over the shuffled one: the same bits. opts: kernel options (k_heads, combine tiles)."""
  layout = _layout(shape)
  h = shape["q_heads"]
  hist = History(layout, tokens, seed=11)
  q, q_pos = _query(11, s_tok, h, shape["head_dim"], tokens)
  kw = dict(layout=layout, block_pages=bp, interpret=interpret, **opts)
  one = check_placement_and_waves(
      functools.partial(km2.span_attention_mosaic2, **kw),
      functools.partial(km2.span_attention_partial_mosaic2, num_q_heads=h, **kw), hist, q, q_pos)
  return one, hist, q, q_pos


def test_interpret_placement_invariance_and_waves_bit_exact():
  _placement_and_waves(True, SMALL, 5 * 64 - 9, 2, 2)


def test_interpret_k_layouts_same_bits():
  """K copied head-major (k_heads, the default: one TMA box a head from the pool's K-row view)
  and token-major (the all-heads span in lines, as before session 13) give the same bits: the
  same bytes reach the same conversion, only their SMEM addresses differ. So do the issue
  options (the page table read once into SMEM; K issued after the PV; each head's K issued by
  its own warpgroup on its own barrier; a V ring of 3 half-tile slots instead of 2; 2 heads a
  warpgroup, in the interpreter the same walk over the heads; Q^T / P^T indexed by the head
  alone instead of through the default's zero read each tile; V rings of 2 or 3 whole tiles):
  the same copies in another order, every barrier completion still waited for (the interpreter
  checks)."""
  layout = _layout(SMALL)
  tokens = 4 * 64 - 21
  hist = History(layout, tokens, seed=13)
  pool, table = hist.shuffled(seed=3)
  q, q_pos = _query(13, 2, SMALL["q_heads"], SMALL["head_dim"], tokens)
  outs = [np.asarray(km2.span_attention_mosaic2(q, pool, table, tokens, q_pos, layout=layout,
                                                block_pages=2, interpret=True, **kw))
          for kw in (dict(), dict(k_heads=False), dict(table_smem=True, late_k=True),
                     dict(table_smem=True, own_k=True), dict(v_halves=3),
                     dict(heads_per_wg=2), dict(rhs_per_tile=False), dict(v_tiles=2),
                     dict(v_tiles=3, late_k=True))]
  for out in outs[1:]:
    np.testing.assert_array_equal(outs[0], out)
  check_against_reference(jnp.asarray(outs[0]), hist, q, pool, table, q_pos, block_pages=2,
                          tol=2e-3)


def test_pages_are_whole_k_rows():
  """The page layout pads each page to whole K rows (the v2 kernel's K-row view of the pool);
  the 27B page is 392 K rows (425,984 B of planes + 512 B); the V lines are 256 B there and
  as long as the small test layout allows (64 B) elsewhere."""
  for shape in (REAL, SMALL, dict(REAL, kv_heads=1), dict(REAL, kv_heads=3)):
    lay = _layout(shape)
    assert lay.page_bytes % lay.k_row_bytes == 0
    assert 0 <= lay.page_bytes - (lay.v_offset + lay.v_plane_bytes) < lay.k_row_bytes
    km2.check_layout(lay, 256)
  real = _layout(REAL)
  assert (real.page_bytes, real.k_rows_per_page) == (426_496, 392)
  assert km2.line_bytes(real) == 256 and km2.line_bytes(_layout(SMALL)) == 64


def test_combine_plan():
  """The combine's tiles: 8 rows x 8 columns a program by default (the real rows of N only),
  partitions padded to whole load groups, clear errors for tiles the Triton combine cannot take."""
  plan = km2.combine_plan(8, 128)
  assert (plan["c_rows"], plan["combine_cols"], plan["combine_warps"]) == (8, 8, 1)
  assert plan["parts"] >= 128 and plan["parts"] % plan["unroll"] == 0
  assert km2.combine_plan(32, 128)["c_rows"] == 8       # S=4: the real 24 rows of N=32 only
  tri = km2.combine_plan(32, 125, cols=8, warps=1, unroll=16, rows_block=32)
  assert (tri["c_rows"], tri["combine_cols"], tri["combine_warps"], tri["unroll"],
          tri["parts"]) == (32, 8, 1, 16, 128)
  for kw, msg in ((dict(cols=24), "combine_cols must be a power of two dividing 256, got 24"),
                  (dict(warps=3), "combine_warps must be 1, 2, 4 or 8, got 3"),
                  (dict(unroll=12), "combine_unroll must be a multiple of 8"),
                  (dict(rows_block=16), "combine_rows must be a power of two dividing N=8")):
    with pytest.raises(ValueError, match=msg):
      km2.combine_plan(8, 128, **kw)


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

  @pytest.mark.parametrize("s_tok", [1, 2, 4, 5, 6])
  def test_gpu_compiled_matches_reference(s_tok):
    """The compiled kernel at the real shape against the jnp reference and the float64 oracle:
    decode (N=8, 2 K slots), verify (N=16 .. 40)."""
    layout = _layout(REAL)
    tokens = 9 * 256 - 37
    hist = History(layout, tokens, seed=21)
    pool, table = hist.shuffled(seed=4)
    q, q_pos = _query(21, s_tok, REAL["q_heads"], REAL["head_dim"], tokens)
    out = km2.span_attention_mosaic2(q, pool, table, tokens, q_pos, layout=layout, block_pages=4)
    check_against_reference(out, hist, q, pool, table, q_pos, block_pages=4, tol=2e-3)

  @pytest.mark.parametrize("s_tok", [1, 4])
  def test_gpu_placement_invariance_and_waves_bit_exact(s_tok):
    _placement_and_waves(False, REAL, 7 * 256 - 11, 2, s_tok)

  @pytest.mark.parametrize("s_tok", [1, 4, 6])
  def test_gpu_k_layouts_and_combines(s_tok):
    """Compiled: head-major K (the default) gives the bits of token-major K, and so do the issue
    options (table_smem, late_k, own_k, v_halves=3, heads_per_wg=2, producer, rhs_per_tile=False:
    the session-14 default; v_tiles=2 where it fits); other combine
    tiles (the default before session 13, and one warp a 8 x 8 tile loading 8 partitions at a
    time) stay on the reference."""
    layout = _layout(REAL)
    tokens = 11 * 256 - 5
    hist = History(layout, tokens, seed=23)
    pool, table = hist.shuffled(seed=6)
    q, q_pos = _query(23, s_tok, REAL["q_heads"], REAL["head_dim"], tokens)
    run = lambda **kw: np.asarray(km2.span_attention_mosaic2(q, pool, table, tokens, q_pos,
                                                             layout=layout, block_pages=2, **kw))
    base = run()
    np.testing.assert_array_equal(base, run(k_heads=False))
    np.testing.assert_array_equal(base, run(table_smem=True))
    np.testing.assert_array_equal(base, run(late_k=True))
    np.testing.assert_array_equal(base, run(own_k=True, table_smem=True))
    if km2.max_v_halves(layout, km2.choose_n(s_tok * 6),
                        km2.choose_k_slots(layout, km2.choose_n(s_tok * 6))) >= 3:
      np.testing.assert_array_equal(base, run(v_halves=3))     # S=6 (N=40): no SMEM for 3
    np.testing.assert_array_equal(base, run(heads_per_wg=2))
    np.testing.assert_array_equal(base, run(rhs_per_tile=False))
    if km2.smem_bytes(layout, km2.choose_n(s_tok * 6), 1, 4) <= km2.SMEM_LIMIT:
      np.testing.assert_array_equal(base, run(v_tiles=2))      # S=1 only: 2 V tiles + 1 K slot
    np.testing.assert_array_equal(base, run(heads_per_wg=2, producer=True))
    for kw in (dict(combine_cols=32, combine_rows=8), dict(combine_unroll=8)):
      check_against_reference(jnp.asarray(run(**kw)), hist, q, pool, table, q_pos,
                              block_pages=2, tol=2e-3)


# ----------------------------------------------------------------------------- combine layouts


@pytest.mark.parametrize("with_carry", [False, True])
def test_combine_reads_the_kernels_layout(with_carry):
  """`kernel_triton.combine_call` on v2's layout (m and l packed [G, parts, 2, rows], O^T
  [G, parts, columns, rows], folded as [columns, rows] blocks) gives what it gives on the Triton
  kernel's layout (separate m / l, acc [G, parts, rows, columns]): m bit for bit, l and acc to
  the last bit or two (the same operations; the compiler may contract a * b + c * d into FMAs
  differently for the two layouts: 1-ulp differences seen in interpret mode on the CPU), with
  and without a carry; and agrees with the left fold in jnp (`reference.merge_partials`). Empty
  partitions (m = -inf, l = 0, acc = 0) and a row no partition saw included. Interpret mode."""
  from kvjax_pallas.span_attention import kernel_triton as kt   # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(5)
  g, parts, rows_pad, rows, d = 2, 16, 8, 6, 256
  m_p = rng.normal(0, 3, (g, parts, rows_pad)).astype(np.float32)
  m_p[:, 3] = -np.inf                                  # an empty partition
  m_p[:, :, 5] = -np.inf                               # a row no partition saw
  l_p = np.where(np.isfinite(m_p), rng.uniform(0.5, 4, m_p.shape), 0).astype(np.float32)
  acc_p = (rng.normal(size=(g, parts, rows_pad, d)) * np.isfinite(m_p)[..., None]).astype(
      np.float32)
  carry = None
  if with_carry:
    carry = ref.Carry(jnp.asarray(rng.normal(0, 3, (g, rows)), jnp.float32),
                      jnp.asarray(rng.uniform(0.5, 4, (g, rows)), jnp.float32),
                      jnp.asarray(rng.normal(size=(g, rows, d)), jnp.float32))
  v_cols = magic_ptx.vt_dims(d)
  kw = dict(rows=rows, c_rows=8, combine_cols=32, combine_warps=4, unroll=8, v_cols=v_cols,
            head_dim=d, interpret=True)
  acc_cols = acc_p[..., v_cols]                        # column c holds dim v_cols[c]
  want = kt.combine_call(jnp.asarray(m_p), jnp.asarray(l_p), jnp.asarray(acc_cols), carry, **kw)
  got = kt.combine_call(jnp.asarray(np.stack([m_p, l_p], axis=2)), None,
                        jnp.asarray(np.swapaxes(acc_cols, 2, 3)), carry, acc_transposed=True, **kw)
  np.testing.assert_array_equal(np.asarray(got.m_gm), np.asarray(want.m_gm))
  for a, b in zip(got[1:], want[1:]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  state = ((carry.m_gm, carry.l_gm, carry.acc_gmd) if with_carry else
           (jnp.full((g, rows), -jnp.inf), jnp.zeros((g, rows)), jnp.zeros((g, rows, d))))
  for j in range(parts):
    state = ref.merge_partials(state, (m_p[:, j, :rows], l_p[:, j, :rows], acc_p[:, j, :rows]))
  for a, b in zip(got, state):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert np.isfinite(np.asarray(got.l_gm)).all()
