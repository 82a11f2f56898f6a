"""Tests for kvjax.streaming.lease: the MTP ring lease loads the MTP layer's committed streamed pages,
byte for byte, into the last ring slots, and nothing else of the pool changes."""

import numpy as np
import pytest

from kvjax import config
from kvjax.engine import on_device
from kvjax.streaming import StreamConfig, StreamedKV
from kvjax_pallas.page_layout import PageLayout

PT = 16     # tokens a page


@pytest.fixture(scope="module")
def tiny():
  cfg = config.tiny()
  assert cfg.has_mtp and cfg.num_attention_layers == 2      # cache layers 0, 1 target, 2 MTP
  return cfg, PageLayout(cfg.num_kv_heads, cfg.head_dim, "q8_0", "q4_0", page_tokens=PT)


# (copy unit, resident pages a cache layer, pool pages, MTP committed tokens, lease end tokens)
CASES = {
    # units [2, 4) .. [6, 8) sealed as one piece whose page 2 is resident (travels, not placed);
    # the open unit [8, 10) holds full page 8 and partial page 9 (5 rows)
    "block_and_open_unit": (2, (2, 2, 3), 21, 9 * PT + 5, 200),
    # one sealed unit [2, 4) (page 2 resident), the open unit [4, 6): page 5 partial (1 row)
    "unit_and_open_unit": (2, (2, 2, 3), 21, 5 * PT + 1, 100),
    # no sealed page past the resident ones: only the partial page 5 (3 rows) of the open unit [4, 6)
    "open_unit_only": (2, (2, 2, 5), 21, 5 * PT + 3, 100),
    # 4-page units: sealed [0, 8) as one piece (pages 0 .. 2 resident), the open unit [8, 12):
    # page 9 partial (5 rows), pages 10 and 11 not written yet (uploaded with the unit, not placed)
    "partial_page_opens_a_unit": (4, (2, 2, 3), 25, 9 * PT + 5, 240),
    # a lease that ends at the committed tokens: its last slot is the pool's last page; the open
    # unit [8, 10) holds the partial page 8 (5 rows), page 9 lies past the lease and the pool
    "lease_ends_at_the_committed_tokens": (2, (2, 2, 3), 21, 8 * PT + 5, 8 * PT + 5),
    # 1-page units: two pieces of sealed pages [1, 17) and [17, 20), the open unit is the partial
    # page 20 (7 rows)
    "two_pieces_and_partial_page": (1, (1, 1, 1), 27, 20 * PT + 7, 340),
    # page-aligned: no open unit, sealed pages [2, 8) only
    "page_aligned": (2, (2, 2, 3), 21, 8 * PT, 200),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_lease_loads_the_committed_suffix_over_junk(tiny, case):
  """The pool is filled with non-zero junk, then the lease loads the MTP layer's committed pages
  [resident, content): every one equals the host history's page, the partial last page whole (the
  lease copies whole pages: its valid rows are the rows written, the rows past them the history's
  zero bytes, not the junk), and every other pool page keeps its junk: the resident regions, the
  target's ring slots before the lease, and the leased slots past the committed pages (the MTP's
  forwards write those)."""
  cfg, layout = tiny
  copy, caps, pool_pages, committed, end = CASES[case]
  kv = StreamedKV(cfg, layout, 25 * PT, StreamConfig(pool_pages, caps, copy), pinned=False)
  assert kv.copy_unit == copy and kv.ring_base == sum(caps)
  hist = kv.histories["mtp"]
  rng = np.random.default_rng(sum(map(ord, case)))
  k = rng.integers(0, 256, (committed, layout.k_row_bytes), np.uint8)
  v = rng.integers(0, 256, (committed, layout.v_row_bytes), np.uint8)
  hist.write_rows(0, 0, k, v)
  junk = rng.integers(1, 256, (pool_pages, layout.page_bytes), np.uint8)
  kv.pool_pn = on_device(junk)

  nbytes = kv.lease_mtp(end)

  cap, content, ring = caps[-1], layout.pages_for(committed), kv.stream.ring_slots
  ls = kv.lease
  assert ls is not None and (ls.layer, ls.end_tokens) == (2, end)
  assert ls.slots == layout.pages_for(end) - cap and ls.first_slot == ring - ls.slots
  assert nbytes > 0 and kv.counters["mtp_lease_bytes"] == nbytes and kv.counters["mtp_leases"] == 1
  pool = np.asarray(kv.pool_pn)
  first = kv.ring_base + ls.first_slot          # the slot of logical page `cap`
  for page in range(cap, content):
    np.testing.assert_array_equal(pool[first + page - cap], hist.pages_lpn[0, page],
                                  err_msg=f"{case}: logical page {page} in slot {ls.first_slot + page - cap}")
  rows = committed % PT
  if rows:                                      # the partial page: its rows, then the history's zeros
    got = pool[first + content - 1 - cap]
    lo = (content - 1) * PT
    kb, vb, vo = layout.k_row_bytes, layout.v_row_bytes, layout.v_offset
    np.testing.assert_array_equal(got[:rows * kb].reshape(rows, kb), k[lo:])
    np.testing.assert_array_equal(got[vo:vo + rows * vb].reshape(rows, vb), v[lo:])
    past = np.ones(layout.page_bytes, bool)
    past[:rows * kb] = past[vo:vo + rows * vb] = False
    assert not hist.pages_lpn[0, content - 1][past].any() and not got[past].any()
  untouched = np.ones(pool_pages, bool)
  untouched[first:first + content - cap] = False
  np.testing.assert_array_equal(pool[untouched], junk[untouched], err_msg=f"{case}: pages outside the lease")
