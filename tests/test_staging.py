"""Tests for kvjax.streaming.staging's parts on their own (no model): `stage_layout` (which host
arrays carry a layer's streamed pages and where their rows go), `Stager` (stages issued and taken,
the prefetched block reused or dropped, refills placed, the bytes it accounts for) and the lease's
sources (`kvjax.streaming.lease.lease_sources`)."""

import numpy as np
import pytest

from kvjax.engine import on_device
from kvjax.streaming import staging
from kvjax.streaming.host_history import HostHistory
from kvjax.streaming.lease import lease_sources
from kvjax.streaming.staging import LayerPlan, Stager, stage_layout
from kvjax_pallas.page_layout import PageLayout

LAYOUT = PageLayout(2, 64, "q8_0", "q4_0", page_tokens=4)
PB = LAYOUT.page_bytes


def counters():
  return dict(h2d_bytes=0, h2d_calls=0, staging_peak_bytes=0, prefetch_hits=0, prefetch_dropped=0)


def history(tokens, copy_pages=2, max_pages=40):
  """A one-layer history whose every committed row is distinct bytes."""
  h = HostHistory("target", LAYOUT, 1, max_pages, copy_pages, pinned=False)
  rng = np.random.default_rng(tokens)
  h.write_rows(0, 0, rng.integers(1, 256, (tokens, LAYOUT.k_row_bytes), np.uint8),
               rng.integers(1, 256, (tokens, LAYOUT.v_row_bytes), np.uint8))
  return h


def test_stage_layout_sealed_pieces_open_unit_and_tail():
  """Pages [3, 13) streamed to pool pages 100.. (2-page units): the sealed units [2, 10) in one
  block whose page 2 travels unplaced, the open unit [10, 12) whole, the partial page 12 alone."""
  live, phys = 3, 100 + np.arange(10)
  sources, pieces, tail = stage_layout(live, phys, need=13, full=12, copy_unit=2, piece_units=16)
  assert sources == (("block", 2, 10), ("unit", 5, 0)) and tail == 12
  np.testing.assert_array_equal(pieces[0], [[99, 1, 8]])      # rows 1..8 of the block -> pool 100..
  np.testing.assert_array_equal(pieces[1], [[107, 0, 2]])     # the open unit [10, 12) -> pool 107, 108
  np.testing.assert_array_equal(pieces[2], [[109, 0, 1]])     # the partial page -> pool 109


def test_stage_layout_held_open_region_and_wrap():
  """With the open unit held on the device (`held_from`), only sealed units stage and no tail; a
  ring run that wraps splits in two destination runs (k=2) and is refused with k=1; sealed units
  come in power-of-two pieces (3 units: a block of 2 and a unit)."""
  live, phys = 2, np.array([10, 11, 12, 13, 0, 1, 2, 3, 4])     # the ring wraps after pool page 13
  sources, pieces, tail = stage_layout(live, phys, need=11, full=10, copy_unit=2, piece_units=16,
                                       held_from=10, k=2)
  assert sources == (("block", 2, 10),) and tail == -1
  np.testing.assert_array_equal(pieces[0], [[10, 0, 4], [-4, 4, 8]])   # rows 0..4 -> 10.., 4..8 -> 0..
  with pytest.raises(AssertionError, match="wrap"):
    stage_layout(live, phys, need=11, full=10, copy_unit=2, piece_units=16, held_from=10, k=1)
  sources, _, _ = stage_layout(live, 20 + np.arange(7), need=8, full=8, copy_unit=2, piece_units=16)
  assert sources == (("block", 2, 6), ("unit", 3, 0))
  assert stage_layout(4, np.arange(0), need=4, full=4, copy_unit=2, piece_units=16) == ((), None, -1)


def test_stager_issue_take_and_prefetch():
  """A stage is issued (bytes counted) and taken once; a prefetched first block is reused by the
  next issue of that layer (a hit, not copied again), another source drops it."""
  h, c = history(41), counters()
  st = Stager(LAYOUT, 2, False, c)
  plan = LayerPlan(None, None, None, (("block", 2, 6), ("unit", 4, 0)), 10, 0, 0)
  nbytes = st.issue(0, h, 0, plan)
  assert nbytes == (4 + 2 + 1) * PB == c["h2d_bytes"] and c["h2d_calls"] == 3
  stage = st.take(0)
  assert len(stage) == 3 and st.held_bytes == nbytes and st.take(0) is None
  np.testing.assert_array_equal(np.asarray(stage[0]), h.pages_lpn[0, 2:6])
  np.testing.assert_array_equal(np.asarray(stage[2]), h.pages_lpn[0, 10:11])
  st.prefetch(0, h, 0, ("block", 2, 6))
  assert c["h2d_calls"] == 4 and st.prefetched[0][1] == 6
  st.issue(0, h, 0, plan)                                  # the block comes from the prefetch
  assert c["prefetch_hits"] == 1 and c["h2d_calls"] == 6 and not st.prefetched
  np.testing.assert_array_equal(np.asarray(st.take(0)[0]), h.pages_lpn[0, 2:6])
  st.prefetch(0, h, 0, ("unit", 1, 0))
  st.issue(0, h, 0, plan)                                  # another first source: dropped
  assert c["prefetch_dropped"] == 1 and c["prefetch_hits"] == 1
  st.prefetch(1, h, 0, ("unit", 1, 0))
  st.drop_prefetch(lambda a, hi: hi > 4)                   # a block ending at page 4 stays
  assert 1 in st.prefetched
  st.drop_prefetch()
  assert not st.prefetched and c["prefetch_dropped"] == 2


def test_stager_refills_place_pages_and_let_go():
  """Refill uploads of pages [1, 7) of a 2-page-unit history (page 6 partial) land at pool pages
  10.. byte for byte; the refill bytes are live until placed; the peak counts them."""
  h, c = history(26), counters()
  st = Stager(LAYOUT, 2, False, c)
  staged = st.upload(h, 0, 1, 7)
  assert st.refill_bytes == sum(int(s.array.nbytes) for s in staged) > 0
  assert c["staging_peak_bytes"] >= st.refill_bytes
  pool = on_device(np.zeros((20, PB), np.uint8))
  pool = np.asarray(st.place(pool, staged, lambda p: 9 + p))
  assert st.refill_bytes == 0
  np.testing.assert_array_equal(pool[10:16], h.pages_lpn[0, 1:7])
  assert not pool[:10].any() and not pool[16:].any()


def test_lease_sources_are_the_pieces_a_layer_stages():
  """The MTP's committed suffix past 3 resident pages, 2-page units, 9 pages + 2 rows committed: the
  sealed units [2, 8) in power-of-two pieces (page 2 travels unplaced), then the open unit [8, 10)."""
  srcs = lease_sources(LAYOUT, 3, 9 * 4 + 2, 2, 16)
  assert srcs == [(("block", 2, 6), 2), (("unit", 3, 0), 6), (("open", 8, 10), 8)]
  assert lease_sources(LAYOUT, 3, 8 * 4, 2, 16) == srcs[:2]                          # page-aligned
  assert lease_sources(LAYOUT, 10, 9 * 4 + 2, 2, 16) == []                            # all resident
  assert staging.staged_shapes(2, 4, False) == [(1, 1), (2, 1), (4, 1), (8, 1)]
