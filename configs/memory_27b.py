"""Memory report for Qwen3.8-27B at 256 Ki context, Q8_0 K / Q4_0 V, MTP depth 3.

`kvjax memory --config=configs/memory_27b.py` (or `python -m kvjax.memory_report --config=...`);
override with e.g. `--config.mtp_depth=5 --config.context_tokens=163840`.
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.model = "qwen38_27b"
  c.model_overrides = ml_collections.ConfigDict()
  c.context_tokens = 262144
  c.k_type = "q8_0"
  c.v_type = "q4_0"
  c.page_tokens = 256
  c.arena_mib = 2240.0
  c.mtp_depth = 3
  # Decode-phase workspace inside the arena: an input assumption (the
  # reference's 2,240 MiB arena granted ~2,228 MiB of KV without MTP, i.e.
  # ~12 MiB of decode workspace). Replace it with a measurement from
  # kvjax.streaming.arena.workspace_bytes_from_compiled for kvjax's own executables.
  c.decode_workspace_mib = 12.0
  c.stage_in_arena = True
  c.weight_type = "bf16"     # or a block format the matrices stay in: q8_0, q4_0, q4_k, q5_k, q6_k
  c.weights_impl = "planar"  # the product the quantized bytes are for: planar (a GPU's default; Q4_K at 6
                             # bits a value) or xla / pallas_gemv / ... (the file's blocks)
  c.copy_pages = 8           # host -> device copy unit (pages): sizes the staging reserve of the plan
  return c
