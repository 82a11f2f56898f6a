"""`code-small`: about 36 M parameters (6 Gated DeltaNet + 2 gated attention in the 3:1 pattern, an
MTP head, BPE of 4,096 tokens) trained on the whole stdlib corpus on one GPU in bfloat16, inside one
10-minute run (training stops at `time_limit_s`, then it evaluates and exports).

  python -m experiments.train --config=configs/train_code_small.py --out=runs/code-small --noprogress

Fields: `kvjax.train.base_config` (every field, with what it means).
"""

import ml_collections

from kvjax import train


def get_config():
  c = train.base_config()
  c.name = "code-small"
  c.max_train_bytes = 0            # every training file
  c.max_heldout_bytes = 2_000_000
  c.bpe_bytes = 4_000_000
  c.vocab_size = 4096
  c.model = ml_collections.ConfigDict(dict(
      hidden_size=512, intermediate_size=1536, num_layers=8, num_attention_heads=8, num_kv_heads=2,
      head_dim=64, rope_dim=32, rope_theta=10000.0, linear_num_key_heads=4, linear_num_value_heads=8,
      linear_head_dim=64, conv_kernel=4, full_attention_interval=4, context_length=4096))
  c.seq_len = 512
  c.batch_size = 32
  c.steps = 1200                   # ~6 passes over a 3 M-token stdlib; the best held-out step is exported
  c.lr = 1.5e-3
  c.warmup_steps = 100
  c.eval_every = 100
  c.eval_windows = 256
  c.ckpt_every = 400
  c.time_limit_s = 420.0           # data + compile + training; evaluation, export and the study follow
  c.compute_dtype = "auto"         # bfloat16 on the GPU
  return c
