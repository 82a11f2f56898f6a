"""Memory accounting for a Qwen3.8-style target + MTP head on the streamed path.

Every number is derived from the model geometry (`kvjax.config`) and the KV
page layout (`kvjax_pallas.page_layout.PageLayout`); nothing is a stored
result. Rows (bytes unless named otherwise):

* KV per token per layer: `PageLayout.token_bytes` (K row + V row).
* KV per page: `PageLayout.page_bytes` (K plane, V aligned up to 128 B).
* KV per layer at the context: `ceil(context / page_tokens)` pages.
* all target attention layers, and the MTP layer (one more attention layer).
* Recurrent state per checkpoint: every Gated DeltaNet layer holds
  `Hv * dk * dv * 4 B` delta-rule state (float32) and
  `(conv_kernel - 1) * conv_dim * 4 B` causal-conv state (the last
  `conv_kernel - 1` inputs, float32).
* Rollback host snapshots for draft depth N: `N` checkpoints. A verify
  forward runs `1 + N` rows; `a` accepted drafts (0..N) keep the state after
  row `a`. With all N accepted the live device state is already right, so
  only the states after rows 0..N-1 need snapshots: `N * checkpoint`.
  (27B, N = 3: 3 * 48 * 3,268,608 B = 448.9 MiB, the reference's ~449 MiB.)
* Two-slot device stage: checkpoints reach the host layer by layer through
  two slots (one filled by the layer being verified while the other drains
  to the host), each holding ONE recurrent layer's N candidate states:
  `2 * N * (delta + conv state of one layer)`.
  (27B, N = 3: 6 * 3,268,608 B = 18.70 MiB, the reference's ~18.7 MiB.)
* Decode KV grant: arena minus the decode workspace minus the stage when
  `stage_in_arena`; the KV pool is what `make_kv`'s plan (`kvjax.streaming.plan.plan_kv`, a
  fixed split) leaves of it after the staging of in-flight uploads, in whole pages, shared by
  target + MTP attention layers (resident pages + ring).

Run: `kvjax memory --config=configs/memory_27b.py` (or `python -m kvjax.memory_report --config=...`).
Arithmetic only: this module imports no JAX, so the command answers at once (`available_memory`,
the bytes free now, imports it when called).
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Tuple

from kvjax import checks
from kvjax import config as config_lib
from kvjax.streaming.budget import StreamBudgetError
from kvjax.streaming.plan import KVGeometry, Workspaces, plan_kv
from kvjax_pallas.page_layout import PageLayout

MIB = 1 << 20
FLOAT32_BYTES = 4


def recurrent_layer_bytes(cfg: config_lib.ModelConfig) -> Tuple[int, int]:
  """(delta-rule state, conv state) bytes of one Gated DeltaNet layer."""
  delta = (cfg.linear_num_value_heads * cfg.linear_head_dim * cfg.linear_head_dim
           * FLOAT32_BYTES)
  conv = (cfg.conv_kernel - 1) * cfg.conv_dim * FLOAT32_BYTES
  return delta, conv


def memory_report(model_cfg: config_lib.ModelConfig, context_tokens: int,
                  k_type: str = "q8_0", v_type: str = "q4_0", arena_mib: float = 2240.0,
                  mtp_depth: int = 3, page_tokens: int = 256,
                  decode_workspace_mib: float = 0.0, stage_in_arena: bool = True,
                  weight_type: str = "bf16", copy_pages: int = 8, weights_impl: str = "planar") -> Dict[str, float]:
  """Byte accounting; returns an ordered dict of named quantities.

  Args:
    model_cfg: model geometry.
    context_tokens: context length the KV sizes are given for.
    k_type, v_type: KV cache encodings ("q8_0", "q4_0", "f16", ...).
    arena_mib: the device phase arena.
    mtp_depth: draft depth N (rollback snapshots and stage scale with it).
    page_tokens: token positions per KV page.
    decode_workspace_mib: the decode phase's workspace inside the arena (an
      input: measure it with `kvjax.streaming.arena.workspace_bytes_from_compiled`).
    stage_in_arena: whether the two-slot stage is carved out of the arena.
    copy_pages: the host -> device copy unit (`make_kv`'s): the pool is the plan's (`plan_kv`, a
      fixed split, pinned host memory), the grant less the staging reserve of in-flight uploads.
    weight_type: the weights' device bytes: "bf16" / "f16" / "f32" every weight at that size, or a
      block format (q8_0, q4_0, q4_k, q5_k, q6_k) for the matrices that stay quantized
      (`kvjax.qweights`), the rest in bf16.
    weights_impl: the quantized product the bytes are counted for: "planar" (a GPU's default: Q8_0 / Q4_0
      at the file's bytes, Q4_K at 5 bits a value against 4.5, Q6_K at 6.75 against 6.5625) or another (the file's blocks).
  """
  if not 1 <= context_tokens <= checks.MAX_POSITIONS:
    raise ValueError(f"context_tokens must be in 1..{checks.MAX_POSITIONS} (int32 token positions), "
                     f"got {context_tokens}")
  if mtp_depth < 0:
    raise ValueError(f"mtp_depth must be >= 0, got {mtp_depth}")
  if mtp_depth > 0 and not model_cfg.has_mtp:
    raise ValueError(f"mtp_depth {mtp_depth} needs a model with an MTP head (mtp_layers=1)")
  pl = PageLayout(model_cfg.num_kv_heads, model_cfg.head_dim, k_type, v_type, page_tokens)
  pages = pl.pages_for(context_tokens)
  layer_bytes = pages * pl.page_bytes
  n_attn = model_cfg.num_attention_layers
  n_rec = len(model_cfg.recurrent_layers)
  delta, conv = recurrent_layer_bytes(model_cfg)
  per_layer_state = delta + conv
  checkpoint = n_rec * per_layer_state
  rollback = mtp_depth * checkpoint
  # rollback by replay: the verify's 1 + N rows' inputs per GDN layer (conv inputs, keys, values,
  # decay, beta; `kvjax.model.ReplayRows`), on the device until the round's rollback
  hv, d = model_cfg.linear_num_value_heads, model_cfg.linear_head_dim
  replay = (mtp_depth + 1) * n_rec * 4 * (model_cfg.conv_dim + 2 * hv * d + 2 * hv) if mtp_depth else 0
  stage = 2 * mtp_depth * per_layer_state
  arena = int(round(arena_mib * MIB))
  workspace = int(round(decode_workspace_mib * MIB))
  grant = arena - workspace - (stage if stage_in_arena else 0)
  if grant < 0:
    raise ValueError(
        f"arena of {arena} B is smaller than the decode workspace ({workspace} B) plus stage "
        f"({stage if stage_in_arena else 0} B); {-grant} B missing")
  pool_layers = n_attn + model_cfg.mtp_layers
  # the pool `make_kv(arena_mib=...)` gives (`plan_kv`: a fixed split, pinned host history): the
  # grant less the staging reserve of in-flight uploads, in whole pages
  kv_plan, refusal = None, ""
  try:
    kv_plan = plan_kv(KVGeometry(n_attn, pool_layers, pl), context_tokens, arena_bytes=arena,
                      copy_pages=copy_pages, workspaces=Workspaces(arena - grant), pinned=True)
  except StreamBudgetError as e:
    refusal = str(e)
  pool_pages = kv_plan.pool_pages if kv_plan else 0
  weights = weight_bytes(model_cfg, weight_type, weights_impl)
  return {
      "weight_type": weight_type,
      "weights_impl": weights_impl,
      "weight_bytes": weights,
      "kv_layout": pl.describe(),
      "context_tokens": context_tokens,
      "page_tokens": page_tokens,
      "kv_bytes_per_token_per_layer": pl.token_bytes,
      "kv_page_bytes": pl.page_bytes,
      "kv_pages_per_layer": pages,
      "kv_layer_bytes": layer_bytes,
      "target_attention_layers": n_attn,
      "target_kv_bytes": n_attn * layer_bytes,
      "mtp_kv_bytes": model_cfg.mtp_layers * layer_bytes,
      "recurrent_layers": n_rec,
      "delta_state_bytes_per_layer": delta,
      "conv_state_bytes_per_layer": conv,
      "recurrent_checkpoint_bytes": checkpoint,
      "mtp_depth": mtp_depth,
      "rollback_host_bytes": rollback,
      "rollback_replay_device_bytes": replay,
      "stage_device_bytes": stage,
      "arena_bytes": arena,
      "decode_workspace_bytes": workspace,
      "decode_kv_grant_bytes": grant,
      "decode_kv_staging_bytes": kv_plan.staging_reserve_pages * pl.page_bytes if kv_plan else 0,
      "decode_kv_pool_pages": pool_pages,
      "decode_kv_pool_bytes": pool_pages * pl.page_bytes,
      "pool_layers": pool_layers,
      "pages_per_pool_layer": pool_pages / pool_layers,
      "resident_pages_per_layer": kv_plan.split.resident_pages_per_layer[0] if kv_plan else 0,
      "ring_slots": kv_plan.split.ring_slots if kv_plan else 0,
      "copy_unit_pages": kv_plan.copy_unit_pages if kv_plan else 0,
      # a decode forward at the full context: ring fills (copy waves) and streamed bytes, in advance
      "decode_ring_fills": kv_plan.decode_cost(context_tokens - 1).ring_fills if kv_plan else 0,
      "decode_stream_bytes": kv_plan.decode_cost(context_tokens - 1).streamed_bytes if kv_plan else 0,
      "plan_refusal": refusal,
  }


_LABELS = [
    ("weight_bytes", "weights on the device"),
    ("kv_bytes_per_token_per_layer", "KV per token per layer"),
    ("kv_page_bytes", "KV per page"),
    ("kv_layer_bytes", "KV per layer at context"),
    ("target_kv_bytes", "KV, all target attention layers"),
    ("mtp_kv_bytes", "KV, MTP layer"),
    ("delta_state_bytes_per_layer", "GDN delta state per layer"),
    ("conv_state_bytes_per_layer", "GDN conv state per layer"),
    ("recurrent_checkpoint_bytes", "recurrent state per checkpoint"),
    ("rollback_host_bytes", "rollback host snapshots"),
    ("rollback_replay_device_bytes", "rollback by replay: verify rows kept"),
    ("stage_device_bytes", "two-slot device stage"),
    ("arena_bytes", "phase arena"),
    ("decode_workspace_bytes", "decode workspace"),
    ("decode_kv_grant_bytes", "decode KV grant"),
    ("decode_kv_staging_bytes", "staging of in-flight uploads"),
    ("decode_kv_pool_bytes", "decode KV pool (whole pages)"),
]


def weight_bytes(model_cfg: config_lib.ModelConfig, weight_type: str = "bf16", weights_impl: str = "planar") -> int:
  """Device bytes of the model's weights: every tensor at `weight_type`'s size ("bf16", "f16",
  "f32"), or the matrices that stay quantized in block format `weight_type` (held for `weights_impl`:
  "planar" / "auto" as planes, another as the file's blocks) and the rest in bf16."""
  shapes = config_lib.gguf_tensor_shapes(model_cfg)
  sizes = {"f32": 4, "bf16": 2, "f16": 2}
  if weight_type not in sizes:
    from kvjax import qweights  # pylint: disable=import-outside-toplevel  (block formats: jax's side)
    qweights.block_values(weight_type)
    if weights_impl not in ("auto",) + qweights.IMPLEMENTATIONS:
      raise ValueError(f"weights_impl {weights_impl!r}: expected auto, {', '.join(qweights.IMPLEMENTATIONS)}")
    shapes = qweights.memory_shapes(shapes, 2, weight_type, "planar" if weights_impl == "auto" else weights_impl)
  return sum(math.prod(s) for s in shapes.values()) * sizes.get(weight_type, 2)


def _fmt_bytes(n: int) -> str:
  if n >= MIB:
    return f"{n / MIB:,.2f} MiB"
  if n >= 1024:
    return f"{n / 1024:,.2f} KiB"
  return f"{n:,} B"


def format_table(report: Dict[str, float]) -> str:
  """Human-readable table of a `memory_report` result."""
  lines: List[str] = [
      f"{report['kv_layout']}",
      f"context {report['context_tokens']:,} tokens = {report['kv_pages_per_layer']:,} pages "
      f"per layer; {report['target_attention_layers']} target attention layers, "
      f"{report['recurrent_layers']} recurrent layers; MTP depth {report['mtp_depth']}",
      f"weights {report['weight_type']}" + ("" if report["weight_type"] in ("bf16", "f16", "f32") else
                                            f", kept quantized for weights_impl {report['weights_impl']}"),
  ]
  w = max(len(l) for _, l in _LABELS)
  for key, label in _LABELS:
    n = int(report[key])
    lines.append(f"  {label:<{w}}  {n:>16,} B  {_fmt_bytes(n):>14}")
  lines.append(f"  {'decode KV pool pages':<{w}}  {report['decode_kv_pool_pages']:>16,}    "
               f"({report['pages_per_pool_layer']:.1f} per layer over {report['pool_layers']} layers)")
  if report["plan_refusal"]:
    lines.append(f"  the plan refuses this arena: {report['plan_refusal']}")
  else:
    lines.append(f"  {'fixed split':<{w}}  {report['resident_pages_per_layer']:>16,}    resident pages a layer, "
                 f"a ring of {report['ring_slots']:,} slots, copy unit {report['copy_unit_pages']} pages")
    lines.append(f"  {'decode forward at ctx':<{w}}  {report['decode_ring_fills']:>16,}    ring fills (copy waves), "
                 f"{_fmt_bytes(report['decode_stream_bytes'])} streamed")
  return "\n".join(lines)


# the fields `report_from_config` reads (a config without them is another command's)
CONFIG_FIELDS = ("model", "context_tokens", "k_type", "v_type", "arena_mib", "mtp_depth", "page_tokens",
                 "decode_workspace_mib", "stage_in_arena")


def report_from_config(cfg) -> Dict[str, float]:
  """Runs `memory_report` from an ml_collections config (see configs/memory_27b.py)."""
  model = config_lib.preset(cfg.model, **dict(cfg.get("model_overrides", {})))
  return memory_report(
      model, context_tokens=cfg.context_tokens, k_type=cfg.k_type, v_type=cfg.v_type,
      arena_mib=cfg.arena_mib, mtp_depth=cfg.mtp_depth, page_tokens=cfg.page_tokens,
      decode_workspace_mib=cfg.decode_workspace_mib, stage_in_arena=cfg.stage_in_arena,
      weight_type=cfg.get("weight_type", "bf16"), copy_pages=cfg.get("copy_pages", 8),
      weights_impl=cfg.get("weights_impl", "planar"))


def main(argv=None):
  from absl import app  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  config_flags.DEFINE_config_file("config", None, "memory report config (configs/memory_27b.py)")

  def _run(_):
    cfg = flags.FLAGS.config
    if cfg is None:
      raise app.UsageError("--config is required, e.g. --config=configs/memory_27b.py")
    print(format_table(report_from_config(cfg)))

  app.run(_run, argv=argv)


if __name__ == "__main__":
  main()


def available_memory() -> Dict[str, Optional[int]]:
  """Bytes available now: "host" (MemAvailable, or physical pages free) and "device" (the default
  device's limit minus what is in use, where the backend reports it; None elsewhere, e.g. on a CPU,
  whose KV lives in host memory)."""
  host = None
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          host = int(line.split()[1]) * 1024
  except OSError:
    pass
  if host is None:
    try:
      host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
      host = None
  import jax  # pylint: disable=import-outside-toplevel  (the report itself needs no JAX)
  device = None
  dev = jax.devices()[0]
  if dev.platform != "cpu":
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
      device = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  return {"host": host, "device": device}
