"""The MTP ring lease of the streamed provider (`StreamedKV` inherits it).

During the MTP's catch-up and drafting, the MTP layer's streamed suffix sits in ring slots at the
END of the ring, loaded once (`lease_mtp`), and its forwards read and write those slots without
staging anything; the target's layers get the ring before them. `release_lease` gives the whole
ring back (before the verify forward). The MTP's resident pages stay valid across rounds as always
(`resident_valid`); only the ring suffix is loaded again, once per lease.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from kvjax.engine import on_device, place_staged
from kvjax.streaming import staging


class MTPLease(NamedTuple):
  """Ring slots [first_slot, first_slot + slots) at the end of the ring, held by the MTP layer."""
  layer: int                         # the MTP's cache layer
  first_slot: int
  slots: int                         # pages of the MTP layer past its resident ones, to end_tokens
  end_tokens: int                    # the furthest its forwards may reach under this lease


class MTPLeaseMixin:
  """`StreamedKV`'s MTP ring lease (uses its histories, stream, pool and counters)."""


  @property
  def lease(self) -> Optional["MTPLease"]:
    return self._lease

  def lease_mtp(self, end_tokens: int) -> int:
    """Hold ring slots for the MTP layer's pages past its resident ones, up to `end_tokens` tokens
    (the furthest its forwards may reach before `release_lease`), and load its committed suffix
    into them in one pass (-> bytes uploaded). A suffix that does not fit the ring is not leased
    (counter `mtp_lease_refused`): the MTP layer then streams per forward as any layer."""
    if "mtp" not in self.histories:
      raise ValueError("lease_mtp: this model has no MTP layer")
    if self._lease is not None:
      raise RuntimeError("lease_mtp: the MTP layer already holds a ring lease (release_lease() first)")
    committed = int(self.histories["mtp"].tokens[0])
    end = min(int(end_tokens), self.max_tokens)
    if end < committed:
      raise ValueError(f"lease_mtp: end_tokens {end_tokens} is below the MTP's {committed} committed tokens")
    self._lease = MTPLease(self.n_layers - 1, 0, 0, end)
    nbytes = self._load_lease()
    if self._lease is not None:
      self.counters["mtp_leases"] += 1
    return nbytes

  def release_lease(self) -> None:
    """Give every ring slot back to the target (a no-op without a lease)."""
    self._lease = None        # the layout key holds the lease: the next forward lays out again

  def _leased(self, a: int) -> bool:
    return self._lease is not None and a == self._lease.layer

  def _target_ring(self) -> int:
    """Ring slots the layers other than a leased MTP layer may use: those before the lease."""
    return self.stream.ring_slots - (0 if self._lease is None else self._lease.slots)

  def _load_lease(self) -> int:
    """(Re)place the leased MTP layer's committed streamed pages [capacity, content) in slots at the
    end of the ring: the sealed copy units in the pieces a layer stages (`staging.unit_pieces`), the
    open unit as one pageable copy. Bytes = the suffix's pages, plus at most one copy unit before it
    and the open unit's unwritten pages. Drops the lease when the ring cannot hold it (after a rebind
    to a smaller ring, too)."""
    ls, lay, c = self._lease, self.layout, self.copy_unit
    hist = self.histories["mtp"]
    cap = self.stream.resident_pages_per_layer[ls.layer]
    slots = max(0, lay.pages_for(ls.end_tokens) - cap)
    self._shape_key = None
    if slots > self.stream.ring_slots:
      self._lease = None
      self.counters["mtp_lease_refused"] += 1
      return 0
    first = self.stream.ring_slots - slots
    committed = int(hist.tokens[0])
    content, full = lay.pages_for(committed), committed // lay.page_tokens
    sealed = full // c * c
    sources = []                      # (host array, its first page): the shapes of the layer stages
    for lo, hi in staging.unit_pieces(cap, sealed, c, self.piece_units):   # the pieces a layer stages
      sources.append((self._source_array(hist, 0, ("block", lo, hi) if hi - lo > c else ("unit", lo // c, 0)), lo))
    if content > max(sealed, cap):    # the open unit, pageable: the host rewrites it
      sources.append((staging.host_pages(hist, 0, sealed, sealed + c), sealed))
    nbytes = sum(int(x.nbytes) for x, _ in sources)
    if sources:
      held = sum(int(p[2].nbytes) for p in self._prefetch.values())
      slot0 = self.ring_base + first - cap           # the pool page of logical page 0 under the lease
      for x, lo in sources:                          # one piece staged at a time, placed at once
        arr = staging.to_device(x)
        self.counters["staging_peak_bytes"] = max(self.counters["staging_peak_bytes"], held + int(x.nbytes))
        rows = (max(lo, cap) - lo, min(lo + int(arr.shape[0]), content) - lo)
        self.pool_pn = place_staged(self.pool_pn, arr, on_device(staging.pieces_array([(slot0 + lo,) + rows])))
      self.counters["h2d_bytes"] += nbytes
      self.counters["h2d_calls"] += len(sources)
    self.counters["mtp_lease_bytes"] += nbytes
    self._lease = ls._replace(first_slot=first, slots=slots)
    return nbytes

  def _lease_plan(self, a: int, live: int, streamed: int) -> staging.LayerPlan:
    """The leased MTP layer's forward: its streamed pages are the lease's slots, in order; nothing
    stages (the committed ones were loaded by the lease, later ones are written by its forwards)."""
    plan, table = self._plan_and_table(a, live, self.ring_base + self._lease.first_slot + np.arange(streamed))
    return staging.LayerPlan(plan, on_device(table), None, (), -1, 0, 0)
