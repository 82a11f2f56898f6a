"""Qwen3.8-27B geometry (random bf16 weights drawn on the GPU), streamed KV within a 2,240 MiB arena.

  python -m experiments.run --config=configs/qwen38_27b_stream.py
  python -m experiments.run --config=configs/qwen38_27b_stream.py --config.prompt_tokens=32768 \\
      --config.attn_impl=triton

Needs one large GPU (the weights alone are ~54 GB in bf16). The logits of
random weights are meaningless; the point is the cost of prefill and decode
and the streamed copy traffic at this geometry. Field meanings: see
configs/tiny_stream.py.
"""

import ml_collections

from kvjax import spec_config


def get_config():
  c = ml_collections.ConfigDict()
  c.name = "qwen38_27b_stream"
  c.model = ""
  c.preset = "qwen38_27b"
  c.dtype = "bfloat16"
  c.k_type = "q8_0"
  c.v_type = "q4_0"
  c.page_tokens = 256
  c.attn_impl = "reference"
  c.block_pages = "auto"  # or pages per partition (an int)
  c.prompt = ""
  c.prompt_tokens = 8192
  c.n_predict = 128
  c.ubatch = 256
  c.ctx_size = 0
  c.temperature = 0.0
  c.top_k = 0
  c.seed = 0
  c.ignore_eos = True
  c.kv = "streamed"
  c.arena_mib = 2240.0
  c.pool_pages = 0
  c.copy_pages = 8
  c.tensor_parallel = 1   # devices the model is sharded over (arena / pool per device)
  c.compare_plain = False
  c.warmup = True
  c.prompt_source = "random"  # a preset has no tokenizer: seeded random ids
  # speculative decoding (fields as in configs/tiny_stream.py); e.g. --config.spec_type=oracle
  c.update(spec_config.config_defaults())   # spec_type "none", spec_n_max 3, ...
  c.out_dir = "runs/"
  return c
