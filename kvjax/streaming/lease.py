"""The MTP ring lease, a part of the streamed provider (`StreamedKV.mtp_lease`).

During the MTP's catch-up and drafting, the MTP layer's streamed suffix sits in ring slots at the
END of the ring, loaded once (`StreamedKV.lease_mtp`), and its forwards read and write those slots
without staging anything; the target's layers get the ring before them. `release` gives the whole
ring back (before the verify forward). The MTP's resident pages stay valid across rounds as always
(`resident_valid`); only the ring suffix is loaded again, once per lease.

Its interface: `hold(end_tokens)` (which tokens the lease must cover), `load(pool, ...)` (place the
committed suffix, through the cache's `staging.Stager`), `release()`, `holds(layer)` and
`target_ring(ring_slots)` (the slots left to the target). Which pages go where is a pure function
(`lease_sources`).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

from kvjax.engine import on_device, place_staged
from kvjax.streaming import staging
from kvjax.streaming.host_history import HostHistory


class MTPLease(NamedTuple):
  """Ring slots [first_slot, first_slot + slots) at the end of the ring, held by the MTP layer."""
  layer: int                         # the MTP's cache layer
  first_slot: int
  slots: int                         # pages of the MTP layer past its resident ones, to end_tokens
  end_tokens: int                    # the furthest its forwards may reach under this lease


def lease_sources(layout, cap: int, committed: int, copy_unit: int, piece_units: int) -> List[Tuple]:
  """The stage sources of a lease over the MTP's `committed` tokens past its `cap` resident pages,
  in order: (("block", lo, hi) | ("unit", u, 0), first page) for the sealed copy units in the pieces a
  layer stages (`staging.unit_pieces`), then (("open", sealed, sealed + c), sealed): the open unit,
  from pageable memory (the host rewrites it)."""
  c = copy_unit
  content, full = layout.pages_for(committed), committed // layout.page_tokens
  sealed = full // c * c
  out = [(("block", lo, hi) if hi - lo > c else ("unit", lo // c, 0), lo)
         for lo, hi in staging.unit_pieces(cap, sealed, c, piece_units)]
  if content > max(sealed, cap):
    out.append((("open", sealed, sealed + c), sealed))
  return out


class RingLease:
  """The MTP layer's ring lease (`held`: an `MTPLease`, or None) over its host history."""

  def __init__(self, layer: int, history: HostHistory, layout, stager: staging.Stager):
    self.layer, self.history, self.layout, self.stager = layer, history, layout, stager
    self.held: Optional[MTPLease] = None

  def holds(self, cache_layer: int) -> bool:
    return self.held is not None and cache_layer == self.layer

  def target_ring(self, ring_slots: int) -> int:
    """Ring slots the layers other than a leased MTP layer may use: those before the lease."""
    return ring_slots - (0 if self.held is None else self.held.slots)

  def release(self) -> None:
    self.held = None

  def hold(self, end_tokens: int, max_tokens: int) -> None:
    """Ask for slots up to `end_tokens` tokens (the furthest the MTP's forwards may reach before
    `release`); `load` places them."""
    if self.held is not None:
      raise RuntimeError("lease_mtp: the MTP layer already holds a ring lease (release_lease() first)")
    committed = int(self.history.tokens[0])
    end = min(int(end_tokens), max_tokens)
    if end < committed:
      raise ValueError(f"lease_mtp: end_tokens {end_tokens} is below the MTP's {committed} committed tokens")
    self.held = MTPLease(self.layer, 0, 0, end)

  def load(self, pool, cap: int, ring_slots: int, ring_base: int, copy_unit: int, piece_units: int):
    """(Re)place the held lease's committed streamed pages [cap, content) in slots at the end of the
    ring -> (pool, bytes uploaded, or None when the ring cannot hold the lease: then it is dropped,
    after a rebind to a smaller ring too). Bytes = the suffix's pages, plus at most one copy unit
    before it and the open unit's unwritten pages."""
    ls, lay = self.held, self.layout
    slots = max(0, lay.pages_for(ls.end_tokens) - cap)
    if slots > ring_slots:
      self.held = None
      return pool, None
    first = ring_slots - slots
    committed = int(self.history.tokens[0])
    content = lay.pages_for(committed)
    sources = [(self.stager.source_array(self.history, 0, src) if src[0] != "open" else
                staging.host_pages(self.history, 0, src[1], src[2]), lo)
               for src, lo in lease_sources(lay, cap, committed, copy_unit, piece_units)]
    nbytes = sum(int(x.nbytes) for x, _ in sources)
    counters = self.stager.counters
    held = sum(int(p[2].nbytes) for p in self.stager.prefetched.values())
    slot0 = ring_base + first - cap                  # the pool page of logical page 0 under the lease
    for x, lo in sources:                            # one piece staged at a time, placed at once
      arr = staging.to_device(x)
      counters["staging_peak_bytes"] = max(counters["staging_peak_bytes"], held + int(x.nbytes))
      rows = (max(lo, cap) - lo, min(lo + int(arr.shape[0]), content) - lo)
      pool = place_staged(pool, arr, on_device(staging.pieces_array([(slot0 + lo,) + rows])))
    if sources:
      counters["h2d_bytes"] += nbytes
      counters["h2d_calls"] += len(sources)
    counters["mtp_lease_bytes"] += nbytes
    self.held = ls._replace(first_slot=first, slots=slots)
    return pool, nbytes
