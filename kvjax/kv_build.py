"""Building the KV cache of a budget (`kvjax.api.make_kv`'s work once its arguments are checked):
plain, streamed (a fixed split or the adaptive policy), phased, or one cache per device of a
sharded model; with the `info` the cache reports (`KVCache.info`)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from kvjax import engine, parallel, speculative
from kvjax.streaming import StreamBudgetError, StreamedKV, adaptive_staging_reserve_pages, fit_adaptive_pool, \
    staging_reserve_pages, stream_config_from_budget
from kvjax.streaming.arena import align_up
from kvjax.streaming.budget import check_pool, minimum_arena, prefill_block_bytes, prefill_block_tokens
from kvjax.streaming.phases import AdaptiveStreamedKV, PhasedKV
from kvjax_pallas.page_layout import PageLayout


def _all_resident(split, layout: PageLayout, max_tokens: int) -> bool:
  return min(split.resident_pages_per_layer) >= layout.pages_for(max_tokens)


def describe(all_pages_resident: bool, phased: bool = False) -> str:
  """`info["kv"]` of a cache with a budget: "streamed", or "all pages resident" where the budget
  holds every page of the context on the device (nothing streams; still the streamed cache's pool
  and programs); "+phased" for the phase arena's cache."""
  return ("all pages resident" if all_pages_resident else "streamed") + ("+phased" if phased else "")


def build_kv(model, max_tokens: int, arena_mib, pool_pages, copy_pages, policy, phased,
              ubatch, draft: Optional[speculative.SpecConfig] = None, prefill_block="auto") -> Tuple[Any, Dict[str, Any]]:
  """The cache of one device, or of a sharded model one cache per device (each with the whole
  budget: `arena_mib` / `pool_pages` are per device) driven as one (`parallel.ShardedKV`)."""
  runner = model.runner
  if getattr(model.runner, "tensor_parallel", 1) == 1:
    return build_device_kv(runner, max_tokens, arena_mib, pool_pages, copy_pages, policy, phased, ubatch,
                           draft=draft, prefill_block=prefill_block)
  ws = (speculative.decode_workspace_bytes(runner.device_runners[0], max_tokens, draft)[0]
        if arena_mib is not None else None)   # the same on every device
  parts = parallel.per_device(runner.mesh, lambda d: build_device_kv(
      runner.device_runners[d], max_tokens, arena_mib, pool_pages, copy_pages, policy, phased, ubatch, ws,
      prefill_block=prefill_block))
  info = dict(parts[0][1], tensor_parallel=getattr(model.runner, "tensor_parallel", 1))
  kv = parallel.ShardedKV(runner.mesh, [kv for kv, _ in parts])
  kv.prefill_block = info.get("prefill_block")
  return kv, info


def build_device_kv(runner: engine.Runner, max_tokens: int, arena_mib, pool_pages, copy_pages, policy, phased,
                    ubatch, ws=None, draft: Optional[speculative.SpecConfig] = None,
                    prefill_block="auto") -> Tuple[Any, Dict[str, Any]]:
  cfg, layout = runner.cfg, runner.layout
  info: Dict[str, Any] = {"kv": "plain", "ctx_size": max_tokens, "page_tokens": layout.page_tokens,
                          "kv_layout": layout.describe()}
  if arena_mib is None and pool_pages is None:
    return engine.PlainKV(cfg, layout, max_tokens), info
  info["kv"] = "streamed"
  wave_pages = runner.partition_pages(ubatch, max_tokens)   # a copy wave holds whole partitions
  n_layers = cfg.num_attention_layers + (1 if cfg.has_mtp else 0)   # the target's attention layers, the MTP's
  # a prefill block's hidden rows (and the MTP's): `generate.prefill`
  row_bytes = cfg.hidden_size * runner.token_embd.dtype.itemsize * (1 if draft is None else 2)
  block = None if prefill_block == "auto" else max(ubatch, int(prefill_block) // ubatch * ubatch)
  if arena_mib is not None:
    states = 0
    if ws is None:   # the scratch of the widest decode-phase forward (a verify's rows and states)
      ws, states = speculative.decode_workspace_bytes(runner, max_tokens, draft)
    info["arena_mib"] = arena_mib
    info["decode_rows"] = 1 if draft is None else draft.verify_width
    info["verify_states_bytes"] = states
    info["decode_workspace_mib"] = ws / 2**20
    if phased:   # the prefill's workspace: its micro-batch's scratch, and a given block's rows
      ws_prefill = engine.group_step_workspace_bytes(runner, ubatch, max_tokens)
      if block is not None and block > ubatch:
        ws_prefill += prefill_block_bytes(block, row_bytes, layout.token_bytes)
    # refused before anything is allocated, with the least arena that holds the cache
    rows = f"a ubatch of {ubatch} rows" + (f", a prefill_block of {block}" if (block or 0) > ubatch else "")
    need = minimum_arena(n_layers, max_tokens, layout, ws, copy_pages, policy == "adaptive", wave_pages,
                         ws_prefill if phased else None, prefill_rows=rows)
    if int(arena_mib * 2**20) < need.bytes:
      raise StreamBudgetError(need.refusal(int(arena_mib * 2**20), layout.page_bytes))
    stream = stream_config_from_budget(cfg, layout, max_tokens, arena_bytes=int(arena_mib * 2**20),
                                       workspace_bytes=ws, copy_pages=copy_pages, wave_pages=wave_pages)
  else:   # refused with the least pool that streams (copy waves hold whole partitions; the policy's)
    check_pool(pool_pages, n_layers, max_tokens, layout, copy_pages, wave_pages, policy == "adaptive")
    stream = stream_config_from_budget(cfg, layout, max_tokens, pool_pages=pool_pages, copy_pages=copy_pages,
                                       wave_pages=wave_pages)
  info["resident_pages_per_layer"] = list(stream.resident_pages_per_layer)
  info["staging_reserve_mib"] = staging_reserve_pages(stream, max_tokens, layout) * layout.page_bytes / 2**20
  info["copy_pages"] = copy_pages
  info["kv_policy"] = policy
  if policy == "adaptive":
    pool = stream.pool_pages
    if arena_mib is not None:   # the staging of ANY split the policy may pick fits beside the pool
      pool = fit_adaptive_pool((int(arena_mib * 2**20) - ws) // layout.page_bytes, max_tokens, layout,
                               copy_pages, n_layers=n_layers, wave_pages=wave_pages)
    kv = AdaptiveStreamedKV(cfg, layout, max_tokens, pool, copy_pages, wave_pages=wave_pages)
    info["resident_pages_per_layer"] = list(kv.stream.resident_pages_per_layer)
    info["staging_reserve_mib"] = (adaptive_staging_reserve_pages(pool, max_tokens, layout, copy_pages,
                                                                  n_layers=n_layers, wave_pages=wave_pages)
                                   * layout.page_bytes / 2**20)
    info["wave_cap_pages"] = kv.wave_cap
    info["wave_pages"] = wave_pages
    info["all_pages_resident"] = _all_resident(kv.stream, layout, max_tokens)   # the starting split
  else:
    kv = StreamedKV(cfg, layout, max_tokens, stream)
    # no forward timed alone (a forced wait every 16th forward, without the next forward's prefetch):
    # the copy rate it measures feeds the adaptive policy only (bench_decode keeps its own timing)
    kv.timing_interval = 0
    info["all_pages_resident"] = _all_resident(stream, layout, max_tokens)
  info["kv"] = describe(info["all_pages_resident"])
  info.update(pool_pages=kv.stream.pool_pages, ring_slots=kv.stream.ring_slots,   # the starting split
              copy_unit_pages=kv.copy_unit)      # copy_pages halved until that ring holds it
  # the prefill's block (`generate.prefill`): its hidden rows within the pool's bytes; in a phased
  # arena its rows and their KV rows on the way to the host (`prefill_block_bytes`) within half of
  # what the prefill layout leaves beside its micro-batch's workspace and the smallest KV region
  if block is None and not phased:
    block = prefill_block_tokens(ubatch, row_bytes, kv.stream.pool_pages * layout.page_bytes, max_tokens)
  elif block is None:
    room = int(arena_mib * 2**20) - align_up(ws_prefill, 256) - align_up(need.region_pages * layout.page_bytes, 256)
    block = prefill_block_tokens(ubatch, row_bytes + 2 * layout.token_bytes, max(0, room - 256) // 2, max_tokens)
    ws_prefill += prefill_block_bytes(block, row_bytes, layout.token_bytes) if block > ubatch else 0
  info["prefill_block"] = block
  if phased:   # each phase's pool: a fixed split, or the policy rebound on it (adaptive)
    kv = PhasedKV(kv, int(arena_mib * 2**20), ws_prefill, ws, max_tokens, wave_pages)
    info["prefill_workspace_mib"] = ws_prefill / 2**20
    info["ubatch"] = ubatch
    info["all_pages_resident"] = all(_all_resident(kv.split_for(pages), layout, max_tokens)
                                     for pages in kv.region_pages.values())
    info["kv"] = describe(info["all_pages_resident"], phased=True)
  kv.prefill_block = block
  return kv, info
