"""Staging for the streamed provider: the arrays on their way to the device and where they go.

* `to_device`: every host-to-device copy of a streamed cache (a pinned_host array or numpy pages
  -> a device array); the fault-injection tests replace it (`experiments.lib.faults`).
* `Staged`, `Wave`, `LayerPlan`: what a forward stages, a copy wave, one cache layer's cached part of
  a forward.
* `unit_pieces`, `piece_units`, `piece_sizes`: the staged arrays' fixed set of shapes (16 copy
  units and the powers of two below); `pack_rows`: the forward's new rows packed into one
  device-to-host copy.
* `ResidentRefillMixin`: resident pages the device does not hold yet (first forwards, after a
  rebind), uploaded in unit-aligned pieces and placed run by run.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.engine import place_staged, default_device, on_device
from kvjax.streaming.host_history import HostHistory
from kvjax.streaming.span_plan import SpanPlan


PIECE_BYTES = 64 << 20   # the largest staged piece: copies of this size run at the link's speed


def piece_units(copy_pages: int, page_bytes: int, pool_pages: int) -> int:
  """The most copy units one staged piece holds: at most `PIECE_BYTES`, at most the pool and at most
  `MAX_PIECE_UNITS` (fixed for a cache's life, so that the set of staged shapes is too)."""
  cap = min(PIECE_BYTES // max(1, copy_pages * page_bytes), pool_pages // max(1, copy_pages), MAX_PIECE_UNITS)
  return max(1, int(cap))


MAX_PIECE_UNITS = 16   # the largest staged piece in copy units (pieces of 16, 8, 4, 2, 1 units and one page)


def unit_pieces(first: int, end: int, copy_pages: int, max_units: int) -> List[Tuple[int, int]]:
  """The copy units that cover pages [first, end) (`end` a multiple of `copy_pages`), from the unit
  holding `first` on, as pieces of `max_units` whole units and the rest in pieces of powers of two
  units, largest first: -> page ranges [(lo, hi)]. Every staged array then has one of the few
  shapes `piece_sizes` lists, whatever the history's length, so the placements compile once
  (`kvjax.engine.Runner.place`: 6 programs for 16-unit pieces, not 16), and a layer streams in few
  large copies; the pages of the first unit before `first` travel along unplaced (at most
  copy_pages - 1)."""
  c = int(copy_pages)
  out, u, end_u = [], int(first) // c, int(end) // c
  while u < end_u:
    n = min(int(max_units), end_u - u)
    if n < max_units:
      n = 1 << (n.bit_length() - 1)     # the largest power of two within the rest
    out.append((u * c, (u + n) * c))
    u += n
  return out


def piece_sizes(max_units: int) -> List[int]:
  """The copy units a piece of `unit_pieces` can hold: `max_units` and the powers of two below it."""
  return sorted({int(max_units)} | {1 << i for i in range(int(max_units).bit_length()) if 1 << i < max_units})


def host_pages(hist: HostHistory, l: int, lo: int, hi: int) -> np.ndarray:
  """Numpy pages [lo, hi) of one layer, zeros past the history's end (a fixed staged shape)."""
  arr = hist.pages_lpn[l, lo:hi]
  if arr.shape[0] < hi - lo:
    arr = np.concatenate([arr, np.zeros((hi - lo - arr.shape[0], arr.shape[1]), np.uint8)])
  return np.ascontiguousarray(arr)


def pieces_array(runs) -> np.ndarray:
  """[(base, lo, hi)] destination runs of one staged array -> int32 [k, 3] (`place_rows`)."""
  return np.asarray(runs, np.int32).reshape(-1, 3)


@jax.jit
def pack_rows(rows):
  """{layer: KVRows} -> one uint8 array [layers, S, k_row_bytes + v_row_bytes]: one device-to-host
  copy for the whole forward instead of two a layer."""
  return jnp.stack([jnp.concatenate([r.k_sn, r.v_sn], axis=1) for r in rows], axis=0)


class Staged(NamedTuple):
  """Pages on their way to the device: `count` logical pages from `first`, at `offset` in `array`."""
  array: jax.Array
  offset: int
  first: int
  count: int


def to_device(src):
  """Host pages (numpy, or a pinned_host jax array) -> a device array (async copy)."""
  if isinstance(src, jax.Array):
    return jax.device_put(src, src.sharding.with_memory_kind("device"))
  return jax.device_put(src, default_device())


class Wave(NamedTuple):
  """One copy wave of a layer whose streamed pages exceed the ring (`_wave_layout`)."""
  tiles: Tuple[int, int]             # logical pages [lo, hi) attended by this wave
  table_t: jax.Array                 # device [max_pages] int32: the wave's pages -> pool pages
  pieces: Optional[Tuple[jax.Array, ...]]   # (device [1, 3] int32,), None when nothing stages
  first: int                         # first logical page of the wave's streamed pages
  count: int                         # pages staged (placed at ring slots 0..count-1)
  units: Tuple[Tuple[str, int, int], ...] = ()   # the stage's host sources (`_stage_layout`)
  tail_page: int = -1                # a partial page uploaded from pageable memory, or -1


class LayerPlan(NamedTuple):
  """One cache layer's part of a forward: cached on the device while the forward's shape holds."""
  plan: Optional[SpanPlan]           # None for a layer in copy waves (one table a wave)
  table_t: jax.Array                 # device [max_pages] int32
  pieces: Optional[Tuple[jax.Array, ...]]   # per staged array device [k, 3] int32; None: nothing stages
  units: Tuple[Tuple[str, int, int], ...]  # the stage's host sources, in order (`_stage_layout`)
  tail_page: int                     # a partial page uploaded from pageable memory, or -1
  streamed: int
  wraps: int
  waves: Tuple[Wave, ...] = ()      # copy waves (empty: one attention call, the common case)
  open_page: int = -1                # the logical page written in the layer's open slot, or -1






def plans_on_device(plans: Dict[int, LayerPlan]) -> Dict[int, LayerPlan]:
  """The layout's host arrays (page tables, placement pieces; of every layer and wave) on the
  device in one transfer call, the plans rebuilt around them."""
  host, index = [], {}

  def take(x):                       # -> the index of a host array in `host`, or x as it is
    if isinstance(x, np.ndarray):
      if id(x) not in index:         # a wave's table is its layer's too: one device array
        index[id(x)] = len(host)
        host.append(x)
      return index[id(x)]
    return x

  def swap(lp):
    pieces = None if lp.pieces is None else tuple(take(x) for x in lp.pieces)
    waves = tuple(w._replace(table_t=take(w.table_t), pieces=None if w.pieces is None else
                             tuple(take(x) for x in w.pieces)) for w in lp.waves)
    return lp._replace(table_t=take(lp.table_t), pieces=pieces, waves=waves)

  marked = {a: swap(lp) for a, lp in plans.items()}
  dev = on_device(host)
  put = lambda x: dev[x] if isinstance(x, int) else x   # pylint: disable=unnecessary-lambda-assignment

  def back(lp):
    waves = tuple(w._replace(table_t=put(w.table_t), pieces=None if w.pieces is None else
                             tuple(put(x) for x in w.pieces)) for w in lp.waves)
    return lp._replace(table_t=put(lp.table_t), pieces=None if lp.pieces is None else
                       tuple(put(x) for x in lp.pieces), waves=waves)

  return {a: back(lp) for a, lp in marked.items()}


def contiguous_runs(phys: np.ndarray):
  """[(i, j)]: the maximal index ranges of `phys` whose values rise by one (contiguous pool pages)."""
  if len(phys) == 0:
    return []
  cut = np.flatnonzero(np.diff(phys) != 1) + 1
  return list(zip(np.concatenate([[0], cut]).tolist(), np.concatenate([cut, [len(phys)]]).tolist()))


def compact_capacities(caps) -> str:
  """Resident capacities per cache layer as runs, "count x pages": (12, 12, 12, 0) -> "3x12,1x0"."""
  runs = []
  for c in caps:
    if runs and runs[-1][1] == c:
      runs[-1][0] += 1
    else:
      runs.append([1, c])
  return ",".join(f"{n}x{c}" for n, c in runs)


class ResidentRefillMixin:
  """`StreamedKV`'s resident refills (uses its histories, counters, split and pool)."""

  def _fill_resident(self, a: int, pool):
    """Upload resident pages holding committed tokens that the device does not hold yet
    (first forwards, and after a rebind: the resident mirror is rebuilt from the host), in
    unit-aligned pieces whose staging fits one staging unit (`staging_unit_pages`)."""
    hist, l = self.history_of(a)
    live = self._open_split(a)[0]
    need = min(live, self._content)
    first = int(self.resident_valid[a])
    base = int(self.resident_base[a])
    c = self.copy_unit
    piece = max(c, (self.staging_unit - c) // c * c)   # unit-aligned pieces: staging <= one unit
    while first < need:
      end = min(need, (first // piece + 1) * piece)
      pool = self._place(pool, self._upload(hist, l, first, end), lambda p: base + p)
      self.pool_pn = pool    # the old buffer was donated: the live one stays even if a later copy fails
      first = end
    return pool

  def _upload(self, hist: HostHistory, l: int, lo: int, hi: int) -> List[Staged]:
    """Host->device copies of logical pages [lo, hi) outside the compiled steps (resident refills):
    whole pinned copy units where the history has them, pageable numpy for the partial tail page(s),
    padded to one copy unit, so every staged array has a shape of the layers' stages."""
    c, pb = hist.copy_pages, self.layout.page_bytes
    staged = []
    page = lo
    while page < hi:
      chunk = page // c
      end = min(hi, (chunk + 1) * c)
      arr, valid = hist.pinned_chunk(l, chunk)
      pinned_end = min(end, chunk * c + valid) if arr is not None else page
      if pinned_end > page:
        staged.append(Staged(to_device(arr), page - chunk * c, page, pinned_end - page))
        self.counters["h2d_bytes"] += c * pb
        self.counters["h2d_calls"] += 1
      if end > pinned_end:      # pageable: the rest of the unit, padded to one unit (one shape)
        n = end - pinned_end
        src = hist.pages_lpn[l, pinned_end:pinned_end + c]
        if src.shape[0] < c:
          src = np.concatenate([src, np.zeros((c - src.shape[0], pb), np.uint8)])
        staged.append(Staged(to_device(src), 0, pinned_end, n))
        self.counters["h2d_bytes"] += c * pb
        self.counters["h2d_calls"] += 1
      page = end
    self._staging_live += sum(int(st.array.nbytes) for st in staged)
    self.counters["staging_peak_bytes"] = max(self.counters["staging_peak_bytes"],
                                              self._held_bytes + self._staging_live)
    return staged

  def _place(self, pool, staged: List[Staged], dst: Callable[[int], int]):
    """Copy staged pages into the pool at `dst(logical page)` (consecutive pages to consecutive
    pool pages): one placement call a staged array, the compiled one of the layer steps."""
    for st in staged:
      base = dst(st.first) - st.offset
      pool = place_staged(pool, st.array, on_device(pieces_array([(base, st.offset, st.offset + st.count)])))
    self._staging_live -= sum(int(st.array.nbytes) for st in staged)   # placed: buffers let go
    return pool


class SourcesMixin:
  """`StreamedKV`'s stage sources (which host array carries a piece of a layer's pages) and its
  fixed set of staged shapes (what `kvjax.warmup` compiles)."""

  def _source_pages(self, src) -> Tuple[int, int]:
    """The logical pages [lo, hi) a stage source carries."""
    kind, lo, hi = src
    c = self.copy_unit
    return (lo, hi) if kind == "block" else (lo * c, (lo + 1) * c)

  def _stage_sources(self, a: int, wave: int = 0, skip_first: bool = False) -> Tuple:
    """The host arrays of layer a's stage (or of its copy wave `wave`), in the order of its pieces:
    pinned_host arrays (numpy pages without pinned memory, padded to the same shapes), then the
    partial last page (numpy). `skip_first`: the first source is already on the device
    (prefetched)."""
    hist, l = self.history_of(a)
    lp = self._layer_plans[a]
    if lp.waves:
      lp = lp.waves[wave]
    out = [self._source_array(hist, l, src) for src in (lp.units[1:] if skip_first else lp.units)]
    if lp.tail_page >= 0:
      out.append(hist.pages_lpn[l, lp.tail_page:lp.tail_page + 1].copy())
    return tuple(out)

  def _source_array(self, hist: HostHistory, l: int, src) -> Any:
    """The host array of one stage source of layer l of `hist`: ("block", lo, hi) a pinned mirror of
    sealed pages [lo, hi), ("unit", u, 0) copy unit u's pinned mirror (numpy pages of the same
    shapes without pinned memory)."""
    kind, lo, hi = src
    if not self.pinned:
      return host_pages(hist, l, *self._source_pages(src))
    if kind == "block":
      return hist.pinned_block(l, lo, hi)
    arr, _ = hist.pinned_chunk(l, lo)
    if arr is None:
      raise AssertionError(f"copy unit {lo} of {hist.name} layer {l} has no full page")
    return arr

  # -- the compiled shapes (kvjax.warmup) -------------------------------------------
  def staged_shapes(self):
    """-> [(pages, k)]: every (staged array pages, destination runs) a placement of this cache can
    take: pieces of `piece_sizes` copy units and the partial page (a layer's, a wave's: k runs, 2
    where a run splits at the ring's wrap), copy units (resident refills, the MTP lease: one run)."""
    c, k = self.copy_unit, 2 if self.split_at_wrap else 1
    sizes = [c * j for j in piece_sizes(self.piece_units)] + [1]
    return sorted({(n, k) for n in sizes} | {(n, 1) for n in sizes})

  def may_stream(self) -> bool:
    """Can a forward of this cache stream a page (a layer's pages at `max_tokens` beyond its
    resident region)?"""
    return any(self.max_pages > r for r in self.stream.resident_pages_per_layer)

  def may_resplit(self) -> bool:
    """Can the split change while the pool keeps its size (the adaptive policy's)?"""
    return False

  def may_wave(self, mtp_lease: bool = False) -> bool:
    """Can a forward of this cache stream a layer in copy waves (its streamed pages at `max_tokens`,
    with the MTP layer's lease taken where speculation drafts with it, beyond the ring)?"""
    caps = self.stream.resident_pages_per_layer
    streamed = max(self.max_pages - r for r in caps) + (self.copy_unit - 1)   # the open region's slack
    lease = self.max_pages - caps[-1] if self.cfg.has_mtp and mtp_lease else 0
    return streamed + lease > self.stream.ring_slots
