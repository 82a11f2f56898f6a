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

`AdaptiveStreamedKV` asks `kvjax.streaming.policy.step` before every forward and applies
the capacity of every cache layer that `policy.layout` gives (`policy_capacities`:
concentrated or spread in decode, uniform in prefill); a new partition or a new
capacity profile rebinds the pool, and the resident mirror is rebuilt from the
host history. Its feedback comes from a
`policy.FeedbackWindow` fed after every forward with the provider's counters:
samples = layers served, misses = readiness misses, peak ring slots in use,
copy time of the sampled (timed) uploads over the forward's wall time. A
repartition starts a new feedback epoch (the policy re-baselines).
"""

from __future__ import annotations

from typing import Optional, Tuple


from kvjax.streaming import arena as arena_lib
from kvjax.streaming import policy as policy_lib
from kvjax.streaming.budget import StreamBudgetError, StreamConfig
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
               decode_workspace_bytes: int, max_tokens: int):
    self.kv = kv
    self.max_tokens = max_tokens
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
    self.pool_pages = {p: self.split_for(pages).pool_pages for p, pages in self.region_pages.items()}

  def split_for(self, region_pages: int) -> StreamConfig:
    """The split of a KV region of `region_pages` pages: the pool plus the staging reserve of its
    in-flight uploads (`fit_split`)."""
    from kvjax.streaming.budget import fit_split
    return fit_split(region_pages, self.kv.n_layers, self.max_tokens, self.kv.layout,
                     self.kv.stream.copy_pages, self.kv.prefetch_depth)

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

  def metrics(self):
    m = self.kv.metrics()
    m.update(prefill_pool_pages=self.pool_pages["prefill"], decode_pool_pages=self.pool_pages["decode"],
             arena_generation=self.arena.generation)
    return m


def policy_capacities(config: policy_lib.PolicyConfig, state: policy_lib.PolicyState, active_tokens: int,
                      prefill: bool) -> Tuple[int, ...]:
  """Resident capacity per cache layer under `state`: `policy.layout`'s (concentrated or spread)
  in decode, the uniform `resident_pages_per_layer` in a prefill (whose active count grows every
  chunk) and while nothing needs streaming. The capacities sum to the same resident total, so
  the ring keeps the policy's size."""
  r = state.resident_pages_per_layer
  if prefill or policy_lib.active_pages(config, active_tokens) <= r:
    return (r,) * config.layers
  return tuple(l.capacity_pages for l in policy_lib.layout(config, state, active_tokens).layers)


class AdaptiveStreamedKV(StreamedKV):
  """StreamedKV whose resident/ring split and per-layer capacities follow `kvjax.streaming.policy`."""

  def __init__(self, cfg, layout, max_tokens, pool_pages: int, copy_pages: int = 32,
               policy_config: Optional[policy_lib.PolicyConfig] = None, pinned=None):
    n_layers = cfg.num_attention_layers + (1 if cfg.has_mtp else 0)
    self.policy_config = policy_config or policy_lib.PolicyConfig(
        page_bytes=layout.page_bytes, pool_bytes=pool_pages * layout.page_bytes, layers=n_layers,
        page_tokens=layout.page_tokens)
    self.policy_state = policy_lib.initialize(self.policy_config)
    caps = policy_capacities(self.policy_config, self.policy_state, 0, True)
    super().__init__(cfg, layout, max_tokens, StreamConfig(pool_pages, caps, copy_pages), pinned)
    self.decisions = []
    self.window = policy_lib.FeedbackWindow()
    self._last = dict(self.counters)

  def begin_forward(self, pos, n_tokens, cache_layers, wave_pages=1):
    feedback = self.window.roll() if self.window.elapsed_ms > 0 else None
    prefill = n_tokens > policy_lib.DECODE_QUERY_ROWS
    obs = policy_lib.Observation(active_tokens=pos + n_tokens, query_tokens=n_tokens, feedback=feedback,
                                 uniform_prefill=prefill)
    decision = policy_lib.step(self.policy_config, self.policy_state, obs)
    old = self.stream
    caps = policy_capacities(self.policy_config, decision.next, pos + n_tokens, prefill)
    relaid = caps != old.resident_pages_per_layer
    if relaid:     # a new partition or capacity profile: the resident mirror is rebuilt from the host
      self.rebind(StreamConfig(old.pool_pages, caps, old.copy_pages))
    try:
      super().begin_forward(pos, n_tokens, cache_layers, wave_pages)
    except StreamBudgetError:
      if relaid:   # leave the previous committed split in force
        self.rebind(old)
      raise
    self.policy_state = decision.next
    self.decisions.append(decision)
    if decision.partition_changed:
      self.window.new_epoch()
    self._ring_peak_before = self.counters["ring_peak_slots"]
    self.counters["ring_peak_slots"] = 0   # per-forward peak for the window

  def metrics(self):
    m = super().metrics()
    m.update(policy_decisions=len(self.decisions),
             policy_repartitions=sum(d.partition_changed for d in self.decisions))
    return m

  def reset(self):
    super().reset()
    self._last = dict(self.counters)

  def end_forward(self):
    super().end_forward()
    c, last = self.counters, self._last
    d = {k: c[k] - last[k] for k in ("elapsed_ms", "timed_copy_ms", "h2d_bytes", "timed_bytes",
                                      "readiness_misses", "deadline_samples")}
    self.window.add(elapsed_ms=max(d["elapsed_ms"], 1e-6), copy_ms=d["timed_copy_ms"],
                    bytes=int(d["h2d_bytes"]), timed_bytes=int(min(d["timed_bytes"], d["h2d_bytes"])),
                    samples=int(d["deadline_samples"]), misses=int(d["readiness_misses"]),
                    peak_slots=int(c["ring_peak_slots"]))
    c["ring_peak_slots"] = max(c["ring_peak_slots"], self._ring_peak_before)
    self._last = dict(c)
