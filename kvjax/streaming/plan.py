"""The KV plan: the one place a budget becomes pages.

`plan_kv(geometry, max_tokens, arena_bytes= | pool_pages=, ...)` turns a budget into everything a
streamed cache is sized by, before anything is allocated: the pool pages and the starting split
(resident pages per layer, ring slots), the copy unit, the staging reserve of in-flight uploads and
the staging cap of the adaptive policy, the prefill block, each phase's KV region and split (the
phase arena) and the workspaces they sit beside. It is a pure function of plain data: the model
enters as a `KVGeometry` (layer count, page layout, attention partition, row bytes) and the
measured device scratch as `Workspaces` (`kvjax.kv_build.measure` compiles the layer step to read
them). A budget that cannot run is refused here (`StreamBudgetError`, naming the pages or MiB
missing); what the plan accepts, the cache is built from (`kvjax.kv_build.build_from_plan`) and
reports (`KVPlan.info`, the flat dict of `KVCache.info`).

The phase arena re-splits its pool at every phase change with the same rule (`region_split`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple, Union

from kvjax.streaming import arena as arena_lib
from kvjax.streaming import budget as budget_lib
from kvjax.streaming import policy as policy_lib
from kvjax.streaming.budget import (StreamBudgetError, StreamConfig, adaptive_ring_hint, adaptive_staging_cap,
                                    adaptive_staging_reserve_pages, check_pool, copy_unit_pages, fit_adaptive_pool,
                                    fit_split, fixed_split, minimum_arena, mib, prefill_block_bytes,
                                    prefill_block_tokens, staging_reserve_pages)
from kvjax_pallas.page_layout import PageLayout

PHASES = ("prefill", "decode")
ALIGNMENT = 256   # the phase arena's region alignment (`arena.phase_layouts`)


@dataclasses.dataclass(frozen=True)
class KVGeometry:
  """What a plan needs of a model, as plain numbers."""
  n_target_layers: int     # the target's attention layers
  n_layers: int            # cache layers: the target's attention layers and the MTP's
  layout: PageLayout
  wave_pages: int = 1      # the largest attention partition of the forwards admitted (copy waves hold whole ones)
  block_row_bytes: int = 0  # device bytes of a prefill block's hidden rows, a token
  partition_auto: bool = False  # the kernels' partition is theirs to choose ("auto"): a pool may cap it
  decode_wave_pages: int = 0  # a decode forward's (one row) attention partition (0: wave_pages)


@dataclasses.dataclass(frozen=True)
class Workspaces:
  """Device scratch measured from the compiled layer step (bytes)."""
  decode_bytes: int                  # the widest decode-phase forward's (one row, or a verify's) and its states
  verify_states_bytes: int = 0       # of which the recurrent states a verify captures
  decode_rows: int = 1               # query rows of that forward
  prefill_bytes: Optional[int] = None  # one prefill micro-batch's (phased arenas)


@dataclasses.dataclass(frozen=True)
class PhasePlan:
  """A phase's KV region of the arena (pool + staging, pages) and the split of its pool."""
  region_pages: int
  split: StreamConfig


@dataclasses.dataclass(frozen=True)
class DecodeCost:
  """What a decode forward of the plan's starting split streams at one context, known before
  anything is built: `ring_fills` (the target layers' ring fills: 1 for a layer streamed in one
  call, one per copy wave for a layer in waves, 0 for one all resident; each copy wave is one more
  kernel call and one more wait for its uploads), `waved_layers` and `streamed_pages` (attended
  from the ring: the uploads, but for the open copy unit a layer keeps on the device)."""
  context_tokens: int
  ring_fills: int
  waved_layers: int
  streamed_pages: int
  streamed_bytes: int


@dataclasses.dataclass(frozen=True)
class KVPlan:
  """A budget decided: every size a cache is built from, units in the names. `split` is the starting
  split (None: a plain cache, every page on the device); `phases` the phase arena's (phased)."""
  max_tokens: int
  layout: PageLayout
  policy: str = "fixed"
  phased: bool = False
  ubatch: int = 256
  arena_bytes: Optional[int] = None
  copy_pages: int = 8
  copy_unit_pages: int = 0
  split: Optional[StreamConfig] = None
  staging_reserve_pages: int = 0
  wave_pages: int = 1
  wave_cap_pages: Optional[int] = None
  partition_cap_pages: Optional[int] = None   # the attention partition capped so the ring holds one
  prefill_block_tokens: Optional[int] = None
  workspaces: Optional[Workspaces] = None
  prefill_workspace_bytes: Optional[int] = None   # the prefill phase's: a micro-batch's and its block's rows
  phases: Tuple[Tuple[str, PhasePlan], ...] = ()
  tensor_parallel: int = 1
  n_target_layers: int = 0       # cache layers a decode forward of the target attends (the first ones)
  decode_wave_pages: int = 1     # a decode forward's attention partition, the cap applied

  @property
  def streamed(self) -> bool:
    return self.split is not None

  @property
  def pool_pages(self) -> int:
    return self.split.pool_pages if self.split is not None else 0

  @property
  def phase(self) -> Dict[str, PhasePlan]:
    return dict(self.phases)

  @property
  def all_pages_resident(self) -> bool:
    """Every page of `max_tokens` resident in every layer (every phase's split, phased)."""
    if self.split is None:
      return True
    splits = [p.split for _, p in self.phases] if self.phased else [self.split]
    a = self.layout.pages_for(self.max_tokens)
    return all(min(s.resident_pages_per_layer) >= a for s in splits)

  def decode_cost(self, context_tokens: int) -> DecodeCost:
    """The cost of one decode forward at `context_tokens` tokens of history (the new token's row
    included) on the starting split (the decode phase's, phased; the adaptive policy may re-split
    later): how many ring fills (copy waves) and streamed pages, as the cache will lay them out."""
    if self.split is None:
      return DecodeCost(int(context_tokens), 0, 0, 0, 0)
    split = self.phase["decode"].split if self.phased else self.split
    ring = split.ring_slots if self.wave_cap_pages is None else min(split.ring_slots, self.wave_cap_pages)
    active = self.layout.pages_for(int(context_tokens) + 1)
    fills = waved = pages = 0
    for cap in split.resident_pages_per_layer[:self.n_target_layers]:
      live = min(cap, active)
      streamed = active - live
      pages += streamed
      if streamed > ring:
        waved += 1
        fills += len(budget_lib.wave_bounds(live, ring, self.decode_wave_pages, active)) - 1
      else:
        fills += int(streamed > 0)
    return DecodeCost(int(context_tokens), fills, waved, pages, pages * self.layout.page_bytes)

  def describe(self) -> str:
    """"plain", "streamed", or "all pages resident" where the budget holds every page of the context
    (nothing streams; still the streamed cache's pool and programs); "+phased" for the phase arena."""
    if self.split is None:
      return "plain"
    return ("all pages resident" if self.all_pages_resident else "streamed") + ("+phased" if self.phased else "")

  def info(self) -> Dict[str, Any]:
    """The plan as the flat dict `KVCache.info` reports (metrics, JSON)."""
    lay = self.layout
    out: Dict[str, Any] = {"kv": self.describe(), "ctx_size": self.max_tokens, "page_tokens": lay.page_tokens,
                           "kv_layout": lay.describe()}
    if self.split is None:
      return out
    ws = self.workspaces
    if self.arena_bytes is not None:
      out.update(arena_mib=self.arena_bytes / 2**20, decode_rows=ws.decode_rows,
                 verify_states_bytes=ws.verify_states_bytes, decode_workspace_mib=ws.decode_bytes / 2**20)
    out.update(resident_pages_per_layer=list(self.split.resident_pages_per_layer),
               staging_reserve_mib=self.staging_reserve_pages * lay.page_bytes / 2**20,
               copy_pages=self.copy_pages, kv_policy=self.policy)
    if self.policy == "adaptive":
      out.update(wave_cap_pages=self.wave_cap_pages, wave_pages=self.wave_pages)
    if self.partition_cap_pages is not None:
      out["partition_cap_pages"] = self.partition_cap_pages
    cost = self.decode_cost(self.max_tokens - 1)
    out.update(decode_ring_fills_at_ctx_size=cost.ring_fills, decode_stream_mib_at_ctx_size=cost.streamed_bytes / 2**20)
    out.update(all_pages_resident=self.all_pages_resident, pool_pages=self.split.pool_pages,
               ring_slots=self.split.ring_slots, copy_unit_pages=self.copy_unit_pages,
               prefill_block=self.prefill_block_tokens)
    if self.phased:
      out.update(prefill_workspace_mib=self.prefill_workspace_bytes / 2**20, ubatch=self.ubatch,
                 **{f"{p}_pool_pages": pp.split.pool_pages for p, pp in self.phases})
    if self.tensor_parallel > 1:
      out["tensor_parallel"] = self.tensor_parallel
    return out


def adaptive_policy_config(geometry: KVGeometry, pool_pages: int) -> policy_lib.PolicyConfig:
  """The adaptive policy's config on a pool of `pool_pages`: the target's attention layers and the
  MTP layer are its two caches of one budget; its ring holds an attention partition (`adaptive_ring_hint`)."""
  lay, n = geometry.layout, geometry.n_layers
  hint = adaptive_ring_hint(pool_pages, n, geometry.wave_pages)
  return policy_lib.PolicyConfig(
      page_bytes=lay.page_bytes, pool_bytes=pool_pages * lay.page_bytes, layers=n, page_tokens=lay.page_tokens,
      caches=policy_lib.model_caches(geometry.n_target_layers, n - geometry.n_target_layers),
      initial_ring_slots=hint)


def adaptive_initial_split(geometry: KVGeometry, pool_pages: int, copy_pages: int) -> StreamConfig:
  """The split a fresh adaptive policy gives a pool of `pool_pages`."""
  config = adaptive_policy_config(geometry, pool_pages)
  return StreamConfig(int(pool_pages), policy_lib.capacities(config, policy_lib.initialize(config)), int(copy_pages))


def region_split(geometry: KVGeometry, region_pages: int, max_tokens: int, copy_pages: int,
                 adaptive: bool, prefetch_depth: int = 1, pinned: Optional[bool] = None) -> StreamConfig:
  """The split of a KV region of `region_pages` pages (pool + the staging reserve of its in-flight
  uploads): the fixed split whose pool and staging fit (`fit_split`), or the adaptive policy's
  starting split of the largest pool that leaves room for the staging of any split it may pick
  (`fit_adaptive_pool`)."""
  lay, n = geometry.layout, geometry.n_layers
  if adaptive:
    pool = fit_adaptive_pool(region_pages, max_tokens, lay, copy_pages, prefetch_depth, pinned, n_layers=n,
                             wave_pages=geometry.wave_pages)
    return adaptive_initial_split(geometry, pool, copy_pages)
  return fit_split(region_pages, n, max_tokens, lay, copy_pages, prefetch_depth, pinned,
                   wave_pages=geometry.wave_pages)


def _block(prefill_block: Union[int, str], ubatch: int) -> Optional[int]:
  """A given prefill block in whole micro-batches (one at least); None for "auto"."""
  return None if prefill_block == "auto" else max(ubatch, int(prefill_block) // ubatch * ubatch)


def plan_kv(geometry: KVGeometry, max_tokens: int, *, arena_bytes: Optional[int] = None,
            pool_pages: Optional[int] = None, **kw) -> KVPlan:
  """The plan of a cache of `max_tokens` positions (`_plan`'s arguments). A pool of pages too small
  for a ring of one attention partition of the kernels' "auto" choice (`geometry.partition_auto`)
  caps the partition instead: the largest one whose ring the pool holds (`partition_cap_pages`;
  layers stream in copy waves of such partitions, more kernel calls a layer, the same tokens), down
  to one page a partition, so that any pool of at least layers + 1 pages runs. (An arena's
  workspace was measured for the kernels' own partition: an arena too small for its ring is
  refused.)"""
  try:
    return _plan(geometry, max_tokens, arena_bytes=arena_bytes, pool_pages=pool_pages, **kw)
  except StreamBudgetError as e:
    if pool_pages is None or not geometry.partition_auto or geometry.wave_pages <= 1:
      raise
    first_error = e
  lo, hi, best = 1, geometry.wave_pages - 1, None     # a smaller partition only ever needs less
  while lo <= hi:
    mid = (lo + hi) // 2
    try:
      best = _plan(dataclasses.replace(geometry, wave_pages=mid), max_tokens, pool_pages=pool_pages, **kw)
      lo = mid + 1
    except StreamBudgetError:
      hi = mid - 1
  if best is None:   # not even one page a partition: the least pool that runs at all
    _plan(dataclasses.replace(geometry, wave_pages=1), max_tokens, pool_pages=pool_pages, **kw)
    raise first_error
  return dataclasses.replace(best, partition_cap_pages=best.wave_pages,
                             decode_wave_pages=min(best.decode_wave_pages, best.wave_pages))


def _plan(geometry: KVGeometry, max_tokens: int, *, arena_bytes: Optional[int] = None,
            pool_pages: Optional[int] = None, copy_pages: int = 8, policy: str = "fixed", phased: bool = False,
            ubatch: int = 256, workspaces: Optional[Workspaces] = None,
            prefill_block: Union[int, str] = "auto", tensor_parallel: int = 1,
            pinned: Optional[bool] = None) -> KVPlan:
  """The plan of a cache of `max_tokens` positions: plain (no budget), or streamed within an arena of
  `arena_bytes` (the pool is what is left after the measured `workspaces` and the staging of
  in-flight uploads, in whole pages) or a pool of `pool_pages` pages (its staging on top).
  `policy` "fixed" | "adaptive"; `phased`: each phase (prefill: `ubatch` rows and the prefill block;
  decode) lays the arena out with its own workspace and pool. Refused (`StreamBudgetError`, the
  least budget that runs and what is missing) before anything is allocated. `pinned`: whether the
  host history is pinned (None: this backend's, `host_history.pinned_available`), which sizes the
  staging of in-flight uploads."""
  lay, n = geometry.layout, geometry.n_layers
  base = dict(max_tokens=int(max_tokens), layout=lay, policy=policy, phased=phased, ubatch=int(ubatch),
              copy_pages=int(copy_pages), wave_pages=int(geometry.wave_pages), tensor_parallel=int(tensor_parallel),
              n_target_layers=int(geometry.n_target_layers),
              decode_wave_pages=int(geometry.decode_wave_pages or geometry.wave_pages))
  if arena_bytes is None and pool_pages is None:
    return KVPlan(**dict(base, policy="plain"))
  if (arena_bytes is None) == (pool_pages is None):
    raise ValueError("give exactly one of arena_bytes or pool_pages")
  if phased and arena_bytes is None:
    raise ValueError("a phased cache lays out an arena: give arena_bytes")
  adaptive, pb = policy == "adaptive", lay.page_bytes
  if pinned is None:
    pinned = budget_lib.pinned_host()
  block = _block(prefill_block, ubatch)
  row_bytes = geometry.block_row_bytes
  ws = workspaces.decode_bytes if workspaces is not None else 0
  ws_prefill = None
  if arena_bytes is not None:
    if workspaces is None:
      raise ValueError("an arena's plan needs the measured workspaces")
    if phased:   # the prefill's workspace: its micro-batch's scratch, and a given block's rows
      ws_prefill = workspaces.prefill_bytes + (prefill_block_bytes(block, row_bytes, lay.token_bytes)
                                               if (block or 0) > ubatch else 0)
    rows = f"a ubatch of {ubatch} rows" + (f", a prefill_block of {block}" if (block or 0) > ubatch else "")
    need = minimum_arena(n, max_tokens, lay, ws, copy_pages, adaptive, geometry.wave_pages, ws_prefill,
                         prefill_rows=rows, pinned=pinned)
    if int(arena_bytes) < need.bytes:
      raise StreamBudgetError(need.refusal(int(arena_bytes)))
    available = (int(arena_bytes) - ws) // pb
    split = region_split(geometry, available, max_tokens, copy_pages, adaptive, pinned=pinned)
  else:   # refused with the least pool that streams (copy waves hold whole partitions; the policy's)
    check_pool(pool_pages, n, max_tokens, lay, copy_pages, geometry.wave_pages, adaptive)
    split = fixed_split(int(pool_pages), n, max_tokens, lay, copy_pages, geometry.wave_pages)
    if adaptive:
      split = adaptive_initial_split(geometry, int(pool_pages), copy_pages)
  if adaptive:
    reserve = adaptive_staging_reserve_pages(split.pool_pages, max_tokens, lay, copy_pages, pinned=pinned,
                                             n_layers=n, wave_pages=geometry.wave_pages)
    wave_cap = adaptive_staging_cap(split.pool_pages, max_tokens, lay, n, copy_pages, geometry.wave_pages)
  else:
    reserve, wave_cap = staging_reserve_pages(split, max_tokens, lay, pinned=pinned), None
  # the prefill's block (`generate.prefill`): its hidden rows within the pool's bytes; in a phased
  # arena its rows and their KV rows on the way to the host (`prefill_block_bytes`) within half of
  # what the prefill layout leaves beside its micro-batch's workspace and the smallest KV region
  if block is None and not phased:
    block = prefill_block_tokens(ubatch, row_bytes, split.pool_pages * pb, max_tokens)
  elif block is None:
    room = (int(arena_bytes) - arena_lib.align_up(ws_prefill, ALIGNMENT)
            - arena_lib.align_up(need.region_pages * pb, ALIGNMENT))
    block = prefill_block_tokens(ubatch, row_bytes + 2 * lay.token_bytes, max(0, room - ALIGNMENT) // 2, max_tokens)
    ws_prefill += prefill_block_bytes(block, row_bytes, lay.token_bytes) if block > ubatch else 0
  phases: Tuple[Tuple[str, PhasePlan], ...] = ()
  if phased:   # both layouts validated up front: a refused phase is refused before any work
    try:
      layouts = arena_lib.phase_layouts(int(arena_bytes), ws_prefill, ws, page_bytes=pb, alignment=ALIGNMENT)
    except arena_lib.CapacityError as e:
      raise StreamBudgetError(str(e)) from None
    out = []
    for p, region in zip(PHASES, (layouts.prefill_kv_pages, layouts.decode_kv_pages)):
      try:
        out.append((p, PhasePlan(region, region_split(geometry, region, max_tokens, copy_pages, adaptive,
                                                      pinned=pinned))))
      except StreamBudgetError as e:   # which layout is short (the prefill's workspace grows with ubatch)
        w = ws_prefill if p == "prefill" else ws
        raise StreamBudgetError(f"{p} phase ({mib(w)} workspace, {region} pages left): {e}") from None
    phases = tuple(out)
  return KVPlan(**base, arena_bytes=None if arena_bytes is None else int(arena_bytes),
                copy_unit_pages=copy_unit_pages(split), split=split, staging_reserve_pages=reserve,
                wave_cap_pages=wave_cap, prefill_block_tokens=block, workspaces=workspaces,
                prefill_workspace_bytes=ws_prefill, phases=phases)
