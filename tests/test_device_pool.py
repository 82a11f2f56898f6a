"""Tests for kvjax.streaming.device_pool on its own (no model): the regions a split lays out, the
valid resident prefixes a same-size re-split keeps (moved byte for byte), and the open region's
decisions (which pages a forward reads from it, what it holds after a forward)."""

import numpy as np

from kvjax.engine import on_device
from kvjax.streaming.budget import StreamConfig
from kvjax.streaming.device_pool import DevicePool
from kvjax_pallas.page_layout import PageLayout

LAYOUT = PageLayout(2, 64, "q8_0", "q4_0", page_tokens=4)


def test_bind_lays_out_regions_and_keeps_valid_prefixes():
  """Caps (4, 4, 2) in 14 pages: regions at 0, 4, 8, the ring at 10. Re-split to (2, 6, 2) in the
  same pool: each layer keeps min(valid, new cap) pages, moved to its new region; a pool of another
  size starts empty."""
  dev = DevicePool(LAYOUT, 3, 2, copy_unit=2)
  assert dev.bind(StreamConfig(14, (4, 4, 2), 2)) == 0
  assert list(dev.resident_base) == [0, 4, 8] and dev.ring_base == 10 and dev.pool_pn.shape == (14, LAYOUT.page_bytes)
  pool = np.zeros((14, LAYOUT.page_bytes), np.uint8)
  pool[:, :8] = np.arange(1, 15)[:, None]                  # page p holds bytes p + 1
  dev.pool_pn = on_device(pool)
  dev.resident_valid[:] = (3, 4, 1)
  dev.open_page[:] = (2, -1, -1)
  moved = dev.bind(StreamConfig(14, (2, 6, 2), 2))
  out = np.asarray(dev.pool_pn)
  assert list(dev.resident_valid) == [2, 4, 1] and list(dev.resident_base) == [0, 2, 8] and dev.ring_base == 10
  assert moved > 0 and list(dev.open_page) == [-1, -1, -1]
  np.testing.assert_array_equal(out[0:2, 0], [1, 2])       # layer 0: its first 2 pages stay
  np.testing.assert_array_equal(out[2:6, 0], [5, 6, 7, 8])  # layer 1: pages 4..7 moved to 2..5
  assert out[8, 0] == 9                                     # layer 2: in place
  dev.bind(StreamConfig(16, (2, 6, 2), 2))
  assert not np.asarray(dev.pool_pn).any() and not dev.resident_valid.any()


def test_open_split_open_held_and_commit():
  """A target layer with 6 resident pages and 2-page units streams its pages past them; a forward
  whose full pages end at 8 (pages [8, 10) open) keeps that unit in the open region (the last 2
  resident slots, whose pages 4, 5 stream instead) when the ring holds the pages between; the MTP
  layer never does; after `commit` the region holds the unit's rows."""
  dev = DevicePool(LAYOUT, 3, 2, copy_unit=2)
  dev.bind(StreamConfig(20, (6, 6, 6), 2))
  assert dev.split(0, 9) == (6, 3) and dev.split(0, 4) == (4, 0)
  assert dev.open_split(0, active=10, full=8, ring=8) == (4, 4, 8)     # pages 4..7 stream, 8..9 open
  assert dev.open_split(0, active=10, full=8, ring=3) == (6, 4, -1)    # the ring holds too few
  assert dev.open_split(2, active=10, full=8, ring=8) == (6, 4, -1)    # the MTP layer: no open region
  assert dev.open_split(0, active=5, full=4, ring=8) == (5, 0, -1)     # all resident
  assert not dev.open_held(0, full=8, pos=34)
  dev.commit(0, 4, 8, end_tokens=35)                                   # rows up to 35 in unit [8, 10)
  assert dev.resident_valid[0] == 4 and dev.open_page[0] == 8 and dev.open_rows[0] == 3
  assert dev.open_held(0, full=8, pos=35) and not dev.open_held(0, full=8, pos=36)
  dev.open_slots = False
  assert dev.open_split(0, active=10, full=8, ring=8) == (6, 4, -1)
  dev.forget()
  assert not dev.resident_valid.any() and (dev.open_page == -1).all()
