"""Building the KV cache of a budget (`kvjax.api.make_kv`'s work once its arguments are checked):
measure what the plan needs of the model (`measure`: its geometry and the compiled layer step's
workspaces), decide the budget (`kvjax.streaming.plan.plan_kv`, pure: every size, or a refusal),
then allocate what the plan says (`build_from_plan`): plain, streamed (a fixed split or the
adaptive policy), phased, or one cache per device of a sharded model."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from kvjax import engine, parallel, speculative, workspace
from kvjax.streaming import StreamedKV
from kvjax.streaming.phases import AdaptiveStreamedKV, PhasedKV
from kvjax.streaming.plan import KVGeometry, KVPlan, Workspaces, plan_kv


def geometry(runner: engine.Runner, max_tokens: int, ubatch: int,
             draft: Optional[speculative.SpecConfig] = None) -> KVGeometry:
  """The model as the plan sees it: its cache layers (the target's attention layers, the MTP's), the
  page layout, the largest attention partition of the forwards the cache admits (a micro-batch of
  `ubatch` rows, a decode row, a verify's rows: a copy wave holds whole ones), the decode row's own
  partition, and a prefill block's hidden-row bytes a token (the MTP's too, with speculation)."""
  cfg = runner.cfg
  rows = {int(ubatch), 1} | ({int(draft.verify_width)} if draft is not None else set())
  return KVGeometry(n_target_layers=cfg.num_attention_layers,
                    n_layers=cfg.num_attention_layers + (1 if cfg.has_mtp else 0), layout=runner.layout,
                    wave_pages=max(runner.partition_pages(r, max_tokens) for r in rows),
                    block_row_bytes=cfg.hidden_size * runner.token_embd.dtype.itemsize * (1 if draft is None else 2),
                    partition_auto=runner.opts.block_pages == "auto",
                    decode_wave_pages=runner.partition_pages(1, max_tokens))


def measure(runner: engine.Runner, max_tokens: int, ubatch: int, phased: bool,
            draft: Optional[speculative.SpecConfig] = None) -> Workspaces:
  """The device scratch an arena holds beside its pool (XLA's memory analysis of the compiled layer
  step): the widest decode-phase forward's (a verify's rows and the states it captures) and, phased,
  one prefill micro-batch's."""
  ws, states = speculative.decode_workspace_bytes(runner, max_tokens, draft)
  return Workspaces(decode_bytes=ws, verify_states_bytes=states, decode_rows=1 if draft is None else draft.verify_width,
                    prefill_bytes=workspace.group_step_workspace_bytes(runner, ubatch, max_tokens) if phased else None)


def plan(runner: engine.Runner, max_tokens: int, arena_mib=None, pool_pages=None, copy_pages: int = 8,
         policy: str = "fixed", phased: bool = False, ubatch: int = 256,
         draft: Optional[speculative.SpecConfig] = None, prefill_block="auto") -> KVPlan:
  """`plan_kv` for `runner` (a sharded runner: per device, each with the whole budget)."""
  tp = getattr(runner, "tensor_parallel", 1)
  device = runner.device_runners[0] if tp > 1 else runner
  if arena_mib is None and pool_pages is None:
    return plan_kv(geometry(device, max_tokens, ubatch), max_tokens, ubatch=ubatch, tensor_parallel=tp)
  return plan_kv(geometry(device, max_tokens, ubatch, draft), max_tokens,
                 arena_bytes=None if arena_mib is None else int(arena_mib * 2**20), pool_pages=pool_pages,
                 copy_pages=copy_pages, policy=policy, phased=phased, ubatch=ubatch,
                 workspaces=measure(device, max_tokens, ubatch, phased, draft) if arena_mib is not None else None,
                 prefill_block=prefill_block, tensor_parallel=tp)


def build_from_plan(runner: engine.Runner, kv_plan: KVPlan) -> Any:
  """The cache `kv_plan` describes, allocated (a sharded runner: one per device, driven as one)."""
  if getattr(runner, "tensor_parallel", 1) > 1:
    parts = parallel.per_device(runner.mesh, lambda d: build_device_kv(runner.device_runners[d], kv_plan))
    kv = parallel.ShardedKV(runner.mesh, parts)
    kv.prefill_block, kv.partition_cap = kv_plan.prefill_block_tokens, kv_plan.partition_cap_pages
    return kv
  return build_device_kv(runner, kv_plan)


def build_device_kv(runner: engine.Runner, p: KVPlan) -> Any:
  """One device's cache of plan `p`."""
  cfg, layout = runner.cfg, runner.layout
  if not p.streamed:
    return engine.PlainKV(cfg, layout, p.max_tokens)
  if p.policy == "adaptive":
    kv = AdaptiveStreamedKV(cfg, layout, p.max_tokens, p.split.pool_pages, p.copy_pages, wave_pages=p.wave_pages)
  else:
    kv = StreamedKV(cfg, layout, p.max_tokens, p.split)
    # no forward timed alone (a forced wait every 16th forward, without the next forward's prefetch):
    # the copy rate it measures feeds the adaptive policy only (bench_decode keeps its own timing)
    kv.timing_interval = 0
  built = (kv.stream, kv.copy_unit, kv.wave_cap)
  if built != (p.split, p.copy_unit_pages, p.wave_cap_pages):   # the cache sizes itself by the plan's rules
    raise AssertionError(f"the cache built {built} differs from its plan's "
                         f"{(p.split, p.copy_unit_pages, p.wave_cap_pages)}")
  if p.phased:   # each phase's pool: a fixed split, or the policy rebound on it (adaptive)
    kv = PhasedKV(kv, p.arena_bytes, p.prefill_workspace_bytes, p.workspaces.decode_bytes, p.max_tokens,
                  p.wave_pages)
    laid = {ph: (kv.region_pages[ph], kv.split_for(kv.region_pages[ph])) for ph in kv.region_pages}
    if laid != {ph: (pp.region_pages, pp.split) for ph, pp in p.phases}:
      raise AssertionError(f"the phase arena laid out {laid}, its plan {p.phases}")
  kv.prefill_block = p.prefill_block_tokens
  kv.partition_cap = p.partition_cap_pages   # the runner's attention partition at most this (None: its own)
  return kv


def build_kv(model, max_tokens: int, arena_mib, pool_pages, copy_pages, policy, phased, ubatch,
             draft: Optional[speculative.SpecConfig] = None, prefill_block="auto") -> Tuple[Any, KVPlan]:
  """Plan, then build: -> (the cache, its plan)."""
  p = plan(model.runner, max_tokens, arena_mib, pool_pages, copy_pages, policy, phased, ubatch, draft, prefill_block)
  return build_from_plan(model.runner, p), p
