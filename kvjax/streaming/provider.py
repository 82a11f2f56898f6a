"""The streamed KV provider: resident pages + one shared ring in one device pool.

Physical pool (one device buffer, `pool_pn [pool_pages, page_bytes]` uint8):

    [ resident region of cache layer 0 | ... | of cache layer L-1 | ring slots ... ]

Cache layers are the target's attention layers followed by the MTP layer
(separate logical caches with their own host histories, sharing the pool).
Cache layer `a` keeps its first `capacity[a]` logical pages resident; its
later pages stream through the ring. The ring is circular and shared by all
layers: each layer's streamed pages take the next slots after the previous
layer's, wrapping at the end (so a layer's history has at most three spans:
resident, ring before the wrap, ring after the wrap).

Per forward and attention layer (`KVProvider` protocol of `kvjax.engine`):

* `begin_forward` checks that every layer's streamed pages fit in the ring and
  that the histories have room — before anything changes (a refused forward
  leaves the provider as it was).
* `layer_kv(a)` places layer a's staged pages into their ring slots (donated,
  in-place `dynamic_update_slice`), uploads any resident page that is not yet
  valid on the device, **issues the next layer's host-to-device copies** (into
  staging buffers: they overlap this layer's compute), builds and validates
  the span plan, and returns `(pool, page_table)`.
* `end_layer` keeps the updated pool and the rows written (the KV writer's tail).
* `end_forward` publishes the new rows to the host histories (device -> host:
  only the changed tail).

Counters: h2d bytes and calls, d2h bytes, ring wraps, streamed pages,
readiness misses (a staged copy not complete when its consumer was enqueued).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.model import KVRows
from kvjax.streaming.budget import StreamBudgetError, StreamConfig, staging_unit_pages
from kvjax.streaming.host_history import HostHistory
from kvjax.streaming.span_plan import SpanPlan, make_plan, page_table, spans_from_pages
from kvjax_pallas.page_layout import PageLayout


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("pieces",))
def _place_run(pool_pn, arrays, dst_page, *, pieces: Tuple[Tuple[int, int], ...]):
  """pool[dst : dst + total] = concat(array[offset : offset + count] for each piece).

  One call per contiguous destination run. Measured on the H200 (jax 0.11.2):
  a donated dynamic_update_slice into the 2.2 GB pool costs about 0.4 ms
  whatever the update size (XLA copies the buffer), so the number of calls,
  not the bytes, is what matters here.
  """
  parts = [jax.lax.slice_in_dim(a, off, off + cnt, axis=0) for a, (off, cnt) in zip(arrays, pieces)]
  run = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
  return jax.lax.dynamic_update_slice(pool_pn, run.astype(pool_pn.dtype), (dst_page, 0))


class _Staged(NamedTuple):
  """Pages on their way to the device: `count` logical pages from `first`, at `offset` in `array`."""
  array: jax.Array
  offset: int
  first: int
  count: int


def _to_device(src):
  """Host pages (numpy, or a pinned_host jax array) -> a device array (async copy)."""
  if isinstance(src, jax.Array):
    return jax.device_put(src, src.sharding.with_memory_kind("device"))
  return jax.device_put(src, jax.devices()[0])


class StreamedKV:
  """KV provider over host-authoritative histories, resident pages and one shared ring."""

  def __init__(self, cfg: ModelConfig, layout: PageLayout, max_tokens: int, stream: StreamConfig,
               pinned: Optional[bool] = None, split_at_wrap: bool = False, prefetch_depth: int = 1):
    self.cfg, self.layout, self.stream = cfg, layout, stream
    self.split_at_wrap = split_at_wrap
    if prefetch_depth < 1:
      raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
    self.prefetch_depth = prefetch_depth  # layers whose copies are in flight ahead of the compute
    n_target = cfg.num_attention_layers
    self.n_layers = n_target + (1 if cfg.has_mtp else 0)
    self._check_stream(stream)
    max_pages = layout.pages_for(max_tokens)
    self.max_tokens = max_pages * layout.page_tokens
    self.histories = {"target": HostHistory("target", layout, n_target, max_pages, stream.copy_pages, pinned)}
    if cfg.has_mtp:
      self.histories["mtp"] = HostHistory("mtp", layout, 1, max_pages, stream.copy_pages, pinned)
    self.max_pages = max_pages
    self.pool_pn = None
    self.resident_valid = np.zeros((self.n_layers,), np.int64)  # valid prefix pages on the device
    self.plans: Dict[int, SpanPlan] = {}
    self._bind(stream)
    self._pending: Dict[int, KVRows] = {}
    self._staged: Dict[int, List[Tuple[int, jax.Array]]] = {}
    self._slots: Dict[int, np.ndarray] = {}
    self._order: Tuple[int, ...] = ()
    self._ring_in_use = 0          # ring slots allocated to layers not yet consumed this forward
    self._layer_streamed: Dict[int, int] = {}
    self.timing_interval = 16      # every N-th forward, one upload is timed (synchronised) for copy-busy
    self._staging_live = 0         # bytes of staging buffers the provider holds (uploads not placed)
    self.counters = dict(h2d_bytes=0, h2d_calls=0, ring_wraps=0, streamed_pages=0, readiness_misses=0,
                         forwards=0, copy_issue_ms=0.0, max_spans=0,
                         ring_peak_slots=0, timed_copy_ms=0.0, timed_bytes=0, elapsed_ms=0.0,
                         staging_peak_bytes=0)

  # -- re-layout (phase change, policy repartition, new request) ---------------------
  def rebind(self, stream: StreamConfig) -> None:
    """Adopt a new physical split. The host history is authoritative, so the resident mirror is
    simply rebuilt from it (lazily, page by page, on the next forwards)."""
    self._check_stream(stream)
    if stream.copy_pages != self.stream.copy_pages:
      raise ValueError("copy_pages is fixed for the lifetime of the host histories")
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
    """Lay out resident regions and the ring in a pool of `stream.pool_pages` (reused if same size)."""
    if self.pool_pn is None or int(self.pool_pn.shape[0]) != stream.pool_pages:
      self.pool_pn = None  # free the old buffer before taking the new one
      self.pool_pn = jnp.zeros((stream.pool_pages, self.layout.page_bytes), jnp.uint8)
    self.stream = stream
    self.staging_unit = staging_unit_pages(stream, self.max_tokens, self.layout,
                                           self.histories["target"].pinned)
    caps = stream.resident_pages_per_layer
    self.resident_base = np.concatenate([[0], np.cumsum(caps)[:-1]]).astype(np.int64)
    self.ring_base = stream.resident_total
    self.ring_head = 0
    self.resident_valid[:] = 0
    self.plans.clear()

  def truncate(self, cache: str, tokens: int) -> None:
    """Forget rows >= tokens of logical cache "target" or "mtp" (rejected speculative rows): the host
    history is authoritative, so that is where they go; device copies past kv_len are never read."""
    if cache not in self.histories:
      raise ValueError(f"unknown logical cache {cache!r}; caches: {sorted(self.histories)}")
    self.histories[cache].truncate(tokens)

  def reset(self) -> None:
    """Start a new request: forget every token (host and device)."""
    for h in self.histories.values():
      h.truncate(0)
    self.resident_valid[:] = 0
    self.ring_head = 0
    self.plans.clear()

  # -- mapping -----------------------------------------------------------------
  def history_of(self, cache_layer: int) -> Tuple[HostHistory, int]:
    n_target = self.cfg.num_attention_layers
    if cache_layer < n_target:
      return self.histories["target"], cache_layer
    return self.histories["mtp"], 0

  def _split(self, a: int, active: int) -> Tuple[int, int]:
    """(resident live pages, streamed pages) of cache layer a with `active` pages."""
    live = min(self.stream.resident_pages_per_layer[a], active)
    return live, active - live

  # -- KVProvider ----------------------------------------------------------------
  def begin_forward(self, pos: int, n_tokens: int, cache_layers: Tuple[int, ...]) -> None:
    lay = self.layout
    end = pos + n_tokens
    if end > self.max_tokens:
      raise ValueError(f"context full: {end} tokens needed, host history holds {self.max_tokens} "
                       f"({end - self.max_tokens} more; raise --ctx-size)")
    active = lay.pages_for(end)
    for a in cache_layers:
      hist, l = self.history_of(a)
      if pos > hist.tokens[l]:
        raise ValueError(f"cache layer {a}: forward at position {pos} but only {hist.tokens[l]} tokens "
                         f"are committed")
      _, streamed = self._split(a, active)
      if streamed > self.stream.ring_slots:
        missing = streamed - self.stream.ring_slots
        raise StreamBudgetError(
            f"ring too small: cache layer {a} streams {streamed} pages at {end} tokens but the ring has "
            f"{self.stream.ring_slots} slots ({missing} more pages = "
            f"{missing * lay.page_bytes / 2**20:.1f} MiB needed)")
    self._pos, self._n, self._active = pos, n_tokens, active
    self._content = lay.pages_for(pos)  # pages that already hold tokens
    self._order = tuple(cache_layers)
    self._pending.clear()
    self._staged.clear()
    self._slots.clear()
    self._ring_in_use = 0
    self._layer_streamed.clear()
    self._t_begin = time.perf_counter()
    self._time_next_copy = self.timing_interval > 0 and self.counters["forwards"] % self.timing_interval == 0
    for a in self._order[:self.prefetch_depth]:
      self._prefetch(a)

  def _prefetch(self, a: int) -> None:
    """Allocate ring slots for layer a and issue its host->device copies (staging buffers)."""
    hist, l = self.history_of(a)
    live, streamed = self._split(a, self._active)
    ring = self.stream.ring_slots
    head = self.ring_head
    if streamed and head + streamed > ring:
      # the ring wraps: with split_at_wrap the layer's pages continue at slot 0 (two ring spans);
      # otherwise the whole run restarts at slot 0 (one span, one in-pool copy)
      self.counters["ring_wraps"] += 1
      if not self.split_at_wrap:
        head = 0
    slots = (head + np.arange(streamed)) % ring
    self.ring_head = (head + streamed) % ring
    self._slots[a] = slots
    self.counters["streamed_pages"] += streamed
    self._layer_streamed[a] = streamed
    self._ring_in_use += streamed
    self.counters["ring_peak_slots"] = max(self.counters["ring_peak_slots"], min(self._ring_in_use, ring))
    # upload pages that hold committed tokens; pages past them are only written this forward
    t0 = time.perf_counter()
    self._staged[a] = staged = self._upload(hist, l, live, min(self._active, self._content))
    self.counters["copy_issue_ms"] += (time.perf_counter() - t0) * 1e3
    if self._time_next_copy and staged:
      # copy-busy sampling: time this layer's uploads to completion (they were just issued)
      jax.block_until_ready([st.array for st in staged])
      self.counters["timed_copy_ms"] += (time.perf_counter() - t0) * 1e3
      self.counters["timed_bytes"] += sum(int(st.array.nbytes) for st in staged)
      self._time_next_copy = False

  def _upload(self, hist: HostHistory, l: int, lo: int, hi: int) -> List[_Staged]:
    """Issue host->device copies of logical pages [lo, hi): whole pinned copy units where the
    history has them (large, fast copies), pageable numpy only for the partial tail page(s).
    Pageable pieces are padded to a power of two so the set of compiled shapes stays small."""
    c, pb = hist.copy_pages, self.layout.page_bytes
    staged = []
    page = lo
    while page < hi:
      chunk = page // c
      end = min(hi, (chunk + 1) * c)
      arr, valid = hist.pinned_chunk(l, chunk)
      pinned_end = min(end, chunk * c + valid) if arr is not None else page
      if pinned_end > page:
        staged.append(_Staged(_to_device(arr), page - chunk * c, page, pinned_end - page))
        self.counters["h2d_bytes"] += c * pb
        self.counters["h2d_calls"] += 1
      if end > pinned_end:
        n = end - pinned_end
        padded = 1 << (n - 1).bit_length()
        src = hist.pages_lpn[l, pinned_end:pinned_end + padded]
        if src.shape[0] < padded:
          src = np.concatenate([src, np.zeros((padded - src.shape[0], pb), np.uint8)])
        staged.append(_Staged(_to_device(src), 0, pinned_end, n))
        self.counters["h2d_bytes"] += padded * pb
        self.counters["h2d_calls"] += 1
      page = end
    self._staging_live += sum(int(st.array.nbytes) for st in staged)
    self.counters["staging_peak_bytes"] = max(self.counters["staging_peak_bytes"], self._staging_live)
    return staged

  def _place(self, pool, staged: List[_Staged], dst: Callable[[int], int]):
    """Copy staged pages into the pool at `dst(logical page)`: one call per contiguous
    destination run (a ring allocation never splits a layer's run, see `_prefetch`)."""
    run_arrays, run_pieces, run_dst, next_dst = [], [], None, None
    for st in staged:
      if hasattr(st.array, "is_ready") and not st.array.is_ready():
        self.counters["readiness_misses"] += 1
      i = 0
      while i < st.count:
        d = dst(st.first + i)
        n = 1
        while i + n < st.count and dst(st.first + i + n) == d + n:
          n += 1
        if run_dst is not None and d != next_dst:
          pool = _place_run(pool, tuple(run_arrays), jnp.int32(run_dst), pieces=tuple(run_pieces))
          run_arrays, run_pieces, run_dst = [], [], None
        if run_dst is None:
          run_dst = d
        run_arrays.append(st.array)
        run_pieces.append((st.offset + i, n))
        next_dst = d + n
        i += n
    if run_dst is not None:
      pool = _place_run(pool, tuple(run_arrays), jnp.int32(run_dst), pieces=tuple(run_pieces))
    self._staging_live -= sum(int(st.array.nbytes) for st in staged)   # placed: buffers let go
    return pool

  def layer_kv(self, cache_layer: int):
    a = cache_layer
    if a not in self._staged:
      raise RuntimeError(f"cache layer {a} was not announced to begin_forward ({self._order})")
    # the next layers' copies go out before this layer's compute is dispatched
    idx = self._order.index(a)
    for nxt in self._order[idx + 1:idx + 1 + self.prefetch_depth]:
      if nxt not in self._staged and nxt not in self._slots:
        self._prefetch(nxt)
    live, _ = self._split(a, self._active)
    slots = self._slots[a]
    pool = self._place(self.pool_pn, self._staged.pop(a),
                       lambda p: self.ring_base + int(slots[p - live]))
    pool = self._fill_resident(a, pool)
    self.pool_pn = pool
    table = self._table(a)
    return pool, jnp.asarray(table)

  def _fill_resident(self, a: int, pool):
    """Upload resident pages holding committed tokens that the device does not hold yet
    (first forwards, and after a rebind: the resident mirror is rebuilt from the host), in
    unit-aligned pieces whose staging fits one staging unit (`staging_unit_pages`)."""
    hist, l = self.history_of(a)
    live, _ = self._split(a, self._active)
    need = min(live, self._content)
    first = int(self.resident_valid[a])
    base = int(self.resident_base[a])
    c = self.stream.copy_pages
    piece = max(c, (self.staging_unit - c) // c * c)   # unit-aligned pieces: staging <= one unit
    while first < need:
      end = min(need, (first // piece + 1) * piece)
      pool = self._place(pool, self._upload(hist, l, first, end), lambda p: base + p)
      first = end
    return pool

  def _table(self, a: int) -> np.ndarray:
    live, streamed = self._split(a, self._active)
    slots = self._slots[a]
    runs = [(int(self.resident_base[a]), live, "resident")]
    if streamed:
      wrap = int(np.argmax(slots[1:] < slots[:-1]) + 1) if streamed > 1 and np.any(slots[1:] < slots[:-1]) \
          else streamed
      runs.append((self.ring_base + int(slots[0]), wrap, "ring"))
      if wrap < streamed:
        runs.append((self.ring_base + int(slots[wrap]), streamed - wrap, "ring_wrapped"))
    spans, kinds = spans_from_pages(self.layout, "pool", runs, self._pos + self._n)
    plan = make_plan(self.layout, {"pool": self.stream.pool_pages * self.layout.page_bytes}, spans,
                     self._pos + self._n, self._n, kinds)
    self.plans[a] = plan
    self.counters["max_spans"] = max(self.counters["max_spans"], len(plan.spans))
    return page_table(plan, self.layout, self.max_pages, buffer="pool")

  def end_layer(self, cache_layer: int, pool_pn, rows: KVRows) -> None:
    self.pool_pn = pool_pn
    self._pending[cache_layer] = rows
    self._ring_in_use -= self._layer_streamed.get(cache_layer, 0)

  def end_forward(self) -> None:
    rows = jax.device_get(self._pending)   # one D2H of every layer's new rows
    for a, r in rows.items():
      hist, l = self.history_of(a)
      hist.write_rows(l, self._pos, np.asarray(r.k_sn)[:self._n], np.asarray(r.v_sn)[:self._n])
      live, _ = self._split(a, self._active)
      self.resident_valid[a] = live
    self._pending.clear()
    self.counters["forwards"] += 1
    self.counters["elapsed_ms"] += (time.perf_counter() - self._t_begin) * 1e3

  # -- reporting -------------------------------------------------------------------
  @property
  def d2h_bytes(self) -> int:
    return sum(h.d2h_bytes for h in self.histories.values())

  def metrics(self) -> Dict[str, float]:
    m = dict(self.counters)
    m.update(d2h_bytes=self.d2h_bytes, resident_pages=self.stream.resident_total,
             ring_slots=self.stream.ring_slots, pool_pages=self.stream.pool_pages,
             pool_mib=self.stream.pool_pages * self.layout.page_bytes / 2**20)
    return m
