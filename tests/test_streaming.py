"""Streamed KV (host history + resident pages + one shared ring) against the plain cache."""

import functools
import re
import time

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st

from kvjax import engine, generate
from kvjax.streaming import (HostHistory, Span, SpanPlanError, StreamBudgetError, StreamConfig, StreamedKV,
                             fit_split, fixed_split, make_plan, page_table, staging_reserve_pages,
                             adaptive_staging_reserve_pages, fit_adaptive_pool)
from kvjax.streaming.budget import adaptive_staging_cap
from kvjax.streaming.budget import staging_pages
from kvjax.streaming.span_plan import SpanPlan, validate_plan
from kvjax_pallas import ggml_codec
from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import reference as ref_attn
from tiny_setup import assert_same_logits, build_tiny_runner, generate_logged


@pytest.fixture(scope="module")
def tiny_runner():
  return build_tiny_runner(0, page_tokens=256)


# One capacity for the caches of the tests on 256-token pages and one for those on 16-token pages:
# the plain caches (and the streamed ones of one pool size) have the same shapes across tests, so
# their programs compile once.
LONG_CAPACITY = 11 * 256
CAPACITY = 256


def test_streamed_greedy_equals_plain_long(tiny_runner):
  """Prompt of 8+ pages, 64 generated tokens crossing into a new page, Q8_0 K / Q4_0 V, every layer
  streams, ring wraps."""
  cfg, runner, layout = tiny_runner
  prompt = list(np.random.default_rng(7).integers(0, cfg.vocab_size, 8 * 256 + 230))
  n_predict = 64     # the decode crosses a page boundary (the 9th page ends at token 2,304)
  max_tokens = LONG_CAPACITY         # 11 pages: a 1-page resident split
  plain_kv = engine.PlainKV(cfg, layout, max_tokens)
  plain, plain_logits = generate_logged(runner, plain_kv, prompt, n_predict)

  n_layers = cfg.num_attention_layers + 1
  stream = fixed_split(pool_pages=14, n_layers=n_layers, max_tokens=max_tokens, layout=layout, copy_pages=4)
  assert stream.resident_pages_per_layer == (1, 1, 1) and stream.ring_slots == 11
  kv = StreamedKV(cfg, layout, max_tokens, stream)
  streamed, logits = generate_logged(runner, kv, prompt, n_predict)

  assert len(plain.tokens) == n_predict
  assert streamed.tokens == plain.tokens
  assert_same_logits(logits, plain_logits)
  m = streamed.metrics
  active_pages = layout.pages_for(len(prompt) + n_predict)
  # every layer streams all but its open page on the last forwards (its one resident page is the
  # open slot, where its rows are written); the ring wrapped many times
  assert kv.plans[0].kinds == ("ring", "open") and kv.counters["max_spans"] == 2
  # the partial page a decode forward attends stayed on the device: uploaded only by the prefill's
  # forwards and the first decode forward, never again
  assert m["open_hits"] >= (n_predict - 2) * cfg.num_attention_layers * 0.9
  assert m["tail_uploads"] <= 2 * cfg.num_attention_layers
  assert m["ring_wraps"] >= n_predict // 2
  assert m["streamed_pages"] >= n_predict * cfg.num_attention_layers * 8
  assert m["h2d_bytes"] >= m["streamed_pages"] * layout.page_bytes * 0.9
  assert m["d2h_bytes"] == (len(prompt) + n_predict - 1) * layout.token_bytes * cfg.num_attention_layers
  assert m["resident_pages"] == 3 and m["ring_slots"] == 11
  assert active_pages > stream.ring_slots - 2
  # the staging buffers of uploads in flight stayed within the reserve an arena carves for them
  reserve = staging_reserve_pages(stream, max_tokens, layout, kv.prefetch_depth, pinned=False)
  assert 0 < m["staging_peak_bytes"] <= reserve * layout.page_bytes

  # the host history is byte-for-byte the plain path's quantized KV for every token
  n_tok = len(prompt) + n_predict - 1
  hist = kv.histories["target"]
  for a in range(cfg.num_attention_layers):
    k_host, v_host = hist.rows(a, n_tok)
    pages = plain_kv.layer_bytes(a, n_tok)
    k_plain = pages[:, :layout.k_plane_bytes].reshape(-1, layout.k_row_bytes)[:n_tok]
    v_plain = pages[:, layout.v_offset:layout.v_offset + layout.v_plane_bytes].reshape(-1, layout.v_row_bytes)[:n_tok]
    np.testing.assert_array_equal(k_host, k_plain)
    np.testing.assert_array_equal(v_host, v_plain)


def test_refused_forward_leaves_provider_intact(tiny_runner):
  """Copy waves need one attention partition in the ring: a ring of 2 slots refuses 4-page
  partitions for a layer that must wave, naming the pages missing, and leaves the provider as it
  was; the same forward with 1-page partitions (this runner's) streams in waves."""
  cfg, runner, layout = tiny_runner
  stream = StreamConfig(pool_pages=5, resident_pages_per_layer=(1, 1, 1), copy_pages=1)
  kv = StreamedKV(cfg, layout, 8 * 256, stream)
  seq = generate.SequenceState(runner, kv)
  prompt = list(range(1, 3 * 256 + 1))
  generate.prefill(seq, prompt[:256 * 3 + 0], ubatch=256)  # 3 pages: 2 streamed per layer, ring 2
  before = (dict(kv.plans), dict(kv.counters), kv.histories["target"].tokens.copy())
  with pytest.raises(StreamBudgetError, match=r"ring too small: cache layer 0 streams 3 pages .* whole "
                     r"4-page attention partitions .* the ring has 2 slots: 2 more pool pages"):
    kv.begin_forward(3 * 256, 256, (0, 1), wave_pages=4)
  assert (kv.plans, kv.counters, list(kv.histories["target"].tokens)) == \
      (before[0], before[1], list(before[2]))
  logits = seq.forward(list(range(256)))  # 3 streamed pages > 2 slots: two waves a layer
  assert np.all(np.isfinite(np.asarray(logits)))
  assert kv.counters["waved_layers"] == 2 and kv.counters["waves"] - before[1]["waves"] == 4


def test_fixed_split_reports_missing_bytes():
  layout = PageLayout(4, 256, "q8_0", "q4_0")
  with pytest.raises(StreamBudgetError, match=r"minimum is 18 pages .*: 8 more pages"):
    fixed_split(pool_pages=10, n_layers=17, max_tokens=131072, layout=layout)
  s = fixed_split(pool_pages=18, n_layers=17, max_tokens=131072, layout=layout)   # copy waves
  assert s.resident_pages_per_layer == (1,) * 17 and s.ring_slots == 1
  s = fixed_split(pool_pages=100, n_layers=17, max_tokens=131072, layout=layout)  # ring hint 8
  assert s.resident_pages_per_layer == (5,) * 17 and s.ring_slots == 15
  s = fixed_split(pool_pages=5400, n_layers=17, max_tokens=131072, layout=layout)
  assert s.ring_slots >= 512 - s.resident_pages_per_layer[0]
  assert s.resident_total + s.ring_slots == 5400


def test_host_history_rejects_gaps_and_overflow():
  layout = PageLayout(2, 64, "q8_0", "q4_0", page_tokens=16)
  h = HostHistory("t", layout, 1, max_pages=2, copy_pages=1)
  k = np.ones((4, layout.k_row_bytes), np.uint8)
  v = np.ones((4, layout.v_row_bytes), np.uint8)
  with pytest.raises(ValueError, match="gap"):
    h.write_rows(0, 3, k, v)
  h.write_rows(0, 0, k, v)
  with pytest.raises(ValueError, match="needs 2 more"):
    h.write_rows(0, 30, np.ones((4, layout.k_row_bytes), np.uint8)[:4], v) if False else \
        h.write_rows(0, 4, np.ones((30, layout.k_row_bytes), np.uint8), np.ones((30, layout.v_row_bytes), np.uint8))
  assert h.tokens[0] == 4
  h.truncate(2)
  assert h.tokens[0] == 2


# ---- span plans --------------------------------------------------------------------------------------

LAYOUT = PageLayout(2, 64, "q8_0", "q4_0", page_tokens=16)
POOL_PAGES = 24
BUF = {"pool": POOL_PAGES * LAYOUT.page_bytes}


def _span(tok, n, page):
  return Span("pool", tok, n, page * LAYOUT.page_bytes, page * LAYOUT.page_bytes + LAYOUT.v_offset)


@st.composite
def valid_plans(draw):
  active = draw(st.integers(1, 10 * 16))
  pages = LAYOUT.pages_for(active)
  # cut the logical pages into up to 4 runs; each run must be physically contiguous, so we choose the runs'
  # physical starts among free contiguous ranges: simplest is to lay runs at arbitrary distinct bases
  n_cuts = draw(st.integers(0, min(3, pages - 1)))
  cuts = sorted(draw(st.lists(st.integers(1, max(pages - 1, 1)), min_size=n_cuts, max_size=n_cuts,
                               unique=True))) if pages > 1 else []
  bounds = [0] + cuts + [pages]
  base = 0
  order = draw(st.permutations(list(range(len(bounds) - 1))))
  starts = {}
  for i in order:  # physical placement of runs in a random order, no overlap
    starts[i] = base
    base += bounds[i + 1] - bounds[i] + draw(st.integers(0, 1))
  if base > POOL_PAGES:
    starts = {i: bounds[i] for i in range(len(bounds) - 1)}
  spans = []
  for i in range(len(bounds) - 1):
    tok = bounds[i] * 16
    n = min(bounds[i + 1] * 16, active) - tok
    spans.append(_span(tok, n, starts[i]))
  q = draw(st.integers(1, min(active, 8)))
  return SpanPlan(tuple(spans), active, q)


# one compiled program for every example: the rows encoded for the largest plan (12 pages) and the
# queries padded to 8 rows (each example's own shapes would compile programs of their own)
_encode_rows = jax.jit(ggml_codec.encode_rows, static_argnames="kind")
_attend = jax.jit(functools.partial(ref_attn.span_attention_reference, layout=LAYOUT))


@settings(max_examples=12, deadline=None)
@given(plan=valid_plans(), seed=st.integers(0, 2**16))
def test_valid_plans_accepted_and_placement_invariant(plan, seed):
  validate_plan(plan, LAYOUT, BUF)
  rng = np.random.default_rng(seed)
  active = plan.active_tokens
  pages = LAYOUT.pages_for(active)
  logical = rng.integers(0, 256, (pages, LAYOUT.page_bytes), dtype=np.uint8)
  # keep the scales sane: write real encoded rows into each logical page
  k = rng.standard_normal((12 * 16, 2, 64)).astype(np.float32)
  v = rng.standard_normal((12 * 16, 2, 64)).astype(np.float32)
  kb = np.asarray(_encode_rows(jnp.asarray(k), kind="q8_0")).reshape(12, -1)[:pages]
  vb = np.asarray(_encode_rows(jnp.asarray(v), kind="q4_0")).reshape(12, -1)[:pages]
  logical[:, :LAYOUT.k_plane_bytes] = kb
  logical[:, LAYOUT.v_offset:LAYOUT.v_offset + LAYOUT.v_plane_bytes] = vb
  table = page_table(plan, LAYOUT, 12)
  pool = rng.integers(0, 256, (POOL_PAGES, LAYOUT.page_bytes), dtype=np.uint8)
  pool[table[:pages]] = logical
  contiguous = np.zeros((POOL_PAGES, LAYOUT.page_bytes), np.uint8)
  contiguous[:pages] = logical
  # the plan's query rows (its last query_tokens positions), padded to 8 with the last position
  q = rng.standard_normal((8, 6, 64)).astype(np.float32)
  q_pos = np.full(8, active - 1, np.int32)
  q_pos[:plan.query_tokens] = np.arange(active - plan.query_tokens, active, dtype=np.int32)
  o_plan = _attend(jnp.asarray(q), jnp.asarray(pool), jnp.asarray(table), active, jnp.asarray(q_pos))
  o_cont = _attend(jnp.asarray(q), jnp.asarray(contiguous), jnp.arange(12, dtype=jnp.int32), active,
                   jnp.asarray(q_pos))
  np.testing.assert_array_equal(np.asarray(o_plan), np.asarray(o_cont))


@pytest.mark.parametrize("spans,active,query,match", [
    ((), 16, 1, "no spans"),
    ((_span(0, 16, 0),), 16, 0, "query tokens 0"),
    ((_span(0, 16, 0),), 16, 17, "query tokens 17"),
    ((_span(0, 0, 0),), 16, 1, "has 0 tokens"),
    ((_span(0, 16, 0), _span(32, 16, 1)), 48, 1, "gap"),
    ((_span(0, 32, 0), _span(16, 16, 4)), 32, 1, "overlap or reorder"),
    ((_span(16, 16, 0), _span(0, 16, 1)), 32, 1, "span 0 begins at token 16"),
    ((Span("pool", 0, 16, 5, 5 + LAYOUT.v_offset),), 16, 1, "misaligned"),
    ((Span("pool", 0, 16, 0, 7),), 16, 1, "misaligned"),
    ((_span(0, 32, POOL_PAGES - 1),), 32, 1, "K rows end at byte"),
    ((_span(0, 16, 0),), 20, 1, "cover 16 tokens but the plan has 20"),
    ((Span("ring", 0, 16, 0, LAYOUT.v_offset),), 16, 1, "unknown buffer"),
    ((_span(0, 10, 0), _span(10, 6, 3)), 16, 1, "ends mid-page"),
])
def test_invalid_plans_rejected(spans, active, query, match):
  with pytest.raises(SpanPlanError, match=match):
    make_plan(LAYOUT, BUF, spans, active, query)


def test_v_plane_overflow_reported_separately():
  # a buffer that ends inside the last page's V plane: K fits, V does not
  buf = {"pool": LAYOUT.page_bytes + LAYOUT.v_offset + 3 * LAYOUT.v_row_bytes}
  make_plan(LAYOUT, buf, (_span(0, 16, 0), _span(16, 3, 1)), 19, 1)
  with pytest.raises(SpanPlanError, match="V rows end at byte"):
    make_plan(LAYOUT, buf, (_span(0, 16, 0), _span(16, 4, 1)), 20, 1)


def test_pinned_chunks_stream_identically():
  """Sealed copy units go through pinned_host memory (as on the GPU); results are unchanged."""
  cfg, runner, layout = build_tiny_runner(1, page_tokens=16)
  prompt = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 150))
  max_tokens = 150 + 40              # the split's ring wraps within this history (3-5 spans)
  plain, plain_logits = generate_logged(runner, engine.PlainKV(cfg, layout, max_tokens), prompt, 40, ubatch=64)
  stream = fixed_split(pool_pages=16, n_layers=3, max_tokens=max_tokens, layout=layout, copy_pages=2)
  kv = StreamedKV(cfg, layout, max_tokens, stream, pinned=True, split_at_wrap=True)
  streamed, logits = generate_logged(runner, kv, prompt, 40, ubatch=64)
  assert streamed.tokens == plain.tokens
  assert_same_logits(logits, plain_logits)
  # resident, ring before the wrap, ring after it; a prefill chunk adds the open slot (its first
  # written page) and the ring pages written after it
  assert 3 <= kv.counters["max_spans"] <= 5
  chunks = kv.histories["target"]._pinned_chunks
  assert chunks and all(arr.sharding.memory_kind == "pinned_host" for arr, _ in chunks.values())
  reserve = staging_reserve_pages(stream, max_tokens, layout, kv.prefetch_depth, pinned=True)
  assert 0 < kv.counters["staging_peak_bytes"] <= reserve * layout.page_bytes


@pytest.mark.parametrize("pinned", [False, True])
def test_staging_reserve_bounds_uploads_in_flight(pinned):
  """Copies in flight beside the step being run, resident pages refilled after a rebind:
  the staging the provider holds never exceeds `staging_reserve_pages`, and the tokens match."""
  cfg, runner, layout = build_tiny_runner(1, page_tokens=16)
  prompt = list(np.random.default_rng(4).integers(0, cfg.vocab_size, 200))
  max_tokens = CAPACITY
  plain, plain_logits = generate_logged(runner, engine.PlainKV(cfg, layout, max_tokens), prompt, 30, ubatch=64)
  stream = fixed_split(pool_pages=20, n_layers=3, max_tokens=max_tokens, layout=layout, copy_pages=2)
  kv = StreamedKV(cfg, layout, max_tokens, stream, pinned=pinned)
  wider = fixed_split(pool_pages=26, n_layers=3, max_tokens=max_tokens, layout=layout, copy_pages=2)

  def on_phase(phase):   # a repartition between prefill and decode: resident pages refill from host
    if phase == "decode":
      kv.rebind(wider)

  res, logits = generate_logged(runner, kv, prompt, 30, ubatch=64, on_phase=on_phase)
  assert res.tokens == plain.tokens and kv.counters["rebinds"] == 1
  assert_same_logits(logits, plain_logits)
  for split in (stream, kv.stream):
    reserve = staging_reserve_pages(split, max_tokens, layout, 1, pinned=pinned)
    assert kv.counters["staging_peak_bytes"] <= reserve * layout.page_bytes
  assert kv.counters["staging_peak_bytes"] > 0


def test_staging_pages_and_fit_split():
  """Staging bounds by hand; fit_split takes the largest pool whose staging still fits, and a budget
  that fits no pool is refused with the pages missing (pool + staging of the cheapest pool)."""
  assert staging_pages(0, 4, True) == staging_pages(0, 4, False) == 0
  # whole units from the one holding the first page (<= n + 3), the open unit (4), the partial page
  assert staging_pages(1, 4, True) == 9
  assert staging_pages(5, 4, True) == staging_pages(5, 4, False) == 13
  assert staging_pages(20, 4, False) == 28
  layout = PageLayout(2, 64, "q8_0", "q4_0", 16)
  for available in (54, 57, 90, 200):
    split = fit_split(available, 3, 256, layout, 2, prefetch_depth=1, pinned=False)
    reserve = staging_reserve_pages(split, 256, layout, 1, pinned=False)
    assert split.pool_pages + reserve <= available
    for bigger in range(split.pool_pages + 1, available + 1):   # no larger pool fits
      try:
        s2 = fixed_split(bigger, 3, 256, layout, 2)
      except StreamBudgetError:
        continue
      assert bigger + staging_reserve_pages(s2, 256, layout, 1, pinned=False) > available
  with pytest.raises(StreamBudgetError) as e:    # below the minimum pool (4 pages) + its staging
    fit_split(10, 3, 256, layout, 2, pinned=False)
  m = re.search(r"smallest is (\d+) pool pages \+ (\d+) staging pages; (\d+) more pages", str(e.value))
  assert m, str(e.value)
  pool, staging, missing = map(int, m.groups())
  assert missing == pool + staging - 10 > 0
  assert fit_split(pool + staging, 3, 256, layout, 2, pinned=False).pool_pages >= pool


def test_adaptive_staging_reserve_covers_every_split():
  """The adaptive reserve bounds the staging reserve of every uniform split of the pool, and
  fit_adaptive_pool is the largest pool that fits with it (or a refusal naming the pages missing)."""
  layout = PageLayout(2, 64, "q8_0", "q4_0", 16)
  for pinned in (False, True):
    for pool in (3, 9, 17, 40):
      worst = adaptive_staging_reserve_pages(pool, 256, layout, 2, 1, pinned)
      for r in range(0, pool // 3 + 1):          # 3 layers, r resident pages each, the rest ring
        split = StreamConfig(pool, (r,) * 3, 2)
        if split.ring_slots >= 1:
          assert staging_reserve_pages(split, 256, layout, 1, pinned) <= worst, (pinned, pool, r)
    for available in (30, 64, 200):
      pool = fit_adaptive_pool(available, 256, layout, 2, 1, pinned)
      assert pool + adaptive_staging_reserve_pages(pool, 256, layout, 2, 1, pinned) <= available
      assert pool + 1 + adaptive_staging_reserve_pages(pool + 1, 256, layout, 2, 1, pinned) > available
  with pytest.raises(StreamBudgetError, match=r"1 pool page \+ \d+ staging pages; \d+ more pages"):
    fit_adaptive_pool(5, 256, layout, 2, 1, pinned=True)
  # with the layers known a layer stages at most the cap (the ring of the split the policy aims at;
  # more streams in copy waves): the reserve covers every split's capped stages, is at most the
  # uncapped one, and fit_adaptive_pool gives the largest pool that fits (need is not monotone)
  for pool in (9, 17, 40, 120):
    cap = adaptive_staging_cap(pool, 256, layout, 3, 2)
    capped = adaptive_staging_reserve_pages(pool, 256, layout, 2, 1, True, n_layers=3)
    assert 2 <= cap <= pool and capped <= adaptive_staging_reserve_pages(pool, 256, layout, 2, 1, True)
    for r in range(0, pool // 3 + 1):
      split = StreamConfig(pool, (r,) * 3, 2)
      if split.ring_slots >= 1:
        assert staging_reserve_pages(split, 256, layout, 1, True, cap=cap) <= capped, (pool, r)
  for available in (30, 64, 200, 400):
    pool = fit_adaptive_pool(available, 256, layout, 2, 1, True, n_layers=3)
    need = lambda p: p + adaptive_staging_reserve_pages(p, 256, layout, 2, 1, True, n_layers=3)
    assert need(pool) <= available and all(need(p) > available for p in range(pool + 1, available + 1))
    assert pool >= fit_adaptive_pool(available, 256, layout, 2, 1, True)


def test_mtp_layer_streams_like_plain():
  """The MTP head's own cache layer (logical cache "mtp") streams through the shared ring too."""
  cfg, runner, layout = build_tiny_runner(4, page_tokens=16)
  # one 64-token forward (the shape of the other tests' prefill chunks): 4 pages a layer, 3 of them
  # streamed through the 9-slot ring
  tokens = np.random.default_rng(9).integers(0, cfg.vocab_size, 64).astype(np.int32)
  n = len(tokens)
  results = []
  for kv in (engine.PlainKV(cfg, layout, CAPACITY),
             StreamedKV(cfg, layout, CAPACITY, fixed_split(12, 3, CAPACITY, layout, copy_pages=2))):
    out = runner.forward(tokens, 0, n, runner.zero_states(), kv)
    logits, _ = runner.mtp_forward(out.hn_se[:-1], tokens[1:], 0, n - 1, kv)
    results.append((np.asarray(out.logits_rv), np.asarray(logits), kv))
  (t_plain, m_plain, _), (t_str, m_str, skv) = results
  np.testing.assert_array_equal(t_plain, t_str)
  np.testing.assert_array_equal(m_plain, m_str)
  assert skv.histories["mtp"].tokens[0] == n - 1
  assert skv.plans[2].kinds == ("resident", "ring")  # the MTP layer streamed


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 12), st.integers(1, 6), st.data())
def test_place_rows_writes_exactly_the_run(n_pool, c, data):
  """place_rows against numpy: rows [lo, hi) of a staged unit land at pool[base + lo : base + hi],
  nothing else changes (the window is clamped at the pool's end)."""
  from kvjax.streaming.placement import place_pages, place_rows
  rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
  pool = rng.integers(0, 255, (n_pool, 8), dtype=np.uint8)
  rows = rng.integers(0, 255, (c, 8), dtype=np.uint8)
  lo = data.draw(st.integers(0, c))
  hi = data.draw(st.integers(lo, min(c, lo + n_pool)))
  base = data.draw(st.integers(-lo, n_pool - hi))
  want = pool.copy()
  want[base + lo:base + hi] = rows[lo:hi]
  got = place_rows(jnp.asarray(pool), jnp.asarray(rows), jnp.int32(base), jnp.int32(lo), jnp.int32(hi))
  np.testing.assert_array_equal(np.asarray(got), want)
  pieces = jnp.asarray([[[base, lo, hi], [0, 0, 0]]], jnp.int32)    # a second, empty run
  np.testing.assert_array_equal(np.asarray(place_pages(jnp.asarray(pool), (jnp.asarray(rows),), pieces)),
                                want)


@pytest.mark.parametrize("pinned,split_at_wrap,depth", [(True, False, 1), (False, True, 2)])
def test_streamed_logits_bit_for_bit_and_layout_cached(pinned, split_at_wrap, depth):
  """Every decode step's logits through the streamed cache are the plain cache's bits (sealed pages
  as one pinned block + the open unit + the partial page, or numpy pages with runs split at the
  ring's wrap); the per-forward layout is made once a page, not once a token; every streamed layer
  after the first is a deadline sample. `depth`: layers whose copies are queued ahead, and the next
  forward's first layers whose blocks are copied during this forward's last layer."""
  cfg, runner, layout = build_tiny_runner(2, page_tokens=16)
  prompt = list(np.random.default_rng(11).integers(0, cfg.vocab_size, 100))
  steps, max_tokens = 24, CAPACITY
  outs = []
  for kv in (engine.PlainKV(cfg, layout, max_tokens),
             StreamedKV(cfg, layout, max_tokens, fixed_split(14, 3, max_tokens, layout, copy_pages=2),
                        pinned=pinned, split_at_wrap=split_at_wrap)):
    kv.prefetch_depth = kv.prefetch_next = depth
    seq = generate.SequenceState(runner, kv)
    logits = [np.asarray(generate.prefill(seq, prompt, ubatch=64))]
    tok = int(np.argmax(logits[-1]))
    for _ in range(steps):
      logits.append(np.asarray(seq.forward([tok])))
      tok = int(np.argmax(logits[-1]))
    outs.append((logits, kv))
  (plain, _), (streamed, skv) = outs
  for i, (a, b) in enumerate(zip(plain, streamed)):
    np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
  c = skv.counters
  assert c["streamed_pages"] > 0 and c["h2d_calls"] > 0
  pages_crossed = layout.pages_for(100 + steps) - layout.pages_for(100) + 1
  assert c["layout_changes"] <= 2 * pages_crossed + 3 < steps   # per page (and prefill), not per token
  assert c["deadline_samples"] >= steps * (cfg.num_attention_layers - 1)
  assert c["readiness_misses"] <= c["deadline_samples"]
  assert skv.deadline_samples.sum() == c["deadline_samples"]
  assert skv.deadline_misses.sum() == c["readiness_misses"]
  # the first layer's sealed block came from the previous forward's prefetch on most steps (not on
  # the timed forward, nor when the block grew); the staging peak counts it
  assert c["prefetch_hits"] >= depth * steps // 2
  assert c["prefetch_hits"] + c["prefetch_dropped"] <= depth * (steps + 2)
  if pinned:
    blocks = skv.histories["target"]._pinned_blocks
    assert any(blocks) and all(arr.sharding.memory_kind == "pinned_host" for b in blocks for arr in b.values())
  if split_at_wrap:
    assert 3 <= c["max_spans"] <= 5 and c["ring_wraps"] > 0
  # decode wrote every layer's rows into its open slot and read them back from there: the partial
  # page went up from the host only in the prefill and at the first decode forward
  assert c["open_hits"] >= (steps - 2) * cfg.num_attention_layers
  assert c["tail_uploads"] <= (layout.pages_for(100) + 1) * cfg.num_attention_layers


@pytest.mark.parametrize("ready", [False, True])
def test_readiness_misses_count_pages_not_there_in_time(monkeypatch, ready):
  """A deadline sample is a miss exactly when a staged page is not ready as its layer is enqueued:
  with every copy reported still in flight each sample is a miss; with every copy done, none is."""
  cfg, runner, layout = build_tiny_runner(2, page_tokens=16)
  kv = StreamedKV(cfg, layout, CAPACITY, fixed_split(14, 3, CAPACITY, layout, copy_pages=2), pinned=False)
  seq = generate.SequenceState(runner, kv)
  generate.prefill(seq, list(range(1, 101)), ubatch=64)
  sample = kv.histories["target"].pages_lpn[0, :1]
  staged = type(jnp.asarray(sample))
  monkeypatch.setattr(staged, "is_ready", lambda self: ready)
  before = dict(kv.counters)
  for tok in (5, 6, 7):
    seq.forward([tok])
  samples = kv.counters["deadline_samples"] - before["deadline_samples"]
  misses = kv.counters["readiness_misses"] - before["readiness_misses"]
  assert samples >= 3 * (cfg.num_attention_layers - 1)
  assert misses == (0 if ready else samples)


def test_prefetched_block_dropped_only_when_rows_inside_it_change():
  """The next forward's first block, prefetched at the last layer, is forgotten when a truncation
  of its cache reaches inside it (and kept when it stays above, or another cache is truncated)."""
  cfg, runner, layout = build_tiny_runner(2, page_tokens=16)
  max_tokens = CAPACITY
  kv = StreamedKV(cfg, layout, max_tokens, fixed_split(14, 3, max_tokens, layout, copy_pages=2), pinned=False)
  kv.timing_interval = 0
  seq = generate.SequenceState(runner, kv)
  generate.prefill(seq, list(range(1, 101)), ubatch=64)
  seq.forward([5])
  (first, (src, hi, block)), = kv.stager.prefetched.items()
  dropped = kv.counters["prefetch_dropped"]
  lo = kv.stager.source_pages(src)[0]
  assert first == 0 and hi > lo and block.shape == (hi - lo, layout.page_bytes)
  kv.truncate("mtp", 0)                                     # another cache's rows: kept
  kv.truncate("target", hi * layout.page_tokens + 1)       # above the block: kept
  assert first in kv.stager.prefetched and kv.counters["prefetch_dropped"] == dropped
  kv.truncate("target", hi * layout.page_tokens - 1)       # inside it: dropped
  assert not kv.stager.prefetched and kv.counters["prefetch_dropped"] == dropped + 1


@pytest.mark.parametrize("kv_types", [("q8_0", "q4_0"), ("f16", "f16")])
def test_copy_waves_bit_for_bit_from_the_minimum_pool(kv_types):
  """The minimum pool, layers + 1 pages (1 resident page a layer, 1 ring slot): every layer, the
  MTP layer included, streams in copy waves; the logits of every prefill row and decode
  step and the MTP head's are the plain cache's bits, and those are the float64 oracle's."""
  from kvjax import config, weights
  import reference_model
  cfg = config.tiny()
  tensors = weights.random_tensors(cfg, 3)
  model = engine.build_model(cfg, tensors.items())
  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, *kv_types, page_tokens=16)
  runner = engine.Runner(model, layout)
  prompt = list(np.random.default_rng(12).integers(0, cfg.vocab_size, 45))
  steps, max_tokens = 2, 80     # 5 pages of capacity: 1 resident page a layer, ring 1
  want = hidden = None
  for pool in (None, 4):
    kv = engine.PlainKV(cfg, layout, max_tokens) if pool is None else \
        StreamedKV(cfg, layout, max_tokens, fixed_split(pool, 3, max_tokens, layout, copy_pages=2))
    seq = generate.SequenceState(runner, kv)
    got = [np.asarray(generate.prefill(seq, prompt, ubatch=32, all_logits=True))]
    toks = list(prompt) + [int(np.argmax(got[0][-1]))]
    for _ in range(steps):
      got.append(np.asarray(seq.forward([toks[-1]])))
      toks.append(int(np.argmax(got[-1])))
    if hidden is None:   # the target's hidden states of the sequence, for the MTP head's rows
      _, hidden = generate.prefill(generate.SequenceState(runner, engine.PlainKV(cfg, layout, max_tokens)),
                                   toks[:-1], ubatch=32, with_hidden=True)
    n = len(toks) - 1
    mtp, _ = runner.mtp_forward(hidden.rows()[:n - 1], np.asarray(toks[1:n], np.int32), 0, n - 1, kv)
    got.append(np.asarray(mtp))
    if want is None:
      want = got
      continue
    for i, (a, b) in enumerate(zip(want, got)):
      np.testing.assert_array_equal(a, b, err_msg=f"pool {pool}: output {i}")
    c = kv.counters
    assert kv.stream.resident_pages_per_layer == (1, 1, 1) and kv.stream.ring_slots == 1
    # 3 active pages from the second prefill chunk on: 2 waves (resident + 1 slot, then 1 slot) for
    # both target layers of that chunk and of 2 decode steps, and for the MTP layer
    assert c["waved_layers"] == 2 + 2 * 2 + 1 and c["waves"] == 2 * c["waved_layers"] + 2
    assert kv.plans[2] is None and kv.metrics()["waves_per_forward"] > 2  # the MTP layer waved too
  # streamed == plain cannot see a fault both share (an attention mask off by one changes both
  # alike): the target's logits of every row against the float64 oracle, K/V through the same
  # round trip (per-position error measured 2.3e-6 / 5.7e-6 median, 1.1e-5 / 3.3e-5 max for
  # q8_0-q4_0 / f16, 2026-12-03; the off-by-one mask: ~0.3)
  oracle = reference_model.forward(cfg, tensors, np.asarray(toks[:-1]), kv_roundtrip=kv_types)
  rows = np.concatenate([want[0], np.stack(want[1:1 + steps])])
  err = np.max(np.abs(rows - oracle), axis=-1) / np.max(np.abs(oracle))
  assert np.median(err) < 2e-5 and err.max() < 1e-4, (np.median(err), err.max())


def test_copy_waves_from_pinned_mirrors():
  """With pinned memory, a copy wave's full pages come from pinned_host mirrors (sealed pieces of
  whole copy units, made once); the tokens and logits are the plain cache's; a truncation drops
  exactly the mirrors that reach past it."""
  cfg, runner, layout = build_tiny_runner(1, page_tokens=16)
  prompt = list(np.random.default_rng(5).integers(0, cfg.vocab_size, 120))
  max_tokens = CAPACITY
  plain, plain_logits = generate_logged(runner, engine.PlainKV(cfg, layout, max_tokens), prompt, 24, ubatch=64)
  kv = StreamedKV(cfg, layout, max_tokens, fixed_split(6, 3, max_tokens, layout, copy_pages=2), pinned=True)
  streamed, logits = generate_logged(runner, kv, prompt, 24, ubatch=64)
  assert streamed.tokens == plain.tokens and kv.counters["waves"] > 0
  assert_same_logits(logits, plain_logits)
  hist = kv.histories["target"]
  c = hist.copy_pages
  mirrors = [(l, lo, hi, arr) for l, b in enumerate(hist._pinned_blocks) for (lo, hi), arr in b.items()]
  mirrors += [(l, u * c, u * c + n, arr) for (l, u), (arr, n) in hist._pinned_chunks.items()]
  assert mirrors and all(arr.sharding.memory_kind == "pinned_host" for *_, arr in mirrors)
  for l, lo, hi, arr in mirrors:    # the mirrors hold the history's bytes of full pages
    assert hi * layout.page_tokens <= hist.tokens[l]
    np.testing.assert_array_equal(np.asarray(arr)[:hi - lo], hist.pages_lpn[l, lo:hi])
  cut = 5 * layout.page_tokens + 3
  kv.truncate("target", cut)
  left = [(l, lo, hi) for l, b in enumerate(hist._pinned_blocks) for (lo, hi) in b]
  left += [(l, u * c, u * c + n) for (l, u), (_, n) in hist._pinned_chunks.items()]
  assert sorted(left) == sorted((l, lo, hi) for l, lo, hi, _ in mirrors if hi * layout.page_tokens <= cut)
  assert 0 < len(left) < len(mirrors)                         # some kept, some dropped


# ---- the kernels end to end: compiled on the GPU, named test_gpu_*, skipped without KVJAX_TEST_GPU=1
# (tests/conftest.py)

def kernel_setup():
  """A model with 256-dim attention heads (the Mosaic GPU kernels' shape; the rest tiny), 64-token
  Q8_0 K / Q4_0 V pages, a 300-token prompt -> (cfg, model, layout, prompt)."""
  from kvjax import config, weights
  cfg = config.tiny(head_dim=256, rope_dim=64, num_attention_heads=6, num_kv_heads=2)
  model = engine.build_model(cfg, weights.random_tensors(cfg, 3).items())
  layout = PageLayout(2, 256, "q8_0", "q4_0", page_tokens=64)
  prompt = [int(t) for t in np.random.default_rng(13).integers(0, cfg.vocab_size, 300)]
  return cfg, model, layout, prompt


def kernel_runs(setup, impl: str, interpret: bool = False, steps: int = 16, pools=(9, 4)):
  """Greedy generation through span attention `impl` (1-page partitions): the plain cache, then
  streamed caches of `pools` pages (9: resident 2 a layer + a 3-slot ring that holds a layer's
  3 streamed pages; 4, the minimum: resident 1 a layer, every layer's 4 streamed pages in copy
  waves through 1 slot)
  -> [(pool or None, result, logits [steps, V], kv)]."""
  from kvjax.model import AttentionOptions
  cfg, model, layout, prompt = setup
  runner = engine.Runner(model, layout, AttentionOptions(impl, block_pages=1, interpret=interpret))
  max_tokens = len(prompt) + steps      # 5 pages a cache layer (2 target attention layers + MTP)
  runs = []
  for pool in (None,) + tuple(pools):
    kv = engine.PlainKV(cfg, layout, max_tokens) if pool is None else \
        StreamedKV(cfg, layout, max_tokens, fixed_split(pool, 3, max_tokens, layout, copy_pages=2))
    res, logits = generate_logged(runner, kv, prompt, steps, ubatch=64)
    runs.append((pool, res, logits, kv))
  return runs


def check_kernel_runs(impl, runs):
  """Every streamed run: the plain run's tokens and logits bits at every step, pages streamed;
  the last one in copy waves."""
  (_, plain, want, _), *streamed = runs
  assert np.isfinite(want).all()
  for pool, res, logits, kv in streamed:
    assert res.tokens == plain.tokens, (impl, pool)
    assert_same_logits(logits, want, f"{impl}, pool {pool}")
    assert kv.counters["streamed_pages"] > 0 and kv.stream.pool_pages == pool
  assert runs[1][3].counters["waved_layers"] == 0 and runs[-1][3].counters["waved_layers"] > 0


@pytest.mark.parametrize("impl", ["auto", "mosaic", "triton"])
def test_gpu_streamed_logits_bit_for_bit_on_the_kernels(impl):
  """The compiled kernels ("auto": the Mosaic GPU decode kernel for decode, its prefill kernel for
  64-token prefill chunks) read streamed pages as they read the plain cache: the same logits bits
  at every step, copy waves included. And they are the kernels, not the reference: the first
  step's logits differ from the reference's, by the f16 operand rounding."""
  from kvjax.model import AttentionOptions
  from kvjax_pallas.span_attention import api as span_api
  setup = kernel_setup()
  cfg, model, layout, prompt = setup
  for rows in (1, 64):
    assert span_api.resolve_implementation(impl, layout=layout, q_shape=(rows, 6, 256)) == \
        ("mosaic" if impl == "auto" else impl)
  runs = kernel_runs(setup, impl)
  check_kernel_runs(impl, runs)
  ref = engine.Runner(model, layout, AttentionOptions("reference", block_pages=1))
  seq = generate.SequenceState(ref, engine.PlainKV(cfg, layout, len(prompt)))
  want = np.asarray(generate.prefill(seq, prompt, 64))
  err = float(np.max(np.abs(runs[0][2][0] - want)) / np.max(np.abs(want)))
  assert 0 < err < 1e-2, err


def test_copy_unit_is_capped_at_the_ring(tiny_runner):
  """A copy unit uploads whole, so a 32-page unit through a 3-slot ring would move ~30x the bytes
  that stream: the cache halves it until the ring holds it (2 pages here), with the same logits."""
  cfg, runner, layout = tiny_runner
  prompt = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 3 * 256 + 100))
  max_tokens = LONG_CAPACITY
  plain, plain_logits = generate_logged(runner, engine.PlainKV(cfg, layout, max_tokens), prompt, 24)
  kv = StreamedKV(cfg, layout, max_tokens, StreamConfig(6, (1, 1, 1), 32))
  assert kv.stream.ring_slots == 3 and kv.copy_unit == 2 and kv.histories["target"].copy_pages == 2
  streamed, logits = generate_logged(runner, kv, prompt, 24)
  assert streamed.tokens == plain.tokens
  assert_same_logits(logits, plain_logits)
  m = streamed.metrics
  assert m["streamed_pages"] > 0 and m["h2d_bytes"] <= 2 * m["streamed_pages"] * layout.page_bytes, \
      (m["h2d_bytes"], m["streamed_pages"])
  kv.rebind(StreamConfig(6, (1, 1, 1), 32))        # the nominal unit is what a rebind compares
  with pytest.raises(ValueError, match="copy_pages is fixed"):
    kv.rebind(StreamConfig(6, (1, 1, 1), 2))


def test_kept_rows_reach_the_host_up_to_the_truncate_and_before_a_read():
  """`defer_rows(True)` (a speculative round's forwards): a forward's rows stay on the device until
  `truncate` publishes those below its count (the rest never reach the host), a forward that reads
  the history publishes them first, and `defer_rows(False)` publishes all; the histories and the
  logits are those of the same forwards published at each end, and the policy's elapsed time is
  counted once for forwards that overlap."""
  cfg, runner, layout = build_tiny_runner(4, page_tokens=16)
  rng = np.random.default_rng(5)
  prompt, rows = rng.integers(0, cfg.vocab_size, 40).astype(np.int32), rng.integers(0, cfg.vocab_size, 9)
  out = {}
  for defer in (False, True):
    kv = StreamedKV(cfg, layout, CAPACITY, fixed_split(12, 3, CAPACITY, layout, copy_pages=2))
    t0 = time.perf_counter()
    runner.forward(prompt, 0, 40, runner.zero_states(), kv)
    kv.defer_rows(defer)
    target = kv.histories["target"]
    a = runner.forward(rows[:4], 40, 4, runner.zero_states(), kv)     # rows 40..43, two of them kept
    assert target.tokens[0] == (40 if defer else 44)
    kv.truncate("target", 42)
    assert target.tokens[0] == 42 and len(kv.kept.items) == 0
    b = runner.forward(rows[4:7], 42, 3, runner.zero_states(), kv)    # rows 42..44
    c = runner.forward(rows[7:9], 45, 2, runner.zero_states(), kv)    # its begin publishes 42..44 first
    assert len(kv.kept.items) == (1 if defer else 0) and target.tokens[0] == (45 if defer else 47)
    kv.defer_rows(False)
    assert target.tokens[0] == 47 and not kv.kept.items
    assert 0 < kv.counters["elapsed_ms"] <= (time.perf_counter() - t0) * 1e3    # wall time, once
    out[defer] = ([np.asarray(x.logits_rv) for x in (a, b, c)],
                  [np.concatenate(target.rows(l, 47), axis=1) for l in range(cfg.num_attention_layers)])
  for want, got in zip(out[False][0] + out[False][1], out[True][0] + out[True][1]):
    np.testing.assert_array_equal(got, want)
