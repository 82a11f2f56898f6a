"""Budget arithmetic of the streamed cache: the physical split of the device pool and the staging
that in-flight uploads need, sized before anything is allocated.

* `StreamConfig`: pool pages, resident capacity per cache layer, host copy unit.
* `fixed_split` / `fit_split`: a uniform resident prefix per layer whose ring holds one layer's
  streamed pages; `fit_split` fits pool + staging reserve into an arena's pages.
* `staging_pages` / `staging_unit_pages` / `staging_reserve_pages`: device pages held by uploads in
  flight (`StreamedKV` keeps its live staging at or under the reserve).
* `fit_adaptive_pool` / `adaptive_staging_reserve_pages`: the same for the adaptive policy, whose
  split changes at run time.
* `stream_config_from_budget`: the split for an arena in bytes or a pool in pages.

Every refusal is a `StreamBudgetError` that names the pages (and MiB) missing.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from kvjax.config import ModelConfig
from kvjax.streaming.host_history import pinned_available
from kvjax.streaming.policy import minimum_pool_pages  # 1 resident page a layer + 1 ring slot
from kvjax_pallas.page_layout import PageLayout


class StreamBudgetError(ValueError):
  """The device pool cannot hold what a forward needs (the message says how much is missing)."""


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


def copy_unit_pages(stream: StreamConfig) -> int:
  """The copy unit a streamed cache uses: `stream.copy_pages`, halved until the ring holds it. A
  layer's open copy unit uploads whole (a fixed shape, so the compiled steps do not change as
  pages fill), so with a ring of a few slots a 32-page unit moved ~30x the bytes that stream
  (measured 2026-12-03: 35.8 MB against 1.1 MB for the same 100 tokens of the tiny model in a
  6-page pool); the staging reserve keeps counting `copy_pages`, an upper bound."""
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
                       pinned: bool) -> int:
  """Staging of one layer in flight: the most-streamed layer's uploads at `max_tokens`, and at
  least one unit-aligned refill piece of resident pages (`StreamedKV._fill_resident` refills in
  aligned pieces that fit this): one copy unit plus a pageable tail when pinned, one padded
  piece of at most min(copy_pages, history) pages when pageable."""
  a = layout.pages_for(max_tokens)
  worst = max(min(a - r, stream.ring_slots) for r in stream.resident_pages_per_layer)
  c = stream.copy_pages
  floor = 2 * c if pinned else min(c, 2 * min(c, a))
  return max(staging_pages(worst, c, pinned), floor)


def staging_reserve_pages(stream: StreamConfig, max_tokens: int, layout: PageLayout,
                          prefetch_depth: int = 1, pinned: Optional[bool] = None) -> int:
  """Device pages the staging buffers of in-flight uploads can hold at once: the layer being
  placed plus `prefetch_depth` layers whose copies are in flight (`StreamedKV` keeps its live
  staging at or under this: counter `staging_peak_bytes`). pinned=None: whether this backend
  has pinned host memory (`host_history.pinned_available`)."""
  if pinned is None:
    pinned = pinned_available()
  return (prefetch_depth + 1) * staging_unit_pages(stream, max_tokens, layout, pinned)


def adaptive_staging_reserve_pages(pool_pages: int, max_tokens: int, layout: PageLayout,
                                   copy_pages: int = 32, prefetch_depth: int = 1,
                                   pinned: Optional[bool] = None) -> int:
  """A staging reserve that holds for EVERY split of a `pool_pages` pool (the adaptive policy
  changes the split at run time): the all-streamed split (no resident pages, the ring is the whole
  pool) streams the most pages a layer, and `staging_pages` only grows with them."""
  all_streamed = StreamConfig(int(pool_pages), (0,), copy_pages)
  return staging_reserve_pages(all_streamed, max_tokens, layout, prefetch_depth, pinned)


def fit_adaptive_pool(available_pages: int, max_tokens: int, layout: PageLayout,
                      copy_pages: int = 32, prefetch_depth: int = 1,
                      pinned: Optional[bool] = None) -> int:
  """The largest pool whose pages plus `adaptive_staging_reserve_pages` fit in `available_pages`
  (pool + reserve grows with the pool, so a bisection finds it)."""
  if pinned is None:
    pinned = pinned_available()
  need = lambda pool: pool + adaptive_staging_reserve_pages(pool, max_tokens, layout, copy_pages,
                                                            prefetch_depth, pinned)
  if need(1) > available_pages:
    raise StreamBudgetError(
        f"{available_pages} pages hold no adaptive pool: the smallest is 1 pool page + "
        f"{need(1) - 1} staging pages; {need(1) - available_pages} more pages needed")
  lo, hi = 1, int(available_pages)
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if need(mid) <= available_pages:
      lo = mid
    else:
      hi = mid - 1
  return lo


def fit_split(available_pages: int, n_layers: int, max_tokens: int, layout: PageLayout,
              copy_pages: int = 32, prefetch_depth: int = 1,
              pinned: Optional[bool] = None, wave_pages: int = 1) -> StreamConfig:
  """The largest `fixed_split` pool whose pages plus its staging reserve fit in `available_pages`
  (the staging buffers of in-flight uploads live in the same arena as the pool)."""
  if pinned is None:
    pinned = pinned_available()

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
  # report what is missing: the pool size whose pool + staging is smallest (more resident pages
  # stream fewer pages, so a larger pool can need less in all)
  everything = layout.pages_for(max_tokens) * n_layers + 1          # all resident: always streams
  lo, hi = 1, everything
  while lo < hi:                                                       # smallest pool that streams
    mid = (lo + hi) // 2
    try:
      need(mid)
      hi = mid
    except StreamBudgetError:
      lo = mid + 1
  total, hi = min((need(q)[1], q) for q in range(lo, everything + 1))
  missing = total - available_pages
  raise StreamBudgetError(
      f"KV budget too small: {available_pages} pages ({mib(available_pages * layout.page_bytes)}) cannot hold a "
      f"pool that streams {n_layers} layers at {max_tokens} tokens plus the staging of its in-flight uploads: "
      f"the smallest is {hi} pool pages + {total - hi} staging pages; {missing} more pages "
      f"({mib(missing * layout.page_bytes)}) needed")


def stream_config_from_budget(cfg: ModelConfig, layout: PageLayout, max_tokens: int, *,
                              arena_bytes: Optional[int] = None, pool_pages: Optional[int] = None,
                              workspace_bytes: int = 0, copy_pages: int = 32,
                              prefetch_depth: int = 1, wave_pages: int = 1) -> StreamConfig:
  """The fixed split for `--kv-stream-arena-mib` (arena minus the decode workspace, in whole pages,
  minus the staging reserve of in-flight uploads: `fit_split`) or `--kv-stream-pool-pages` (the
  pool directly; its staging comes on top, see `staging_reserve_pages`)."""
  if (arena_bytes is None) == (pool_pages is None):
    raise ValueError("give exactly one of arena_bytes or pool_pages")
  n_layers = cfg.num_attention_layers + (1 if cfg.has_mtp else 0)
  if pool_pages is None:
    left = arena_bytes - workspace_bytes
    if left < layout.page_bytes:
      raise StreamBudgetError(
          f"arena of {mib(arena_bytes)} leaves no page after the {mib(workspace_bytes)} decode workspace: "
          f"the workspace plus the minimum pool of {minimum_pool_pages(n_layers)} pages ({n_layers} layers + "
          f"1) is {mib(workspace_bytes + minimum_pool_pages(n_layers) * layout.page_bytes)}, and the staging "
          f"of in-flight uploads comes on top")
    return fit_split(left // layout.page_bytes, n_layers, max_tokens, layout, copy_pages,
                     prefetch_depth, wave_pages=wave_pages)
  return fixed_split(int(pool_pages), n_layers, max_tokens, layout, copy_pages, wave_pages)


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
