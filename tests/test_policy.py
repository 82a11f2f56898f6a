"""Tests for kvjax.streaming.policy: every rule on chosen inputs, plus properties."""

import dataclasses
import math

import pytest
from hypothesis import given, settings, strategies as st

from kvjax.streaming import policy as P
from kvjax.streaming.policy import (COUNTER_MAX, Feedback, FeedbackWindow, Observation, PolicyConfig,
                          PolicyError, initialize, layout, overlap_target, step)

PT = P.PAGE_TOKENS


def cfg(**kw):
  """50 pages of 100 B, 4 layers: min ring 10, initial resident 10."""
  base = dict(page_bytes=100, pool_bytes=5000, layers=4)
  base.update(kw)
  return PolicyConfig(**base)


def decode(pages, **kw):
  return Observation(active_tokens=pages * PT, query_tokens=1, **kw)


def prefill(pages, **kw):
  return Observation(active_tokens=pages * PT, query_tokens=PT, **kw)


def with_resident(config, state, r):
  return dataclasses.replace(state, resident_pages_per_layer=r,
                             ring_slots=state.pages - r * config.layers)


# ---- budget and initialisation ------------------------------------------------

def test_budget_and_fresh_state():
  c = cfg(pool_bytes=5030, conversion_bytes=30)
  b = P.budget(c)
  assert (b.pages, b.ring_hint, b.initial_resident_pages, b.minimum_ring_slots) == (50, 8, 10, 10)
  s = initialize(c)
  assert (s.pages, s.resident_pages_per_layer, s.ring_slots, s.minimum_ring_slots) == (50, 10, 10, 10)
  assert s.evaluations_since_repartition == COUNTER_MAX
  assert not s.feedback_initialized and s.starved == 0 and s.overprovisioned == 0
  assert not s.spread_streaming and s.decode_active_pages == 0


def test_explicit_ring_hint_and_auto_with_small_pool():
  s = initialize(cfg(initial_ring_slots=5))
  # resident = (50 - 5) // 4 = 11, minimum ring = 50 - 44 = 6 (>= hint).
  assert (s.resident_pages_per_layer, s.minimum_ring_slots, s.ring_slots) == (11, 6, 6)
  # Auto hint is min(8, pages - layers): 7 pages, 4 layers -> hint 3, resident 1.
  s = initialize(cfg(pool_bytes=700))
  assert (s.resident_pages_per_layer, s.minimum_ring_slots) == (1, 3)


@pytest.mark.parametrize("kw, words", [
    (dict(pool_bytes=499), ["too small", "5 pages", "1 B missing"]),
    (dict(pool_bytes=520, conversion_bytes=30), ["conversion", "10 B missing"]),
    (dict(layers=0), ["layers must be >= 1"]),
    (dict(initial_ring_slots=47), ["initial_ring_slots 47 cannot fit", "at most 46"]),
    (dict(initial_ring_slots=-1), ["initial_ring_slots"]),
    (dict(overlap_ratio=math.nan), ["overlap_ratio"]),
    (dict(overlap_ratio=math.inf), ["overlap_ratio"]),
    (dict(grow_evaluations=0), ["grow_evaluations must be >= 1"]),
    (dict(shrink_evaluations=0), ["shrink_evaluations must be >= 1"]),
    (dict(cooldown_evaluations=0), ["cooldown_evaluations must be >= 1"]),
    (dict(page_bytes=0), ["page_bytes"]),
    (dict(fixed_ring=1), ["fixed_ring"]),
])
def test_invalid_config_refused(kw, words):
  with pytest.raises(PolicyError) as e:
    initialize(cfg(**kw))
  for w in words:
    assert w in str(e.value)
  assert isinstance(e.value, ValueError)


def test_step_refuses_foreign_state_and_bad_observation():
  c = cfg()
  s = initialize(c)
  with pytest.raises(PolicyError, match="pages"):
    step(cfg(pool_bytes=6000), s, decode(5))
  with pytest.raises(PolicyError, match="ring_slots"):
    step(c, dataclasses.replace(s, ring_slots=11), decode(5))
  with pytest.raises(PolicyError, match="query_tokens"):
    step(c, s, Observation(active_tokens=10, query_tokens=11))
  with pytest.raises(PolicyError, match="active_tokens"):
    step(c, s, Observation(active_tokens=-1, query_tokens=0))
  with pytest.raises(PolicyError, match="feedback.samples"):
    step(c, s, decode(5, feedback=Feedback(samples=-1)))
  assert s == initialize(c)  # inputs are untouched


# ---- overlap target ----------------------------------------------------------

def test_overlap_target_values():
  c = cfg()  # 50 pages, 4 layers, cap 10
  assert overlap_target(c, 0) == 1
  assert overlap_target(c, 7) == 7              # fits: r == active
  assert overlap_target(c, 12) == 10            # 50 - 40 = 10 >= 1.1 * 2
  assert overlap_target(c, 20) == 9             # 14 >= 12.1; r = 10 gives 10 < 11
  assert overlap_target(c, 40) == 2             # 42 >= 41.8; r = 3: 38 < 40.7
  assert overlap_target(c, 10_000) == 1         # nothing qualifies -> at least 1


def _brute_target(c, active):
  b = P.budget(c)
  hi = min(active, b.initial_resident_pages)
  best = 1
  for r in range(1, hi + 1):
    if r == active or b.pages - r * c.layers >= c.overlap_ratio * (active - r):
      best = r
  return best


@settings(max_examples=300, deadline=None)
@given(layers=st.integers(1, 20), extra=st.integers(1, 400), active=st.integers(0, 600),
       ratio=st.sampled_from([0.5, 1.0, 1.1, 1.5, 3.0]))
def test_overlap_target_matches_linear_scan(layers, extra, active, ratio):
  c = PolicyConfig(page_bytes=1, pool_bytes=layers + extra, layers=layers, overlap_ratio=ratio)
  assert overlap_target(c, active) == _brute_target(c, active)


# ---- modes, pressure and rule A ----------------------------------------------

def test_no_pressure_keeps_partition_and_clears_counters():
  c = cfg()
  s = dataclasses.replace(initialize(c), starved=2, overprovisioned=5, spread_streaming=True)
  d = step(c, s, decode(8))
  assert not d.partition_changed and d.next.resident_pages_per_layer == 10
  assert d.next.starved == 0 and d.next.overprovisioned == 0
  assert not d.next.spread_streaming and d.layout_changed
  assert d.target_resident_pages == 8


def test_partial_page_counts_as_active_page():
  c = cfg()
  s = initialize(c)
  assert not step(c, s, Observation(10 * PT, 1)).partition_changed          # 10 pages fit
  d = step(c, s, Observation(19 * PT + 1, 1))                                # 20 pages
  assert d.target_resident_pages == 9 and d.next.resident_pages_per_layer == 9


def test_rule_a_entering_decode_cuts_to_target_at_once():
  c = cfg()
  s = initialize(c)
  d = step(c, s, decode(20))
  assert d.partition_changed and d.layout_changed
  n = d.next
  assert (n.resident_pages_per_layer, n.ring_slots, n.decode_active_pages) == (9, 14, 20)
  assert n.evaluations_since_repartition == 0 and n.starved == 0
  # Same active count again: no new entry; cooldown holds rule B back.
  d2 = step(c, n, decode(20))
  assert not d2.partition_changed and d2.next.evaluations_since_repartition == 1


def test_rule_a_ignores_cooldown_but_needs_new_active_count():
  c = cfg()
  s = dataclasses.replace(initialize(c), evaluations_since_repartition=0, decode_active_pages=20)
  assert not step(c, s, decode(20)).partition_changed      # same count, not cooled
  assert step(c, s, decode(21)).partition_changed          # new count: at once


@pytest.mark.parametrize("obs, is_decode", [
    (Observation(20 * PT, 32), True),
    (Observation(20 * PT, 33), False),
    (Observation(20 * PT, 1, uniform_prefill=True), False),
])
def test_decode_cutoff_at_32_query_rows(obs, is_decode):
  c = cfg()
  s = dataclasses.replace(initialize(c), evaluations_since_repartition=0)
  d = step(c, s, obs)
  assert d.partition_changed == is_decode
  assert d.next.decode_active_pages == (20 if is_decode else 0)


def test_prefill_resets_decode_entry():
  c = cfg()
  n = step(c, initialize(c), decode(20)).next
  n = step(c, n, prefill(20)).next
  assert n.decode_active_pages == 0
  # Same active count, but after a prefill this is entering decode again.
  n = dataclasses.replace(with_resident(c, n, 10), evaluations_since_repartition=0)
  assert step(c, n, decode(20)).next.resident_pages_per_layer == 9


# ---- rule B: grow the ring ------------------------------------------------------

def test_rule_b_above_target_after_grow_evaluations():
  c = cfg()
  s = initialize(c)  # cooled
  seq = []
  for _ in range(3):
    d = step(c, s, prefill(40))  # target 2, resident 10, no rule A in prefill
    s = d.next
    seq.append((d.partition_changed, s.starved, s.resident_pages_per_layer))
  assert seq == [(False, 1, 10), (False, 2, 10), (True, 0, 2)]
  assert not s.spread_streaming and s.ring_slots == 42


def _feed(epoch, samples, misses, busy, peak=0):
  return Feedback(available=True, epoch=epoch, samples=samples, misses=misses,
                  copy_busy_ratio=busy, peak_slots=peak)


def test_rule_b_starved_at_target_steps_down_and_spreads():
  c = cfg(cooldown_evaluations=2)
  s = step(c, initialize(c), decode(20)).next          # resident 9 == target
  s = step(c, s, decode(20, feedback=_feed(0, 0, 0, 0.2))).next   # baseline
  assert s.feedback_initialized and s.starved == 0
  changed = []
  for i in range(1, 4):
    d = step(c, s, decode(20, feedback=_feed(0, 100 * i, 10 * i, 0.2)))
    assert d.feedback_used
    s = d.next
    changed.append(d.partition_changed)
  assert changed == [False, False, True]
  assert s.resident_pages_per_layer == 8 and s.spread_streaming and s.ring_slots == 18


def test_starved_needs_copy_stream_headroom():
  c = cfg(cooldown_evaluations=1)
  s = step(c, initialize(c), decode(20)).next
  s = step(c, s, decode(20, feedback=_feed(0, 0, 0, 0.95))).next
  for i in range(1, 6):  # misses, but the copy stream is >= 90 % busy
    d = step(c, s, decode(20, feedback=_feed(0, 100 * i, 50 * i, 0.95)))
    s = d.next
    assert d.feedback_used and s.starved == 0 and not d.partition_changed
  # Miss ratio exactly 0.01 is not starved either.
  d = step(c, s, decode(20, feedback=_feed(0, 600, 251, 0.2)))
  assert d.next.starved == 0


def test_rule_b_cooldown_and_hard_deadline_miss():
  c = cfg()  # cooldown 64
  s = dataclasses.replace(initialize(c), evaluations_since_repartition=0, starved=5)
  d = step(c, s, prefill(40))
  assert not d.partition_changed and d.next.starved == 6
  d = step(c, s, prefill(40, deadline_miss=True))
  assert d.partition_changed and d.next.resident_pages_per_layer == 2


def test_rule_b_never_below_one_resident_page():
  c = cfg(cooldown_evaluations=1)
  s = with_resident(c, initialize(c), 1)
  s = dataclasses.replace(s, starved=10, feedback_initialized=True)
  d = step(c, s, prefill(40, feedback=_feed(0, 100, 50, 0.1)))
  assert d.feedback_used and d.next.starved == 11
  assert not d.partition_changed and d.next.resident_pages_per_layer == 1


# ---- rule C: shrink the ring ------------------------------------------------------

def test_rule_c_light_for_shrink_evaluations_grows_resident():
  c = cfg()
  s = with_resident(c, initialize(c), 9)             # ring 14 = min ring + layers
  s = dataclasses.replace(s, feedback_initialized=True)
  history = []
  for i in range(1, 9):  # active 12 pages: target 10 > resident 9
    d = step(c, s, decode(12, feedback=_feed(0, 100 * i, 0, 0.1, peak=6)))
    s = d.next
    history.append((d.partition_changed, s.overprovisioned))
  assert history[:7] == [(False, k) for k in range(1, 8)]
  assert history[7] == (True, 0)
  assert s.resident_pages_per_layer == 10 and s.ring_slots == 10


def test_rule_c_needs_light_every_evaluation():
  c = cfg()
  s = dataclasses.replace(with_resident(c, initialize(c), 9), feedback_initialized=True,
                          overprovisioned=7)
  # peak ring use 7 of 14 slots is not below half the ring -> not light
  d = step(c, s, decode(12, feedback=_feed(0, 100, 0, 0.1, peak=7)))
  assert d.feedback_used and d.next.overprovisioned == 0 and not d.partition_changed
  d = step(c, s, decode(12, feedback=_feed(0, 100, 0, 0.5, peak=0)))  # busy not < 0.5
  assert d.next.overprovisioned == 0
  d = step(c, s, decode(12, feedback=_feed(0, 100, 0, 0.49, peak=6)))
  assert d.partition_changed and d.next.resident_pages_per_layer == 10


def test_rule_c_respects_cooldown():
  c = cfg()
  s = dataclasses.replace(with_resident(c, initialize(c), 9), feedback_initialized=True,
                          overprovisioned=7, evaluations_since_repartition=10)
  d = step(c, s, decode(12, feedback=_feed(0, 100, 0, 0.1)))
  assert not d.partition_changed and d.next.overprovisioned == 8


def test_fixed_ring_never_repartitions():
  c = cfg(fixed_ring=True)
  s = initialize(c)
  for _ in range(5):
    d = step(c, s, decode(40, deadline_miss=True))
    s = d.next
    assert not d.partition_changed
  assert s.resident_pages_per_layer == 10 and s.starved == 5


def test_counters_saturate():
  c = cfg(fixed_ring=True)
  s = dataclasses.replace(initialize(c), starved=COUNTER_MAX)
  n = step(c, s, prefill(40)).next
  assert n.starved == COUNTER_MAX and n.evaluations_since_repartition == COUNTER_MAX


# ---- feedback deltas and resets -----------------------------------------------------

def test_first_feedback_is_baseline_and_unavailable_is_ignored():
  c = cfg()
  s = initialize(c)
  d = step(c, s, decode(5, feedback=_feed(3, 40, 2, 0.3)))
  assert not d.feedback_used and not d.feedback_reset
  n = d.next
  assert (n.feedback_initialized, n.feedback_epoch, n.samples, n.misses) == (True, 3, 40, 2)
  d = step(c, n, decode(5, feedback=Feedback(available=False, epoch=9, samples=0)))
  assert not d.feedback_used and not d.feedback_reset and d.next.samples == 40
  d = step(c, n, decode(5, feedback=_feed(3, 40, 2, 0.3)))   # no new samples
  assert not d.feedback_used and not d.feedback_reset


@pytest.mark.parametrize("fb", [
    _feed(1, 200, 20, 0.2),            # epoch change
    _feed(0, 50, 5, 0.2),              # samples decreased
    _feed(0, 200, 5, 0.2),             # misses decreased
    _feed(0, 200, 20, math.nan),       # NaN busy
    _feed(0, 200, 20, 1.5),            # busy > 1
    _feed(0, 200, 20, -0.1),           # busy < 0
    _feed(0, 105, 17, 0.2),            # 7 new misses out of 5 new samples
])
def test_feedback_reset_clears_counters_and_rebaselines(fb):
  c = cfg()
  s = dataclasses.replace(initialize(c), feedback_initialized=True, samples=100, misses=10,
                          starved=2, overprovisioned=3)
  d = step(c, s, prefill(40, feedback=fb))
  assert d.feedback_reset and not d.feedback_used
  assert d.next.starved == 0 and d.next.overprovisioned == 0 and not d.partition_changed
  assert (d.next.feedback_epoch, d.next.samples, d.next.misses) == (fb.epoch, fb.samples, fb.misses)
  # Without the reset the third above-target evaluation would have repartitioned.
  d = step(c, s, prefill(40, feedback=_feed(0, 200, 10, 0.2)))
  assert not d.feedback_reset and d.partition_changed


# ---- layout ---------------------------------------------------------------------------

def test_layout_without_pressure():
  c = cfg()
  lay = layout(c, initialize(c), 7 * PT)
  assert lay.deficit_pages == 0 and lay.splits == 0 and lay.waves == 0
  assert all((l.capacity_pages, l.resident_live_pages, l.streamed_pages) == (10, 7, 0)
             for l in lay.layers)


def test_layout_concentrated_streams_fewest_layers():
  c = cfg()
  s = with_resident(c, initialize(c), 9)      # ring 14
  lay = layout(c, s, 12 * PT)                   # deficit 3 * 4 = 12 <= ring
  assert lay.splits == 1 and lay.streamed_layers == (3,) and lay.waves == 1
  assert [(l.capacity_pages, l.resident_live_pages, l.streamed_pages, l.waves)
          for l in lay.layers] == [(12, 12, 0, 0)] * 3 + [(0, 0, 12, 1)]
  lay = layout(c, s, 20 * PT)                   # deficit 44: ceil(44/14)=4, ceil(44/20)=3
  assert lay.splits == 4 and lay.waves == 4
  assert [l.streamed_pages for l in lay.layers] == [11, 11, 11, 11]
  s2 = with_resident(c, initialize(c), 2)       # ring 42
  lay = layout(c, s2, 40 * PT)                  # deficit 152: ceil(152/42)=4 splits
  assert [l.streamed_pages for l in lay.layers] == [38, 38, 38, 38]
  s3 = with_resident(cfg(layers=2, pool_bytes=3000), initialize(cfg(layers=2, pool_bytes=3000)), 5)
  lay = layout(cfg(layers=2, pool_bytes=3000), s3, 8 * PT)   # ring 20, deficit 6 -> 1 split
  assert lay.splits == 1 and [l.streamed_pages for l in lay.layers] == [0, 6]


def test_layout_spread_streams_every_layer():
  c = cfg()
  s = dataclasses.replace(with_resident(c, initialize(c), 8), spread_streaming=True)  # ring 18
  lay = layout(c, s, 30 * PT)
  assert lay.splits == 4 and lay.streamed_layers == (0, 1, 2, 3)
  assert all((l.capacity_pages, l.resident_live_pages, l.streamed_pages, l.waves) == (8, 8, 22, 2)
             for l in lay.layers)


@st.composite
def layout_cases(draw):
  layers = draw(st.integers(1, 18))
  pages = draw(st.integers(layers + 1, layers * 40 + 20))
  hint = draw(st.integers(0, pages - layers))
  c = PolicyConfig(page_bytes=7, pool_bytes=pages * 7 + draw(st.integers(0, 6)), layers=layers,
                   initial_ring_slots=hint)
  s = initialize(c)
  r = draw(st.integers(1, s.resident_pages_per_layer))
  s = dataclasses.replace(with_resident(c, s, r), spread_streaming=draw(st.booleans()))
  tokens = draw(st.integers(0, 80 * PT))
  return c, s, tokens


@settings(max_examples=400, deadline=None)
@given(layout_cases())
def test_layout_properties(case):
  c, s, tokens = case
  lay = layout(c, s, tokens)
  active = -(-tokens // PT)
  assert len(lay.layers) == c.layers
  # conserves pages and never exceeds the pool
  assert lay.capacity_pages + lay.ring_slots == s.pages
  assert lay.ring_slots >= s.minimum_ring_slots
  for l in lay.layers:
    assert l.resident_live_pages + l.streamed_pages == active
    assert 0 <= l.resident_live_pages <= l.capacity_pages
    assert l.streamed_pages >= 0
    assert l.waves == -(-l.streamed_pages // s.ring_slots)
  assert lay.streamed_pages == max(0, active - s.resident_pages_per_layer) * c.layers
  assert lay.streamed_pages == lay.deficit_pages
  assert sum(1 for l in lay.layers if l.streamed_pages) == lay.splits
  if lay.deficit_pages and not s.spread_streaming:
    # Fewest streamed layers: no layer streams more than its active pages,
    # and with fewer than all layers streamed each fits one ring fill.
    d, k, ring = lay.deficit_pages, lay.splits, s.ring_slots
    assert -(-d // active) <= k <= c.layers
    assert k == -(-d // active) or k == min(c.layers, -(-d // ring))
    if k < c.layers:
      assert all(l.streamed_pages <= ring for l in lay.layers)
    assert lay.streamed_layers == tuple(range(c.layers - k, c.layers))
  elif lay.deficit_pages:
    assert lay.splits == c.layers


@settings(max_examples=150, deadline=None)
@given(case=layout_cases(), obs=st.lists(st.tuples(
    st.integers(0, 80), st.sampled_from([1, 4, 32, 33, 256]), st.booleans(),
    st.integers(0, 30), st.floats(0, 1), st.integers(0, 50), st.booleans()), max_size=25))
def test_step_keeps_state_valid(case, obs):
  c, s, _ = case
  c = dataclasses.replace(c, cooldown_evaluations=2)
  samples = misses = 0
  cap = P.budget(c).initial_resident_pages
  for pages, q, uniform, new_misses, busy, peak, miss in obs:
    samples += 30
    misses += new_misses
    tokens = max(pages * PT, q)
    d = step(c, s, Observation(tokens, q, _feed(0, samples, misses, busy, peak), uniform, miss))
    s = d.next
    assert 1 <= s.resident_pages_per_layer <= cap
    assert s.ring_slots == s.pages - s.resident_pages_per_layer * c.layers
    assert s.ring_slots >= s.minimum_ring_slots
    assert d.partition_changed == (s.evaluations_since_repartition == 0)
    lay = layout(c, s, tokens)
    assert lay.capacity_pages + lay.ring_slots == s.pages


# ---- feedback window --------------------------------------------------------------------

def test_feedback_window_busy_ratio_and_roll():
  w = FeedbackWindow(epoch=4)
  w.add(elapsed_ms=10.0, copy_ms=2.0, bytes=1000, timed_bytes=500, samples=10, misses=1,
        peak_slots=3)
  w.add(elapsed_ms=10.0, copy_ms=1.0, bytes=1000, timed_bytes=500, samples=10, peak_slots=2)
  # 3 ms busy on 1000 timed of 2000 bytes in 20 ms: 3 / 20 * 2 = 0.3
  fb = w.roll()
  assert fb.available and fb.epoch == 4 and (fb.samples, fb.misses, fb.peak_slots) == (20, 1, 3)
  assert fb.copy_busy_ratio == pytest.approx(0.3)
  assert w.feedback().available is False and w.samples == 20   # counters kept, timing reset
  w.add(elapsed_ms=1.0, copy_ms=0.9, bytes=400, timed_bytes=100)
  assert w.feedback().copy_busy_ratio == 1.0                   # clamped
  w.roll()
  w.add(elapsed_ms=5.0)
  assert w.feedback().available and w.feedback().copy_busy_ratio == 0.0
  w.roll()
  w.add(elapsed_ms=5.0, bytes=100)                              # copied, none timed
  assert not w.feedback().available


@pytest.mark.parametrize("kw, word", [
    (dict(elapsed_ms=math.nan), "finite"),
    (dict(elapsed_ms=1.0, copy_ms=math.nan), "finite"),
    (dict(elapsed_ms=1.0, samples=-1), "cannot decrease"),
    (dict(elapsed_ms=1.0, bytes=10, timed_bytes=11), "exceed copied bytes"),
    (dict(elapsed_ms=0.0), "zero elapsed"),
    (dict(elapsed_ms=1.0, samples=1, misses=5), "exceed samples"),
])
def test_feedback_window_rejects(kw, word):
  w = FeedbackWindow()
  w.add(elapsed_ms=2.0, copy_ms=1.0, bytes=100, timed_bytes=100, samples=4, misses=1)
  before = dict(vars(w))
  with pytest.raises(PolicyError, match=word):
    w.add(**kw)
  assert vars(w) == before


def test_feedback_window_observe_totals():
  w = FeedbackWindow()
  w.observe(elapsed_ms=4.0, copy_ms=1.0, bytes=100, timed_bytes=50, samples=5, misses=0)
  w.observe(elapsed_ms=8.0, copy_ms=2.0, bytes=200, timed_bytes=100, samples=9, misses=1)
  assert (w.samples, w.misses, w.bytes) == (9, 1, 200)
  before = dict(vars(w))
  with pytest.raises(PolicyError, match="samples decreased"):
    w.observe(elapsed_ms=9.0, copy_ms=2.0, bytes=200, timed_bytes=100, samples=8, misses=1)
  with pytest.raises(PolicyError, match="zero elapsed"):
    w.observe(elapsed_ms=8.0, copy_ms=2.0, bytes=200, timed_bytes=100, samples=9, misses=1)
  assert vars(w) == before


def test_feedback_window_drives_policy():
  c = cfg(cooldown_evaluations=1)
  s = step(c, initialize(c), decode(20)).next
  w = FeedbackWindow()
  w.add(elapsed_ms=1.0)
  s = step(c, s, decode(20, feedback=w.roll())).next      # baseline
  for _ in range(3):
    w.add(elapsed_ms=10.0, copy_ms=1.0, bytes=100, timed_bytes=100, samples=50, misses=5)
    d = step(c, s, decode(20, feedback=w.roll()))
    assert d.feedback_used
    s = d.next
  assert s.resident_pages_per_layer == 8 and s.spread_streaming
  w.new_epoch()
  w.add(elapsed_ms=1.0, samples=1)
  d = step(c, s, decode(20, feedback=w.roll()))
  assert d.feedback_reset and d.next.feedback_epoch == 1
