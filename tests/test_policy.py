"""Tests for kvjax.streaming.policy: every rule of the reference policy on its own numbers, plus
properties."""

import dataclasses
import math

import pytest
from hypothesis import given, settings, strategies as st

from kvjax.streaming import policy as P
from kvjax.streaming.policy import (COUNTER_MAX, MTP_CACHE, TARGET_CACHE, Feedback, FeedbackWindow,
                                    Observation, PolicyConfig, PolicyError, admit_prefill, capacities,
                                    initialize, layout, overlap_target, rebind, step)

PT = P.PAGE_TOKENS


def cfg(**kw):
  """50 pages of 100 B, 4 layers: min ring 10, initial resident 10."""
  base = dict(page_bytes=100, pool_bytes=5000, layers=4)
  base.update(kw)
  return PolicyConfig(**base)


def decode(pages, **kw):
  return Observation(active_tokens=pages * PT, query_tokens=1, **kw)


def prefill(pages, **kw):
  return Observation(active_tokens=pages * PT, query_tokens=PT, uniform_prefill=True, **kw)


def with_resident(config, state, r, **kw):
  return dataclasses.replace(state, resident_pages_per_layer=r,
                             ring_slots=state.pages - r * config.layers, **kw)


def _feed(epoch, samples, misses, busy, peak=0, **kw):
  return Feedback(available=True, epoch=epoch, samples=samples, misses=misses,
                  copy_busy_ratio=busy, peak_slots=peak, **kw)


def _primed(c, state, samples=0, misses=0, **kw):
  """`state` with an initialized feedback cursor at (samples, misses)."""
  return dataclasses.replace(state, feedback_initialized=True, samples=samples, misses=misses, **kw)


# ---- config, budget, caches, minimum pool ----------------------------------------

def test_budget_and_fresh_state():
  c = cfg(pool_bytes=5030, conversion_bytes=30)
  b = P.budget(c)
  assert (b.pages, b.ring_hint, b.initial_resident_pages, b.minimum_ring_slots) == (50, 8, 10, 10)
  s = initialize(c)
  assert (s.pages, s.resident_pages_per_layer, s.ring_slots, s.minimum_ring_slots) == (50, 10, 10, 10)
  assert s.evaluations_since_repartition == COUNTER_MAX
  assert not s.feedback_initialized and s.starved == 0 and s.overprovisioned == 0
  assert not s.spread_streaming and s.decode_active_pages == 0
  assert s.caches == ((TARGET_CACHE, 4),) and s.layer_samples == () == s.layer_misses


def test_explicit_ring_hint_and_auto_with_small_pool():
  s = initialize(cfg(initial_ring_slots=5))
  # resident = (50 - 5) // 4 = 11, minimum ring = 50 - 44 = 6 (>= hint).
  assert (s.resident_pages_per_layer, s.minimum_ring_slots, s.ring_slots) == (11, 6, 6)
  # Auto hint is min(8, pages - layers): 7 pages, 4 layers -> hint 3, resident 1.
  s = initialize(cfg(pool_bytes=700))
  assert (s.resident_pages_per_layer, s.minimum_ring_slots) == (1, 3)


def test_minimum_pool_is_layers_plus_one_pages():
  """(L + 1) pages + conversion bytes is the smallest pool: 1 resident page a layer, 1 ring slot,
  and every layer streams the rest in waves through that slot."""
  c = cfg(pool_bytes=530, conversion_bytes=30)               # 5 pages for 4 layers
  assert P.minimum_pool_bytes(4, 100, 30) == 530 and P.minimum_pool_pages(4) == 5
  s = initialize(c)
  assert (s.resident_pages_per_layer, s.ring_slots, s.minimum_ring_slots) == (1, 1, 1)
  lay = layout(c, s, 3 * PT)
  assert [(l.capacity_pages, l.streamed_pages, l.waves) for l in lay.layers] == [(1, 2, 2)] * 4
  assert lay.waves == 8
  with pytest.raises(PolicyError, match="1 B missing"):
    initialize(cfg(pool_bytes=529, conversion_bytes=30))


@pytest.mark.parametrize("kw, words", [
    (dict(pool_bytes=499), ["too small", "5 pages", "1 B missing"]),
    (dict(pool_bytes=520, conversion_bytes=30), ["conversion", "10 B missing"]),
    (dict(pool_bytes=30, conversion_bytes=30), ["too small", "500 B missing"]),
    (dict(layers=0), ["layers must be >= 1"]),
    (dict(initial_ring_slots=47), ["initial_ring_slots 47 cannot fit", "at most 46"]),
    (dict(initial_ring_slots=-1), ["initial_ring_slots"]),
    (dict(overlap_ratio=math.nan), ["overlap_ratio"]),
    (dict(overlap_ratio=math.inf), ["overlap_ratio"]),
    (dict(overlap_ratio=0.0), ["overlap_ratio"]),
    (dict(grow_evaluations=0), ["grow_evaluations must be >= 1"]),
    (dict(shrink_evaluations=0), ["shrink_evaluations must be >= 1"]),
    (dict(cooldown_evaluations=0), ["cooldown_evaluations must be >= 1"]),
    (dict(page_bytes=0), ["page_bytes"]),
    (dict(fixed_ring=1), ["fixed_ring"]),
    (dict(caches=((1, 3), (2, 2))), ["caches count 5 layers", "layers is 4"]),
    (dict(caches=((1, 3), (1, 1))), ["distinct"]),
    (dict(caches=((0, 3), (2, 1))), ["non-zero"]),
    (dict(caches=((1, 4), (2, 0))), ["cache 2 has 0 layers"]),
    (dict(caches=(5,)), ["pairs"]),
])
def test_invalid_config_refused(kw, words):
  with pytest.raises(PolicyError) as e:
    initialize(cfg(**kw))
  for w in words:
    assert w in str(e.value)
  assert isinstance(e.value, ValueError)


def test_caches_tag_every_layer_target_16_plus_mtp_1():
  """Target 16 + MTP 1 share one budget (178 pages: resident 10, ring 8); each layer is tagged
  with its cache and its index there. At 12 decode pages the deficit (12 - 10) * 17 = 34 goes to
  S = max(min(17, ceil(34 / 8)), ceil(34 / 12)) = 5 layers floor(j * 17 / 5) = 0, 3, 6, 10, 13
  (6 a layer, the first 4 one more); every other layer, the MTP layer too, holds all 12."""
  caches = P.model_caches(16, 1)
  assert caches == ((TARGET_CACHE, 16), (MTP_CACHE, 1))
  c = PolicyConfig(page_bytes=100, pool_bytes=17800, layers=17, caches=caches)
  d = step(c, initialize(c), decode(12))
  s = d.next
  assert (s.resident_pages_per_layer, s.ring_slots, s.decode_active_pages) == (10, 8, 12)
  assert not d.partition_changed and d.layout_changed and s.caches == caches
  lay = layout(c, s, 12 * PT)
  assert [(l.cache_id, l.cache_layer) for l in lay.layers] == [(1, i) for i in range(16)] + [(2, 0)]
  caps = {0: 5, 3: 5, 6: 5, 10: 5, 13: 6}
  assert lay.capacities == tuple(caps.get(i, 12) for i in range(17)) and sum(lay.capacities) == 170
  assert lay.streamed_layers == (0, 3, 6, 10, 13)
  assert [(l.streamed_pages, l.waves) for l in lay.layers if l.streamed_pages] == [(7, 1)] * 4 + [(6, 1)]
  mtp = lay.layers[16]
  assert (mtp.cache_id, mtp.capacity_pages, mtp.resident_live_pages, mtp.streamed_pages) == (MTP_CACHE, 12, 12, 0)
  # a state made for other caches is refused
  other = dataclasses.replace(c, caches=((TARGET_CACHE, 17),))
  with pytest.raises(PolicyError, match="caches"):
    step(other, s, decode(12))


# ---- state and observation checks ----------------------------------------------------

@pytest.mark.parametrize("change, word", [
    (dict(pages=51), "51 pages"),
    (dict(ring_slots=11), "ring_slots 11 != pages - resident"),
    (dict(resident_pages_per_layer=0, ring_slots=50), "must be >= 1"),
    (dict(resident_pages_per_layer=11, ring_slots=6), "below the minimum ring 10"),
    (dict(decode_active_pages=7), "decode_active_pages 7 must be 0 or > resident"),
    (dict(decode_active_pages=10), "decode_active_pages 10"),
    (dict(feedback_initialized=True, samples=3, misses=4), "4 misses for 3 samples"),
    (dict(feedback_initialized=True, layer_samples=(1, 1, 1, 1), layer_misses=(0, 2, 0, 0)),
     "layer 1 has 2 misses for 1 samples"),
    (dict(layer_samples=(1, 1), layer_misses=(0, 0)), "0 or 4"),
    (dict(caches=((1, 2), (2, 2))), "caches"),
    (dict(starved=-1), "starved"),
])
def test_state_check_refuses(change, word):
  c = cfg()
  s = dataclasses.replace(initialize(c), **change)
  with pytest.raises(PolicyError, match=word):
    step(c, s, decode(5))
  with pytest.raises(PolicyError, match=word):
    layout(c, s, 5 * PT)


def test_uninitialized_cursor_may_hold_any_totals():
  """Misses > samples only refuses an INITIALIZED feedback cursor (an invalid total leaves it
  uninitialized at 0 / 0, see test_invalid_feedback_totals_leave_cursor_uninitialized)."""
  c = cfg()
  s = dataclasses.replace(initialize(c), samples=3, misses=4)
  assert not step(c, s, decode(5)).partition_changed


def test_observation_check_refuses():
  c = cfg()
  s = initialize(c)
  with pytest.raises(PolicyError, match="query_tokens must be an int >= 1"):
    step(c, s, Observation(active_tokens=10, query_tokens=0))
  with pytest.raises(PolicyError, match="active_tokens"):
    step(c, s, Observation(active_tokens=-1, query_tokens=1))
  with pytest.raises(PolicyError, match="feedback.samples"):
    step(c, s, decode(5, feedback=Feedback(samples=-1)))
  with pytest.raises(PolicyError, match="0 or 4"):
    step(c, s, decode(5, feedback=Feedback(layer_samples=(1, 2), layer_misses=(0, 0))))
  with pytest.raises(PolicyError, match="layer counters"):
    step(c, s, decode(5, feedback=Feedback(layer_samples=(1, 2, 3, -1), layer_misses=(0,) * 4)))
  assert s == initialize(c)  # inputs are untouched


# ---- overlap target ----------------------------------------------------------

def test_overlap_target_values():
  c = cfg()  # 50 pages, 4 layers, cap 10
  assert overlap_target(c, 0) == 0
  assert overlap_target(c, 7) == 7              # fits: r == active
  assert overlap_target(c, 12) == 10            # 50 - 40 = 10 >= 1.1 * 2
  assert overlap_target(c, 20) == 9             # 14 >= 12.1; r = 10 gives 10 < 11
  assert overlap_target(c, 40) == 2             # 42 >= 41.8; r = 3: 38 < 40.7
  assert overlap_target(c, 10_000) == 0         # nothing qualifies
  # the step moves to T' = max(1, T) but reports T
  d = step(c, initialize(c), decode(10_000))
  assert d.target_resident_pages == 0 and d.next.resident_pages_per_layer == 1


def _brute_target(c, active):
  b = P.budget(c)
  hi = min(active, b.initial_resident_pages)
  best = 0
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


# ---- modes, pressure, decode active pages and rule (a) -------------------------------

def test_no_pressure_keeps_partition_and_clears_counters():
  c = cfg()
  s = dataclasses.replace(initialize(c), starved=2, overprovisioned=5, spread_streaming=True)
  d = step(c, s, decode(8))
  assert not d.partition_changed and d.next.resident_pages_per_layer == 10
  assert d.next.starved == 0 and d.next.overprovisioned == 0
  assert not d.next.spread_streaming and d.next.decode_active_pages == 0
  assert not d.layout_changed          # spread without decode pages holds R a layer either way
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
  # Same active count again, no feedback: nothing is evaluated (not even counted).
  d2 = step(c, n, decode(20))
  assert not d2.partition_changed and d2.next == n


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


def test_decode_active_pages_only_above_the_new_resident_count():
  """D = A when decoding and A > the new R, else 0: 9 decode pages under R 10 store 0, 12 store 12
  (R stays 10: T(12) = 10), 20 store 20 after rule (a) cut R to 9."""
  c = cfg()
  s = initialize(c)
  assert step(c, s, decode(9)).next.decode_active_pages == 0
  assert step(c, s, decode(12)).next.decode_active_pages == 12
  d = step(c, s, decode(20))
  assert (d.next.resident_pages_per_layer, d.next.decode_active_pages) == (9, 20)


def test_prefill_resets_decode_entry():
  c = cfg()
  n = step(c, initialize(c), decode(20)).next
  n = step(c, n, prefill(20)).next
  assert n.decode_active_pages == 0
  # Same active count, but after a prefill this is entering decode again.
  n = dataclasses.replace(with_resident(c, n, 10), evaluations_since_repartition=0)
  assert step(c, n, decode(20)).next.resident_pages_per_layer == 9


def test_spread_streaming_clears_when_decode_pages_drop_to_zero():
  c = cfg()
  s = with_resident(c, initialize(c), 8, spread_streaming=True, decode_active_pages=20)
  d = step(c, s, prefill(20))           # pressure, but no decode entry and no feedback: no rule
  assert not d.partition_changed and d.next.decode_active_pages == 0
  assert not d.next.spread_streaming and not d.layout_changed   # spread = R each = uniform


def test_capacity_profile_change_is_a_layout_change_without_repartition():
  """R 9 (ring 14) at 12 decode pages concentrates the deficit 12 into layer 0: (0, 12, 12, 12).
  At 13 pages R stays (T = 10 > 9) but the deficit 16 needs S = 2 layers, 0 and 2: (5, 13, 5, 13)."""
  c = cfg()
  s = with_resident(c, initialize(c), 9, decode_active_pages=12)
  assert capacities(c, s) == (0, 12, 12, 12)
  d = step(c, s, decode(13))
  assert not d.partition_changed and d.layout_changed
  assert capacities(c, d.next) == (5, 13, 5, 13)
  d = step(c, s, decode(12))
  assert not d.layout_changed


# ---- feedback: used, reset, repeated totals --------------------------------------------

def test_repeated_feedback_totals_never_train():
  """Resident 10 above the target 2 at 40 prefill pages: each NEW sample trains `starved`, the same
  totals again do nothing (no count, no evaluation); only the third real increase repartitions."""
  c = cfg()
  s = _primed(c, initialize(c), samples=100)
  seq = []
  for samples in (150, 150, 150, 200, 200, 250):
    d = step(c, s, prefill(40, feedback=_feed(0, samples, 0, 0.2)))
    s = d.next
    seq.append((d.feedback_used, d.feedback_reset, s.starved, s.resident_pages_per_layer))
  assert seq == [(True, False, 1, 10), (False, False, 1, 10), (False, False, 1, 10),
                 (True, False, 2, 10), (False, False, 2, 10), (True, False, 0, 2)]
  assert s.samples == 250 and s.ring_slots == 42 and not s.spread_streaming


def test_rule_b_starved_at_target_steps_down_and_spreads():
  c = cfg(cooldown_evaluations=2)
  s = step(c, initialize(c), decode(20)).next          # resident 9 == target, counters at 0
  d = step(c, s, decode(20, feedback=_feed(0, 0, 0, 0.2)))
  assert d.feedback_reset and not d.feedback_used      # the first feedback only sets the cursor
  s = d.next
  assert s.feedback_initialized and s.starved == 0
  changed = []
  for i in range(1, 4):   # 10 % misses, copy stream 20 % busy: starved; cooled at the 2nd
    d = step(c, s, decode(20, feedback=_feed(0, 100 * i, 10 * i, 0.2)))
    assert d.feedback_used
    s = d.next
    changed.append((d.partition_changed, s.evaluations_since_repartition))
  assert changed == [(False, 1), (False, 2), (True, 0)]
  assert s.resident_pages_per_layer == 8 and s.spread_streaming and s.ring_slots == 18
  assert capacities(c, s) == (8, 8, 8, 8)                 # spread: every layer streams D - R


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


def test_rule_b_waits_for_cooldown():
  c = cfg(cooldown_evaluations=5)
  s = _primed(c, initialize(c), evaluations_since_repartition=0, starved=5)
  for i in range(1, 5):     # used evaluations 1..4: not cooled
    d = step(c, s, prefill(40, feedback=_feed(0, 10 * i, 0, 0.2)))
    s = d.next
    assert not d.partition_changed and s.evaluations_since_repartition == i
  d = step(c, s, prefill(40, feedback=_feed(0, 50, 0, 0.2)))
  assert d.partition_changed and d.next.resident_pages_per_layer == 2


def test_rule_b_never_below_one_resident_page():
  c = cfg(cooldown_evaluations=1)
  s = _primed(c, with_resident(c, initialize(c), 1), starved=10)
  d = step(c, s, prefill(40, feedback=_feed(0, 100, 50, 0.1)))
  assert d.feedback_used and d.next.starved == 11
  assert not d.partition_changed and d.next.resident_pages_per_layer == 1


# ---- per-layer deadline counters ---------------------------------------------------------

def _layers(samples, misses, total_samples=None, total_misses=0, busy=0.2):
  return _feed(0, sum(samples) if total_samples is None else total_samples, total_misses, busy,
               layer_samples=tuple(samples), layer_misses=tuple(misses))


def test_layer_counters_give_the_miss_ratio_and_lift_the_cooldown():
  """After rule (a) the evaluations restart at 0 (cooldown 64). Layer counters 10 a layer, 1 miss
  in layer 0: m = 1 / 40 > 0.01 -> starved, and a starved signal from layer counters is cooled at
  once: R 9 -> 8 with spread streaming. The same totals without layer counters wait."""
  c = cfg(grow_evaluations=1)
  s = step(c, initialize(c), decode(20)).next
  s = _primed(c, s, layer_samples=(0,) * 4, layer_misses=(0,) * 4)
  d = step(c, s, decode(20, feedback=_layers((10, 10, 10, 10), (1, 0, 0, 0), total_misses=1)))
  assert d.feedback_used and d.partition_changed
  assert d.next.resident_pages_per_layer == 8 and d.next.spread_streaming
  assert (d.next.layer_samples, d.next.layer_misses) == ((10,) * 4, (1, 0, 0, 0))
  plain = _primed(c, step(c, initialize(c), decode(20)).next)
  d = step(c, plain, decode(20, feedback=_feed(0, 40, 1, 0.2)))
  assert d.feedback_used and d.next.starved == 1 and not d.partition_changed


def test_upload_level_misses_alone_do_not_grow_the_ring():
  c = cfg(grow_evaluations=1, cooldown_evaluations=1)
  s = _primed(c, step(c, initialize(c), decode(20)).next, layer_samples=(0,) * 4, layer_misses=(0,) * 4)
  d = step(c, s, decode(20, feedback=_layers((5, 5, 5, 5), (0,) * 4, total_samples=100, total_misses=50)))
  assert d.feedback_used and d.next.starved == 0 and not d.partition_changed


def test_layer_counters_from_the_cursor_count_when_the_feedback_has_none():
  """Once the cursor holds layer samples, feedback without them reads as every layer going back
  to 0: a reset."""
  c = cfg()
  s = _primed(c, initialize(c), samples=40, layer_samples=(10,) * 4, layer_misses=(0,) * 4)
  d = step(c, s, prefill(40, feedback=_feed(0, 60, 0, 0.2)))
  assert d.feedback_reset and d.next.layer_samples == ()


@pytest.mark.parametrize("samples, misses", [
    ((10, 9, 12, 12), (2, 0, 0, 0)),        # layer 1's samples went back (the total grew)
    ((12, 12, 12, 12), (1, 0, 0, 0)),       # layer 0's misses went back
    ((11, 11, 11, 11), (2, 5, 0, 0)),       # 5 new misses for 4 new samples
])
def test_layer_counter_going_backwards_or_overflowing_resets(samples, misses):
  c = cfg()
  s = _primed(c, initialize(c), samples=40, misses=2, starved=2, overprovisioned=1,
              layer_samples=(10,) * 4, layer_misses=(2, 0, 0, 0))
  d = step(c, s, prefill(40, feedback=_layers(samples, misses, total_misses=5)))
  assert d.feedback_reset and not d.feedback_used
  assert d.next.starved == 0 and d.next.overprovisioned == 0 and not d.partition_changed
  assert d.next.layer_samples == samples and d.next.layer_misses == misses


# ---- rule (c): shrink the ring ------------------------------------------------------

def test_rule_c_light_for_shrink_evaluations_grows_resident():
  c = cfg()
  s = _primed(c, with_resident(c, initialize(c), 9))     # ring 14 = min ring + layers
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
  s = _primed(c, with_resident(c, initialize(c), 9), overprovisioned=7)
  # peak ring use 7 of 14 slots is not below half the ring -> not light
  d = step(c, s, decode(12, feedback=_feed(0, 100, 0, 0.1, peak=7)))
  assert d.feedback_used and d.next.overprovisioned == 0 and not d.partition_changed
  d = step(c, s, decode(12, feedback=_feed(0, 100, 0, 0.5, peak=0)))  # busy not < 0.5
  assert d.next.overprovisioned == 0
  d = step(c, s, decode(12, feedback=_feed(0, 100, 0, 0.49, peak=6)))
  assert d.partition_changed and d.next.resident_pages_per_layer == 10


def test_rule_c_respects_cooldown():
  c = cfg()
  s = _primed(c, with_resident(c, initialize(c), 9), overprovisioned=7, evaluations_since_repartition=10)
  d = step(c, s, decode(12, feedback=_feed(0, 100, 0, 0.1)))
  assert not d.partition_changed and d.next.overprovisioned == 8


def test_fixed_ring_never_repartitions_nor_counts():
  c = cfg(fixed_ring=True)
  s = _primed(c, initialize(c))
  for i in range(1, 6):
    d = step(c, s, decode(40, feedback=_feed(0, 10 * i, 5 * i, 0.2)))
    s = d.next
    assert d.feedback_used and not d.partition_changed
  assert s.resident_pages_per_layer == 10 and s.starved == 0
  assert s.evaluations_since_repartition == COUNTER_MAX and s.samples == 50


def test_counters_saturate():
  c = cfg()
  s = _primed(c, with_resident(c, initialize(c), 1), starved=COUNTER_MAX)   # R 1: rule (b) cannot fire
  d = step(c, s, prefill(40, feedback=_feed(0, 10, 5, 0.2)))
  assert d.feedback_used and not d.partition_changed
  assert d.next.starved == COUNTER_MAX and d.next.evaluations_since_repartition == COUNTER_MAX


# ---- feedback resets -----------------------------------------------------------------

def test_first_feedback_resets_and_unavailable_is_ignored():
  c = cfg()
  s = initialize(c)
  d = step(c, s, decode(5, feedback=_feed(3, 40, 2, 0.3)))
  assert not d.feedback_used and d.feedback_reset
  n = d.next
  assert (n.feedback_initialized, n.feedback_epoch, n.samples, n.misses) == (True, 3, 40, 2)
  d = step(c, n, decode(5, feedback=Feedback(available=False, epoch=9, samples=0)))
  assert not d.feedback_used and not d.feedback_reset and d.next == n
  d = step(c, n, decode(5, feedback=_feed(3, 40, 2, 0.3)))   # no new samples
  assert not d.feedback_used and not d.feedback_reset


@pytest.mark.parametrize("fb", [
    _feed(1, 200, 20, 0.2),            # epoch change
    _feed(0, 50, 5, 0.2),              # samples decreased
    _feed(0, 200, 5, 0.2),             # misses decreased
    _feed(0, 200, 20, math.nan),       # NaN busy
    _feed(0, 200, 20, math.inf),       # infinite busy
    _feed(0, 200, 20, 1.5),            # busy > 1
    _feed(0, 200, 20, -0.1),           # busy < 0
    _feed(0, 105, 17, 0.2),            # 7 new misses out of 5 new samples
])
def test_feedback_reset_clears_counters_and_moves_the_cursor(fb):
  c = cfg()
  s = _primed(c, initialize(c), samples=100, misses=10, starved=2, overprovisioned=3)
  d = step(c, s, prefill(40, feedback=fb))
  assert d.feedback_reset and not d.feedback_used
  assert d.next.starved == 0 and d.next.overprovisioned == 0 and not d.partition_changed
  assert (d.next.feedback_epoch, d.next.samples, d.next.misses) == (fb.epoch, fb.samples, fb.misses)
  assert d.next.feedback_initialized
  # Without the reset the third above-target evaluation would have repartitioned.
  d = step(c, s, prefill(40, feedback=_feed(0, 200, 10, 0.2)))
  assert not d.feedback_reset and d.partition_changed


def test_invalid_feedback_totals_leave_cursor_uninitialized():
  """Feedback with more misses than samples resets, stores 0 / 0 and leaves the cursor
  uninitialized, so the next feedback resets too (it only sets the cursor)."""
  c = cfg()
  s = _primed(c, initialize(c), samples=100, misses=10, starved=2)
  d = step(c, s, prefill(40, feedback=_feed(0, 120, 130, 0.2)))
  n = d.next
  assert d.feedback_reset and not n.feedback_initialized and (n.samples, n.misses) == (0, 0)
  d = step(c, n, prefill(40, feedback=_feed(0, 150, 10, 0.2)))
  assert d.feedback_reset and d.next.feedback_initialized and d.next.samples == 150
  d = step(c, n, prefill(40, feedback=_layers((5, 5, 5, 5), (0, 6, 0, 0))))   # a layer's misses > samples
  assert d.feedback_reset and not d.next.feedback_initialized and d.next.layer_samples == ()


# ---- capacities and layout -----------------------------------------------------------------

def test_layout_without_pressure():
  c = cfg()
  lay = layout(c, initialize(c), 7 * PT)
  assert lay.deficit_pages == 0 and lay.splits == 0 and lay.waves == 0
  assert all((l.capacity_pages, l.resident_live_pages, l.streamed_pages, l.waves) == (10, 7, 0, 0)
             for l in lay.layers)


def test_layout_concentrated_streams_fewest_layers():
  c = cfg()
  s = with_resident(c, initialize(c), 9, decode_active_pages=15)    # ring 14
  # deficit (15 - 9) * 4 = 24: S = max(min(4, ceil(24 / 14)), ceil(24 / 15)) = 2 layers, 0 and 2,
  # 12 a layer streamed: they hold 3, the others all 15
  lay = layout(c, s, 15 * PT)
  assert lay.splits == 2 and lay.streamed_layers == (0, 2) and lay.waves == 2
  assert [(l.capacity_pages, l.resident_live_pages, l.streamed_pages, l.waves) for l in lay.layers] == \
      [(3, 3, 12, 1), (15, 15, 0, 0)] * 2
  # the remainder goes to the first layers: 3 layers of 7 pages, R 4 (ring 30), deficit 9 in 30
  # slots -> S = max(1, ceil(9 / 7)) = 2 layers (0 and 1), 5 and 4 streamed
  c3 = PolicyConfig(page_bytes=100, pool_bytes=4200, layers=3, initial_ring_slots=30)
  s3 = with_resident(c3, initialize(c3), 4, decode_active_pages=7)
  assert capacities(c3, s3) == (2, 3, 7)
  # a page grown past the profile's D streams from every layer's capacity: 16 pages here
  lay = layout(c, s, 16 * PT)
  assert [l.streamed_pages for l in lay.layers] == [13, 1, 13, 1]
  # S = L is uniform: R 9 at D 20 (deficit 44 in 14 slots: S = 4)
  assert capacities(c, with_resident(c, initialize(c), 9, decode_active_pages=20)) == (9,) * 4


def test_layout_spread_streams_every_layer():
  c = cfg()
  s = with_resident(c, initialize(c), 8, spread_streaming=True, decode_active_pages=30)  # ring 18
  lay = layout(c, s, 30 * PT)
  assert lay.splits == 4 and lay.streamed_layers == (0, 1, 2, 3) and lay.waves == 8
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
  d = draw(st.one_of(st.just(0), st.integers(r + 1, r + 80)))
  s = with_resident(c, s, r, spread_streaming=draw(st.booleans()) and d > 0, decode_active_pages=d)
  tokens = draw(st.one_of(st.just(d * PT), st.integers(0, 80 * PT)))
  return c, s, tokens


@settings(max_examples=300, deadline=None)
@given(layout_cases())
def test_layout_properties(case):
  c, s, tokens = case
  lay = layout(c, s, tokens)
  active = -(-tokens // PT)
  d, r, ring, L = s.decode_active_pages, s.resident_pages_per_layer, s.ring_slots, c.layers
  assert len(lay.layers) == L
  # conserves pages and never exceeds the pool
  assert lay.capacity_pages + lay.ring_slots == s.pages and sum(capacities(c, s)) == r * L
  assert lay.ring_slots >= s.minimum_ring_slots
  for l in lay.layers:
    assert l.resident_live_pages + l.streamed_pages == active
    assert l.resident_live_pages == min(active, l.capacity_pages)
    assert l.waves == -(-l.streamed_pages // ring)
  assert lay.streamed_pages == lay.deficit_pages and lay.waves == sum(l.waves for l in lay.layers)
  assert sum(1 for l in lay.layers if l.streamed_pages) == lay.splits
  if d > r and not s.spread_streaming:
    # at the profile's own length the deficit (D - R) * L is streamed by the fewest layers the
    # ring and D allow, no layer more than D pages, the others fully resident
    lay = layout(c, s, d * PT)
    deficit = (d - r) * L
    k = sum(1 for cap in capacities(c, s) if cap < d)
    assert lay.deficit_pages == deficit
    assert k == max(min(L, -(-deficit // ring)), -(-deficit // d)) or (k == 0 and deficit == 0)
    if k < L:
      assert all(l.capacity_pages in (d, d - deficit // k, d - deficit // k - 1) for l in lay.layers)
  else:
    assert capacities(c, s) == (r,) * L


@settings(max_examples=150, deadline=None)
@given(case=layout_cases(), obs=st.lists(st.tuples(
    st.integers(0, 80), st.sampled_from([1, 4, 32, 33, 256]), st.booleans(),
    st.integers(0, 30), st.floats(0, 1), st.integers(0, 50), st.integers(0, 3)), max_size=25))
def test_step_keeps_state_valid(case, obs):
  c, s, _ = case
  c = dataclasses.replace(c, cooldown_evaluations=2)
  samples = misses = 0
  for pages, q, uniform, new_misses, busy, peak, repeat in obs:
    samples += 30 if repeat else 0
    misses += new_misses if repeat else 0
    tokens = max(pages * PT, q)
    d = step(c, s, Observation(tokens, q, _feed(0, samples, misses, busy, peak), uniform))
    s = d.next
    assert 1 <= s.resident_pages_per_layer <= P.budget(c).initial_resident_pages
    assert s.ring_slots == s.pages - s.resident_pages_per_layer * c.layers
    assert s.ring_slots >= s.minimum_ring_slots
    assert s.decode_active_pages == 0 or s.decode_active_pages > s.resident_pages_per_layer
    assert not d.partition_changed or s.evaluations_since_repartition == 0
    assert not (d.feedback_used and d.feedback_reset)
    lay = layout(c, s, tokens)
    assert lay.capacity_pages + lay.ring_slots == s.pages


# ---- rebind on a grown or shrunk arena ---------------------------------------------------

def test_rebind_grown_pool():
  """50 -> 80 pages at 20 active pages: resident 18 (ring 8) is the overlap target; the fresh
  decode step keeps it and concentrates the deficit 8 into layer 0."""
  c = cfg()
  r = rebind(c, 8000, 20 * PT)
  s = r.decision.next
  assert r.config.pool_bytes == 8000 and c.pool_bytes == 5000
  assert (s.pages, s.resident_pages_per_layer, s.ring_slots, s.decode_active_pages) == (80, 18, 8, 20)
  assert not r.decision.partition_changed and r.decision.layout_changed
  assert not s.feedback_initialized and s.evaluations_since_repartition == COUNTER_MAX
  assert r.layout.capacities == (12, 20, 20, 20) and r.layout.streamed_layers == (0,)


def test_rebind_shrunk_pool():
  """50 -> 20 pages at 20 active pages: no resident count leaves an overlapping ring (T = 0), so
  the step moves to T' = 1 (ring 16) and every layer streams 19 pages in 2 waves."""
  c = cfg()
  r = rebind(c, 2000, 20 * PT)
  s = r.decision.next
  assert r.decision.target_resident_pages == 0 and r.decision.partition_changed
  assert (s.pages, s.resident_pages_per_layer, s.ring_slots) == (20, 1, 16)
  assert [(l.capacity_pages, l.streamed_pages, l.waves) for l in r.layout.layers] == [(1, 19, 2)] * 4


def test_rebind_refuses_a_pool_below_the_minimum():
  with pytest.raises(PolicyError, match="100 B missing"):
    rebind(cfg(), 400, 20 * PT)


# ---- prefill admission -----------------------------------------------------------------------

def test_prefill_admission_grows_the_ring():
  c = cfg()
  s = initialize(c)                                 # R 10, ring 10
  a = admit_prefill(c, s, prefill(12))              # 2 streamed a layer: 2.2 slots needed
  assert a.next == s and not a.partition_changed and a.required_ring_slots == pytest.approx(2.2)
  a = admit_prefill(c, s, prefill(20))              # 10 streamed: 11 > 10 -> R 9, ring 14 >= 12.1
  assert a.partition_changed and a.required_ring_slots == pytest.approx(11.0)
  n = a.next
  assert (n.resident_pages_per_layer, n.ring_slots, n.evaluations_since_repartition) == (9, 14, 0)
  assert admit_prefill(c, s, decode(20)).next == s  # decode: no admission rule


def test_prefill_admission_refusals():
  c = cfg(fixed_ring=True)
  with pytest.raises(PolicyError, match="needs 11 ring slots .*fixed ring has 10"):
    admit_prefill(c, initialize(c), prefill(20))
  c = cfg()
  # 100 pages: even R 1 leaves 46 slots for 1.1 x 99 = 108.9 -> 109
  with pytest.raises(PolicyError, match="109 slots.*leaves 46 .63 more pages needed"):
    admit_prefill(c, initialize(c), prefill(100))


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
  s = step(c, s, decode(20, feedback=w.roll())).next      # sets the cursor
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


def test_feedback_window_layer_counters():
  w = FeedbackWindow(layers=3)
  w.add(elapsed_ms=1.0, samples=2, layer_samples=(1, 0, 1), layer_misses=(1, 0, 0), misses=1)
  w.observe(elapsed_ms=2.0, copy_ms=0.0, bytes=0, timed_bytes=0, samples=3, misses=1,
            layer_samples=(1, 1, 1), layer_misses=(1, 0, 0))
  fb = w.roll()
  assert (fb.layer_samples, fb.layer_misses) == ((1, 1, 1), (1, 0, 0))
  before = dict(vars(w))
  for kw, word in ((dict(layer_samples=(1, 1), layer_misses=(0, 0)), "3 layers"),
                   (dict(layer_samples=(0, 0, 0), layer_misses=(0, 2, 0)), "layer 1: misses 2"),
                   (dict(layer_samples=(0, -1, 0), layer_misses=(0, 0, 0)), "cannot decrease")):
    with pytest.raises(PolicyError, match=word):
      w.add(elapsed_ms=1.0, **kw)
  with pytest.raises(PolicyError, match=r"layer_samples\[1\] decreased"):
    w.observe(elapsed_ms=1.0, copy_ms=0.0, bytes=0, timed_bytes=0, samples=3, misses=1,
              layer_samples=(1, 0, 1), layer_misses=(1, 0, 0))
  assert vars(w) == before
  w.new_epoch()
  assert w.feedback().layer_samples == (0, 0, 0)


# ---- thresholds: a step on each side of every threshold ------------------------------------------

# The thresholds as the reference design states them (docs/reference-design.md, "Policy"; the
# config's defaults for the counts and the overlap ratio). The boundary tests below take the values
# from here, not from `kvjax.streaming.policy_types`: a probe computed from the module's own constant
# would move with it, and a changed constant must flip a decision here.
DESIGN = dict(PAGE_TOKENS=256, DECODE_QUERY_ROWS=32, STARVED_MISS_RATIO=0.01, STARVED_COPY_BUSY=0.90,
              LIGHT_COPY_BUSY=0.50, LIGHT_PEAK_FRACTION=0.50, AUTO_RING_HINT=8, COUNTER_MAX=2**32 - 1)
DESIGN_DEFAULTS = dict(overlap_ratio=1.10, grow_evaluations=3, shrink_evaluations=8, cooldown_evaluations=64)
EPS = 0.02          # ratio thresholds are probed at value * (1 - EPS) and value * (1 + EPS)
NOT_THRESHOLDS = {"TARGET_CACHE", "MTP_CACHE"}   # cache ids


def big():
  """1,000 pages of 1 B, 4 layers, ring hint 200: R 200, minimum ring 200. Fine enough that a probe
  2 % past a threshold is another whole page, slot or evaluation count. At 300 active pages the
  overlap target is 200 (ring 200 >= 1.1 x 100 streamed)."""
  return PolicyConfig(page_bytes=1, pool_bytes=1000, layers=4, initial_ring_slots=200)


A_BIG = 300   # active pages of the feedback probes: target 200 at any overlap ratio <= 2


def _outcome(d):
  """What a step decided: (partition changed, new R, new ring, spread streaming)."""
  n = d.next
  return d.partition_changed, n.resident_pages_per_layer, n.ring_slots, n.spread_streaming


class TestThresholdBoundaries:
  """Every threshold of the policy (`policy_types`), probed just below and just above its value
  (and at it where the comparison is strict), asserting the decision: whether the partition
  changed, the new resident / ring split and the rule that made it. (a) cuts R to T', (b) at the
  target steps R down by 1 with spread streaming, (c) steps R up by 1; no rule keeps R."""

  NO_CHANGE_AT_TARGET = (False, 200, 200, False)
  RULE_B_SPREAD = (True, 199, 204, True)          # starved at the target: R - 1, spread on
  NO_CHANGE_BELOW_TARGET = (False, 199, 204, False)
  RULE_C_SHRINK = (True, 200, 200, False)         # light: R + 1, the ring 4 slots smaller

  def test_every_threshold_constant_has_a_boundary_test(self):
    """Every numeric constant of `policy_types` but the cache ids, and every count / ratio default
    of the config, has its design value above (and a boundary test below)."""
    from kvjax.streaming import policy_types
    numeric = {n for n, v in vars(policy_types).items()
               if n.isupper() and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert numeric - NOT_THRESHOLDS == set(DESIGN)
    defaults = {f.name for f in dataclasses.fields(PolicyConfig)
                if f.name.endswith("_evaluations") or f.name == "overlap_ratio"}
    assert defaults == set(DESIGN_DEFAULTS)

  # -- feedback signals: starved (rule b) and light (rule c) -----------------------------------

  def _at_target(self, c, **kw):
    """R 200 == the target at A_BIG decode pages (not entering decode), cooled, feedback cursor at
    0 / 0, `starved` one short of the grow count: a starved signal now fires rule (b)."""
    s = dataclasses.replace(initialize(c), decode_active_pages=A_BIG, starved=c.grow_evaluations - 1)
    return _primed(c, s, **kw)

  def _below_target(self, c, **kw):
    """R 199 < the target 200 (ring 204 = minimum ring + layers), cooled, `overprovisioned` one
    short of the shrink count: a light evaluation now fires rule (c)."""
    s = with_resident(c, initialize(c), 199, decode_active_pages=A_BIG,
                      overprovisioned=c.shrink_evaluations - 1)
    return _primed(c, s, **kw)

  def test_starved_miss_ratio(self):
    """Starved needs a miss ratio above STARVED_MISS_RATIO (the copy stream 20 % busy): 98 % and
    100 % of it keep R at the target, 102 % steps R down with spread streaming."""
    c, t = big(), DESIGN["STARVED_MISS_RATIO"]
    samples = 100_000
    got = []
    for ratio in (t * (1 - EPS), t, t * (1 + EPS)):
      d = step(c, self._at_target(c), decode(A_BIG, feedback=_feed(0, samples, round(ratio * samples), 0.2)))
      assert d.feedback_used and not d.feedback_reset
      got.append(_outcome(d))
    assert got == [self.NO_CHANGE_AT_TARGET, self.NO_CHANGE_AT_TARGET, self.RULE_B_SPREAD]

  def test_starved_copy_busy(self):
    """Misses (50 %) are starved only while the copy stream is below STARVED_COPY_BUSY: at 98 % of
    it R steps down, at 100 % and 102 % the copy stream has no headroom and R stays."""
    c, t = big(), DESIGN["STARVED_COPY_BUSY"]
    got = []
    for busy in (t * (1 - EPS), t, t * (1 + EPS)):
      d = step(c, self._at_target(c), decode(A_BIG, feedback=_feed(0, 1000, 500, busy)))
      assert d.feedback_used and not d.feedback_reset
      got.append(_outcome(d))
    assert got == [self.RULE_B_SPREAD, self.NO_CHANGE_AT_TARGET, self.NO_CHANGE_AT_TARGET]

  def test_light_copy_busy(self):
    """Light needs the copy stream below LIGHT_COPY_BUSY (no misses, no ring use): at 98 % of it the
    shrink count is reached and R grows by 1; at 100 % and 102 % it is not light and R stays."""
    c, t = big(), DESIGN["LIGHT_COPY_BUSY"]
    got = []
    for busy in (t * (1 - EPS), t, t * (1 + EPS)):
      d = step(c, self._below_target(c), decode(A_BIG, feedback=_feed(0, 1000, 0, busy, peak=0)))
      assert d.feedback_used
      got.append(_outcome(d))
    assert got == [self.RULE_C_SHRINK, self.NO_CHANGE_BELOW_TARGET, self.NO_CHANGE_BELOW_TARGET]

  def test_light_peak_fraction(self):
    """Light needs the peak ring use below LIGHT_PEAK_FRACTION of the ring (204 slots, copy stream
    10 % busy): 99 slots (98 %) is light and R grows; 102 (100 %) and 105 (102 %) are not."""
    c, t = big(), DESIGN["LIGHT_PEAK_FRACTION"]
    ring = self._below_target(c).ring_slots
    at = t * ring
    assert ring == 204 and at == int(at)
    peaks = (math.floor(at * (1 - EPS)), int(at), math.ceil(at * (1 + EPS)))
    assert peaks == (99, 102, 105)
    got = []
    for peak in peaks:
      d = step(c, self._below_target(c), decode(A_BIG, feedback=_feed(0, 1000, 0, 0.1, peak=peak)))
      assert d.feedback_used
      got.append(_outcome(d))
    assert got == [self.RULE_C_SHRINK, self.NO_CHANGE_BELOW_TARGET, self.NO_CHANGE_BELOW_TARGET]

  # -- the config's counts -------------------------------------------------------------------

  def test_grow_evaluations_default(self):
    """Rule (b) fires at the grow_evaluations-th starved evaluation in a row, not one before."""
    c, n = big(), DESIGN_DEFAULTS["grow_evaluations"]
    got = []
    for before in (n - 2, n - 1):     # starved after this evaluation: n - 1, n
      s = dataclasses.replace(self._at_target(c), starved=before)
      d = step(c, s, decode(A_BIG, feedback=_feed(0, 1000, 500, 0.2)))
      got.append(_outcome(d))
    assert got == [self.NO_CHANGE_AT_TARGET, self.RULE_B_SPREAD]

  def test_shrink_evaluations_default(self):
    """Rule (c) fires at the shrink_evaluations-th light evaluation in a row, not one before."""
    c, n = big(), DESIGN_DEFAULTS["shrink_evaluations"]
    got = []
    for before in (n - 2, n - 1):
      s = dataclasses.replace(self._below_target(c), overprovisioned=before)
      d = step(c, s, decode(A_BIG, feedback=_feed(0, 1000, 0, 0.1, peak=0)))
      got.append(_outcome(d))
    assert got == [self.NO_CHANGE_BELOW_TARGET, self.RULE_C_SHRINK]

  def test_cooldown_evaluations_default(self):
    """An upload-level starved signal waits for cooldown_evaluations evaluations since the last
    repartition: the (n - 1)-th keeps R, the n-th steps it down."""
    c, n = big(), DESIGN_DEFAULTS["cooldown_evaluations"]
    got = []
    for before in (n - 2, n - 1):     # evaluations after this one: n - 1, n
      s = self._at_target(c, evaluations_since_repartition=before)
      d = step(c, s, decode(A_BIG, feedback=_feed(0, 1000, 500, 0.2)))
      assert d.feedback_used
      got.append(_outcome(d))
    assert got == [self.NO_CHANGE_AT_TARGET, self.RULE_B_SPREAD]

  def test_overlap_ratio_default(self):
    """Entering decode, R 200 stays while its ring of 200 slots holds overlap_ratio x the pages a
    layer streams (A - 200): 178 streamed pages (ring / streamed = 102 % of the ratio) keep R,
    186 (98 %) cut it to the overlap target (rule a)."""
    c, ratio = big(), DESIGN_DEFAULTS["overlap_ratio"]
    ring = initialize(c).ring_slots
    keep, cut = math.floor(ring / (ratio * (1 + EPS))), math.ceil(ring / (ratio * (1 - EPS)))
    assert (ring, keep, cut) == (200, 178, 186)
    d = step(c, initialize(c), decode(200 + keep))
    assert d.target_resident_pages == 200 and _outcome(d) == (False, 200, 200, False)
    assert d.next.decode_active_pages == 200 + keep
    d = step(c, initialize(c), decode(200 + cut))
    assert d.target_resident_pages == 198 and _outcome(d) == (True, 198, 208, False)

  # -- geometry and modes ----------------------------------------------------------------------

  def test_page_tokens(self):
    """A page holds PAGE_TOKENS token positions: 381 pages' tokens keep R 200 on entering decode
    (ring 200 >= 1.1 x 181), one token more is page 382 and cuts R to the target 199."""
    c, pt = big(), DESIGN["PAGE_TOKENS"]
    d = step(c, initialize(c), Observation(381 * pt, 1))
    assert _outcome(d) == (False, 200, 200, False) and d.next.decode_active_pages == 381
    d = step(c, initialize(c), Observation(381 * pt + 1, 1))
    assert _outcome(d) == (True, 199, 204, False) and d.next.decode_active_pages == 382

  def test_decode_query_rows(self):
    """Up to DECODE_QUERY_ROWS query rows an evaluation is decode (entering it cuts R 200 to the
    target 198 at 386 pages, rule a); one row more is not, and nothing changes."""
    c, q = big(), DESIGN["DECODE_QUERY_ROWS"]
    got = []
    for rows in (q - 1, q, q + 1):
      d = step(c, initialize(c), Observation(386 * PT, rows))
      got.append(_outcome(d) + (d.next.decode_active_pages,))
    assert got == [(True, 198, 208, False, 386)] * 2 + [(False, 200, 200, False, 0)]

  def test_auto_ring_hint(self):
    """Without initial_ring_slots the ring starts at min(AUTO_RING_HINT, pages - layers): one layer
    with hint - 1, hint, hint + 1 and 10 x hint pages beyond its first."""
    h = DESIGN["AUTO_RING_HINT"]
    got = []
    for extra in (h - 1, h, h + 1, 10 * h):
      c = PolicyConfig(page_bytes=1, pool_bytes=1 + extra, layers=1)
      s = initialize(c)
      assert P.budget(c).ring_hint == s.minimum_ring_slots == s.ring_slots
      got.append((s.resident_pages_per_layer, s.ring_slots))
    assert got == [(1, h - 1), (1, h), (2, h), (9 * h + 1, h)]

  def test_counter_max(self):
    """`starved` and the evaluation count saturate at COUNTER_MAX (uint32): one below it counts up
    to it, at it they stay (R 1: rule (b) cannot fire, nothing repartitions)."""
    c, m = big(), DESIGN["COUNTER_MAX"]
    got = []
    for before in (m - 1, m):
      s = _primed(c, with_resident(c, initialize(c), 1, decode_active_pages=A_BIG), starved=before,
                  evaluations_since_repartition=before)
      d = step(c, s, decode(A_BIG, feedback=_feed(0, 1000, 500, 0.2)))
      assert d.feedback_used and not d.partition_changed
      got.append((d.next.starved, d.next.evaluations_since_repartition))
    assert got == [(m, m), (m, m)]
