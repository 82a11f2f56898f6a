"""Adaptive resident/ring policy: pure functions over frozen dataclasses.

The device KV pool of `pages` pages is split into `resident_pages_per_layer`
(R) resident pages for each of `layers` (L) attention layers and one shared
ring of `ring_slots = pages - R * L` slots. The layers belong to named
caches sharing one budget (`caches`: the target's attention layers, id
`TARGET_CACHE`, then the MTP layer, id `MTP_CACHE`: e.g. 16 + 1 = 17). Host
history is authoritative; the policy only proposes how many pages stay
resident and where. It is pure metadata: no jax, no device types, no copies.

Vocabulary follows the reference design (design-details.md, "Policy
vocabulary") so decisions compare with the reference's on the same inputs:

* `PolicyConfig`: `page_bytes`, `pool_bytes`, `layers`, `conversion_bytes`,
  `initial_ring_slots`, `fixed_ring`, `overlap_ratio`, `grow_evaluations`,
  `shrink_evaluations`, `cooldown_evaluations`, `caches` (+ `page_tokens`).
* `PolicyState`: `pages`, `minimum_ring_slots`, `resident_pages_per_layer`,
  `ring_slots`, `decode_active_pages`, `spread_streaming`, `starved`,
  `overprovisioned`, `evaluations_since_repartition`, `feedback_initialized`,
  `feedback_epoch`, `samples`, `misses`, `layer_samples`, `layer_misses`
  (+ `caches`, checked against the config's).
* `Observation`: `active_tokens`, `query_tokens`, `uniform_prefill`,
  `feedback` (`Feedback`: `available`, `epoch`, `samples`, `misses`,
  `copy_busy_ratio`, `peak_slots`, `layer_samples`, `layer_misses`).
* `Decision`: `next`, `target_resident_pages`, `partition_changed`,
  `layout_changed`, `feedback_used`, `feedback_reset`.
* `layout(...)` gives per layer `cache_id`, `cache_layer`, `capacity_pages`,
  `resident_live_pages`, `streamed_pages`, `waves`.

The rules, in evaluation order (P pages, L layers, R resident a layer, A
active pages, D decode active pages, T the overlap target; counters
saturate at `COUNTER_MAX`):

* Config (`budget`): L >= 1, overlap ratio finite and > 0, grow / shrink /
  cooldown >= 1, caches valid (ids non-zero and distinct, counts > 0, sum L),
  P = (pool - conversion) // page_bytes >= L + 1 (`minimum_pool_bytes`:
  1 resident page a layer + 1 ring slot), ring hint <= P - L.
  Hint = `initial_ring_slots` or min(8, P - L); minimum ring =
  P - ((P - hint) // L) * L; a fresh state starts at the minimum ring with
  `evaluations_since_repartition` at its maximum (cooldown satisfied).
* State check: budget and caches equal the config's, R >= 1, ring >=
  minimum ring, R * L + ring == P, D == 0 or D > R, initialized feedback
  with misses <= samples (per layer too).
* Observation check: query tokens >= 1. A = ceil(active / page tokens);
  decode = not uniform prefill and query <= `DECODE_QUERY_ROWS` (32).
* Feedback (when available) against the cursor (the totals last seen): a
  reset when not initialized, another epoch, misses > samples, copy-busy
  not finite or outside [0, 1], a total (or a layer counter) below the
  cursor, or more new misses than new samples. Otherwise new samples dS > 0
  make the feedback *used* with miss ratio dM / dS; dS == 0 is neither used
  nor reset (repeated totals never train). The cursor always moves to the
  new totals (0 when misses > samples, which also leaves it
  uninitialized). A reset zeroes `starved` and `overprovisioned`. When the
  feedback's or the cursor's layer samples are non-zero, dS and dM come
  from the per-layer deadline counters, and a starved signal from them
  lifts the cooldown.
* Overlap target T: the largest r <= min(A, (P - minimum ring) // L) with
  r == A or P - r * L >= overlap_ratio * (A - r); 0 when none; the rules
  use T' = max(1, T).
* Without pressure (A <= R): starved = overprovisioned = 0, spread off.
  With pressure, no fixed ring, and (entering decode with a new A, or
  feedback used): a used evaluation counts (`evaluations_since_repartition`
  + 1) and trains `starved` (below T' or starved signal) and
  `overprovisioned` (light signal); then the first of
  (a) entering decode and R > T' -> R = T';
  (b) cooled, used, (R > T' or starved signal), starved >= grow, R > 1 ->
      R = T' if above it, else R - 1 with spread streaming;
  (c) cooled, light, overprovisioned >= shrink, R < T', ring >= minimum
      ring + L -> R + 1.
  A changed partition zeroes the three counters. D = A when decoding and
  A > the new R, else 0 (spread streaming clears with it).
* Capacities (`capacities`): D <= R or spread -> R each; otherwise the
  deficit (D - R) * L is concentrated into S = max(min(L, ceil(deficit /
  ring)), ceil(deficit / D)) layers floor(j * L / S), the others holding D.
  `layout_changed` = partition changed or capacities changed.
* Layout: a layer serves min(A, capacity) resident and streams the rest in
  ceil(streamed / ring) waves through the ring.
* `rebind` (the arena grew or shrank): initialize on the new pool, one step
  with query 1 and no feedback, the layout.
* `admit_prefill`: a uniform prefill needs a ring of overlap_ratio x one
  layer's streamed pages; the ring grows to the overlap target for it,
  refused (`PolicyError`) with a fixed ring or when no split fits.

Invalid input raises `PolicyError` (a `ValueError`) naming the problem and
the number needed; no function here mutates its inputs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

from kvjax.streaming.policy_types import (  # noqa: F401  (re-exported: the policy vocabulary)
    PAGE_TOKENS,
    DECODE_QUERY_ROWS,
    STARVED_MISS_RATIO,
    STARVED_COPY_BUSY,
    LIGHT_COPY_BUSY,
    LIGHT_PEAK_FRACTION,
    AUTO_RING_HINT,
    COUNTER_MAX,
    TARGET_CACHE,
    MTP_CACHE,
    Caches,
    PolicyError,
    _sat_inc,
    _is_int,
    _ceil_div,
    model_caches,
    minimum_pool_pages,
    PolicyConfig,
    Budget,
    PolicyState,
    Feedback,
    Observation,
    Decision,
    LayerLayout,
    Layout,
    Admission,
    Rebind)


def _resolve_caches(c: PolicyConfig) -> Caches:
  caches = c.caches
  if caches == ():
    return ((TARGET_CACHE, c.layers),)
  try:
    caches = tuple((cid, n) for cid, n in caches)
  except (TypeError, ValueError):
    raise PolicyError(f"caches must be (cache id, layer count) pairs, got {c.caches!r}") from None
  ids = [cid for cid, _ in caches]
  for cid, n in caches:
    if not _is_int(cid) or cid == 0:
      raise PolicyError(f"caches: cache id {cid!r} must be a non-zero int")
    if not _is_int(n) or n < 1:
      raise PolicyError(f"caches: cache {cid} has {n!r} layers; it needs at least 1")
  if len(set(ids)) != len(ids):
    raise PolicyError(f"caches: ids {ids} must be distinct")
  total = sum(n for _, n in caches)
  if total != c.layers:
    raise PolicyError(f"caches count {total} layers; layers is {c.layers}")
  return caches


def budget(config: PolicyConfig) -> Budget:
  """Validates `config` and derives the page budget. Raises `PolicyError`."""
  c = config
  for name in ("page_bytes", "pool_bytes", "layers", "conversion_bytes",
               "initial_ring_slots", "grow_evaluations", "shrink_evaluations",
               "cooldown_evaluations", "page_tokens"):
    if not _is_int(getattr(c, name)):
      raise PolicyError(f"{name} must be an int, got {getattr(c, name)!r}")
  if not isinstance(c.fixed_ring, bool):
    raise PolicyError(f"fixed_ring must be a bool, got {c.fixed_ring!r}")
  if c.layers < 1:
    raise PolicyError(f"layers must be >= 1 (got {c.layers}): the pool needs at least 1 attention layer")
  if c.page_bytes < 1:
    raise PolicyError(f"page_bytes must be >= 1, got {c.page_bytes}")
  if c.page_tokens < 1:
    raise PolicyError(f"page_tokens must be >= 1, got {c.page_tokens}")
  if c.conversion_bytes < 0 or c.pool_bytes < 0:
    raise PolicyError(f"pool_bytes ({c.pool_bytes}) and conversion_bytes ({c.conversion_bytes}) must be >= 0")
  try:
    ratio = float(c.overlap_ratio)
  except (TypeError, ValueError):
    raise PolicyError(f"overlap_ratio must be a number, got {c.overlap_ratio!r}") from None
  if not math.isfinite(ratio) or ratio <= 0:
    raise PolicyError(f"overlap_ratio must be finite and > 0, got {c.overlap_ratio!r}")
  for name in ("grow_evaluations", "shrink_evaluations", "cooldown_evaluations"):
    if getattr(c, name) < 1:
      raise PolicyError(f"{name} must be >= 1, got {getattr(c, name)}")
  caches = _resolve_caches(c)
  need = minimum_pool_bytes(c.layers, c.page_bytes, c.conversion_bytes)
  if c.pool_bytes < need:
    raise PolicyError(
        f"pool of {c.pool_bytes} B is too small: {c.layers} layers need (layers + 1) = "
        f"{c.layers + 1} pages of {c.page_bytes} B plus {c.conversion_bytes} B conversion "
        f"scratch = {need} B; {need - c.pool_bytes} B missing")
  pages = (c.pool_bytes - c.conversion_bytes) // c.page_bytes
  if c.initial_ring_slots < 0:
    raise PolicyError(f"initial_ring_slots must be >= 0 (0 = auto), got {c.initial_ring_slots}")
  if c.initial_ring_slots > pages - c.layers:
    raise PolicyError(
        f"initial_ring_slots {c.initial_ring_slots} cannot fit: {pages} pages with one resident "
        f"page for each of {c.layers} layers leave at most {pages - c.layers} ring slots")
  hint = c.initial_ring_slots or min(AUTO_RING_HINT, pages - c.layers)
  resident = (pages - hint) // c.layers
  return Budget(pages=pages, minimum_ring_slots=pages - resident * c.layers,
                initial_resident_pages=resident, ring_hint=hint, caches=caches)


def minimum_pool_bytes(layers: int, page_bytes: int, conversion_bytes: int = 0) -> int:
  """Bytes of the smallest pool (`minimum_pool_pages`) plus the conversion scratch."""
  return minimum_pool_pages(layers) * page_bytes + conversion_bytes


def _check_counters(where: str, layers: int, samples, misses) -> None:
  """Per-layer counters: both empty, or both `layers` ints >= 0."""
  if not isinstance(samples, tuple) or not isinstance(misses, tuple):
    raise PolicyError(f"{where}layer_samples / layer_misses must be tuples, got {samples!r} / {misses!r}")
  if len(samples) != len(misses) or len(samples) not in (0, layers):
    raise PolicyError(
        f"{where}layer_samples / layer_misses have {len(samples)} / {len(misses)} entries; "
        f"both need 0 or {layers} (one a layer)")
  for v in samples + misses:
    if not _is_int(v) or v < 0:
      raise PolicyError(f"{where}layer counters must be ints >= 0, got {v!r}")


def _layer_excess(samples, misses) -> Optional[int]:
  """The first layer whose misses exceed its samples, or None."""
  return next((i for i, (s, m) in enumerate(zip(samples, misses)) if m > s), None)


def _check_state(config: PolicyConfig, state: PolicyState, b: Budget) -> None:
  if state.pages != b.pages or state.minimum_ring_slots != b.minimum_ring_slots:
    raise PolicyError(
        f"state was made for {state.pages} pages / {state.minimum_ring_slots} minimum ring slots; "
        f"config gives {b.pages} / {b.minimum_ring_slots}")
  if state.caches != b.caches:
    raise PolicyError(f"state was made for caches {state.caches}; config gives {b.caches}")
  r = state.resident_pages_per_layer
  if not _is_int(r) or r < 1:
    raise PolicyError(f"resident_pages_per_layer {r!r} must be >= 1")
  if state.ring_slots != b.pages - r * config.layers:
    raise PolicyError(
        f"ring_slots {state.ring_slots} != pages - resident * layers = "
        f"{b.pages} - {r} * {config.layers} = {b.pages - r * config.layers}")
  if state.ring_slots < b.minimum_ring_slots:
    raise PolicyError(
        f"ring_slots {state.ring_slots} below the minimum ring {b.minimum_ring_slots} "
        f"(resident_pages_per_layer {r} > {b.initial_resident_pages})")
  d = state.decode_active_pages
  if not _is_int(d) or not (d == 0 or d > r):
    raise PolicyError(f"decode_active_pages {d!r} must be 0 or > resident_pages_per_layer {r}")
  for name in ("starved", "overprovisioned", "evaluations_since_repartition", "samples", "misses"):
    v = getattr(state, name)
    if not _is_int(v) or not 0 <= v <= COUNTER_MAX:
      raise PolicyError(f"state.{name} {v!r} outside [0, {COUNTER_MAX}]")
  _check_counters("state.", config.layers, state.layer_samples, state.layer_misses)
  if state.feedback_initialized:
    if state.misses > state.samples:
      raise PolicyError(f"state has {state.misses} misses for {state.samples} samples (misses <= samples)")
    i = _layer_excess(state.layer_samples, state.layer_misses)
    if i is not None:
      raise PolicyError(f"state layer {i} has {state.layer_misses[i]} misses for "
                        f"{state.layer_samples[i]} samples (misses <= samples)")


def _check_observation(config: PolicyConfig, obs: Observation) -> None:
  if not _is_int(obs.active_tokens) or obs.active_tokens < 0:
    raise PolicyError(f"active_tokens must be an int >= 0, got {obs.active_tokens!r}")
  if not _is_int(obs.query_tokens) or obs.query_tokens < 1:
    raise PolicyError(f"query_tokens must be an int >= 1 (an evaluation queries 1 token or more), "
                      f"got {obs.query_tokens!r}")
  fb = obs.feedback
  if fb is not None and fb.available:
    for name in ("epoch", "samples", "misses", "peak_slots"):
      v = getattr(fb, name)
      if not _is_int(v) or (name != "epoch" and v < 0):
        raise PolicyError(f"feedback.{name} must be an int{'' if name == 'epoch' else ' >= 0'}, got {v!r}")
    _check_counters("feedback.", config.layers, fb.layer_samples, fb.layer_misses)


# ---- pure policy ------------------------------------------------------------

def initialize(config: PolicyConfig) -> PolicyState:
  """Fresh state: the minimum ring, cooldown already satisfied."""
  b = budget(config)
  return PolicyState(
      pages=b.pages, minimum_ring_slots=b.minimum_ring_slots,
      resident_pages_per_layer=b.initial_resident_pages,
      ring_slots=b.pages - b.initial_resident_pages * config.layers, caches=b.caches)


def active_pages(config: PolicyConfig, active_tokens: int) -> int:
  return _ceil_div(active_tokens, config.page_tokens)


def overlap_target(config: PolicyConfig, active: int) -> int:
  """Largest resident count per layer that leaves an overlapping ring.

  The largest `r` in `[1, min(active, (pages - min_ring) // layers)]` with
  `r == active` or `pages - r * layers >= overlap_ratio * (active - r)`;
  0 when none qualifies. The predicate is linear in `r`: with `layers >=
  overlap_ratio` it holds below a threshold (binary search); otherwise
  (one layer, ratio > 1) it holds above one, so the bound is the answer if
  it qualifies.
  """
  b = budget(config)
  layers, ratio = config.layers, float(config.overlap_ratio)
  hi = min(active, b.initial_resident_pages)
  if hi < 1:
    return 0

  def ok(r: int) -> bool:
    return r == active or b.pages - r * layers >= ratio * (active - r)

  if layers < ratio:
    return hi if ok(hi) else 0
  if not ok(1):
    return 0
  lo = 1
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if ok(mid):
      lo = mid
    else:
      hi = mid - 1
  return lo


@dataclasses.dataclass(frozen=True)
class _FeedbackResult:
  used: bool = False
  reset: bool = False
  miss_ratio: float = 0.0
  busy: float = 0.0
  peak_slots: int = 0
  from_layers: bool = False
  cursor: Optional[dict] = None     # new cursor fields, None: unchanged


def _feedback(config: PolicyConfig, state: PolicyState, fb: Optional[Feedback]) -> _FeedbackResult:
  if fb is None or not fb.available:
    return _FeedbackResult()
  L = config.layers
  invalid = fb.misses > fb.samples or _layer_excess(fb.layer_samples, fb.layer_misses) is not None
  cursor = dict(feedback_initialized=not invalid, feedback_epoch=fb.epoch,
                samples=0 if invalid else fb.samples, misses=0 if invalid else fb.misses,
                layer_samples=() if invalid else fb.layer_samples,
                layer_misses=() if invalid else fb.layer_misses)
  try:
    busy = float(fb.copy_busy_ratio)
  except (TypeError, ValueError):
    busy = math.nan
  from_layers = any(fb.layer_samples) or any(state.layer_samples)
  if from_layers:
    zeros = (0,) * L
    fs, fm = fb.layer_samples or zeros, fb.layer_misses or zeros
    ss, sm = state.layer_samples or zeros, state.layer_misses or zeros
    backwards = any(f < s for f, s in zip(fs + fm, ss + sm))
    ds, dm = sum(fs) - sum(ss), sum(fm) - sum(sm)
  else:
    backwards = False
    ds, dm = fb.samples - state.samples, fb.misses - state.misses
  backwards = backwards or fb.samples < state.samples or fb.misses < state.misses
  if (not state.feedback_initialized or fb.epoch != state.feedback_epoch or invalid
      or not 0.0 <= busy <= 1.0 or backwards or dm > ds):   # NaN fails the range test
    return _FeedbackResult(reset=True, cursor=cursor)
  if ds == 0:
    return _FeedbackResult(cursor=cursor)
  return _FeedbackResult(used=True, miss_ratio=dm / ds, busy=busy, peak_slots=fb.peak_slots,
                         from_layers=from_layers, cursor=cursor)


def capacities(config: PolicyConfig, state: PolicyState) -> Tuple[int, ...]:
  """Resident capacity of every layer under `state` (sums to R * L)."""
  L, r, d, ring = config.layers, state.resident_pages_per_layer, state.decode_active_pages, state.ring_slots
  if d <= r or state.spread_streaming:
    return (r,) * L
  deficit = (d - r) * L
  splits = max(min(L, _ceil_div(deficit, ring)), _ceil_div(deficit, d))
  base, rem = divmod(deficit, splits)
  caps = [d] * L
  for j in range(splits):
    caps[j * L // splits] = d - base - (1 if j < rem else 0)
  return tuple(caps)


def step(config: PolicyConfig, state: PolicyState, observation: Observation) -> Decision:
  """One policy evaluation. Pure: returns a new state in the decision."""
  b = budget(config)
  _check_state(config, state, b)
  _check_observation(config, observation)
  obs, L = observation, config.layers
  active = active_pages(config, obs.active_tokens)
  resident = state.resident_pages_per_layer
  decode = (not obs.uniform_prefill) and obs.query_tokens <= DECODE_QUERY_ROWS
  target = overlap_target(config, active)
  target1 = max(1, target)
  fb = _feedback(config, state, obs.feedback)

  starved, over = state.starved, state.overprovisioned
  evals, spread = state.evaluations_since_repartition, state.spread_streaming
  if fb.reset:
    starved = over = 0
  new_resident = resident
  entering = decode and active != state.decode_active_pages
  if active <= resident:
    starved = over = 0
    spread = False
  elif not config.fixed_ring and (entering or fb.used):
    below = resident > target1
    sig = fb.used and fb.miss_ratio > STARVED_MISS_RATIO and fb.busy < STARVED_COPY_BUSY
    light = (fb.used and fb.miss_ratio <= STARVED_MISS_RATIO and fb.busy < LIGHT_COPY_BUSY
             and fb.peak_slots < LIGHT_PEAK_FRACTION * state.ring_slots)
    if fb.used:
      evals = _sat_inc(evals)
      starved = _sat_inc(starved) if (below or sig) else 0
      over = _sat_inc(over) if light else 0
    cooled = evals >= config.cooldown_evaluations or (sig and fb.from_layers)
    if entering and below:
      new_resident = target1
    elif cooled and fb.used and (below or sig) and starved >= config.grow_evaluations and resident > 1:
      if below:
        new_resident = target1
      else:
        new_resident, spread = resident - 1, True
    elif (cooled and light and over >= config.shrink_evaluations and resident < target1
          and state.ring_slots >= state.minimum_ring_slots + L):
      new_resident = resident + 1

  partition_changed = new_resident != resident
  if partition_changed:
    starved = over = evals = 0
  d = active if decode and active > new_resident else 0
  if d == 0:
    spread = False
  nxt = dataclasses.replace(
      state, resident_pages_per_layer=new_resident, ring_slots=b.pages - new_resident * L,
      decode_active_pages=d, spread_streaming=spread, starved=starved, overprovisioned=over,
      evaluations_since_repartition=evals, **(fb.cursor or {}))
  return Decision(
      next=nxt, target_resident_pages=target, partition_changed=partition_changed,
      layout_changed=partition_changed or capacities(config, nxt) != capacities(config, state),
      feedback_used=fb.used, feedback_reset=fb.reset)


def layout(config: PolicyConfig, state: PolicyState, active_tokens: int) -> Layout:
  """Per-layer placement of `active_tokens` under `state`'s capacities."""
  b = budget(config)
  _check_state(config, state, b)
  if not _is_int(active_tokens) or active_tokens < 0:
    raise PolicyError(f"active_tokens must be an int >= 0, got {active_tokens!r}")
  active = active_pages(config, active_tokens)
  ring = state.ring_slots
  tags = [(cid, i) for cid, n in b.caches for i in range(n)]
  per = []
  for a, (cap, (cid, idx)) in enumerate(zip(capacities(config, state), tags)):
    live = min(active, cap)
    s = active - live
    per.append(LayerLayout(a, cid, idx, cap, live, s, _ceil_div(s, ring)))
  streamed = tuple(l.layer for l in per if l.streamed_pages)
  return Layout(active, state.resident_pages_per_layer, ring, state.spread_streaming,
                sum(l.streamed_pages for l in per), len(streamed), streamed,
                sum(l.waves for l in per), tuple(per))


def rebind(config: PolicyConfig, pool_bytes: int, active_tokens: int) -> Rebind:
  """The policy on a grown or shrunk pool: initialize on `pool_bytes`, one step with query 1 and no
  feedback at `active_tokens`, the layout. Raises `PolicyError` (nothing changed) when the new
  pool is refused."""
  new = dataclasses.replace(config, pool_bytes=pool_bytes)
  decision = step(new, initialize(new), Observation(active_tokens=active_tokens, query_tokens=1))
  return Rebind(new, decision, layout(new, decision.next, active_tokens))


def admit_prefill(config: PolicyConfig, state: PolicyState, observation: Observation) -> Admission:
  """Prefill admission: during a uniform prefill the ring must hold overlap_ratio x one layer's
  streamed pages (A - R); a smaller ring grows to the overlap target (a repartition: the counters
  restart). Refused (`PolicyError`, nothing changed) with a fixed ring, or when no split's ring
  covers it (the reservation exceeds the pool). Other evaluations pass unchanged."""
  b = budget(config)
  _check_state(config, state, b)
  _check_observation(config, observation)
  L, ratio = config.layers, float(config.overlap_ratio)
  active = active_pages(config, observation.active_tokens)
  r = state.resident_pages_per_layer
  required = ratio * max(0, active - r)
  if not observation.uniform_prefill or state.ring_slots >= required:
    return Admission(state, required, False)
  if config.fixed_ring:
    raise PolicyError(
        f"prefill admission: a prefill at {active} pages streams {active - r} pages a layer and needs "
        f"{math.ceil(required)} ring slots (overlap ratio {ratio}); the fixed ring has {state.ring_slots}")
  target = overlap_target(config, active)
  if target == 0:
    least = ratio * (active - 1)
    raise PolicyError(
        f"prefill admission: a prefill at {active} pages needs a ring of {math.ceil(least)} slots even "
        f"with 1 resident page a layer; the pool leaves {b.pages - L} "
        f"({math.ceil(least) - (b.pages - L)} more pages needed)")
  nxt = dataclasses.replace(state, resident_pages_per_layer=target, ring_slots=b.pages - target * L,
                            decode_active_pages=0, spread_streaming=False, starved=0,
                            overprovisioned=0, evaluations_since_repartition=0)
  return Admission(nxt, required, target != r)


# ---- feedback window --------------------------------------------------------

class FeedbackWindow:
  """Accumulates copy-stream measurements into `Feedback`.

  Within an epoch the counters (`samples`, `misses`, and with `layers` > 0
  the per-layer `layer_samples` / `layer_misses`) only grow (the policy
  takes deltas); the timing window (`copy_ms`, `elapsed_ms`, `bytes`,
  `timed_bytes`, `peak_slots`) restarts at every `roll()`. `copy_ms` is the
  time the copy stream was busy on the `timed_bytes` it timed, out of
  `elapsed_ms` wall time in which `bytes` were copied in total, so

      copy_busy_ratio = min(1, copy_ms / elapsed_ms * bytes / timed_bytes).

  It is a busy ratio, not measured link bandwidth. With nothing copied the
  ratio is 0; with bytes copied but none timed it is unknown and
  `feedback()` reports `available=False`. Every rejected update raises
  `PolicyError` and leaves the window unchanged.
  """

  def __init__(self, epoch: int = 0, layers: int = 0):
    if not _is_int(epoch):
      raise PolicyError(f"epoch must be an int, got {epoch!r}")
    if not _is_int(layers) or layers < 0:
      raise PolicyError(f"layers must be an int >= 0, got {layers!r}")
    self.epoch = epoch
    self.layers = layers
    self._clear_counters()
    self._clear_timing()

  def _clear_counters(self):
    self.samples = 0
    self.misses = 0
    self.layer_samples = (0,) * self.layers
    self.layer_misses = (0,) * self.layers

  def _clear_timing(self):
    self.copy_ms = 0.0
    self.elapsed_ms = 0.0
    self.bytes = 0
    self.timed_bytes = 0
    self.peak_slots = 0

  def _layer_deltas(self, samples, misses):
    samples, misses = tuple(samples), tuple(misses)
    if not samples and not misses:
      return (0,) * self.layers, (0,) * self.layers
    if len(samples) != self.layers or len(misses) != self.layers:
      raise PolicyError(f"layer_samples / layer_misses have {len(samples)} / {len(misses)} entries; "
                        f"the window counts {self.layers} layers")
    for v in samples + misses:
      if not _is_int(v) or v < 0:
        raise PolicyError(f"layer counter increment {v!r} must be an int >= 0: counters cannot decrease")
    new_s = tuple(a + b for a, b in zip(self.layer_samples, samples))
    new_m = tuple(a + b for a, b in zip(self.layer_misses, misses))
    i = _layer_excess(new_s, new_m)
    if i is not None:
      raise PolicyError(f"layer {i}: misses {new_m[i]} would exceed samples {new_s[i]}")
    return new_s, new_m

  def add(self, *, elapsed_ms: float, copy_ms: float = 0.0, bytes: int = 0,  # pylint: disable=redefined-builtin
          timed_bytes: int = 0, samples: int = 0, misses: int = 0,
          peak_slots: int = 0, layer_samples=(), layer_misses=()) -> None:
    """Adds one interval's increments (all >= 0; `elapsed_ms` > 0)."""
    vals = dict(copy_ms=copy_ms, elapsed_ms=elapsed_ms, bytes=bytes,
                timed_bytes=timed_bytes, samples=samples, misses=misses)
    for name, v in vals.items():
      try:
        f = float(v)
      except (TypeError, ValueError):
        raise PolicyError(f"{name} must be a number, got {v!r}") from None
      if not math.isfinite(f):
        raise PolicyError(f"{name} must be finite, got {v!r}")
      if f < 0:
        raise PolicyError(f"{name} increment {v!r} < 0: counters cannot decrease")
    for name in ("bytes", "timed_bytes", "samples", "misses"):
      if not _is_int(vals[name]):
        raise PolicyError(f"{name} must be an int, got {vals[name]!r}")
    if not _is_int(peak_slots) or peak_slots < 0:
      raise PolicyError(f"peak_slots must be an int >= 0, got {peak_slots!r}")
    if float(elapsed_ms) <= 0:
      raise PolicyError(f"elapsed_ms must be > 0 (zero elapsed time), got {elapsed_ms!r}")
    if self.timed_bytes + timed_bytes > self.bytes + bytes:
      raise PolicyError(
          f"timed bytes {self.timed_bytes + timed_bytes} would exceed copied bytes "
          f"{self.bytes + bytes} by {self.timed_bytes + timed_bytes - self.bytes - bytes} B")
    if self.misses + misses > self.samples + samples:
      raise PolicyError(
          f"misses {self.misses + misses} would exceed samples {self.samples + samples}")
    new_ls, new_lm = self._layer_deltas(layer_samples, layer_misses)
    self.copy_ms += float(copy_ms)
    self.elapsed_ms += float(elapsed_ms)
    self.bytes += bytes
    self.timed_bytes += timed_bytes
    self.samples += samples
    self.misses += misses
    self.layer_samples, self.layer_misses = new_ls, new_lm
    self.peak_slots = max(self.peak_slots, peak_slots)

  def observe(self, *, elapsed_ms: float, copy_ms: float, bytes: int,  # pylint: disable=redefined-builtin
              timed_bytes: int, samples: int, misses: int, peak_slots: int = 0,
              layer_samples=(), layer_misses=()) -> None:
    """Takes cumulative totals since the epoch / window began.

    Timing totals are relative to the last `roll()`, counters to the epoch.
    A total below the current one is a decreasing counter and is rejected;
    so is a total elapsed time that did not advance.
    """
    cur = dict(copy_ms=self.copy_ms, elapsed_ms=self.elapsed_ms, bytes=self.bytes,
               timed_bytes=self.timed_bytes, samples=self.samples, misses=self.misses)
    new = dict(copy_ms=copy_ms, elapsed_ms=elapsed_ms, bytes=bytes,
               timed_bytes=timed_bytes, samples=samples, misses=misses)
    deltas = {}
    for name, v in new.items():
      try:
        f = float(v)
      except (TypeError, ValueError):
        raise PolicyError(f"{name} must be a number, got {v!r}") from None
      if math.isnan(f):
        raise PolicyError(f"{name} is NaN")
      if f < cur[name]:
        raise PolicyError(f"{name} decreased from {cur[name]} to {v}")
      deltas[name] = v - cur[name]
    layer = {}
    for name, totals in (("layer_samples", tuple(layer_samples)), ("layer_misses", tuple(layer_misses))):
      if totals:
        old = getattr(self, name)
        if len(totals) != len(old):
          raise PolicyError(f"{name} has {len(totals)} entries; the window counts {len(old)} layers")
        i = next((i for i, (t, o) in enumerate(zip(totals, old)) if t < o), None)
        if i is not None:
          raise PolicyError(f"{name}[{i}] decreased from {old[i]} to {totals[i]}")
        layer[name] = tuple(t - o for t, o in zip(totals, old))
    self.add(peak_slots=peak_slots, **deltas, **layer)

  def copy_busy_ratio(self) -> float:
    if self.bytes == 0:
      return 0.0
    if self.timed_bytes == 0 or self.elapsed_ms <= 0:
      return math.nan
    return min(1.0, self.copy_ms / self.elapsed_ms * self.bytes / self.timed_bytes)

  def feedback(self) -> Feedback:
    busy = self.copy_busy_ratio()
    available = self.elapsed_ms > 0 and not math.isnan(busy)
    return Feedback(available=available, epoch=self.epoch, samples=self.samples,
                    misses=self.misses, copy_busy_ratio=0.0 if math.isnan(busy) else busy,
                    peak_slots=self.peak_slots, layer_samples=self.layer_samples,
                    layer_misses=self.layer_misses)

  def roll(self) -> Feedback:
    """Returns `feedback()` and starts a new timing window (same epoch)."""
    fb = self.feedback()
    self._clear_timing()
    return fb

  def new_epoch(self) -> int:
    """Starts a new epoch: every counter restarts at 0 (the policy resets)."""
    self.epoch += 1
    self._clear_counters()
    self._clear_timing()
    return self.epoch
