"""The streamed KV provider: resident pages + one shared ring in one device pool.

Physical pool (one device buffer, `pool_pn [pool_pages, page_bytes]` uint8):

    [ resident region of cache layer 0 | ... | of cache layer L-1 | ring slots ... ]

Cache layers are the target's attention layers followed by the MTP layer
(separate logical caches with their own host histories, sharing the pool).
Cache layer `a` keeps its first `capacity[a]` logical pages resident; its
later pages stream through the ring. Within a forward the ring is circular and
shared by all layers: each layer's streamed pages take the next slots after the
previous layer's (from slot 0 at every forward), and a run that would pass the
end restarts at slot 0 (or, with `split_at_wrap`, continues there: then a
layer's history has three spans, resident, ring before the wrap, ring after).

How a forward streams (`KVProvider` protocol of `kvjax.engine`). Each layer's
streamed pages that hold tokens come as at most three host arrays: the sealed
full pages as one pinned block (made again only every `copy_pages` pages), the
open copy unit, and the partial last page. Their host-to-device copies are
issued one layer ahead: when the step of attention layer a is dispatched, the
copies of layer a+1 are already queued, so they run beside layer a's compute.
The step places the staged pages into their ring slots itself (an in-place
update of the donated pool, `kvjax.model.place_pages`). Few, large copies
matter: a `jax.device_put` issued while several others are in flight holds the
host until one completes, which delays the dispatch of the compute it should
hide behind (docs/PERFORMANCE.md, "Host-to-device copies").

* `begin_forward` checks that every layer's streamed pages fit in the ring and
  that the histories have room, before anything changes (a refused forward
  leaves the provider as it was); it lays out every layer's ring slots, span
  plan, page table and placement pieces (cached on the device while the page
  count and the split stay the same) and issues the first layer's copies.
* `layer_kv(a)` issues layer a+1's copies, refills resident pages the device
  does not hold yet (first forwards, after a rebind) and returns the layer's
  `LayerKV`: pool, page table, staged pages and their pieces. At the last
  layer it issues the next forward's first copy instead: the first layer's
  sealed block, which stays the same for `copy_pages` pages, so it runs beside
  the end of this forward rather than alone at the start of the next one
  (dropped unused if the next forward differs: another order, another block,
  rows rewritten below its end).
* `end_layer` keeps the updated pool and the rows written.
* `end_forward` publishes the new rows to the host histories (device -> host:
  only the changed tail), or with `defer_rows` keeps them back (`kept_rows`).

Parts, each with its own interface and tests: `device` (`device_pool.DevicePool`:
the pool, its regions, valid resident prefixes and open regions), `stager`
(`staging.Stager`: every upload, stages in flight, the prefetched block, resident
refills), `mtp_lease` (`lease.RingLease`: slots at the end of the ring hold the
MTP layer's streamed suffix for speculative decoding), the host histories
(`host_history.HostHistory`) and `kept` (`kept_rows.KeptRows`). What stays here:
the forward's layout and the `KVProvider` protocol that drives the parts.

Counters: h2d bytes and copies, d2h bytes, ring wraps, streamed pages, MTP
leases (taken, bytes loaded, reloads after a rebind, refused: not in the ring), host
time per forward (the provider's own Python work, including any wait inside
`jax.device_put`). Deadline samples, per cache layer and in total: one for each
streamed layer of every forward after the first layer, a readiness miss when
its staged pages were not yet on the device when its step was enqueued. Every
`timing_interval`-th forward the first layer's copies are timed alone: the copy
rate behind the copy-busy ratio.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np

from kvjax.config import ModelConfig
from kvjax.engine import LayerKV, on_device, zeros_on_device
from kvjax.model import KVRows
from kvjax.streaming.budget import (StreamBudgetError, StreamConfig, copy_unit_pages, mib, staging_unit_pages,
                                    wave_bounds)
from kvjax.streaming import staging
from kvjax.streaming.host_history import HostHistory
from kvjax.streaming.kept_rows import Kept, KeptRows
from kvjax.streaming.device_pool import DevicePool
from kvjax.streaming.lease import MTPLease, RingLease
from kvjax.streaming.span_plan import SpanPlan, make_plan, page_table, spans_from_pages
from kvjax.streaming.staging import Stager, compact_capacities
from kvjax_pallas.page_layout import PageLayout


PIPELINE_DEPTH = 1   # layers whose copies are in flight beside the step being run
LAYOUTS_KEPT = 4     # forward layouts kept by key (`begin_forward`)


class StreamedKV:
  """KV provider over host-authoritative histories, resident pages and one shared ring, composed of
  parts with their own interfaces: `histories` (`HostHistory` a logical cache), `device`
  (`DevicePool`: the pool and its regions), `stager` (`staging.Stager`: the uploads on their way to
  the device) and `mtp_lease` (`lease.RingLease`: the MTP layer's ring lease; None without one)."""

  def __init__(self, cfg: ModelConfig, layout: PageLayout, max_tokens: int, stream: StreamConfig,
               pinned: Optional[bool] = None, split_at_wrap: bool = False):
    self.cfg, self.layout = cfg, layout
    self.split_at_wrap = split_at_wrap
    self.prefetch_depth = PIPELINE_DEPTH
    n_target = cfg.num_attention_layers
    self.n_layers = n_target + (1 if cfg.has_mtp else 0)
    self._check_stream(stream)
    max_pages = layout.pages_for(max_tokens)
    self.max_tokens = max_pages * layout.page_tokens
    self.copy_unit = copy_unit_pages(stream)     # fixed with the histories' copy units
    self.histories = {"target": HostHistory("target", layout, n_target, max_pages, self.copy_unit, pinned)}
    if cfg.has_mtp:
      self.histories["mtp"] = HostHistory("mtp", layout, 1, max_pages, self.copy_unit, pinned)
    self.pinned = self.histories["target"].pinned
    self.max_pages = max_pages
    self.piece_units = staging.piece_units(self.copy_unit, layout.page_bytes, stream.pool_pages)
    self.device = DevicePool(layout, self.n_layers, n_target, self.copy_unit)   # the pool, its regions
    self.plans: Dict[int, SpanPlan] = {}
    self._bind_generation = 0
    # the next forward's first `prefetch_next` layers' first sealed blocks are copied during this
    # forward's last layer (`stager.prefetch`)
    self.prefetch_next = 1
    self._layouts: Dict[tuple, Tuple[tuple, Dict[int, staging.LayerPlan]]] = {}   # key -> layout, LRU
    self.counters = dict(h2d_bytes=0, h2d_calls=0, ring_wraps=0, streamed_pages=0, readiness_misses=0,
                         forwards=0, host_ms=0.0, max_spans=0, ring_peak_slots=0, timed_copy_ms=0.0,
                         timed_bytes=0, elapsed_ms=0.0, staging_peak_bytes=0, deadline_samples=0,
                         layout_changes=0, layout_hits=0, prefetch_hits=0, prefetch_dropped=0, waves=0,
                         waved_layers=0, tail_uploads=0, open_hits=0, host_begin_ms=0.0,
                         host_end_ms=0.0, rows_wait_ms=0.0, mtp_leases=0, mtp_lease_bytes=0,
                         mtp_lease_reloads=0, mtp_lease_refused=0, moved_pages=0)
    self.stager = Stager(layout, self.copy_unit, self.pinned, self.counters)
    self.mtp_lease = RingLease(self.n_layers - 1, self.histories["mtp"], layout, self.stager) if cfg.has_mtp else None
    self._bind(stream)
    self._pending: Dict[int, Any] = {}           # rows of ended layers not yet published to the host
    self._ended = []                              # the layers of this forward that ended
    self._packed: Optional[jax.Array] = None     # the forward's rows on their way to the host
    self.kept = KeptRows()         # with `defer_rows(True)`: ended forwards not yet published
    self._wave_pages = 1
    self._order: Tuple[int, ...] = ()
    self._layer_plans: Dict[int, staging.LayerPlan] = {}
    self._shape_key = None
    self.timing_interval = 16      # every N-th forward is a deadline sample (0: never)
    self.deadline_samples = np.zeros((self.n_layers,), np.int64)
    self.deadline_misses = np.zeros((self.n_layers,), np.int64)

  # -- re-layout (phase change, policy repartition, new request) ---------------------
  def rebind(self, stream: StreamConfig) -> None:
    """Adopt a new physical split. The host history is authoritative, so the resident mirror is
    simply rebuilt from it (lazily, page by page, on the next forwards)."""
    self._check_stream(stream)
    if stream.copy_pages != self.stream.copy_pages:
      raise ValueError("copy_pages is fixed for the lifetime of the host histories")
    self._publish_deferred()       # the mirror is rebuilt from the host: it must hold every row
    self._bind(stream)
    self.counters["rebinds"] = self.counters.get("rebinds", 0) + 1

  def _check_stream(self, stream: StreamConfig) -> None:
    if len(stream.resident_pages_per_layer) != self.n_layers:
      raise ValueError(f"stream config has {len(stream.resident_pages_per_layer)} resident capacities; "
                       f"the model has {self.n_layers} cache layers")
    if stream.ring_slots < 1:
      raise StreamBudgetError(f"no ring slots: resident regions take {stream.resident_total} of "
                              f"{stream.pool_pages} pages")

  def _bind(self, stream: StreamConfig) -> None:
    """Lay out resident regions and the ring in a pool of `stream.pool_pages`. A pool of the same
    size is kept, and each layer's valid resident prefix (up to its new capacity) moves inside it
    to its new region (`relocate`); a new pool starts empty (refilled from the host)."""
    self.counters["moved_pages"] += self.device.bind(stream)
    self.wave_cap = self._wave_cap(stream)
    self.staging_unit = staging_unit_pages(stream, self.max_tokens, self.layout, self.pinned, self.wave_cap)
    self._forget_layout()
    self._bind_generation += 1
    if self.lease is not None:   # the leased pages went with the old layout: load them again
      self.counters["mtp_lease_reloads"] += 1
      self._load_lease()

  def _wave_cap(self, stream: StreamConfig) -> Optional[int]:   # pylint: disable=unused-argument
    """The most streamed pages a layer stages at a time (more go in copy waves), or None: the
    ring's (the fixed split's reserve holds its layers' stages whole)."""
    return None

  def _wave_ring(self) -> int:
    """Ring slots a layer's streamed pages may take at once: the ring, or the staging cap."""
    ring = self._target_ring()
    return ring if self.wave_cap is None else min(ring, self.wave_cap)

  def _forget_layout(self) -> None:
    self.plans.clear()
    self._shape_key = None
    self._layouts.clear()
    self.stager.clear()
    self.stager.drop_prefetch()

  def _drop_prefetch(self, below_token: int, history: HostHistory) -> None:
    """Forget the next forward's prefetched blocks of `history` in which rows from `below_token` on
    change."""
    pt = self.layout.page_tokens
    self.stager.drop_prefetch(lambda a, hi: self.history_of(a)[0] is history and below_token < hi * pt)

  def truncate(self, cache: str, tokens: int) -> None:
    """Forget rows >= tokens of logical cache "target" or "mtp" (rejected speculative rows): the host
    history is authoritative, so that is where they go; device copies past kv_len are never read."""
    if cache not in self.histories:
      raise ValueError(f"unknown logical cache {cache!r}; caches: {sorted(self.histories)}")
    self._publish_deferred(cache, tokens)      # rows kept back are published up to `tokens` only
    self.histories[cache].truncate(tokens)
    self._drop_prefetch(tokens, self.histories[cache])
    # the layout stays: its key (committed pages, content pages, open-slot state) changes with
    # any truncation that changes what a forward reads, and pinned units cover sealed pages only

  def reset(self) -> None:
    """Start a new request: forget every token (host and device), and every counter."""
    self.kept.items.clear()
    for h in self.histories.values():
      h.truncate(0)
      h.d2h_bytes = 0
    self.release_lease()
    self.device.forget()
    self._forget_layout()
    self._drop_forward_state()
    self.deadline_samples[:] = 0
    self.deadline_misses[:] = 0
    for k, v in self.counters.items():
      self.counters[k] = type(v)(0)

  def _drop_forward_state(self) -> None:
    """Let go of what a forward holds (a failed one's too): staged uploads, rows not yet published."""
    self._pending.clear()
    self._ended = []
    self._packed = None
    self.stager.clear()

  # -- mapping -----------------------------------------------------------------
  def history_of(self, cache_layer: int) -> Tuple[HostHistory, int]:
    n_target = self.cfg.num_attention_layers
    if cache_layer < n_target:
      return self.histories["target"], cache_layer
    return self.histories["mtp"], 0

  # -- the device pool (`device_pool.DevicePool`) ------------------------------------
  pool_pn = property(lambda self: self.device.pool_pn, lambda self, v: setattr(self.device, "pool_pn", v))
  open_slots = property(lambda self: self.device.open_slots, lambda self, v: setattr(self.device, "open_slots", v))
  stream = property(lambda self: self.device.stream)
  resident_valid = property(lambda self: self.device.resident_valid)
  resident_base = property(lambda self: self.device.resident_base)
  ring_base = property(lambda self: self.device.ring_base)
  open_page = property(lambda self: self.device.open_page)
  open_rows = property(lambda self: self.device.open_rows)

  def _split(self, a: int, active: int) -> Tuple[int, int]:
    return self.device.split(a, active)

  def _open_split(self, a: int) -> Tuple[int, int, int]:
    """Layer a's (resident live pages, ring pages, open unit's first page or -1) in this forward."""
    return self.device.open_split(a, self._active, self._full, self._target_ring())

  def _fill_resident(self, a: int, pool):
    """Upload committed resident pages the device does not hold (first forwards, after a rebind),
    in unit-aligned pieces whose staging fits one staging unit (`staging_unit_pages`)."""
    hist, l = self.history_of(a)
    need = min(self._open_split(a)[0], self._content)
    first, base, c = int(self.resident_valid[a]), int(self.resident_base[a]), self.copy_unit
    piece = max(c, (self.staging_unit - c) // c * c)   # unit-aligned pieces: staging <= one unit
    while first < need:
      end = min(need, (first // piece + 1) * piece)
      pool = self.stager.place(pool, self.stager.upload(hist, l, first, end), lambda p: base + p)
      self.pool_pn = pool    # the old buffer was donated: the live one stays even if a later copy fails
      first = end
    return pool

  # -- the MTP ring lease (`lease.RingLease`) ------------------------------------------
  @property
  def lease(self) -> Optional[MTPLease]:
    return None if self.mtp_lease is None else self.mtp_lease.held

  def lease_mtp(self, end_tokens: int) -> int:
    """Hold ring slots for the MTP layer's pages past its resident ones, up to `end_tokens` tokens
    (the furthest its forwards may reach before `release_lease`), and load its committed suffix
    into them in one pass (-> bytes uploaded). A suffix that does not fit the ring is not leased
    (counter `mtp_lease_refused`): the MTP layer then streams per forward as any layer."""
    if self.mtp_lease is None:
      raise ValueError("lease_mtp: this model has no MTP layer")
    self._publish_deferred("mtp")        # the lease loads the committed suffix from the host
    self.mtp_lease.hold(end_tokens, self.max_tokens)
    nbytes = self._load_lease()
    self.counters["mtp_leases"] += self.lease is not None
    return nbytes

  def release_lease(self) -> None:
    """Give every ring slot back to the target (a no-op without a lease)."""
    if self.mtp_lease is not None:
      self.mtp_lease.release()   # the layout key holds the lease: the next forward lays out again

  def _leased(self, a: int) -> bool:
    return self.mtp_lease is not None and self.mtp_lease.holds(a)

  def _target_ring(self) -> int:
    return self.stream.ring_slots if self.mtp_lease is None else self.mtp_lease.target_ring(self.stream.ring_slots)

  def _load_lease(self) -> int:
    self._shape_key = None
    a = self.mtp_lease.layer
    self.pool_pn, nbytes = self.mtp_lease.load(self.pool_pn, self.stream.resident_pages_per_layer[a],
                                               self.stream.ring_slots, self.ring_base, self.copy_unit,
                                               self.piece_units)
    self.counters["mtp_lease_refused"] += nbytes is None
    return nbytes or 0

  def _lease_plan(self, a: int, live: int, streamed: int) -> staging.LayerPlan:
    """The leased MTP layer's forward: its streamed pages are the lease's slots, in order; nothing
    stages (the committed ones were loaded by the lease, later ones are written by its forwards)."""
    plan, table = self._plan_and_table(a, live, self.ring_base + self.lease.first_slot + np.arange(streamed))
    return staging.LayerPlan(plan, on_device(table), None, (), -1, 0, 0)

  # -- the compiled shapes (kvjax.warmup) --------------------------------------------
  def staged_shapes(self):
    """Every (staged array pages, destination runs) a placement of this cache can take."""
    return staging.staged_shapes(self.copy_unit, self.piece_units, self.split_at_wrap)

  def may_stream(self) -> bool:
    """Can a forward stream a page (a layer's pages at `max_tokens` beyond its resident region)?"""
    return any(self.max_pages > r for r in self.stream.resident_pages_per_layer)

  def may_resplit(self) -> bool:
    """Can the split change while the pool keeps its size (the adaptive policy's)?"""
    return False

  def may_wave(self, mtp_lease: bool = False) -> bool:
    """Can a forward stream a layer in copy waves (its streamed pages at `max_tokens`, with the MTP
    layer's lease taken where speculation drafts with it, beyond the ring)?"""
    caps = self.stream.resident_pages_per_layer
    streamed = max(self.max_pages - r for r in caps) + (self.copy_unit - 1)   # the open region's slack
    lease = self.max_pages - caps[-1] if self.cfg.has_mtp and mtp_lease else 0
    return streamed + lease > self.stream.ring_slots

  # -- KVProvider ----------------------------------------------------------------
  def begin_forward(self, pos: int, n_tokens: int, cache_layers: Tuple[int, ...],
                    wave_pages: int = 1) -> None:
    t_host = time.perf_counter()
    lay = self.layout
    end = pos + n_tokens
    if end > self.max_tokens:
      raise ValueError(f"context full: {end} tokens needed, host history holds {self.max_tokens} "
                       f"({end - self.max_tokens} more; raise --ctx-size)")
    active = lay.pages_for(end)
    ring = self._target_ring()
    for a in cache_layers:
      hist, l = self.history_of(a)
      if self.kept.items and (pos > hist.tokens[l] or not self._leased(a)):   # it may read kept rows
        self._publish_deferred(hist.name)
      if pos > hist.tokens[l]:
        raise ValueError(f"cache layer {a}: forward at position {pos} but only {hist.tokens[l]} tokens "
                         f"are committed")
      if self._leased(a):
        if end > self.lease.end_tokens:
          raise ValueError(f"MTP forward to {end} tokens runs past its ring lease ({self.lease.end_tokens} "
                           f"tokens): release_lease() and lease_mtp({end}) first")
        continue
      _, streamed = self._split(a, active)
      if streamed > ring and ring < wave_pages:
        missing = wave_pages - ring   # copy waves need one partition in the ring
        raise StreamBudgetError(
            f"ring too small: cache layer {a} streams {streamed} pages in copy waves of whole "
            f"{wave_pages}-page attention partitions (a forward of {n_tokens} rows up to token {end}), but "
            f"the ring has {ring} slots{' outside the MTP lease' if self.lease else ''}: {missing} more "
            f"pool pages ({mib(missing * lay.page_bytes)}), attention block_pages 1, or fewer rows a "
            f"forward (ubatch) would do")
    self._pos, self._n, self._active = pos, n_tokens, active
    self._wave_pages = int(wave_pages)
    self._content = lay.pages_for(pos)  # pages that already hold tokens
    self._full = pos // lay.page_tokens  # pages whose every token is committed
    self._order = tuple(cache_layers)
    self._drop_forward_state()     # a forward that failed half-way left its stage and counts behind
    held = tuple(self._open_held(a) for a in self._order)
    for a in self._order:    # a slot about to take another page is not trusted until this forward ends
      if self._open_split(a)[2] != self.open_page[a]:
        self.open_page[a] = -1
    key = (self._bind_generation, self._full, self._content, active, self._order, self._wave_pages, held,
           None if self.lease is None else self.lease[:3])
    if key != self._shape_key:     # a layout per key, the last few kept: roles that alternate
      kept = self._layouts.pop(key, None)    # (MTP, verify, decode) lay out once each
      if kept is None:
        self._held = held
        self._lay_out_forward()
      else:
        self._held, self._layer_plans = kept
        self.counters["layout_hits"] += 1
      self._layouts[key] = (self._held, self._layer_plans)
      while len(self._layouts) > LAYOUTS_KEPT:
        self._layouts.pop(next(iter(self._layouts)))
      self._shape_key = key
    for a in self._order:
      lp = self._layer_plans[a]
      self.counters["streamed_pages"] += lp.streamed
      self.counters["ring_wraps"] += lp.wraps
      self.counters["waves"] += len(lp.waves) or int(lp.streamed > 0)
      self.counters["waved_layers"] += bool(lp.waves)
      self.counters["tail_uploads"] += lp.tail_page >= 0
      self.counters["open_hits"] += lp.open_page >= 0 and lp.tail_page < 0 and self._content > self._full
      self.plans[a] = lp.plan
    self._t_begin = time.perf_counter()
    c = self.counters
    self._sampling = self.timing_interval > 0 and c["forwards"] % self.timing_interval == 1 % self.timing_interval
    c["host_ms"] += (self._t_begin - t_host) * 1e3
    c["host_begin_ms"] += (self._t_begin - t_host) * 1e3
    # layers whose copies are queued ahead of the step being run (one when any layer is in waves)
    self._depth = 1 if any(self._layer_plans[a].waves for a in self._order) else max(1, self.prefetch_depth)
    first = self._order[0] if self._order else None
    if first is not None and self._leased(first):
      self.stager.stage[first] = ()   # nothing stages; a block prefetched for the next verify stays
    elif first is not None:
      t0 = time.perf_counter()
      nbytes = self._issue(first)
      c["host_ms"] += (time.perf_counter() - t0) * 1e3
      c["host_begin_ms"] += (time.perf_counter() - t0) * 1e3
      if self._sampling and nbytes:   # the first layer's copies run alone: the copy rate
        jax.block_until_ready(self.stager.stage[first])
        c["timed_copy_ms"] += (time.perf_counter() - t0) * 1e3
        c["timed_bytes"] += nbytes
      t0 = time.perf_counter()
      for a in self._order[1:self._depth]:
        self._issue(a)
      c["host_ms"] += (time.perf_counter() - t0) * 1e3
      c["host_begin_ms"] += (time.perf_counter() - t0) * 1e3

  def _open_held(self, a: int) -> bool:
    return self.device.open_held(a, self._full, self._pos)

  def stage_sources(self, a: int, wave: int = 0) -> Tuple:
    """The host arrays layer a's stage (or its copy wave `wave`) copies in this forward."""
    lp = self._layer_plans[a]
    return self.stager.sources(*self.history_of(a), lp.waves[wave] if lp.waves else lp)

  def _issue(self, a: int, wave: int = 0) -> int:
    """Queue the host-to-device copies of layer a's stage, or of its copy wave `wave` (-> bytes)."""
    lp = self._layer_plans[a]
    hist, l = self.history_of(a)
    return self.stager.issue((a, wave) if wave else a, hist, l, lp.waves[wave] if lp.waves else lp)

  def _issue_prefetch(self) -> None:
    """After the last layer's copies: copy the sealed blocks of the next forward's first
    `prefetch_next` layers (same order, same blocks), unless that forward times its first copies
    alone. They run while the host finishes this forward and begins the next."""
    c = self.counters
    nxt = c["forwards"] + 1
    if self.timing_interval > 0 and nxt % self.timing_interval == 1 % self.timing_interval:
      return
    sealed = self._full // self.copy_unit * self.copy_unit
    for a in self._order[:max(1, self.prefetch_next)]:
      units = self._layer_plans[a].units
      if units and self.stager.source_pages(units[0])[1] <= sealed:   # sealed pieces only: they stay
        self.stager.prefetch(a, *self.history_of(a), units[0])

  def _lay_out_forward(self) -> None:
    """Ring slots, span plan, page table and placement pieces of every layer of this forward."""
    self.counters["layout_changes"] += 1
    ring, head = self._target_ring(), 0
    plans = {}
    for a, held in zip(self._order, self._held):
      if self._leased(a):       # the MTP layer's pages are in its leased slots already
        live, streamed = self._split(a, self._active)
        plans[a] = self._lease_plan(a, live, streamed)
        continue
      live, streamed, open_page = self._open_split(a)
      wraps = 0
      if streamed > self._wave_ring():   # more streamed pages than slots (or the cap): copy waves
        plans[a] = self._wave_layout(a, live, streamed)
        head = plans[a].waves[-1].count % ring
        self.counters["ring_peak_slots"] = max(self.counters["ring_peak_slots"], ring)
        continue
      if streamed and head + streamed > ring:
        # the ring wraps: with split_at_wrap the layer's pages continue at slot 0 (two ring spans);
        # otherwise the whole run restarts at slot 0 (one span)
        wraps = 1
        if not self.split_at_wrap:
          head = 0
      slots = (head + np.arange(streamed)) % ring
      head = (head + streamed) % ring
      self.counters["ring_peak_slots"] = max(self.counters["ring_peak_slots"], min(streamed, ring))
      phys = self.ring_base + slots                 # pool page of each streamed page [live, active)
      if open_page >= 0:                            # the open unit's pages take the open region
        phys = np.concatenate([phys, self.resident_base[a] + live + np.arange(self._active - open_page)])
      plan, table = self._plan_and_table(a, live, phys)
      units, pieces, tail = self._stage_layout(a, live, phys, held_from=open_page if held else -1)
      plans[a] = staging.LayerPlan(plan, table, pieces,
                            units, tail, streamed, wraps, open_page=open_page)
      self.counters["max_spans"] = max(self.counters["max_spans"], len(plan.spans))
    self._layer_plans = staging.plans_on_device(plans)

  def _wave_layout(self, a: int, live: int, streamed: int) -> staging.LayerPlan:
    """Copy waves of layer a: wave 0 attends its resident pages and the streamed pages the ring
    holds, each later wave the next ring-ful, every boundary on a multiple of the attention
    partition (`wave_pages`), so the folded carry has the bits of one call. A wave's streamed pages
    take ring slots 0.. and stage as a layer's do (`_stage_layout`: pieces of whole copy units, the
    partial last page; pages that hold no committed token yet are written by this forward's rows)."""
    ring, active, need = self._wave_ring(), self._active, min(self._active, self._content)
    bounds = wave_bounds(live, ring, self._wave_pages, active)
    waves = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
      first = max(lo, live)
      table = np.zeros((self.max_pages,), np.int32)
      table[:live] = self.resident_base[a] + np.arange(live)
      table[first:hi] = self.ring_base + np.arange(hi - first)
      count = max(0, min(hi, need) - first)
      units, pieces, tail = ((), None, -1) if count == 0 else \
          self._stage_layout(a, first, self.ring_base + np.arange(hi - first), end=hi)
      waves.append(staging.Wave((lo, hi), table, pieces, first, count, units, tail))
    return staging.LayerPlan(None, waves[0].table_t, waves[0].pieces, (), -1, streamed, 0, tuple(waves))

  def _plan_and_table(self, a: int, live: int, phys: np.ndarray):
    """Span plan and page table of layer a: its resident prefix, then the pool pages `phys` of its
    logical pages [live, active) as contiguous runs (ring, a wrapped ring run, the open slot)."""
    runs = [(int(self.resident_base[a]), live, "resident")]
    ring_runs = 0
    for i, j in staging.contiguous_runs(phys):
      if phys[i] < self.ring_base:
        kind = "open"
      else:
        kind = "ring" if ring_runs == 0 else "ring_wrapped"
        ring_runs += 1
      runs.append((int(phys[i]), j - i, kind))
    kv_len = self._pos + self._n
    spans, kinds = spans_from_pages(self.layout, "pool", runs, kv_len)
    plan = make_plan(self.layout, {"pool": self.stream.pool_pages * self.layout.page_bytes}, spans,
                     kv_len, max(1, self._n), kinds)   # a forward of no row (`prime`): as one row's
    return plan, page_table(plan, self.layout, self.max_pages, buffer="pool")

  def _stage_layout(self, a: int, live: int, phys: np.ndarray, held_from: int = -1,
                    end: Optional[int] = None):
    """Layer a's stage in this forward (`staging.stage_layout`; `end`: a copy wave's last page + 1)."""
    need = min(self._active if end is None else end, self._content)   # committed streamed: [live, need)
    return staging.stage_layout(live, phys, need, min(need, self._full), self.copy_unit, self.piece_units,
                                held_from, 2 if self.split_at_wrap else 1)

  def layer_kv(self, cache_layer: int):
    t0 = time.perf_counter()
    a = cache_layer
    if a not in self._layer_plans or a not in self._order:
      raise RuntimeError(f"cache layer {a} was not announced to begin_forward ({self._order})")
    lp = self._layer_plans[a]
    idx = self._order.index(a)
    stage = self.stager.take(a)
    if stage is None:
      raise RuntimeError(f"cache layer {a}: no staged pages (layers must run in the order given to "
                         f"begin_forward: {self._order})")
    pool = self._fill_resident(a, self.pool_pn)      # refills (rare) before the next layer's copies
    ahead = idx + self._depth
    if len(lp.waves) > 1:               # the layer's next wave goes out before this wave's step
      self._issue(a, 1)
    elif ahead < len(self._order):      # the copies `depth` layers ahead go out before this step
      self._issue(self._order[ahead])
    elif ahead == len(self._order):     # ... and then the next forward's first
      self._issue_prefetch()
    self.stager.note_peak()
    if stage and idx > 0:       # a deadline sample: were this layer's pages there when enqueued?
      self.deadline_samples[a] += 1
      self.counters["deadline_samples"] += 1
      if not all(s.is_ready() for s in stage):
        self.deadline_misses[a] += 1
        self.counters["readiness_misses"] += 1
    self.pool_pn = pool
    self.counters["host_ms"] += (time.perf_counter() - t0) * 1e3
    if lp.waves:
      return LayerKV(pool, lp.table_t, stage, lp.pieces if stage else None, len(lp.waves), lp.waves[0].tiles)
    return LayerKV(pool, lp.table_t, stage, lp.pieces if stage else None)

  def wave_kv(self, cache_layer: int, wave: int) -> LayerKV:
    """Copy wave `wave` >= 1 of a layer (`layer_kv` gave wave 0): its table and staged pages; the
    runner threads the pool from the previous wave's step. Issues the next wave's copies (or, after
    the last wave, the next layer's)."""
    t0 = time.perf_counter()
    a = cache_layer
    lp = self._layer_plans.get(a)
    stage = self.stager.take((a, wave))
    if lp is None or not 0 < wave < len(lp.waves) or stage is None:
      raise RuntimeError(f"cache layer {a}: wave {wave} was not issued (waves run in order after "
                         f"layer_kv)")
    idx = self._order.index(a)
    if wave + 1 < len(lp.waves):
      self._issue(a, wave + 1)
    elif idx + 1 < len(self._order):
      self._issue(self._order[idx + 1])
    else:
      self._issue_prefetch()
    self.stager.note_peak()
    wv = lp.waves[wave]
    self.counters["host_ms"] += (time.perf_counter() - t0) * 1e3
    return LayerKV(None, wv.table_t, stage, wv.pieces if stage else None, len(lp.waves), wv.tiles)

  def end_layer(self, cache_layer: int, pool_pn, rows) -> None:
    """`rows`: the layer's `KVRows`, or a tuple of them, one a chunk of a chunked forward
    (`Runner.forward(chunk_rows=)`, the prefill's blocks), each chunk's rows at the positions after
    the previous one's. A chunked forward's rows leave for the host as soon as they are made and are
    published when the next layer's are, so the device holds at most two layers' rows of a block."""
    self.pool_pn = pool_pn
    self._ended.append(cache_layer)
    if rows is None:         # a forward whose rows are not kept (MTP drafting: rebuilt by its catch-up)
      return
    if not isinstance(rows, KVRows):
      for r in rows:
        r.k_sn.copy_to_host_async()
        r.v_sn.copy_to_host_async()
      for b in list(self._pending):
        self._publish(b, self._pending.pop(b))
      self._pending[cache_layer] = tuple(rows)
      return
    self._pending[cache_layer] = rows
    if len(self._pending) == len(self._order):   # the last layer: its rows start for the host now
      self._packed = staging.pack_rows(tuple(self._pending[a] for a in self._order))
      self._packed.copy_to_host_async()

  def pack_inert(self, rows: int) -> None:
    """`staging.pack_rows` of a target forward's `rows` new rows run once on zeros, so that a phase's
    first forward does not compile it (137 ms of the first token's 244 at 128K, H100, 2026-12-05)."""
    lay = self.layout
    z = KVRows(zeros_on_device((rows, lay.k_row_bytes), np.uint8), zeros_on_device((rows, lay.v_row_bytes), np.uint8))
    staging.pack_rows((z,) * (self.n_layers - (self.mtp_lease is not None)))

  def _publish(self, a: int, chunks) -> None:
    """Layer a's rows of a chunked forward into its host history, chunk by chunk."""
    t0 = time.perf_counter()
    chunks = [(np.asarray(r.k_sn), np.asarray(r.v_sn)) for r in chunks]
    self.counters["rows_wait_ms"] += (time.perf_counter() - t0) * 1e3
    hist, l = self.history_of(a)
    at, end = self._pos, self._pos + self._n
    for k_sn, v_sn in chunks:
      n = min(k_sn.shape[0], end - at)
      hist.write_rows(l, at, k_sn[:n], v_sn[:n])
      at += n

  def defer_rows(self, on: bool) -> None:
    """`on`: forwards end without publishing their rows (a wait for the forward); they are kept back
    until `truncate` of their cache (published up to its count), a forward that may read that
    history, `lease_mtp`, a rebind, or `defer_rows(False)`. A speculative round reads once."""
    self.kept.on = bool(on)
    if not on:
      self._publish_deferred()

  def _publish_deferred(self, cache: Optional[str] = None, below: Optional[int] = None) -> None:
    """Publish the kept-back rows of `cache` (None: every cache), those below token `below` only."""
    for k in self.kept.take(lambda a: self.history_of(a)[0].name, cache):
      self._write_rows(self._read_rows(k.packed_lsr, k.layers), k.pos, k.rows_below(below))
      self._drop_prefetch(k.pos, self.history_of(k.layers[0])[0])   # blocks prefetched before this
      self.counters["elapsed_ms"] += self.kept.elapsed_ms(k.t_begin)

  def _read_rows(self, packed_lsr, layers) -> Dict[int, np.ndarray]:
    t0 = time.perf_counter()
    rows = dict(zip(layers, np.asarray(packed_lsr)))     # one D2H of every row
    self.counters["rows_wait_ms"] += (time.perf_counter() - t0) * 1e3
    return rows

  def _write_rows(self, rows: Dict[int, np.ndarray], pos: int, n: int) -> None:
    """Layers' packed rows [S, K + V bytes] into their host histories, rows pos..pos + n - 1."""
    kb = self.layout.k_row_bytes
    for a, rows_sr in rows.items() if n else ():
      hist, l = self.history_of(a)
      hist.write_rows(l, pos, rows_sr[:n, :kb], rows_sr[:n, kb:])

  def end_forward(self) -> None:
    layers = tuple(self._ended)
    rows, kept = {}, False
    if self._pending and not isinstance(next(iter(self._pending.values())), KVRows):
      for a in list(self._pending):          # a chunked forward: the rows not yet published
        self._publish(a, self._pending.pop(a))
    elif self._pending:
      pending = tuple(self._pending)
      if self._packed is None or pending != self._order:
        self._packed = staging.pack_rows(tuple(self._pending[a] for a in pending))
      if self.kept.on:
        kept = self.kept.keep(Kept(self._packed, pending, self._pos, self._n, self._t_begin))
      else:
        rows = self._read_rows(self._packed, pending)
      self._packed = None
    t0 = time.perf_counter()
    for hist in {id(self.history_of(a)[0]): self.history_of(a)[0] for a in layers}.values():
      self._drop_prefetch(self._pos, hist)   # rows rewritten inside a prefetched block (rare)
    self._write_rows(rows, self._pos, self._n)
    for a in layers:     # the rows written stay in the open region (not in copy waves)
      live, _, open_page = self._open_split(a)
      self.device.commit(a, live, -1 if self._layer_plans[a].waves else open_page, self._pos + self._n)
    self._ended.clear()
    self._pending.clear()
    c = self.counters
    c["forwards"] += 1
    c["host_ms"] += (time.perf_counter() - t0) * 1e3
    c["host_end_ms"] += (time.perf_counter() - t0) * 1e3
    if not kept:
      c["elapsed_ms"] += self.kept.elapsed_ms(self._t_begin)

  # -- reporting -------------------------------------------------------------------
  @property
  def d2h_bytes(self) -> int:
    return sum(h.d2h_bytes for h in self.histories.values())

  def metrics(self) -> Dict[str, float]:
    m = dict(self.counters)
    m["waves_per_forward"] = m["waves"] / max(1, m["forwards"])
    m["capacities"] = compact_capacities(self.stream.resident_pages_per_layer)
    m.update(d2h_bytes=self.d2h_bytes, resident_pages=self.stream.resident_total,
             ring_slots=self.stream.ring_slots, pool_pages=self.stream.pool_pages,
             pool_mib=self.stream.pool_pages * self.layout.page_bytes / 2**20)
    return m
