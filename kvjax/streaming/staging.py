"""Staging for the streamed provider: the arrays on their way to the device and where they go.

* `to_device`: every host-to-device copy of a streamed cache (a pinned_host array or numpy pages
  -> a device array); the fault-injection tests replace it (`experiments.lib.faults`).
* `Staged`, `Wave`, `LayerPlan`: what a forward stages, a copy wave, one cache layer's cached part of
  a forward.
* `unit_pieces`, `piece_units`, `piece_sizes`: the staged arrays' fixed set of shapes (16 copy
  units and the powers of two below); `pack_rows`: the forward's new rows packed into one
  device-to-host copy.
* `Stager`: the uploads of a streamed cache as a part of it: each layer's stage issued ahead of its
  step, the next forward's prefetched block, resident refills (pages the device does not hold
  yet: first forwards, after a rebind), and the staging bytes they hold.
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


class Stager:
  """The uploads of a streamed cache, a part with a small interface: it owns what is on its way to
  the device and accounts for it.

  * A layer's stage (or a copy wave's), issued ahead of its step (`issue`) and taken by it
    (`take`); a layer's first piece may come from the block prefetched for it during the previous
    forward (`prefetch`; `drop_prefetch` forgets blocks whose rows change).
  * Resident refills: pages uploaded in copy-unit pieces (`upload`) and placed run by run (`place`).
  * The sources: which host array carries a stage source (`source_array`: a pinned mirror, or numpy
    pages of the same shapes without pinned memory) and the pages it carries (`source_pages`).
  * Staging bytes: `held_bytes` (the stage of the step being run), `refill_bytes` (refills not yet
    placed), the peak of everything live in `counters["staging_peak_bytes"]`; bytes and calls in
    `counters["h2d_bytes"]`, `["h2d_calls"]`, prefetch hits and drops.

  Every copy goes through this module's `to_device` (the fault-injection tests replace it)."""

  def __init__(self, layout, copy_unit: int, pinned: bool, counters: Dict[str, Any]):
    self.layout, self.copy_unit, self.pinned, self.counters = layout, int(copy_unit), bool(pinned), counters
    self.stage: Dict[Any, Tuple[jax.Array, ...]] = {}        # layer a, or (a, wave) -> device arrays
    self.prefetched: Dict[int, Tuple[Any, int, jax.Array]] = {}   # a -> (source, its end page, array)
    self.held_bytes = 0
    self.refill_bytes = 0

  # -- sources -----------------------------------------------------------------------
  def source_pages(self, src) -> Tuple[int, int]:
    """The logical pages [lo, hi) a stage source carries."""
    kind, lo, hi = src
    c = self.copy_unit
    return (lo, hi) if kind == "block" else (lo * c, (lo + 1) * c)

  def source_array(self, hist: HostHistory, l: int, src) -> Any:
    """The host array of one stage source of layer l of `hist`: ("block", lo, hi) a pinned mirror of
    sealed pages [lo, hi), ("unit", u, 0) copy unit u's pinned mirror (numpy pages of the same
    shapes without pinned memory)."""
    kind, lo, hi = src
    if not self.pinned:
      return host_pages(hist, l, *self.source_pages(src))
    if kind == "block":
      return hist.pinned_block(l, lo, hi)
    arr, _ = hist.pinned_chunk(l, lo)
    if arr is None:
      raise AssertionError(f"copy unit {lo} of {hist.name} layer {l} has no full page")
    return arr

  def sources(self, hist: HostHistory, l: int, plan, skip_first: bool = False) -> Tuple:
    """The host arrays of a stage (`plan`: a `LayerPlan` or a `Wave`), in the order of its pieces:
    its units' arrays, then the partial last page (numpy). `skip_first`: the first is on the device
    already (prefetched)."""
    out = [self.source_array(hist, l, src) for src in (plan.units[1:] if skip_first else plan.units)]
    if plan.tail_page >= 0:
      out.append(hist.pages_lpn[l, plan.tail_page:plan.tail_page + 1].copy())
    return tuple(out)

  # -- a layer's stage -----------------------------------------------------------------
  def issue(self, key, hist: HostHistory, l: int, plan) -> int:
    """Queue the copies of the stage `plan` under `key` (a cache layer, or (layer, wave) for a copy
    wave) -> bytes copied. A layer's block prefetched by the previous forward is used as it is when
    it is the stage's first source (a prefetch hit), else dropped."""
    reuse, pre = False, None
    if not isinstance(key, tuple):
      pre = self.prefetched.pop(key, None)
      reuse = pre is not None and bool(plan.units) and plan.units[0] == pre[0]
      if pre is not None:
        self.counters["prefetch_hits" if reuse else "prefetch_dropped"] += 1
    sources = self.sources(hist, l, plan, skip_first=reuse)
    self.stage[key] = ((pre[2],) if reuse else ()) + tuple(to_device(x) for x in sources)
    nbytes = sum(int(x.nbytes) for x in sources)
    self.counters["h2d_bytes"] += nbytes
    self.counters["h2d_calls"] += len(sources)
    return nbytes

  def take(self, key) -> Optional[Tuple[jax.Array, ...]]:
    """The stage issued under `key` (None: none was), now held by the step being run."""
    stage = self.stage.pop(key, None)
    if stage is not None:
      self.held_bytes = sum(int(s.nbytes) for s in stage)
    return stage

  def prefetch(self, a: int, hist: HostHistory, l: int, src) -> None:
    """Copy layer a's first stage source now, for the next forward (`issue` uses it)."""
    arr = self.source_array(hist, l, src)
    self.prefetched[a] = (src, self.source_pages(src)[1], to_device(arr))
    self.counters["h2d_bytes"] += int(arr.nbytes)
    self.counters["h2d_calls"] += 1

  def drop_prefetch(self, drop: Callable[[int, int], bool] = lambda a, hi: True) -> None:
    """Forget the prefetched blocks for which `drop(layer, end page)` holds (default: all)."""
    for a, (_, hi, _) in list(self.prefetched.items()):
      if drop(a, hi):
        del self.prefetched[a]
        self.counters["prefetch_dropped"] += 1

  def clear(self) -> None:
    """Let go of every stage in flight (a new layout, a failed forward); prefetched blocks stay."""
    self.stage = {}
    self.held_bytes = 0
    self.refill_bytes = 0

  def note_peak(self) -> None:
    """The staging peak: the step's stage, the stages in flight, refills, prefetched blocks."""
    live = self.held_bytes + self.refill_bytes + sum(int(s.nbytes) for v in self.stage.values() for s in v)
    live += sum(int(p[2].nbytes) for p in self.prefetched.values())
    self.counters["staging_peak_bytes"] = max(self.counters["staging_peak_bytes"], live)

  # -- resident refills ------------------------------------------------------------------
  def upload(self, hist: HostHistory, l: int, lo: int, hi: int) -> List[Staged]:
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
    self.refill_bytes += sum(int(st.array.nbytes) for st in staged)
    self.note_peak()
    return staged

  def place(self, pool, staged: List[Staged], dst: Callable[[int], int]):
    """Copy staged pages into the pool at `dst(logical page)` (consecutive pages to consecutive
    pool pages): one placement call a staged array, the compiled one of the layer steps."""
    for st in staged:
      base = dst(st.first) - st.offset
      pool = place_staged(pool, st.array, on_device(pieces_array([(base, st.offset, st.offset + st.count)])))
    self.refill_bytes -= sum(int(st.array.nbytes) for st in staged)   # placed: buffers let go
    return pool


def staged_shapes(copy_unit: int, piece_units: int, split_at_wrap: bool):
  """-> [(pages, k)]: every (staged array pages, destination runs) a placement of a cache can take:
  pieces of `piece_sizes` copy units and the partial page (a layer's, a wave's: k runs, 2 where a
  run splits at the ring's wrap), copy units (resident refills, the MTP lease: one run)."""
  k = 2 if split_at_wrap else 1
  sizes = [copy_unit * j for j in piece_sizes(piece_units)] + [1]
  return sorted({(n, k) for n in sizes} | {(n, 1) for n in sizes})


def stage_layout(live: int, phys: np.ndarray, need: int, full: int, copy_unit: int, piece_units: int,
                 held_from: int = -1, k: int = 1):
  """-> (sources, pieces (one [k, 3] int32 per staged array) or None, tail page or -1): which host
  arrays carry a layer's streamed pages [live, need) that hold committed tokens (`full`: pages whose
  every token is committed), and where their rows go (`phys`: the pool page of each logical page
  from `live` on).

  Sources are ("block", lo, hi): sealed copy units [lo, hi) as one pinned mirror, and
  ("unit", u, 0): one copy unit u, whole (the open unit too: pinned memory mirrors full pages
  only). The sealed units come in pieces of 16 units and powers of two below (`unit_pieces`), so
  every staged array has one of a fixed set of shapes whatever the history's length (the placements
  compile once); the first unit's pages before `live` travel along unplaced. A partial last page that
  streams is uploaded on its own (`tail`). `held_from`: the device holds the committed rows of pages
  from this one on (the open region; -1: none). `k`: destination runs a staged array may have (2:
  a ring run may split at the wrap)."""
  c = copy_unit
  sources, rows = [], []

  def runs(first, end, row0):                   # contiguous destination runs (a wrap splits them)
    seg = phys[first - live:end - live]
    return [(int(seg[i]) - (first + i - row0), first + i - row0, first + j - row0)
            for i, j in contiguous_runs(seg)]

  sealed = full // c * c
  for lo, hi in unit_pieces(live, sealed, c, piece_units):
    sources.append(("block", lo, hi) if hi - lo > c else ("unit", lo // c, 0))
    rows.append(runs(max(lo, live), hi, lo))
  held = held_from >= 0
  if full > max(sealed, live) and not (held and held_from <= sealed):   # the open copy unit, whole
    sources.append(("unit", sealed // c, 0))
    rows.append(runs(max(sealed, live), full, sealed))
  tail = full if need > full and full >= live and not held else -1
  if tail >= 0:
    rows.append([(int(phys[tail - live]), 0, 1)])
  if not rows:
    return (), None, -1
  if max(len(r) for r in rows) > k:
    raise AssertionError("a ring run that does not split at the wrap crossed it")
  pieces = np.zeros((len(rows), k, 3), np.int32)
  for i, r in enumerate(rows):
    pieces[i, :len(r)] = r
  return tuple(sources), tuple(pieces), tail      # host arrays: the forward's layout sends them
