"""Adaptive resident/ring policy: pure functions over frozen dataclasses.

The device KV pool of `pages` pages is split into `resident_pages_per_layer`
resident pages for each of `layers` attention layers (target layers plus the
MTP layer, e.g. 16 + 1 = 17) and one shared ring of
`ring_slots = pages - resident_pages_per_layer * layers` slots. Host history
is authoritative; the policy only proposes how many pages stay resident. It
is pure metadata: no jax, no device types, no copies (cross-cutting rule 6).

Vocabulary follows the reference design (`design-details.md`, "Policy
vocabulary") so decisions can be compared with the reference on the same
inputs:

* `PolicyConfig`: `page_bytes`, `pool_bytes`, `layers`, `conversion_bytes`,
  `initial_ring_slots`, `fixed_ring`, `overlap_ratio`, `grow_evaluations`,
  `shrink_evaluations`, `cooldown_evaluations` (+ `page_tokens`).
* `PolicyState`: `pages`, `minimum_ring_slots`, `resident_pages_per_layer`,
  `ring_slots`, `decode_active_pages`, `spread_streaming`, `starved`,
  `overprovisioned`, `evaluations_since_repartition`, `feedback_initialized`,
  `feedback_epoch`, `samples`, `misses`.
* `Observation`: `active_tokens`, `query_tokens`, `feedback`,
  `uniform_prefill` (+ `deadline_miss`, see below).
* `Decision`: `next`, `target_resident_pages`, `partition_changed`,
  `layout_changed`, `feedback_used`, `feedback_reset`.
* `layout(...)` gives per layer `capacity_pages`, `resident_live_pages`,
  `streamed_pages`, `waves`.

Rules (reference wording in quotes; kvjax's choices where the reference is
ambiguous are marked CHOICE and are tested in tests/test_policy.py):

* Budget: `pages = (pool_bytes - conversion_bytes) // page_bytes`;
  ring hint `h = initial_ring_slots or min(8, pages - layers)`;
  `minimum_ring_slots = pages - ((pages - h) // layers) * layers`;
  initial resident `(pages - minimum_ring_slots) // layers`.
* `active = ceil(active_tokens / page_tokens)`; pressure when
  `active > resident`. Decode mode when not `uniform_prefill` and
  `query_tokens <= DECODE_QUERY_ROWS` (32).
* Overlap target: the largest `r` in `[1, min(active, (pages - min_ring) //
  layers)]` with `r == active` or `pages - r * layers >= overlap_ratio *
  (active - r)`; 1 when none qualifies. The predicate is linear in `r`; when
  `layers >= overlap_ratio` it is monotone (true below a threshold) and a
  binary search finds the answer. CHOICE: when `layers < overlap_ratio`
  (only possible with one layer) the predicate grows with `r`, so the answer
  is the upper bound if it qualifies, else 1.
* Feedback: `samples` and `misses` are counters that grow within an
  `epoch`; the policy keeps the last ones and uses deltas. A reset (counters
  `starved` / `overprovisioned` cleared, baseline re-taken from this
  feedback, no feedback-driven rule this evaluation) happens on an epoch
  change, a decreasing counter, a copy-busy ratio outside [0, 1] or NaN, and
  (CHOICE) more new misses than new samples. CHOICE: the first available
  feedback only sets the baseline (`feedback_used` False); an evaluation with
  no new samples carries no signal (`feedback_used` False). Negative
  counters are bad input (`PolicyError`), not a reset.
  `starved` signal: miss ratio > 0.01 and copy-busy < 0.90.
  `light` signal: miss ratio <= 0.01, copy-busy < 0.50 and
  `peak_slots < 0.50 * ring_slots`.
* Counters (saturating at `COUNTER_MAX`): `starved += 1` if resident is
  above target or the starved signal is set, else 0; `overprovisioned += 1`
  if light, else 0. Without pressure both are 0.
* `evaluations_since_repartition` is incremented (saturating) at every
  evaluation before the rules run; a fresh state holds `COUNTER_MAX`, so the
  cooldown is already satisfied. The cooldown holds while
  `evaluations_since_repartition < cooldown_evaluations`.
* Rules (none when `fixed_ring`, none without pressure), first match wins:
  A. decode with an active page count different from `decode_active_pages`
     (CHOICE: a prefill evaluation stores 0 there, so the first decode
     evaluation after prefill always counts as "entering decode") and
     resident above target -> resident = target (ignores the cooldown).
  B. "grow" the ring: after the cooldown or on a hard deadline miss, if
     (resident above target or starved signal) and
     `starved >= grow_evaluations` and resident > 1 -> resident = target if
     above it, else resident - 1 and `spread_streaming` is set (CHOICE: the
     spread mark applies to the resident - 1 branch only).
  C. "shrink" the ring: after the cooldown, if light and
     `overprovisioned >= shrink_evaluations` and resident < target and
     `ring_slots >= minimum_ring_slots + layers` -> resident + 1.
  Any partition change resets `starved`, `overprovisioned` and
  `evaluations_since_repartition` (to 0). CHOICE: `spread_streaming` is
  cleared by rule A and whenever there is no pressure.
* Hard deadline miss (CHOICE of representation): `Observation.deadline_miss`
  (default False). It only lifts the cooldown for rule B.
* `layout_changed` (CHOICE): the partition changed or `spread_streaming`
  flipped. A growing active count under the same partition streams more
  pages but is not a layout change.
* Placement (see `layout`): deficit `(active - resident) * layers` pages
  are streamed. Concentrated placement streams as few layers as possible:
  `splits = max(min(layers, ceil(deficit / ring)), ceil(deficit / active))`
  layers (CHOICE: the last `splits` layers, so the copy stream can prefetch
  while the earlier, fully resident layers compute), the deficit shared
  evenly between them (the first ones take the remainder). Spread
  streaming streams `active - resident` pages from every layer.
  Copy waves of a layer = `ceil(streamed / ring_slots)`.

Invalid configurations raise `PolicyError` (a `ValueError`) naming the
problem and the number needed; no function here mutates its inputs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

PAGE_TOKENS = 256            # token positions per KV page
DECODE_QUERY_ROWS = 32       # query rows at or below which an evaluation is "decode"
STARVED_MISS_RATIO = 0.01    # miss ratio above which the ring is starved ...
STARVED_COPY_BUSY = 0.90     # ... unless the copy stream is already this busy
LIGHT_COPY_BUSY = 0.50       # light: copy-busy below this ...
LIGHT_PEAK_FRACTION = 0.50   # ... and peak ring use below this fraction of the ring
AUTO_RING_HINT = 8           # initial_ring_slots = 0 -> min(8, pages - layers)
COUNTER_MAX = 2**32 - 1      # saturating counters (uint32 in the reference)


class PolicyError(ValueError):
  """Invalid policy configuration, state or observation."""


def _sat_inc(n: int) -> int:
  return n + 1 if n < COUNTER_MAX else COUNTER_MAX


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """Inputs fixed for a session.

  `layers` counts every attention layer that shares the pool (target + MTP,
  e.g. 17). `grow_evaluations` is the starved-count needed to grow the ring
  (resident shrinks); `shrink_evaluations` the overprovisioned-count needed
  to shrink it (resident grows).
  """

  page_bytes: int
  pool_bytes: int
  layers: int
  conversion_bytes: int = 0
  initial_ring_slots: int = 0
  fixed_ring: bool = False
  overlap_ratio: float = 1.10
  grow_evaluations: int = 3
  shrink_evaluations: int = 8
  cooldown_evaluations: int = 64
  page_tokens: int = PAGE_TOKENS


@dataclasses.dataclass(frozen=True)
class Budget:
  """Page budget derived from a config."""

  pages: int
  minimum_ring_slots: int
  initial_resident_pages: int   # == max resident pages per layer
  ring_hint: int


@dataclasses.dataclass(frozen=True)
class PolicyState:
  """Policy state carried between evaluations (reference field names)."""

  pages: int
  minimum_ring_slots: int
  resident_pages_per_layer: int
  ring_slots: int
  decode_active_pages: int = 0
  spread_streaming: bool = False
  starved: int = 0
  overprovisioned: int = 0
  evaluations_since_repartition: int = COUNTER_MAX
  feedback_initialized: bool = False
  feedback_epoch: int = 0
  samples: int = 0
  misses: int = 0


@dataclasses.dataclass(frozen=True)
class Feedback:
  """Copy-stream feedback. `samples` / `misses` are counters within `epoch`.

  `copy_busy_ratio` is a busy ratio of the copy stream over a window (see
  `FeedbackWindow`), not measured link bandwidth. `peak_slots` is the peak
  number of ring slots in use during the window.
  """

  available: bool = True
  epoch: int = 0
  samples: int = 0
  misses: int = 0
  copy_busy_ratio: float = 0.0
  peak_slots: int = 0


@dataclasses.dataclass(frozen=True)
class Observation:
  """One evaluation's input. `deadline_miss` marks a hard deadline miss."""

  active_tokens: int
  query_tokens: int = 1
  feedback: Optional[Feedback] = None
  uniform_prefill: bool = False
  deadline_miss: bool = False


@dataclasses.dataclass(frozen=True)
class Decision:
  """Output of `step`: the next state and what changed."""

  next: PolicyState
  target_resident_pages: int
  partition_changed: bool
  layout_changed: bool
  feedback_used: bool
  feedback_reset: bool


@dataclasses.dataclass(frozen=True)
class LayerLayout:
  """Placement of one layer's active history.

  `capacity_pages`: resident pages assigned to the layer;
  `resident_live_pages`: active pages served from them;
  `streamed_pages`: active pages served through the ring;
  `waves`: ring fills needed for this layer (`ceil(streamed / ring)`).
  """

  layer: int
  capacity_pages: int
  resident_live_pages: int
  streamed_pages: int
  waves: int


@dataclasses.dataclass(frozen=True)
class Layout:
  """Placement of every layer for one active length under one partition."""

  active_pages: int
  resident_pages_per_layer: int
  ring_slots: int
  spread_streaming: bool
  deficit_pages: int            # pages that must be streamed, all layers together
  splits: int                   # number of streamed layers
  streamed_layers: Tuple[int, ...]
  waves: int                    # ceil(deficit / ring): ring fills per forward
  layers: Tuple[LayerLayout, ...]

  @property
  def capacity_pages(self) -> int:
    return sum(l.capacity_pages for l in self.layers)

  @property
  def streamed_pages(self) -> int:
    return sum(l.streamed_pages for l in self.layers)


# ---- validation -------------------------------------------------------------

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
  need = (c.layers + 1) * c.page_bytes + c.conversion_bytes
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
                initial_resident_pages=resident, ring_hint=hint)


def _check_state(config: PolicyConfig, state: PolicyState, b: Budget) -> None:
  if state.pages != b.pages or state.minimum_ring_slots != b.minimum_ring_slots:
    raise PolicyError(
        f"state was made for {state.pages} pages / {state.minimum_ring_slots} minimum ring slots; "
        f"config gives {b.pages} / {b.minimum_ring_slots}")
  r = state.resident_pages_per_layer
  if not _is_int(r) or not 1 <= r <= b.initial_resident_pages:
    raise PolicyError(f"resident_pages_per_layer {r!r} outside [1, {b.initial_resident_pages}]")
  if state.ring_slots != b.pages - r * config.layers:
    raise PolicyError(
        f"ring_slots {state.ring_slots} != pages - resident * layers = "
        f"{b.pages - r * config.layers}")


def _check_observation(obs: Observation) -> None:
  if not _is_int(obs.active_tokens) or obs.active_tokens < 0:
    raise PolicyError(f"active_tokens must be an int >= 0, got {obs.active_tokens!r}")
  if not _is_int(obs.query_tokens) or not 0 <= obs.query_tokens <= obs.active_tokens:
    raise PolicyError(
        f"query_tokens must be an int in [0, active_tokens={obs.active_tokens}], got {obs.query_tokens!r}")
  fb = obs.feedback
  if fb is not None and fb.available:
    for name in ("epoch", "samples", "misses", "peak_slots"):
      v = getattr(fb, name)
      if not _is_int(v) or (name != "epoch" and v < 0):
        raise PolicyError(f"feedback.{name} must be an int{'' if name == 'epoch' else ' >= 0'}, got {v!r}")


# ---- pure policy ------------------------------------------------------------

def initialize(config: PolicyConfig) -> PolicyState:
  """Fresh state: initial partition, cooldown already satisfied."""
  b = budget(config)
  return PolicyState(
      pages=b.pages, minimum_ring_slots=b.minimum_ring_slots,
      resident_pages_per_layer=b.initial_resident_pages,
      ring_slots=b.pages - b.initial_resident_pages * config.layers)


def active_pages(config: PolicyConfig, active_tokens: int) -> int:
  return -(-active_tokens // config.page_tokens)


def overlap_target(config: PolicyConfig, active: int) -> int:
  """Largest resident count per layer that leaves an overlapping ring.

  The largest `r` in `[1, min(active, (pages - min_ring) // layers)]` with
  `r == active` or `pages - r * layers >= overlap_ratio * (active - r)`;
  1 when none qualifies.
  """
  b = budget(config)
  layers, ratio = config.layers, float(config.overlap_ratio)
  hi = min(active, b.initial_resident_pages)
  if hi < 1:
    return 1

  def ok(r: int) -> bool:
    return r == active or b.pages - r * layers >= ratio * (active - r)

  if layers < ratio:  # predicate increasing in r (single layer, ratio > 1)
    return hi if ok(hi) else 1
  if not ok(1):
    return 1
  lo = 1
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if ok(mid):
      lo = mid
    else:
      hi = mid - 1
  return lo


def _feedback(state: PolicyState, fb: Optional[Feedback]):
  """Returns (used, reset, starved_signal, light_signal, baseline updates)."""
  base = dict(feedback_initialized=state.feedback_initialized,
              feedback_epoch=state.feedback_epoch, samples=state.samples,
              misses=state.misses)
  if fb is None or not fb.available:
    return False, False, False, False, base
  new_base = dict(feedback_initialized=True, feedback_epoch=fb.epoch,
                  samples=fb.samples, misses=fb.misses)
  if not state.feedback_initialized:
    return False, False, False, False, new_base
  try:
    busy = float(fb.copy_busy_ratio)
  except (TypeError, ValueError):
    busy = math.nan
  ds, dm = fb.samples - state.samples, fb.misses - state.misses
  if (fb.epoch != state.feedback_epoch or ds < 0 or dm < 0 or dm > ds
      or not 0.0 <= busy <= 1.0):  # NaN fails the range test
    return False, True, False, False, new_base
  if ds == 0:
    return False, False, False, False, new_base
  miss_ratio = dm / ds
  starved = miss_ratio > STARVED_MISS_RATIO and busy < STARVED_COPY_BUSY
  light = (miss_ratio <= STARVED_MISS_RATIO and busy < LIGHT_COPY_BUSY
           and fb.peak_slots < LIGHT_PEAK_FRACTION * state.ring_slots)
  return True, False, starved, light, new_base


def step(config: PolicyConfig, state: PolicyState, observation: Observation) -> Decision:
  """One policy evaluation. Pure: returns a new state in the decision."""
  b = budget(config)
  _check_state(config, state, b)
  _check_observation(observation)
  obs = observation
  layers = config.layers
  active = active_pages(config, obs.active_tokens)
  resident = state.resident_pages_per_layer
  pressure = active > resident
  decode = (not obs.uniform_prefill) and obs.query_tokens <= DECODE_QUERY_ROWS
  target = overlap_target(config, active)
  evals = _sat_inc(state.evaluations_since_repartition)

  used, reset, starved_sig, light_sig, fb_base = _feedback(state, obs.feedback)
  if reset or not pressure:
    starved = overprovisioned = 0
  else:
    starved = _sat_inc(state.starved) if (resident > target or starved_sig) else 0
    overprovisioned = _sat_inc(state.overprovisioned) if light_sig else 0

  new_resident, spread = resident, state.spread_streaming
  if not pressure:
    spread = False
  elif not config.fixed_ring:
    cooled = evals >= config.cooldown_evaluations
    if decode and active != state.decode_active_pages and resident > target:
      new_resident, spread = target, False
    elif ((cooled or obs.deadline_miss) and (resident > target or starved_sig)
          and starved >= config.grow_evaluations and resident > 1):
      if resident > target:
        new_resident = target
      else:
        new_resident, spread = resident - 1, True
    elif (cooled and light_sig and overprovisioned >= config.shrink_evaluations
          and resident < target
          and state.ring_slots >= state.minimum_ring_slots + layers):
      new_resident = resident + 1

  partition_changed = new_resident != resident
  if partition_changed:
    starved = overprovisioned = evals = 0
  nxt = dataclasses.replace(
      state, resident_pages_per_layer=new_resident,
      ring_slots=b.pages - new_resident * layers,
      decode_active_pages=active if decode else 0,
      spread_streaming=spread, starved=starved, overprovisioned=overprovisioned,
      evaluations_since_repartition=evals, **fb_base)
  return Decision(
      next=nxt, target_resident_pages=target,
      partition_changed=partition_changed,
      layout_changed=partition_changed or spread != state.spread_streaming,
      feedback_used=used, feedback_reset=reset)


def layout(config: PolicyConfig, state: PolicyState, active_tokens: int) -> Layout:
  """Per-layer placement of `active_tokens` under `state`'s partition."""
  b = budget(config)
  _check_state(config, state, b)
  if not _is_int(active_tokens) or active_tokens < 0:
    raise PolicyError(f"active_tokens must be an int >= 0, got {active_tokens!r}")
  L = config.layers
  active = active_pages(config, active_tokens)
  r, ring = state.resident_pages_per_layer, state.ring_slots
  if active <= r:
    per = tuple(LayerLayout(i, r, active, 0, 0) for i in range(L))
    return Layout(active, r, ring, False, 0, 0, (), 0, per)
  deficit = (active - r) * L
  if state.spread_streaming:
    s = active - r
    w = -(-s // ring)
    per = tuple(LayerLayout(i, r, r, s, w) for i in range(L))
    return Layout(active, r, ring, True, deficit, L, tuple(range(L)),
                  -(-deficit // ring), per)
  splits = max(min(L, -(-deficit // ring)), -(-deficit // active))
  q, rem = divmod(deficit, splits)
  streamed_layers = tuple(range(L - splits, L))
  per = []
  for i in range(L):
    if i < L - splits:
      per.append(LayerLayout(i, active, active, 0, 0))
    else:
      s = q + (1 if i - (L - splits) < rem else 0)
      per.append(LayerLayout(i, active - s, active - s, s, -(-s // ring)))
  return Layout(active, r, ring, False, deficit, splits, streamed_layers,
                -(-deficit // ring), tuple(per))


# ---- feedback window --------------------------------------------------------

class FeedbackWindow:
  """Accumulates copy-stream measurements into `Feedback`.

  Within an epoch `samples` and `misses` only grow (the policy takes deltas);
  the timing window (`copy_ms`, `elapsed_ms`, `bytes`, `timed_bytes`,
  `peak_slots`) restarts at every `roll()`. `copy_ms` is the time the copy
  stream was busy on the `timed_bytes` it timed, out of `elapsed_ms` wall
  time in which `bytes` were copied in total, so

      copy_busy_ratio = min(1, copy_ms / elapsed_ms * bytes / timed_bytes).

  It is a busy ratio, not measured link bandwidth. With nothing copied the
  ratio is 0; with bytes copied but none timed it is unknown and
  `feedback()` reports `available=False`. Every rejected update raises
  `PolicyError` and leaves the window unchanged.
  """

  _TIMING = ("copy_ms", "elapsed_ms", "bytes", "timed_bytes")
  _COUNTS = ("samples", "misses")

  def __init__(self, epoch: int = 0):
    if not _is_int(epoch):
      raise PolicyError(f"epoch must be an int, got {epoch!r}")
    self.epoch = epoch
    self.samples = 0
    self.misses = 0
    self._clear_timing()

  def _clear_timing(self):
    self.copy_ms = 0.0
    self.elapsed_ms = 0.0
    self.bytes = 0
    self.timed_bytes = 0
    self.peak_slots = 0

  def add(self, *, elapsed_ms: float, copy_ms: float = 0.0, bytes: int = 0,  # pylint: disable=redefined-builtin
          timed_bytes: int = 0, samples: int = 0, misses: int = 0,
          peak_slots: int = 0) -> None:
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
    self.copy_ms += float(copy_ms)
    self.elapsed_ms += float(elapsed_ms)
    self.bytes += bytes
    self.timed_bytes += timed_bytes
    self.samples += samples
    self.misses += misses
    self.peak_slots = max(self.peak_slots, peak_slots)

  def observe(self, *, elapsed_ms: float, copy_ms: float, bytes: int,  # pylint: disable=redefined-builtin
              timed_bytes: int, samples: int, misses: int, peak_slots: int = 0) -> None:
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
    self.add(peak_slots=peak_slots, **deltas)

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
                    peak_slots=self.peak_slots)

  def roll(self) -> Feedback:
    """Returns `feedback()` and starts a new timing window (same epoch)."""
    fb = self.feedback()
    self._clear_timing()
    return fb

  def new_epoch(self) -> int:
    """Starts a new epoch: every counter restarts at 0 (the policy resets)."""
    self.epoch += 1
    self.samples = self.misses = 0
    self._clear_timing()
    return self.epoch
