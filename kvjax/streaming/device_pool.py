"""The device pool of a streamed cache, a part of `StreamedKV` (`StreamedKV.device`).

One buffer `pool_pn [pool_pages, page_bytes]` (uint8):

    [ resident region of cache layer 0 | ... | of cache layer L-1 | ring slots ... ]

It knows where each cache layer's resident region starts (`resident_base`) and the ring
(`ring_base`), how many of a layer's resident pages hold its valid rows (`resident_valid`: the
device mirror of the host history's prefix), and each target layer's open region: the last copy
unit of its resident region, which holds the copy unit its rows are written to (`open_page`: the
unit's first logical page, -1 for none; `open_rows`: the rows of it the device holds), so that a
decode forward uploads neither the open unit nor the partial page.

Its interface: `bind(stream)` (a new split: a pool of the same size keeps each layer's valid prefix,
moved to its new region (`relocate`); a new pool starts empty), `split` / `open_split` (which of a
layer's pages a forward reads from its resident region, the open region and the ring),
`open_held`, `commit` (what a finished forward leaves on the device) and `forget` (a new request).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax.numpy as jnp
import numpy as np

from kvjax.engine import on_device
from kvjax.streaming import relocate
from kvjax.streaming.budget import StreamConfig


class DevicePool:
  """Resident regions and the ring of one pool buffer (`n_layers` cache layers, the first
  `n_target` the target's: only those have an open region)."""

  def __init__(self, layout, n_layers: int, n_target: int, copy_unit: int):
    self.layout, self.n_target, self.copy_unit = layout, n_target, int(copy_unit)
    self.pool_pn = None
    self.stream: Optional[StreamConfig] = None
    self.resident_base = np.zeros((n_layers,), np.int64)
    self.ring_base = 0
    self.resident_valid = np.zeros((n_layers,), np.int64)  # valid prefix pages on the device
    self.open_page = np.full((n_layers,), -1, np.int64)
    self.open_rows = np.zeros((n_layers,), np.int64)
    self.open_slots = True          # the open region in use (off: every streamed page streams)

  def bind(self, stream: StreamConfig) -> int:
    """Lay out resident regions and the ring in a pool of `stream.pool_pages` -> pages moved."""
    caps = stream.resident_pages_per_layer
    base = np.concatenate([[0], np.cumsum(caps)[:-1]]).astype(np.int64)
    moved = 0
    if self.pool_pn is None or int(self.pool_pn.shape[0]) != stream.pool_pages:
      self.pool_pn = None  # free the old buffer before taking the new one
      self.pool_pn = on_device(jnp.zeros((stream.pool_pages, self.layout.page_bytes), jnp.uint8))
      self.resident_valid[:] = 0
    else:
      keep = np.minimum(self.resident_valid, np.asarray(caps, np.int64))
      self.pool_pn, moved = relocate.keep_prefixes(self.pool_pn, self.resident_base, base, keep,
                                                   self.layout.page_bytes)
      self.resident_valid[:] = keep
    self.stream, self.resident_base, self.ring_base = stream, base, stream.resident_total
    self.open_page[:] = -1
    return moved

  def forget(self) -> None:
    """A new request: no valid resident page, no open region in use."""
    self.resident_valid[:] = 0
    self.open_page[:] = -1

  def split(self, a: int, active: int) -> Tuple[int, int]:
    """(resident live pages, streamed pages) of cache layer a with `active` pages."""
    live = min(self.stream.resident_pages_per_layer[a], active)
    return live, active - live

  def open_pages(self, a: int) -> int:
    """The open region's pages: one copy unit, or one page where the resident region is smaller (then
    the open unit's full pages stream, and only the partial page stays on the device)."""
    return self.copy_unit if self.stream.resident_pages_per_layer[a] >= self.copy_unit else 1

  def open_split(self, a: int, active: int, full: int, ring: int) -> Tuple[int, int, int]:
    """-> (resident live pages, ring pages, first page of the open unit or -1) of cache layer a in a
    forward over `active` pages whose first `full` are full (`ring`: the slots the layer may use).

    A layer that streams without copy waves keeps its open copy unit on the device: the open region
    (the last `open_pages` slots of its resident region) holds the unit of the forward's first
    written page instead of resident pages [cap - o, cap), which stream instead. The rows written
    stay there, so a decode forward uploads neither the open unit nor the partial page, and a page
    that fills needs no new pinned mirror. The forward's pages must lie in that unit, past the
    resident prefix. The target's layers only: the MTP layer's forwards run under its ring lease."""
    cap = self.stream.resident_pages_per_layer[a]
    if active <= cap:
      return active, 0, -1
    o = self.open_pages(a)
    first = full // o * o
    if self.open_slots and cap >= 1 and a < self.n_target and first >= cap - o \
        and active <= first + o and first - (cap - o) <= ring:
      return cap - o, first - (cap - o), first
    return cap, active - cap, -1

  def open_held(self, a: int, full: int, pos: int) -> bool:
    """Does layer a's open region hold the committed rows (up to `pos`) of the open unit of a forward
    whose first `full` pages are full?"""
    o = self.open_pages(a)
    first = full // o * o
    return bool(self.open_page[a] == first and self.open_rows[a] >= pos - first * self.layout.page_tokens)

  def commit(self, a: int, live: int, open_page: int, end_tokens: int) -> None:
    """After a forward: layer a's first `live` resident pages hold valid rows, and its open region
    (`open_page` >= 0) the rows of its open unit up to `end_tokens`."""
    self.resident_valid[a] = live
    if open_page >= 0:
      self.open_page[a] = open_page
      self.open_rows[a] = end_tokens - open_page * self.layout.page_tokens
