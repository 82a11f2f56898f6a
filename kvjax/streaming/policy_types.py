"""The policy's vocabulary: constants, errors and the frozen records `kvjax.streaming.policy` takes
and returns (config, budget, state, feedback, observation, decision, layout, admission, rebind).
Pure data, no jax; `kvjax.streaming.policy` re-exports every name."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

PAGE_TOKENS = 256            # token positions per KV page
DECODE_QUERY_ROWS = 32       # query rows at or below which an evaluation is "decode"
STARVED_MISS_RATIO = 0.01    # miss ratio above which the ring is starved ...
STARVED_COPY_BUSY = 0.90     # ... unless the copy stream is already this busy
LIGHT_COPY_BUSY = 0.50       # light: copy-busy below this ...
LIGHT_PEAK_FRACTION = 0.50   # ... and peak ring use below this fraction of the ring
AUTO_RING_HINT = 8           # initial_ring_slots = 0 -> min(8, pages - layers)
COUNTER_MAX = 2**32 - 1      # saturating counters (uint32 in the reference)
TARGET_CACHE = 1             # cache id of the target model's attention layers
MTP_CACHE = 2                # cache id of the MTP head's attention layer

Caches = Tuple[Tuple[int, int], ...]


class PolicyError(ValueError):
  """Invalid policy configuration, state or observation."""


def _sat_inc(n: int) -> int:
  return n + 1 if n < COUNTER_MAX else COUNTER_MAX


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def model_caches(target_layers: int, mtp_layers: int = 0) -> Caches:
  """The caches of a model sharing one pool: the target's attention layers, then the MTP layer(s)."""
  return ((TARGET_CACHE, target_layers),) + (((MTP_CACHE, mtp_layers),) if mtp_layers else ())


def minimum_pool_pages(layers: int) -> int:
  """The smallest pool that streams any context: 1 resident page a layer + 1 ring slot."""
  return layers + 1


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """Inputs fixed for a pool.

  `layers` counts every attention layer that shares the pool (target + MTP,
  e.g. 17); `caches` names them in order, ((cache id, layer count), ...);
  empty = one target cache of `layers` layers. `grow_evaluations` is the
  starved count needed to grow the ring (resident shrinks);
  `shrink_evaluations` the overprovisioned count needed to shrink it.
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
  caches: Caches = ()


@dataclasses.dataclass(frozen=True)
class Budget:
  """Page budget derived from a config."""

  pages: int
  minimum_ring_slots: int
  initial_resident_pages: int   # == max resident pages per layer
  ring_hint: int
  caches: Caches


@dataclasses.dataclass(frozen=True)
class PolicyState:
  """Policy state carried between evaluations (reference field names).

  `samples` / `misses` (and per layer `layer_samples` / `layer_misses`,
  empty when the feedback carries none) are the feedback cursor: the totals
  last seen in `feedback_epoch`.
  """

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
  layer_samples: Tuple[int, ...] = ()
  layer_misses: Tuple[int, ...] = ()
  caches: Caches = ()


@dataclasses.dataclass(frozen=True)
class Feedback:
  """Copy-stream feedback: counters that only grow within `epoch`.

  `samples` / `misses`: upload-level deadline samples and readiness misses.
  `layer_samples` / `layer_misses`: per-layer deadline counters (one sample
  per complete streamed layer, a miss when its pages were not ready when its
  attention was enqueued); empty when not measured. `copy_busy_ratio` is a
  busy ratio of the copy stream over a window (see `FeedbackWindow`), not
  measured link bandwidth; `peak_slots` the peak ring slots in use.
  """

  available: bool = True
  epoch: int = 0
  samples: int = 0
  misses: int = 0
  copy_busy_ratio: float = 0.0
  peak_slots: int = 0
  layer_samples: Tuple[int, ...] = ()
  layer_misses: Tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Observation:
  """One evaluation's input."""

  active_tokens: int
  query_tokens: int = 1
  feedback: Optional[Feedback] = None
  uniform_prefill: bool = False


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

  `cache_id` / `cache_layer`: the cache the layer belongs to and its index
  there; `capacity_pages`: resident pages assigned to the layer;
  `resident_live_pages`: active pages served from them; `streamed_pages`:
  active pages served through the ring; `waves`: ring fills for them
  (`ceil(streamed / ring)`, 0 when nothing streams).
  """

  layer: int
  cache_id: int
  cache_layer: int
  capacity_pages: int
  resident_live_pages: int
  streamed_pages: int
  waves: int


@dataclasses.dataclass(frozen=True)
class Layout:
  """Placement of every layer for one active length under one state."""

  active_pages: int
  resident_pages_per_layer: int
  ring_slots: int
  spread_streaming: bool
  deficit_pages: int            # pages streamed, all layers together
  splits: int                   # number of streamed layers
  streamed_layers: Tuple[int, ...]
  waves: int                    # ring fills per forward, all layers together
  layers: Tuple[LayerLayout, ...]

  @property
  def capacity_pages(self) -> int:
    return sum(l.capacity_pages for l in self.layers)

  @property
  def streamed_pages(self) -> int:
    return sum(l.streamed_pages for l in self.layers)

  @property
  def capacities(self) -> Tuple[int, ...]:
    return tuple(l.capacity_pages for l in self.layers)


@dataclasses.dataclass(frozen=True)
class Admission:
  """Output of `admit_prefill`: the state the prefill runs under."""

  next: PolicyState
  required_ring_slots: float    # overlap_ratio x one layer's streamed pages
  partition_changed: bool


@dataclasses.dataclass(frozen=True)
class Rebind:
  """Output of `rebind`: the policy on a grown or shrunk pool."""

  config: PolicyConfig
  decision: Decision
  layout: Layout


# ---- validation -------------------------------------------------------------
