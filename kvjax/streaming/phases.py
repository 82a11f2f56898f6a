"""The phase arena wired to the streamed KV, and the adaptive resident/ring split.

`PhasedKV` owns one fixed arena budget (`kvjax.streaming.arena.Arena`) with two layouts:
prefill (a workspace sized for the micro-batch step, smaller KV pool) and
decode (a workspace sized for the one-row step, larger KV pool). Both
workspaces come from the compiled group steps' own memory analysis. A phase
change runs the coordinator's safe handoff; the streamed KV consumer drains
its in-flight pool, drops its plans, and rebinds to the new pool size. The
host history is authoritative, so nothing is lost: the resident mirror is
rebuilt from it.

What the arena is in JAX: XLA decides where its temporaries live, so the
workspace region is a ledger entry (reserved by accounting, sized from
`memory_analysis()`), while the KV pool is a real device buffer sized to its
region. The bookkeeping (transactions, leases, fences, stale views) is the
reference design's.

`AdaptiveStreamedKV` asks `kvjax.streaming.policy.step` before every forward (and, in a prefill,
`policy.admit_prefill`: the ring grows to cover the overlap; where no ring can, copy waves carry
the prefill) and places the capacity of every cache layer that `policy.capacities` gives
(concentrated or spread in decode, uniform otherwise); a new partition or a new capacity profile
rebinds the pool, and the resident mirror is rebuilt from the host history. The target's
attention layers and the MTP layer are the policy's two caches of one budget. A pool of another
size (a phase change of the arena) rebinds the policy itself (`policy.rebind`). Its feedback comes
from a `policy.FeedbackWindow` fed after every forward with the provider's counters: samples and
misses (the deadline counters per cache layer, one sample per streamed layer after the first, a
miss when its staged pages were not on the device when its step was enqueued), peak ring slots in
use, copy time of the sampled (timed) uploads over the forward's wall time. A repartition starts
a new feedback epoch (the policy resets its cursor).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from kvjax.streaming import arena as arena_lib
from kvjax.streaming import budget as budget_lib
from kvjax.streaming import policy as policy_lib
from kvjax.streaming.budget import StreamBudgetError, StreamConfig, adaptive_ring_hint
from kvjax.streaming.plan import KVGeometry, adaptive_policy_config, region_split
from kvjax.streaming.provider import StreamedKV


class _KVConsumer(arena_lib.PhaseConsumer):
  name = "streamed-kv"

  def __init__(self, owner: "PhasedKV"):
    self.owner = owner
    self.lease = None

  def fences(self):
    kv = self.owner.kv
    return (arena_lib.JaxFence([kv.pool_pn]),) if kv.pool_pn is not None else ()

  def invalidate(self, plan):
    if arena_lib.KV_POOL in plan.changed:
      self.owner.kv.plans.clear()

  def release(self, plan):
    if self.lease is not None and arena_lib.KV_POOL in plan.changed:
      self.lease.release()
      self.lease = None

  def rebind(self, arena, plan):
    view = arena.view(arena_lib.KV_POOL)
    pages = view.size // self.owner.kv.layout.page_bytes
    self.owner.kv.rebind(self.owner.split_for(pages))
    if self.lease is None:
      self.lease = arena.acquire(arena_lib.KV_POOL, owner=self.name)


class PhasedKV:
  """A StreamedKV whose pool lives in the KV region of a two-layout phase arena."""

  def __init__(self, kv: StreamedKV, arena_bytes: int, prefill_workspace_bytes: int,
               decode_workspace_bytes: int, max_tokens: int, wave_pages: int = 1):
    self.kv = kv
    self.max_tokens = max_tokens
    self.wave_pages = wave_pages   # the widest forward's attention partition (`fixed_split`)
    self.layouts = arena_lib.phase_layouts(arena_bytes, prefill_workspace_bytes, decode_workspace_bytes,
                                           page_bytes=kv.layout.page_bytes)
    self.arena = arena_lib.Arena(arena_bytes)
    self.coordinator = arena_lib.PhaseCoordinator(self.arena)
    self.consumer = _KVConsumer(self)
    self.coordinator.register(self.consumer)
    self.phase: Optional[str] = None
    # KV region of each phase: the pool plus the staging of its in-flight uploads; both layouts are
    # validated up front (a refused phase is refused before any work)
    self.region_pages = {"prefill": self.layouts.prefill_kv_pages, "decode": self.layouts.decode_kv_pages}
    self.pool_pages = {}
    for p, pages in self.region_pages.items():
      try:
        self.pool_pages[p] = self.split_for(pages).pool_pages
      except StreamBudgetError as e:   # which layout is short (the prefill's workspace grows with ubatch)
        ws = prefill_workspace_bytes if p == "prefill" else decode_workspace_bytes
        raise StreamBudgetError(f"{p} phase ({budget_lib.mib(ws)} workspace, {pages} pages left): {e}") from None

  def split_for(self, region_pages: int) -> StreamConfig:
    """The split of a KV region of `region_pages` pages: the plan's rule (`plan.region_split`: the
    pool plus the staging reserve of its in-flight uploads; an adaptive provider's pool leaves room
    for the staging of any split, and its policy splits it on rebind)."""
    kv = self.kv
    adaptive = isinstance(kv, AdaptiveStreamedKV)
    geometry = KVGeometry(kv.n_layers - ("mtp" in kv.histories), kv.n_layers, kv.layout,
                          kv.wave_pages if adaptive else self.wave_pages)
    return region_split(geometry, region_pages, self.max_tokens, kv.stream.copy_pages, adaptive, kv.prefetch_depth)

  def enter(self, phase: str) -> None:
    if phase not in self.pool_pages:
      raise ValueError(f"unknown phase {phase!r}; phases: prefill, decode")
    if phase == self.phase:
      return
    spec = self.layouts.prefill if phase == "prefill" else self.layouts.decode
    self.coordinator.transition(spec)
    self.phase = phase

  # KVProvider: delegate to the bound StreamedKV
  def begin_forward(self, *a, **kw):
    if self.phase is None:
      raise RuntimeError("PhasedKV: enter('prefill') or enter('decode') before the first forward")
    return self.kv.begin_forward(*a, **kw)

  def layer_kv(self, a):
    return self.kv.layer_kv(a)

  def wave_kv(self, a, w):
    return self.kv.wave_kv(a, w)

  def end_layer(self, *a):
    return self.kv.end_layer(*a)

  def end_forward(self):
    return self.kv.end_forward()

  def reset(self):
    self.kv.reset()

  def truncate(self, cache, tokens):
    self.kv.truncate(cache, tokens)

  def lease_mtp(self, end_tokens):
    return self.kv.lease_mtp(end_tokens)

  def release_lease(self):
    self.kv.release_lease()

  def defer_rows(self, on):
    self.kv.defer_rows(on)

  def metrics(self):
    m = self.kv.metrics()
    m.update(prefill_pool_pages=self.pool_pages["prefill"], decode_pool_pages=self.pool_pages["decode"],
             arena_generation=self.arena.generation)
    return m


class AdaptiveStreamedKV(StreamedKV):
  """StreamedKV whose resident/ring split and per-layer capacities follow `kvjax.streaming.policy`:
  the target's attention layers and the MTP layer are the policy's two caches of one budget."""

  def __init__(self, cfg, layout, max_tokens, pool_pages: int, copy_pages: int = 32,
               policy_config: Optional[policy_lib.PolicyConfig] = None, pinned=None, wave_pages: int = 1):
    n_target = cfg.num_attention_layers
    n_layers = n_target + (1 if cfg.has_mtp else 0)
    # the widest forward's attention partition: the policy's ring holds one (`adaptive_ring_hint`),
    # so the copy waves of a layer it leaves more streamed pages than the ring hold whole partitions
    self.wave_pages = int(wave_pages)
    self.policy_config = policy_config or adaptive_policy_config(
        KVGeometry(n_target, n_layers, layout, self.wave_pages), pool_pages)
    self.policy_state = policy_lib.initialize(self.policy_config)
    caps = policy_lib.capacities(self.policy_config, self.policy_state)
    super().__init__(cfg, layout, max_tokens, StreamConfig(pool_pages, caps, copy_pages), pinned)
    self.decisions = []
    self.window = policy_lib.FeedbackWindow(layers=n_layers)
    self.counters.update(policy_admissions=0, admission_refusals=0, policy_rebinds=0)
    self._snapshot()

  def may_stream(self) -> bool:
    return True   # the policy may shrink any layer's resident region

  def may_wave(self, mtp_lease: bool = False) -> bool:
    return True   # the policy may give any layer fewer ring slots than it streams

  def may_resplit(self) -> bool:
    return True   # the policy re-splits the pool as the history grows

  def _wave_cap(self, stream: StreamConfig):
    # the reserve holds the stages of the split the policy aims at, not of every split: a layer
    # the policy leaves more streamed pages streams them in copy waves (`adaptive_staging_cap`)
    return budget_lib.adaptive_staging_cap(stream.pool_pages, self.max_tokens, self.layout, self.n_layers,
                                           stream.copy_pages, self.wave_pages)

  def initial_split(self, pool_pages: int) -> StreamConfig:
    """The split a fresh policy gives a pool of `pool_pages` (`PhasedKV` sizes its phases with it;
    `rebind` then applies the policy's own step on that pool)."""
    config = self._config_for(pool_pages)
    return StreamConfig(pool_pages, policy_lib.capacities(config, policy_lib.initialize(config)),
                        self.stream.copy_pages)

  def _config_for(self, pool_pages: int) -> policy_lib.PolicyConfig:
    """The policy's config on a pool of `pool_pages` (a partition's ring hint follows the pool)."""
    hint = adaptive_ring_hint(pool_pages, self.n_layers, self.wave_pages)
    return dataclasses.replace(self.policy_config, pool_bytes=pool_pages * self.layout.page_bytes
                               + self.policy_config.conversion_bytes, initial_ring_slots=hint)

  def _snapshot(self):
    self._last = dict(self.counters)
    self._last_layers = (self.deadline_samples.copy(), self.deadline_misses.copy())

  def begin_forward(self, pos, n_tokens, cache_layers, wave_pages=1):
    feedback = self.window.roll() if self.window.elapsed_ms > 0 else None
    prefill = n_tokens > policy_lib.DECODE_QUERY_ROWS
    rows = max(1, n_tokens)   # a forward of no row (`SequenceState.prime`) is laid out as the next decode's
    obs = policy_lib.Observation(active_tokens=pos + rows, query_tokens=rows, feedback=feedback,
                                 uniform_prefill=prefill)
    decision = policy_lib.step(self.policy_config, self.policy_state, obs)
    state, admitted = decision.next, False
    if prefill:
      try:
        admission = policy_lib.admit_prefill(self.policy_config, state, obs)
        state, admitted = admission.next, admission.partition_changed
      except policy_lib.PolicyError:   # no ring covers the prefill: copy waves carry it instead
        self.counters["admission_refusals"] += 1
    old = self.stream
    caps = policy_lib.capacities(self.policy_config, state)
    relaid = caps != old.resident_pages_per_layer
    if relaid:     # a new partition or capacity profile: the resident mirror is rebuilt from the host
      self.rebind(StreamConfig(old.pool_pages, caps, old.copy_pages))
    try:
      super().begin_forward(pos, n_tokens, cache_layers, wave_pages)
    except StreamBudgetError:
      if relaid:   # leave the previous committed split in force
        self.rebind(old)
      raise
    self.policy_state = state
    self.decisions.append(decision)
    self.counters["policy_admissions"] += admitted
    if decision.partition_changed or admitted:
      self.window.new_epoch()
    self._ring_peak_before = self.counters["ring_peak_slots"]
    self.counters["ring_peak_slots"] = 0   # per-forward peak for the window

  def rebind(self, stream: StreamConfig) -> None:
    """A pool of another size (the arena grew or shrank: a phase change) rebinds the policy too
    (`policy.rebind`: a fresh state on the new pool, one step at the committed length) and places
    its capacities; the same pool takes `stream` as given."""
    if stream.pool_pages == self.stream.pool_pages:
      super().rebind(stream)
      return
    tokens = max(int(np.max(h.tokens)) for h in self.histories.values())
    config = self._config_for(stream.pool_pages)
    r = policy_lib.rebind(config, config.pool_bytes, tokens)
    super().rebind(StreamConfig(stream.pool_pages, r.layout.capacities, stream.copy_pages))
    self.policy_config, self.policy_state = r.config, r.decision.next
    self.decisions.append(r.decision)
    self.counters["policy_rebinds"] += 1
    self.window.new_epoch()

  def metrics(self):
    m = super().metrics()
    m.update(policy_decisions=len(self.decisions),
             policy_repartitions=sum(d.partition_changed for d in self.decisions))
    return m

  def reset(self):
    super().reset()
    self._snapshot()

  def end_forward(self):
    super().end_forward()
    c, last = self.counters, self._last
    d = {k: c[k] - last[k] for k in ("elapsed_ms", "timed_copy_ms", "h2d_bytes", "timed_bytes",
                                      "readiness_misses", "deadline_samples")}
    layer_samples = tuple(int(x) for x in self.deadline_samples - self._last_layers[0])
    layer_misses = tuple(int(x) for x in self.deadline_misses - self._last_layers[1])
    self.window.add(elapsed_ms=max(d["elapsed_ms"], 1e-6), copy_ms=d["timed_copy_ms"],
                    bytes=int(d["h2d_bytes"]), timed_bytes=int(min(d["timed_bytes"], d["h2d_bytes"])),
                    samples=int(d["deadline_samples"]), misses=int(d["readiness_misses"]),
                    peak_slots=int(c["ring_peak_slots"]), layer_samples=layer_samples,
                    layer_misses=layer_misses)
    c["ring_peak_slots"] = max(c["ring_peak_slots"], self._ring_peak_before)
    self._snapshot()
