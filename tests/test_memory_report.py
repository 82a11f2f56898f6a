"""Tests for kvjax.memory_report against the reference's 27B numbers."""

import os
import subprocess
import sys

import pytest

from kvjax import config as config_lib
from kvjax import memory_report as M
from kvjax.streaming.plan import KVGeometry, Workspaces, plan_kv

MIB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_27b_kv_sizes():
  r = M.memory_report(config_lib.qwen38_27b(), 262_144, "q8_0", "q4_0", arena_mib=2240,
                      mtp_depth=3)
  assert r["kv_bytes_per_token_per_layer"] == 1088 + 576
  # the reference's 425,984 B of K and V rows a page (416 MiB a layer at 256 Ki), padded to whole
  # K rows (392 x 1088 B: the v2 kernel's K-row view of the pool, kvjax_pallas.page_layout)
  assert r["kv_page_bytes"] == 425_984 + 512 == 392 * 1088
  assert r["kv_pages_per_layer"] == 1024
  assert r["kv_layer_bytes"] == 416.5 * MIB
  assert r["target_attention_layers"] == 16
  assert r["target_kv_bytes"] == 16 * 416.5 * MIB
  assert r["mtp_kv_bytes"] == 416.5 * MIB
  assert r["pool_layers"] == 17


def test_27b_recurrent_rollback_and_stage():
  r = M.memory_report(config_lib.qwen38_27b(), 262_144, mtp_depth=3, arena_mib=2240)
  assert r["recurrent_layers"] == 48
  assert r["delta_state_bytes_per_layer"] == 48 * 128 * 128 * 4 == 3 * MIB
  assert r["conv_state_bytes_per_layer"] == 3 * 10_240 * 4
  assert r["recurrent_checkpoint_bytes"] == 48 * (3 * MIB + 122_880)
  assert r["rollback_host_bytes"] / MIB == pytest.approx(449, abs=0.5)     # reference: ~449 MiB
  assert r["stage_device_bytes"] / MIB == pytest.approx(18.7, abs=0.05)    # reference: ~18.7 MiB
  r5 = M.memory_report(config_lib.qwen38_27b(), 262_144, mtp_depth=5, arena_mib=2240)
  assert r5["rollback_host_bytes"] * 3 == r["rollback_host_bytes"] * 5
  assert r5["stage_device_bytes"] * 3 == r["stage_device_bytes"] * 5
  r0 = M.memory_report(config_lib.qwen38_27b(), 262_144, mtp_depth=0, arena_mib=2240)
  assert r0["rollback_host_bytes"] == 0 and r0["stage_device_bytes"] == 0
  # replay keeps the 1 + N verify rows' inputs: what kvjax.speculative counts, ~3 % of the snapshots
  from kvjax import speculative
  assert r["rollback_replay_device_bytes"] == 4 * speculative.replay_row_bytes(config_lib.qwen38_27b())
  assert r0["rollback_replay_device_bytes"] == 0
  assert r["rollback_replay_device_bytes"] < 0.05 * r["rollback_host_bytes"]   # 16.6 MiB against 449


def test_decode_grant_is_arena_minus_workspace_and_stage():
  cfg = config_lib.qwen38_27b()
  r = M.memory_report(cfg, 163_840, arena_mib=2240, mtp_depth=3, decode_workspace_mib=12)
  assert r["decode_kv_grant_bytes"] == 2240 * MIB - 12 * MIB - r["stage_device_bytes"]
  page = r["kv_page_bytes"]
  # the pool is make_kv's plan of that arena: the grant less the staging of in-flight uploads
  geometry = KVGeometry(cfg.num_attention_layers, cfg.num_attention_layers + 1, M.PageLayout(
      cfg.num_kv_heads, cfg.head_dim, "q8_0", "q4_0", 256))
  plan = plan_kv(geometry, 163_840, arena_bytes=2240 * MIB, copy_pages=8, pinned=True,
                 workspaces=Workspaces(12 * MIB + r["stage_device_bytes"]))
  assert r["decode_kv_pool_pages"] == plan.pool_pages > 0 and r["ring_slots"] == plan.split.ring_slots
  assert r["decode_kv_staging_bytes"] == plan.staging_reserve_pages * page > 0
  assert r["decode_kv_pool_bytes"] + r["decode_kv_staging_bytes"] <= r["decode_kv_grant_bytes"]
  assert r["plan_refusal"] == "" and "resident pages a layer" in M.format_table(r)
  # an arena with a grant but too small to stream the context: the plan's refusal, in the table
  small = M.memory_report(cfg, 163_840, arena_mib=40, mtp_depth=3, decode_workspace_mib=12)
  assert small["decode_kv_grant_bytes"] > 0 and small["decode_kv_pool_pages"] == 0
  assert small["plan_refusal"].startswith("too small: at least ") and small["plan_refusal"].endswith(" MiB more")
  assert "the plan refuses this arena: too small" in M.format_table(small)
  r2 = M.memory_report(cfg, 163_840, arena_mib=2240, mtp_depth=3, decode_workspace_mib=12,
                       stage_in_arena=False)
  assert r2["decode_kv_grant_bytes"] == 2228 * MIB
  with pytest.raises(ValueError, match="missing"):
    M.memory_report(cfg, 1024, arena_mib=10, mtp_depth=3, decode_workspace_mib=9)


def test_tiny_model_and_other_types():
  cfg = config_lib.tiny()   # 2 KV heads x 64, 6 GDN layers of 4 heads x 32 x 32, conv 3 x 384
  r = M.memory_report(cfg, 1000, "f16", "q8_0", arena_mib=1, mtp_depth=2, page_tokens=64)
  assert r["kv_bytes_per_token_per_layer"] == 2 * 64 * 2 + 2 * 68
  k_plane = 64 * 256
  assert r["kv_page_bytes"] == k_plane + 64 * 136
  assert r["kv_pages_per_layer"] == 16
  assert r["target_attention_layers"] == 2 and r["recurrent_layers"] == 6
  per_layer = 4 * 32 * 32 * 4 + 3 * (2 * 64 + 128) * 4
  assert r["recurrent_checkpoint_bytes"] == 6 * per_layer
  assert r["rollback_host_bytes"] == 2 * 6 * per_layer
  assert r["stage_device_bytes"] == 2 * 2 * per_layer
  with pytest.raises(ValueError, match="MTP"):
    M.memory_report(config_lib.tiny(mtp_layers=0), 1000, mtp_depth=1)


def test_format_table_and_cli():
  r = M.memory_report(config_lib.qwen38_27b(), 262_144, mtp_depth=3, arena_mib=2240)
  table = M.format_table(r)
  assert "416.50 MiB" in table and "two-slot device stage" in table
  out = subprocess.run(
      [sys.executable, "-m", "kvjax.memory_report", "--config=configs/memory_27b.py",
       "--config.mtp_depth=5"], cwd=ROOT, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr
  assert "MTP depth 5" in out.stdout and "436,731,904 B" in out.stdout   # 1,024 pages of 426,496 B
  assert "rollback host snapshots" in out.stdout


def test_weight_bytes_by_type():
  """The weights' device bytes: every tensor at the dtype's size, or the kept matrices in their
  block format (the 27B: 53.3 GiB in bf16, about 15 GiB with Q4_K matrices), or as planes (the
  GPU's default product: Q4_K about 16.6 GiB, measured 16.65 on an H100; Q8_0 the blocks' bytes)."""
  from kvjax import config as config_lib
  from kvjax.memory_report import memory_report, weight_bytes
  cfg = config_lib.qwen38_27b()
  bf16, q4k, q8 = (weight_bytes(cfg, t, "xla") for t in ("bf16", "q4_k", "q8_0"))
  assert weight_bytes(cfg, "f32") == 2 * bf16 and 53 * 2**30 < bf16 < 54 * 2**30
  assert 14 * 2**30 < q4k < 16 * 2**30 < q8 < bf16
  planar = weight_bytes(cfg, "q4_k", "planar")
  assert 16.6 * 2**30 < planar < 16.7 * 2**30 and planar == weight_bytes(cfg, "q4_k", "auto") == weight_bytes(cfg, "q4_k")
  assert weight_bytes(cfg, "q8_0", "planar") == q8 and weight_bytes(cfg, "bf16", "planar") == bf16
  assert memory_report(cfg, 4096, weight_type="q4_k", weights_impl="xla")["weight_bytes"] == q4k
  with pytest.raises(ValueError, match="^weights_impl 'bogus': expected auto, xla"):
    weight_bytes(cfg, "q4_k", "bogus")
  with pytest.raises(ValueError, match="q3_k"):
    weight_bytes(cfg, "q3_k")
