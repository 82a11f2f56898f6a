"""Span attention: every implementation against the float64 oracle, placement
invariance (bit-exact), waves == one call (bit-exact), and error cases.

CPU (default): small shapes, Pallas kernels in interpret mode.
GPU: `KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda pytest tests/test_span_attention.py`
runs the same class at real shapes (Hq=24, Hkv=4, D=256, 256-token pages)
with compiled kernels (interpret=False).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import jax.numpy as jnp

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import api
from kvjax_pallas.span_attention import reference as ref
from kvjax_pallas.span_attention import triton
from span_history import History

ON_GPU = os.environ.get("KVJAX_TEST_GPU", "0") == "1"

if ON_GPU:
  SHAPE = dict(kv_heads=4, q_heads=24, head_dim=256, page_tokens=256, tokens=9 * 256 - 37,
               block_pages=4, prefill_rows=64)
else:
  SHAPE = dict(kv_heads=2, q_heads=6, head_dim=64, page_tokens=16, tokens=7 * 16 - 5,
               block_pages=2, prefill_rows=20)
# Kernels run the class with precision="f16x3" (16-bit tensor-core operands split into a head
# and a tail: float32-class results on the GPU too); the fast "f16" default is checked apart.
TOL = {"reference": 1e-5, "triton": 1e-5}
KERNEL_PRECISION = "f16x3"
INTERPRET = not ON_GPU

PAIRS = (("q8_0", "q4_0"), ("q8_0", "q8_0"), ("f16", "f16"), ("bf16", "bf16"))


def _layout(pair=("q8_0", "q4_0")) -> PageLayout:
  return PageLayout(SHAPE["kv_heads"], SHAPE["head_dim"], pair[0], pair[1], SHAPE["page_tokens"])


def _history(layout: PageLayout, seed: int) -> History:
  """A History of the class's tokens whose placements below all have one pool shape (2 n + 3
  physical pages for n pages: the largest placement's) and one table length (n + 3): a kernel
  compiles once for a (pair, rows, precision), whichever test places the pages."""
  n = layout.pages_for(SHAPE["tokens"])
  return History(layout, SHAPE["tokens"], seed=seed, pool_pages=2 * n + 3, table_len=n + 3)


def _query(seed: int, rows: int, kv_len: int):
  rng = np.random.default_rng(seed + 1000)
  q = rng.standard_normal((rows, SHAPE["q_heads"], SHAPE["head_dim"])).astype(np.float32)
  q_pos = np.arange(kv_len - rows, kv_len, dtype=np.int32)  # new rows are the last positions
  return q, q_pos


def _rel(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(params=api.FULL_IMPLEMENTATIONS)
def impl(request):
  return request.param


class TestSpanAttention:
  """Runs for every implementation in `api.FULL_IMPLEMENTATIONS` (the Mosaic GPU kernels have their
  own files)."""

  def _run(self, impl, q, pool, table, kv_len, q_pos, layout, **kw):
    if impl != "reference":
      kw.setdefault("precision", KERNEL_PRECISION)
    return np.asarray(api.span_attention(
        jnp.asarray(q), pool, table, kv_len, jnp.asarray(q_pos), layout=layout,
        block_pages=SHAPE["block_pages"], implementation=impl, interpret=INTERPRET, **kw))

  @pytest.mark.parametrize("pair,rows", [(PAIRS[0], 1), (PAIRS[0], 5), (PAIRS[0], "prefill"),
                                         (PAIRS[1], 2), (PAIRS[2], 4), (PAIRS[3], 1)])
  def test_matches_f64_oracle(self, impl, pair, rows):
    rows = SHAPE["prefill_rows"] if rows == "prefill" else rows
    layout = _layout(pair)
    hist = _history(layout, seed=7)
    pool, table = hist.resident_ring(resident=2, ring_base=hist.num_pages + 4, ring_slots=5, wrap=3)
    q, q_pos = _query(7, rows, hist.tokens)
    out = self._run(impl, q, pool, table, hist.tokens, q_pos, layout)
    assert out.shape == q.shape and np.isfinite(out).all()
    oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, q_pos, hist.tokens)
    assert _rel(out, oracle) <= TOL[impl], _rel(out, oracle)

  def test_rows_past_a_call_run_in_pieces(self, impl, monkeypatch):
    """More query rows than a kernel call takes (`api.ROWS_PER_CALL`, 8 here) run as calls over
    pieces of at most that many rows, their carries joined row by row, also when a partial call
    continues a carry (copy waves): each row's result is the one a call over all the rows gives,
    up to the rounding of products over another row count (XLA blocks a dot by its shape)."""
    layout = _layout()
    hist = _history(layout, seed=21)
    pool, table = hist.resident_ring(resident=2, ring_base=hist.num_pages + 4, ring_slots=5, wrap=3)
    q, q_pos = _query(21, SHAPE["prefill_rows"], hist.tokens)
    whole = self._run(impl, q, pool, table, hist.tokens, q_pos, layout)
    monkeypatch.setattr(api, "ROWS_PER_CALL", 8)
    pieces = self._run(impl, q, pool, table, hist.tokens, q_pos, layout)
    oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, q_pos, hist.tokens)
    assert _rel(pieces, oracle) <= TOL[impl], _rel(pieces, oracle)
    kw = dict(layout=layout, num_q_heads=q.shape[1], block_pages=SHAPE["block_pages"], implementation=impl,
              interpret=INTERPRET, **({} if impl == "reference" else {"precision": KERNEL_PRECISION}))
    half = SHAPE["block_pages"] * (table.shape[0] // SHAPE["block_pages"] // 2)
    carry = api.span_attention_partial(jnp.asarray(q), pool, table, hist.tokens, jnp.asarray(q_pos), None,
                                       jnp.int32(0), jnp.int32(half), **kw)
    carry = api.span_attention_partial(jnp.asarray(q), pool, table, hist.tokens, jnp.asarray(q_pos), carry,
                                       jnp.int32(half), jnp.int32(table.shape[0]), **kw)
    waves = np.asarray(api.finalize(carry, q.shape[1]))
    assert _rel(waves, oracle) <= TOL[impl], _rel(waves, oracle)
    assert _rel(pieces, whole) <= 1e-6 and _rel(waves, pieces) <= 1e-6

  @pytest.mark.parametrize("pair", PAIRS)
  @pytest.mark.parametrize("impl", [i for i in api.FULL_IMPLEMENTATIONS if i != "reference"])
  def test_f16x3_is_float32_class(self, impl, pair):
    """precision="f16x3" (16-bit tensor-core operands, split) stays within 1e-5 of float64."""
    layout = _layout(pair)
    hist = _history(layout, seed=13)
    pool, table = hist.resident_ring(resident=1, ring_base=hist.num_pages + 2, ring_slots=5, wrap=2)
    q, q_pos = _query(13, 2, hist.tokens)
    out = self._run(impl, q, pool, table, hist.tokens, q_pos, layout, precision="f16x3")
    oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, q_pos, hist.tokens)
    assert _rel(out, oracle) <= 1e-5, _rel(out, oracle)
    fast = self._run(impl, q, pool, table, hist.tokens, q_pos, layout, precision="f16")
    assert 2 * _rel(out, oracle) < _rel(fast, oracle) <= 3e-3  # the split did something

  @staticmethod
  def _ring_case(seed: int, rows, wrap: int, pair=PAIRS[0]):
    """A history (Q8_0/Q4_0 unless `pair`) over resident + ring pages -> (history, q, q_pos,
    positional args, keyword args) of a direct `triton` call at the class's precision.
    rows="prefill": the class's prefill chunk."""
    rows = SHAPE["prefill_rows"] if rows == "prefill" else rows
    layout = _layout(pair)
    hist = _history(layout, seed=seed)
    pool, table = hist.resident_ring(resident=2, ring_base=hist.num_pages + 1, ring_slots=6, wrap=wrap)
    q, q_pos = _query(seed, rows, hist.tokens)
    args = (jnp.asarray(q), pool, table, hist.tokens, jnp.asarray(q_pos))
    kw = dict(layout=layout, block_pages=SHAPE["block_pages"], interpret=INTERPRET,
              precision=KERNEL_PRECISION)
    return hist, q, q_pos, args, kw

  @staticmethod
  def _poison_past_history(hist, args, layout):
    """The case's args with the rows past the history in its (partial) last page set to 0xFF
    bytes (NaN scales and values): a load that reached them would show as NaN."""
    pool = np.array(args[1])
    table = np.asarray(args[2])
    pt = layout.page_tokens
    last_page, used = (hist.tokens - 1) // pt, (hist.tokens - 1) % pt + 1
    assert used < pt, "the case needs a partial last page"
    page = pool[table[last_page]]
    for r in range(used, pt):
      page[r * layout.k_row_bytes:(r + 1) * layout.k_row_bytes] = 0xFF
      v0 = layout.v_offset + r * layout.v_row_bytes
      page[v0:v0 + layout.v_row_bytes] = 0xFF
    return (args[0], jnp.asarray(pool), *args[2:])

  @pytest.mark.parametrize("impl", [i for i in api.FULL_IMPLEMENTATIONS if i != "reference"])
  def test_tile_options(self, impl):
    """Other key tiles and warps (`triton.TritonOptions`) stay on the oracle."""
    hist, q, q_pos, args, kw = self._ring_case(seed=17, rows=2, wrap=1)
    oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, q_pos, hist.tokens)
    other = np.asarray(triton.span_attention_triton(
        *args, options=triton.TritonOptions(block_tokens=16, num_warps=8), **kw))
    assert _rel(other, oracle) <= TOL[impl]

  @pytest.mark.parametrize("pair,rows", [(PAIRS[0], 1), (PAIRS[0], 6), (PAIRS[0], "prefill"),
                                         (PAIRS[2], 5)])
  @pytest.mark.parametrize("impl", [i for i in api.FULL_IMPLEMENTATIONS if i != "reference"])
  def test_rows_past_the_history_are_not_read(self, impl, pair, rows):
    """A partial key tile re-reads its last visible row instead of the rows past the history:
    with those rows poisoned (`_poison_past_history`: NaN scales and values) the result is
    finite and bit for bit the clean pool's, in one call and in waves."""
    hist, _, _, args, kw = self._ring_case(seed=43, rows=rows, wrap=3, pair=pair)
    clean = np.asarray(triton.span_attention_triton(*args, **kw))
    args = self._poison_past_history(hist, args, kw["layout"])
    poisoned = np.asarray(triton.span_attention_triton(*args, **kw))
    assert np.isfinite(poisoned).all()
    np.testing.assert_array_equal(clean, poisoned)
    h, bp, table = SHAPE["q_heads"], kw["block_pages"], args[2]
    carry = None
    for a, b in ((0, bp), (bp, table.shape[0])):
      carry = triton.span_attention_partial_triton(
          args[0], args[1], table, jnp.int32(hist.tokens), args[4], carry, jnp.int32(a),
          jnp.int32(b), num_q_heads=h, **kw)
    np.testing.assert_array_equal(clean, np.asarray(api.finalize(carry, h)))

  @pytest.mark.parametrize("impl", [i for i in api.FULL_IMPLEMENTATIONS if i != "reference"])
  def test_row_blocks(self, impl):
    """block_rows=16 splits 6 tokens' folded rows over several row blocks (each reads the pages
    again) and stays on the oracle; other sizes are refused by name."""
    hist, q, q_pos, args, kw = self._ring_case(seed=23, rows=6, wrap=2)
    layout = kw["layout"]
    rows = 6 * SHAPE["q_heads"] // SHAPE["kv_heads"]
    opts = triton.TritonOptions(block_rows=16)
    assert triton.tile_config(6, rows // 6, layout.page_tokens, options=opts).block_rows == 16
    assert rows > 16   # more than one row block
    oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, q_pos, hist.tokens)
    split = np.asarray(triton.span_attention_triton(*args, options=opts, **kw))
    assert _rel(split, oracle) <= TOL[impl], _rel(split, oracle)
    with pytest.raises(ValueError, match="block_rows must be a power of two >= 16, got 24"):
      triton.tile_config(6, 3, layout.page_tokens, options=triton.TritonOptions(block_rows=24))

  @pytest.mark.parametrize("pair,rows", [(PAIRS[0], 1), (PAIRS[0], 6), (PAIRS[1], 2),
                                         (PAIRS[0], "prefill")])
  @pytest.mark.parametrize("impl", [i for i in api.FULL_IMPLEMENTATIONS if i != "reference"])
  def test_asm_decode_same_bits(self, impl, pair, rows):
    """decode="asm" (packed PTX, compiled kernels only) gives the bits of decode="jnp" at the fast
    "f16" precision. On the CPU the interpreter runs jnp for both: tests/test_span_decode_asm.py
    checks the PTX there instead."""
    if INTERPRET:
      pytest.skip("inline PTX runs only in compiled kernels (GPU); see test_span_decode_asm.py")
    hist, q, q_pos, args, kw = self._ring_case(seed=29, rows=rows, wrap=3, pair=pair)
    kw.update(interpret=False, precision="f16")
    outs = [np.asarray(triton.span_attention_triton(
        *args, options=triton.TritonOptions(decode=dec), **kw)) for dec in ("asm", "jnp")]
    np.testing.assert_array_equal(outs[0], outs[1])
    oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, q_pos, hist.tokens)
    assert _rel(outs[0], oracle) <= 3e-3

  def test_auto_block_pages_same_answer(self, impl):
    """block_pages="auto" resolves to an int for the call's shapes and computes what that int does."""
    layout = _layout()
    hist = _history(layout, seed=31)
    pool, table = hist.resident_ring(resident=1, ring_base=hist.num_pages + 2, ring_slots=5, wrap=1)
    q, q_pos = _query(31, 5, hist.tokens)
    bp = api.resolve_block_pages("auto", table.shape[0], 5, SHAPE["q_heads"], layout)
    assert 1 <= bp <= table.shape[0]
    run = lambda b: np.asarray(api.span_attention(
        jnp.asarray(q), pool, table, hist.tokens, jnp.asarray(q_pos), layout=layout,
        block_pages=b, implementation=impl, interpret=INTERPRET,
        **({} if impl == "reference" else {"precision": KERNEL_PRECISION})))
    np.testing.assert_array_equal(run("auto"), run(bp))

  def test_kv_len_and_positions_are_respected(self, impl):
    """A shorter kv_len and earlier query positions change the answer exactly as the oracle says."""
    layout = _layout()
    hist = _history(layout, seed=3)
    pool, table = hist.contiguous()
    kv_len = hist.tokens - layout.page_tokens - 3  # ends mid-page, one page fewer
    q, _ = _query(3, 2, kv_len)
    q_pos = np.asarray([layout.page_tokens // 2, kv_len - 1], np.int32)  # row 0 sees half a page
    out = self._run(impl, q, pool, table, kv_len, q_pos, layout)
    oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, q_pos, kv_len)
    assert _rel(out, oracle) <= TOL[impl]
    full = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, np.full(2, 10 ** 6), hist.tokens)
    assert _rel(out, full) > 100 * TOL[impl]  # the masks mattered

  @pytest.mark.parametrize("rows", [1, 5])
  def test_placement_invariance_bit_exact(self, impl, rows):
    layout = _layout()
    hist = _history(layout, seed=11)
    q, q_pos = _query(11, rows, hist.tokens)
    outs = []
    for pool, table in (hist.contiguous(),
                        hist.resident_ring(resident=3, ring_base=hist.num_pages + 2, ring_slots=6, wrap=4),
                        hist.resident_ring(resident=0, ring_base=1, ring_slots=hist.num_pages + 1, wrap=5)):
      outs.append(self._run(impl, q, pool, table, hist.tokens, q_pos, layout))
    for o in outs[1:]:
      np.testing.assert_array_equal(outs[0], o)

  def test_waves_equal_one_call_bit_exact(self, impl):
    layout = _layout()
    hist = _history(layout, seed=5)
    pool, table = hist.resident_ring(resident=2, ring_base=hist.num_pages + 1, ring_slots=7, wrap=6)
    q, q_pos = _query(5, 3, hist.tokens)
    h, d, bp = SHAPE["q_heads"], SHAPE["head_dim"], SHAPE["block_pages"]
    one = self._run(impl, q, pool, table, hist.tokens, q_pos, layout)
    carry = api.init_carry(layout.num_kv_heads, 3 * (h // layout.num_kv_heads), d)
    cuts = [0, bp, 3 * bp, table.shape[0]]  # boundaries at multiples of block_pages; last clipped
    for a, b in zip(cuts[:-1], cuts[1:]):
      carry = api.span_attention_partial(
          jnp.asarray(q), pool, table, jnp.int32(hist.tokens), jnp.asarray(q_pos), carry,
          jnp.int32(a), jnp.int32(b), layout=layout, num_q_heads=h, block_pages=bp,
          implementation=impl, interpret=INTERPRET,
          **({} if impl == "reference" else {"precision": KERNEL_PRECISION}))
    waves = np.asarray(api.finalize(carry, h))
    np.testing.assert_array_equal(one, waves)

  # ---- errors ----

  def test_table_entry_out_of_range(self, impl):
    layout = _layout()
    hist = _history(layout, seed=1)
    pool, table = hist.contiguous()
    q, q_pos = _query(1, 1, hist.tokens)
    bad = table.at[1].set(pool.shape[0])
    with pytest.raises(ValueError, match=r"page table entry 1 = \d+ is out of range.*pool has"):
      self._run(impl, q, pool, bad, hist.tokens, q_pos, layout)
    with pytest.raises(ValueError, match="out of range"):
      self._run(impl, q, pool, table.at[0].set(-1), hist.tokens, q_pos, layout)

  def test_head_dim_checks(self, impl):
    with pytest.raises(ValueError, match="not a multiple of 32"):
      PageLayout(2, 48, "q8_0", "q4_0", 16)
    if impl == "reference":
      return
    with pytest.raises(ValueError, match="not a multiple of 32"):
      triton.check_layout(_layout(), 48)
    with pytest.raises(ValueError, match="query head_dim 128 != layout head_dim"):
      triton.check_layout(PageLayout(2, 64, "q8_0", "q4_0", 16), 128)

  def test_operand_checks(self, impl):
    """Operands no implementation takes are one ValueError naming them, the reference's too."""
    layout = _layout()
    hist = _history(layout, seed=1)
    pool, table = hist.contiguous()
    q, q_pos = _query(1, 2, hist.tokens)
    for args, msg in (
        ((q[..., :32], pool, table, q_pos), f"query head_dim 32 != layout head_dim {SHAPE['head_dim']}"),
        ((q[:, :SHAPE["kv_heads"] + 1], pool, table, q_pos), "query heads are not a multiple of"),
        ((q[0], pool, table, q_pos), r"q must be \[rows, heads, head_dim\]"),
        ((q, pool.astype(jnp.float32), table, q_pos), "pool must be uint8"),
        ((q, pool[:, :-2], table, q_pos), "pool must be uint8"),
        ((q, pool, table.astype(jnp.float32), q_pos), "page table must be integer"),
        ((q, pool, table, q_pos[:1]), r"q_pos must be \[2\]")):
      with pytest.raises(ValueError, match=msg):
        self._run(impl, args[0], args[1], args[2], hist.tokens, args[3], layout)

  @pytest.mark.parametrize("kernel", [i for i in api.FULL_IMPLEMENTATIONS if i != "reference"])
  def test_kernel_refusals(self, kernel):
    impl = kernel
    layout = PageLayout(SHAPE["kv_heads"], SHAPE["head_dim"], "q4_0", "q8_0", SHAPE["page_tokens"])
    hist = _history(_layout(), seed=2)
    pool, table = hist.contiguous()
    q, q_pos = _query(2, 1, hist.tokens)
    with pytest.raises(ValueError, match="unsupported K/V pair Q4_0/Q8_0"):
      self._run(impl, q, jnp.zeros((4, layout.page_bytes), jnp.uint8), table[:2] * 0, 16,
                q_pos, layout)
    with pytest.raises(ValueError, match="too many query rows: 257 > 256"):   # the API calls in pieces
      triton.select_path(257)
    q5, p5 = _query(2, 5, hist.tokens)
    with pytest.raises(ValueError, match="too many query rows for the vector path: 5 tokens > 2"):
      self._run(impl, q5, pool, table, hist.tokens, p5, _layout(), path="vector")


def test_pages_from_kv_is_a_pool_the_attention_reads():
  """`pages_from_kv`: a history's K / V rows encoded into pages (the last one partly filled); the
  reference's attention over them equals softmax(q k^T / sqrt(d)) v over the decoded rows."""
  from kvjax_pallas import ggml_codec
  from kvjax_pallas.span_attention import pages_from_kv
  layout = _layout()
  g, d, t = SHAPE["kv_heads"], SHAPE["head_dim"], 3 * SHAPE["page_tokens"] - 5
  rng = np.random.default_rng(3)
  k, v = (rng.standard_normal((t, g, d)).astype(np.float32) for _ in range(2))
  pool = pages_from_kv(k, v, layout)
  assert pool.shape == (3, layout.page_bytes) and pool.dtype == jnp.uint8
  q, q_pos = _query(4, 3, t)
  out = np.asarray(api.span_attention(q, pool, jnp.arange(3, dtype=jnp.int32), t, q_pos, layout=layout))
  kd = np.asarray(ggml_codec.decode(ggml_codec.encode(jnp.asarray(k), layout.k_type), layout.k_type))
  vd = np.asarray(ggml_codec.decode(ggml_codec.encode(jnp.asarray(v), layout.v_type), layout.v_type))
  h = q.shape[1]
  qg = np.asarray(q, np.float64).reshape(len(q_pos), g, h // g, d)
  for i, pos in enumerate(np.asarray(q_pos)):
    sc = np.einsum("grd,tgd->grt", qg[i], kd[:pos + 1]) / np.sqrt(d)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    want = np.einsum("grt,tgd->grd", p / p.sum(-1, keepdims=True), vd[:pos + 1]).reshape(h, d)
    np.testing.assert_allclose(out[i], want, rtol=0, atol=1e-5)
  with pytest.raises(ValueError, match=r"k and v must both be \[tokens"):
    pages_from_kv(k[..., :32], v[..., :32], layout)


def test_unknown_implementation():
  layout = _layout()
  with pytest.raises(ValueError, match="unknown span-attention implementation 'nope'"):
    api.span_attention(jnp.zeros((1, SHAPE["q_heads"], SHAPE["head_dim"])),
                       jnp.zeros((2, layout.page_bytes), jnp.uint8), jnp.zeros(2, jnp.int32), 1,
                       jnp.zeros(1, jnp.int32), layout=layout, implementation="nope")


def test_block_pages_values_checked():
  layout = _layout()
  for bad in (0, -2, "8", "fast", 2.5):
    with pytest.raises(ValueError, match="block_pages must be an int >= 1 or 'auto'"):
      api.resolve_block_pages(bad, 16, 1, SHAPE["q_heads"], layout)
  assert api.resolve_block_pages(3, 16, 1, SHAPE["q_heads"], layout) == 3


def test_choose_block_pages_fits_the_h200_measurements():
  """The "auto" partition sizes at the 27B geometry (4 KV heads, 6 query heads each, 256-token
  pages, 132 SMs) are the best sizes measured on the H200 (docs/PERFORMANCE.md: 128K bp4, 160K
  bp5, 256K bp8 at S=1; 160K S=4 bp7, S=6 bp10)."""
  kt = triton
  pages = {131072: 512, 163840: 640, 262144: 1024}
  choose = lambda ctx, s: kt.choose_block_pages(pages[ctx], 4, s, 6, num_sms=132)
  assert [choose(c, 1) for c in (131072, 163840, 262144)] == [4, 5, 8]
  assert choose(163840, 4) == 7
  assert choose(163840, 6) == 10
  # matrix rows: one round of 2 CTAs an SM (64-row tile) -> 64 partitions x 4 heads = 256 <= 264
  assert kt.ctas_per_sm(kt.tile_config(6, 6, 256).block_rows) == 2
  assert kt.ctas_per_sm(kt.tile_config(1, 6, 256).block_rows) == 4   # 128 registers
  for n_pages in (1, 3, 40, 700, 4096):        # always a size in [1, pages]
    for s in (1, 2, 3, 6, 8, 64, 256):
      bp = kt.choose_block_pages(n_pages, 4, s, 6)
      assert 1 <= bp <= n_pages, (n_pages, s, bp)
  # more SMs -> smaller partitions (more of them) for decode
  assert kt.choose_block_pages(1024, 4, 1, 6, num_sms=264) < kt.choose_block_pages(1024, 4, 1, 6)


def test_column_dims_cover_every_dim_once():
  """Every K / V kind's kernel columns hold each head dim exactly once; F16 / BF16 and Q8_0 in
  order (the query's columns are its dims), Q4_0 in its nibble order."""
  for kind in ("q8_0", "q4_0", "f16", "bf16"):
    for d in (64, 256):
      cols = triton.column_dims(kind, d)
      assert sorted(cols.tolist()) == list(range(d)), kind
      assert (kind == "q4_0") != np.array_equal(cols, np.arange(d)), kind
  np.testing.assert_array_equal(triton.column_dims("q4_0", 64)[:8], [0, 16, 1, 17, 2, 18, 3, 19])
