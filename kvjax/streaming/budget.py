"""Budget arithmetic of the streamed cache: the physical split of the device pool and the staging
that in-flight uploads need, sized before anything is allocated.

* `StreamConfig`: pool pages, resident capacity per cache layer, host copy unit.
* `fixed_split` / `fit_split`: a uniform resident prefix per layer whose ring holds one layer's
  streamed pages; `fit_split` fits pool + staging reserve into an arena's pages.
* `staging_pages` / `staging_unit_pages` / `staging_reserve_pages`: device pages held by uploads in
  flight (`StreamedKV` keeps its live staging at or under the reserve).
* `fit_adaptive_pool` / `adaptive_staging_reserve_pages`: the same for the adaptive policy, whose
  split changes at run time; `adaptive_minimum_pool` / `adaptive_ring_hint`: the smallest pool it
  streams through (its ring holds an attention partition for copy waves).
* `minimum_pool` / `check_pool`: the smallest pool a budget of pages streams through;
  `smallest_budget` / `minimum_arena`: the least pages / bytes an arena's KV region / the arena needs.

A budget becomes a split in one place, `kvjax.streaming.plan.plan_kv`, made of these pieces.

Every refusal is a `StreamBudgetError` that names the pages (and MiB) missing.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from kvjax.streaming.policy import minimum_pool_pages  # 1 resident page a layer + 1 ring slot
from kvjax.streaming.policy_types import AUTO_RING_HINT
from kvjax_pallas.page_layout import PageLayout


class StreamBudgetError(ValueError):
  """The device pool cannot hold what a forward needs (the message says how much is missing)."""


def pinned_host() -> bool:
  """Whether this backend has pinned host memory (imports JAX: the arithmetic itself does not)."""
  from kvjax.streaming.host_history import pinned_available   # pylint: disable=import-outside-toplevel
  return pinned_available()


def mib(nbytes: float) -> str:
  """Bytes as MiB with three significant digits (small budgets do not print as 0.0)."""
  return f"{nbytes / 2**20:.3g} MiB"


@dataclasses.dataclass(frozen=True)
class StreamConfig:
  """Physical split of the device pool (fixed here; `kvjax.policy` proposes adaptive splits)."""
  pool_pages: int
  resident_pages_per_layer: Tuple[int, ...]   # capacity of each cache layer's resident region
  copy_pages: int = 32                          # host copy unit (power of two)

  @property
  def resident_total(self) -> int:
    return sum(self.resident_pages_per_layer)

  @property
  def ring_slots(self) -> int:
    return self.pool_pages - self.resident_total


def fixed_split(pool_pages: int, n_layers: int, max_tokens: int, layout: PageLayout,
                copy_pages: int = 32, wave_pages: int = 1) -> StreamConfig:
  """Uniform resident pages per layer. Where the pool allows, the ring holds one layer's streamed
  pages at `max_tokens` (one attention call a layer) and the copy_pages - 1 its open region adds:
  r = min(A, floor((P - A - copy_pages + 1) / (L - 1))) with A = pages at max_tokens. Otherwise every layer streams in copy waves through a ring of
  h = min(max(8, W), P - L) slots (the policy's initial ring hint, at least the W = `wave_pages`
  of the widest forward's attention partition: a copy wave holds whole partitions), r = floor((P - h)
  / L). Below the minimum pool (L + 1 pages), or a ring that cannot hold W pages where layers wave
  -> StreamBudgetError with the pages missing."""
  a = layout.pages_for(max_tokens)
  need = minimum_pool_pages(n_layers)
  if pool_pages < need:
    missing = need - pool_pages
    raise StreamBudgetError(
        f"KV pool too small: {pool_pages} pages ({mib(pool_pages * layout.page_bytes)}) cannot "
        f"stream {n_layers} layers: the minimum is {need} pages (1 resident page a layer + 1 ring slot): "
        f"{missing} more pages ({mib(missing * layout.page_bytes)}) needed")
  # a streaming layer whose resident region holds a copy unit keeps its open unit in the region's
  # last copy_pages slots (`StreamedKV._open_split`), so the ring holds copy_pages - 1 pages more
  # than A - r; a smaller region keeps one page there and needs no more
  def uniform(slack):
    if n_layers > 1:
      return min(a, max((pool_pages - a - slack) // (n_layers - 1), 0))
    return min(a, pool_pages - 1 - slack)

  c = int(copy_pages)
  if pool_pages > n_layers * a:
    r = a
  else:
    r = uniform(c - 1)
    if r < c:
      r = min(uniform(0), max(c - 1, 0))
  r = max(0, min(r, (pool_pages - 1) // n_layers))  # keep at least one ring slot
  if pool_pages - r * n_layers < a - r:             # the ring cannot hold a layer: copy waves
    if pool_pages - n_layers < wave_pages:
      missing = wave_pages + n_layers - pool_pages
      raise StreamBudgetError(
          f"KV pool too small: {pool_pages} pages ({mib(pool_pages * layout.page_bytes)}) stream {n_layers} "
          f"layers in copy waves of whole {wave_pages}-page attention partitions, which needs a ring of "
          f"{wave_pages} slots beside a resident page a layer: {missing} more pages "
          f"({mib(missing * layout.page_bytes)}), or fewer rows a forward (ubatch)")
    hint = min(max(8, wave_pages), pool_pages - n_layers)
    r = min(a, (pool_pages - hint) // n_layers)
  return StreamConfig(pool_pages, (r,) * n_layers, copy_pages)


def wave_bounds(live: int, ring: int, wave_pages: int, active: int) -> List[int]:
  """Logical page bounds [0, b1, ..., active] of a layer's copy waves: wave 0 attends its `live`
  resident pages and the streamed pages the ring holds, each later wave the next ring-ful, every
  inner bound a multiple of the attention partition (`wave_pages`), so that the folded carry has the
  bits of one call."""
  width = ring // wave_pages * wave_pages
  if width < 1:
    raise ValueError(f"a ring of {ring} slots holds no {wave_pages}-page partition")
  bounds, end = [0], (live + ring) // wave_pages * wave_pages
  while end < active:
    bounds.append(end)
    end += width
  bounds.append(active)
  return bounds


def copy_unit_pages(stream: StreamConfig) -> int:
  """The copy unit a streamed cache uses: `stream.copy_pages`, halved until the ring holds it. A
  layer's open copy unit uploads whole (a fixed shape, so the compiled steps do not change as
  pages fill), so with a ring of a few slots a 32-page unit moved ~30x the bytes that stream
  (docs/log/performance-log.md, "The copy unit capped at the ring"); the staging reserve keeps
  counting `copy_pages`, an upper bound."""
  c = int(stream.copy_pages)
  while c > 1 and c > stream.ring_slots:
    c //= 2
  return c


def staging_pages(streamed_pages: int, copy_pages: int, pinned: bool) -> int:
  """Upper bound of the device pages that the stage of `streamed_pages` consecutive logical pages
  occupies (`StreamedKV`): the sealed streamed pages in whole copy units from the one holding the
  first (at most n + copy_pages - 1 pages), the open copy unit whole (`copy_pages`) and the partial
  last page. The same with or without pinned host memory (`pinned` is accepted for the callers'
  symmetry)."""
  del pinned
  n, c = int(streamed_pages), int(copy_pages)
  if n <= 0:
    return 0
  return n + 2 * c


def staging_unit_pages(stream: StreamConfig, max_tokens: int, layout: PageLayout,
                       pinned: bool, cap: Optional[int] = None) -> int:
  """Staging of one layer in flight: the most-streamed layer's uploads at `max_tokens` (at most
  `cap` pages where the cache streams a layer in copy waves of at most that many: `wave_cap`),
  and at least one unit-aligned refill piece of resident pages (`StreamedKV._fill_resident`
  refills in aligned pieces that fit this): one copy unit plus a pageable tail when pinned, one
  padded piece of at most min(copy_pages, history) pages when pageable."""
  a = layout.pages_for(max_tokens)
  worst = max(min(a - r, stream.ring_slots) for r in stream.resident_pages_per_layer)
  if cap is not None:
    worst = min(worst, int(cap))
  c = stream.copy_pages
  floor = 2 * c if pinned else min(c, 2 * min(c, a))
  return max(staging_pages(worst, c, pinned), floor)


def staging_reserve_pages(stream: StreamConfig, max_tokens: int, layout: PageLayout,
                          prefetch_depth: int = 1, pinned: Optional[bool] = None,
                          cap: Optional[int] = None) -> int:
  """Device pages the staging buffers of in-flight uploads can hold at once: the layer being
  placed plus `prefetch_depth` layers whose copies are in flight (`StreamedKV` keeps its live
  staging at or under this: counter `staging_peak_bytes`). pinned=None: whether this backend
  has pinned host memory (`host_history.pinned_available`)."""
  if pinned is None:
    pinned = pinned_host()
  return (prefetch_depth + 1) * staging_unit_pages(stream, max_tokens, layout, pinned, cap)


ADAPTIVE_OVERLAP_RATIO = 1.10   # the policy's default ring: 1.1 x one layer's streamed pages


def adaptive_staging_cap(pool_pages: int, max_tokens: int, layout: PageLayout, n_layers: int,
                         copy_pages: int = 32, wave_pages: int = 1) -> Optional[int]:
  """The most streamed pages an adaptive cache of `pool_pages` over `n_layers` layers stages for
  one layer at a time (`AdaptiveStreamedKV.wave_cap`; a layer that streams more goes in copy waves
  of at most this many): the ring of the split the policy aims at for `max_tokens` (the most
  resident pages a layer that leave a ring of `ADAPTIVE_OVERLAP_RATIO` x a layer's streamed pages:
  `policy.overlap_target`), which holds what its decode profile streams a layer, at least a copy
  unit and an attention partition (`wave_pages`). None (no cap) without layers."""
  if n_layers < 1:
    return None
  a, p, L, q = layout.pages_for(max_tokens), int(pool_pages), int(n_layers), ADAPTIVE_OVERLAP_RATIO
  r = 0 if L <= q else max(0, min(a, int((p - q * a) // (L - q)), (p - 1) // L))
  while r > 0 and p - r * L < q * (a - r):      # the float bound's rounding
    r -= 1
  return max(1, min(p, max(p - r * L, int(copy_pages), int(wave_pages))))


def adaptive_staging_reserve_pages(pool_pages: int, max_tokens: int, layout: PageLayout,
                                   copy_pages: int = 32, prefetch_depth: int = 1,
                                   pinned: Optional[bool] = None, n_layers: int = 0,
                                   wave_pages: int = 1) -> int:
  """A staging reserve that holds for EVERY split of a `pool_pages` pool (the adaptive policy
  changes the split at run time): the all-streamed split (no resident pages, the ring is the whole
  pool) streams the most pages a layer, and `staging_pages` only grows with them; with `n_layers`
  a layer stages at most `adaptive_staging_cap` pages at a time (more go in copy waves)."""
  all_streamed = StreamConfig(int(pool_pages), (0,), copy_pages)
  cap = adaptive_staging_cap(pool_pages, max_tokens, layout, n_layers, copy_pages, wave_pages)
  return staging_reserve_pages(all_streamed, max_tokens, layout, prefetch_depth, pinned, cap)


def adaptive_minimum_pool(n_layers: int, max_tokens: int, layout: PageLayout, wave_pages: int = 1) -> int:
  """The smallest pool the adaptive policy streams through: a resident page a layer beside a ring of
  one attention partition (`wave_pages`: the policy may leave a layer more streamed pages than the
  ring holds, and copy waves hold whole partitions; its ring never shrinks below the hint
  `adaptive_ring_hint` gives), or of a layer's pages at `max_tokens` where that is fewer; one slot
  at least."""
  return n_layers + max(1, min(int(wave_pages), layout.pages_for(max_tokens)))


def adaptive_ring_hint(pool_pages: int, n_layers: int, wave_pages: int = 1) -> int:
  """The policy's `initial_ring_slots` for a pool: 0 (its own hint, min(8, pages - layers)) where
  that ring holds an attention partition, else a partition's slots (the policy's smallest ring is
  at least its hint), within the pool."""
  if wave_pages <= AUTO_RING_HINT:
    return 0
  return max(0, min(int(wave_pages), int(pool_pages) - n_layers))


def minimum_pool(n_layers: int, max_tokens: int, layout: PageLayout, copy_pages: int = 32, wave_pages: int = 1,
                 adaptive: bool = False) -> int:
  """The smallest pool `fixed_split` takes: layers + 1 pages, more where that split streams in copy
  waves through a ring narrower than one `wave_pages` attention partition; adaptive, also one the
  policy streams through (`adaptive_minimum_pool`)."""
  least = max(minimum_pool_pages(n_layers), adaptive_minimum_pool(n_layers, max_tokens, layout, wave_pages)
              if adaptive else 0)
  for pool in range(least, n_layers * layout.pages_for(max_tokens) + 2):   # all resident always streams
    try:
      fixed_split(pool, n_layers, max_tokens, layout, copy_pages, wave_pages)
      return pool
    except StreamBudgetError:
      continue
  return n_layers * layout.pages_for(max_tokens) + 1


def check_pool(pool_pages: int, n_layers: int, max_tokens: int, layout: PageLayout, copy_pages: int = 32,
               wave_pages: int = 1, adaptive: bool = False) -> None:
  """A pool of `pool_pages` at least `minimum_pool`, else StreamBudgetError with the pages missing."""
  need = minimum_pool(n_layers, max_tokens, layout, copy_pages, wave_pages, adaptive)
  if pool_pages < need:
    base, missing = minimum_pool_pages(n_layers), need - pool_pages
    waves = "" if need == base else (
        f"{f', {base - pool_pages} more pages,' if pool_pages < base else ''} and {need} where its layers stream "
        f"in copy waves of whole {wave_pages}-page attention partitions (a ring of {need - n_layers} slots)")
    raise StreamBudgetError(
        f"KV pool too small: {pool_pages} pages ({mib(pool_pages * layout.page_bytes)}) cannot stream {n_layers} "
        f"layers{' through the adaptive policy' if adaptive else ''}: the minimum is {base} pages (1 resident page "
        f"a layer + 1 ring slot){waves}: {missing} more pages ({mib(missing * layout.page_bytes)}) needed"
        + (", or fewer rows a forward (ubatch)" if waves else ""))


def fit_adaptive_pool(available_pages: int, max_tokens: int, layout: PageLayout,
                      copy_pages: int = 32, prefetch_depth: int = 1,
                      pinned: Optional[bool] = None, n_layers: int = 0, wave_pages: int = 1) -> int:
  """The largest pool whose pages plus `adaptive_staging_reserve_pages` fit in `available_pages`
  (pool + reserve grows with the pool, so a bisection finds it), at least the policy's minimum pool
  for `n_layers` cache layers and copy waves of `wave_pages` (`adaptive_minimum_pool`; 0 layers:
  any pool of a page)."""
  if pinned is None:
    pinned = pinned_host()
  need = lambda pool: pool + adaptive_staging_reserve_pages(pool, max_tokens, layout, copy_pages,
                                                            prefetch_depth, pinned, n_layers, wave_pages)
  smallest = adaptive_minimum_pool(n_layers, max_tokens, layout, wave_pages) if n_layers else 1
  if need(smallest) > available_pages:
    missing = need(smallest) - available_pages
    ring = f" ({n_layers} layers + a ring of {smallest - n_layers})" if n_layers else ""
    raise StreamBudgetError(
        f"KV budget too small: {available_pages} pages ({mib(available_pages * layout.page_bytes)}) hold no "
        f"adaptive pool: the smallest is {smallest} pool page{'s' * (smallest > 1)}{ring} + "
        f"{need(smallest) - smallest} staging pages; {missing} more pages ({mib(missing * layout.page_bytes)}) "
        f"needed (the staging of any split the policy may pick)")
  # with the staging cap the reserve falls where the aimed-at split gains a resident page a
  # layer, so `need` is not monotone: the largest fitting pool is searched from the top
  lo, hi = smallest, int(available_pages)
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if mid + adaptive_staging_reserve_pages(mid, max_tokens, layout, copy_pages, prefetch_depth, pinned) \
        <= available_pages:
      lo = mid                                    # uncapped: a pool that surely fits
    else:
      hi = mid - 1
  best = lo
  for pool in range(int(available_pages), lo, -1):
    if need(pool) <= available_pages:
      best = pool
      break
  return best


def fit_split(available_pages: int, n_layers: int, max_tokens: int, layout: PageLayout,
              copy_pages: int = 32, prefetch_depth: int = 1,
              pinned: Optional[bool] = None, wave_pages: int = 1) -> StreamConfig:
  """The largest `fixed_split` pool whose pages plus its staging reserve fit in `available_pages`
  (the staging buffers of in-flight uploads live in the same arena as the pool)."""
  if pinned is None:
    pinned = pinned_host()

  def need(pool):
    split = fixed_split(pool, n_layers, max_tokens, layout, copy_pages, wave_pages)
    return split, pool + staging_reserve_pages(split, max_tokens, layout, prefetch_depth, pinned)

  # pool + staging is not monotonic in the pool (a larger pool streams fewer pages and stages less;
  # below a ring that holds one layer, copy waves stage one ring's worth), so every size is tried
  for pool in range(int(available_pages), 0, -1):
    try:
      split, total = need(pool)
    except StreamBudgetError:
      break                                   # smaller pools cannot stream either
    if total <= available_pages:
      return split
  hi, total = smallest_budget(n_layers, max_tokens, layout, copy_pages, prefetch_depth, pinned, wave_pages)
  missing = total - available_pages
  raise StreamBudgetError(
      f"KV budget too small: {available_pages} pages ({mib(available_pages * layout.page_bytes)}) cannot hold a "
      f"pool that streams {n_layers} layers at {max_tokens} tokens plus the staging of its in-flight uploads: "
      f"the smallest is {hi} pool pages + {total - hi} staging pages; {missing} more pages "
      f"({mib(missing * layout.page_bytes)}) needed")


def smallest_budget(n_layers: int, max_tokens: int, layout: PageLayout, copy_pages: int = 32,
                    prefetch_depth: int = 1, pinned: Optional[bool] = None,
                    wave_pages: int = 1) -> Tuple[int, int]:
  """-> (pool pages, pool + staging pages) of the `fixed_split` pool whose pages plus staging reserve
  are fewest: the least an arena's KV region holds a streamed cache in (`fit_split` takes any region
  of at least that many pages). More resident pages stream fewer pages, so a larger pool can need
  less in all: every pool from the smallest that streams to all resident is tried."""
  if pinned is None:
    pinned = pinned_host()

  def need(pool):
    split = fixed_split(pool, n_layers, max_tokens, layout, copy_pages, wave_pages)
    return pool + staging_reserve_pages(split, max_tokens, layout, prefetch_depth, pinned)

  everything = layout.pages_for(max_tokens) * n_layers + 1          # all resident: always streams
  lo, hi = 1, everything
  while lo < hi:                                                       # smallest pool that streams
    mid = (lo + hi) // 2
    try:
      need(mid)
      hi = mid
    except StreamBudgetError:
      lo = mid + 1
  # every reserve holds at least `floor` pages a layer in flight (`staging_unit_pages`), so a pool
  # past the best total less that cannot beat it
  c, a = int(copy_pages), layout.pages_for(max_tokens)
  floor = (prefetch_depth + 1) * (2 * c if pinned else min(c, 2 * min(c, a)))
  best = (need(lo), lo)
  for q in range(lo + 1, everything + 1):
    if q + floor >= best[0]:
      break
    best = min(best, (need(q), q))
  return best[1], best[0]


@dataclasses.dataclass(frozen=True)
class ArenaNeed:
  """The smallest arena a streamed cache fits (`minimum_arena`): `bytes`, the pages of a phase's
  KV region (pool + staging) at least, and what decides it (`reason`, for a refusal)."""
  bytes: int
  region_pages: int
  reason: str

  def mib(self) -> str:
    """`bytes` in MiB rounded up to 0.001 (an arena of that many MiB holds the cache)."""
    return f"{-(-(self.bytes + 1) * 1000 // 2**20) / 1000:.3f} MiB"

  def refusal(self, arena_bytes: int) -> str:
    """The refusal of an arena of `arena_bytes`: the least needed, what decides it, the MiB missing
    (in bytes, not pages: the workspace beside the pages is part of it)."""
    return f"too small: at least {self.mib()} needed ({self.reason}); {mib(self.bytes - arena_bytes)} more"


def minimum_arena(n_layers: int, max_tokens: int, layout: PageLayout, decode_workspace_bytes: int,
                  copy_pages: int = 32, adaptive: bool = False, wave_pages: int = 1,
                  prefill_workspace_bytes: Optional[int] = None, prefetch_depth: int = 1,
                  alignment: int = 256, prefill_rows: str = "ubatch rows a forward",
                  pinned: Optional[bool] = None) -> ArenaNeed:
  """The smallest arena `kvjax.api.make_kv` takes: the decode workspace beside the fewest pages of a
  fixed pool plus its staging (`smallest_budget`; adaptive, also the policy's smallest pool plus the
  staging of any split: `adaptive_minimum_pool`); phased (`prefill_workspace_bytes` given), each
  phase's layout (`arena.phase_layouts`: its workspace, `alignment`-aligned, then the KV region)
  holds a region of that many pages (`prefill_rows`: what sizes the prefill's workspace, for the
  reason). An arena of at least this many bytes passes every check."""
  pb = layout.page_bytes
  pool, fixed = smallest_budget(n_layers, max_tokens, layout, copy_pages, prefetch_depth, pinned, wave_pages=wave_pages)
  region, what = fixed, f"{pool} pool + {fixed - pool} staging"
  if adaptive:
    apool = adaptive_minimum_pool(n_layers, max_tokens, layout, wave_pages)
    region = apool + adaptive_staging_reserve_pages(apool, max_tokens, layout, copy_pages, prefetch_depth, pinned,
                                                    n_layers=n_layers, wave_pages=wave_pages)
    what = f"{apool} pool + {region - apool} staging for any split the adaptive policy picks"
  pages = max(fixed, region)
  needs = [ArenaNeed(decode_workspace_bytes + pages * pb, region,
                     f"the {mib(decode_workspace_bytes)} decode workspace beside {pages} KV pages ({what})")]
  if prefill_workspace_bytes is not None:
    up = lambda n: -(-n // alignment) * alignment
    for phase, ws in (("prefill", prefill_workspace_bytes), ("decode", decode_workspace_bytes)):
      rows = f" ({prefill_rows})" if phase == "prefill" else ""
      needs.append(ArenaNeed(up(ws) + up(region * pb), region, f"the {phase} phase: its {mib(ws)} workspace{rows} "
                                                               f"beside a KV region of {region} pages ({what})"))
  return max(needs, key=lambda n: n.bytes)


PREFILL_BLOCK_MAX_TOKENS = 16384   # the prefill's block: at most this many tokens a forward


def prefill_block_tokens(ubatch: int, row_bytes: int, kv_budget_bytes: int, max_tokens: int,
                         cap: int = PREFILL_BLOCK_MAX_TOKENS) -> int:
  """Tokens of the prefill's block (`kvjax.generate.prefill(block=)`): the micro-batches a forward
  runs group-major, so that a streamed layer's history is uploaded once a block. Uploads over a
  prompt of n tokens fall as n / block, so the block is as large as its device bytes allow: its
  rows' hidden states (`row_bytes` a token: the activations, and the post-norm hidden kept for
  the MTP head) within `kv_budget_bytes` (the pool's bytes; half of them where the block's bytes
  come out of the prefill's own pool, the phased arena), at most `cap` tokens and the cache's
  `max_tokens`; a whole number of micro-batches, one at least."""
  rows = min(kv_budget_bytes // max(1, row_bytes), cap, -(-max_tokens // ubatch) * ubatch)
  return max(ubatch, rows // ubatch * ubatch)


def prefill_block_bytes(block: int, row_bytes: int, layer_row_bytes: int) -> int:
  """Device bytes of a prefill block beside one micro-batch's workspace: its rows' hidden states
  and the KV rows of two layers on their way to the host (`StreamedKV.end_layer`)."""
  return block * (row_bytes + 2 * layer_row_bytes)
