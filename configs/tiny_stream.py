"""Tiny built-in model, streamed KV through a 6-page pool, checked against the plain cache (CPU, seconds).

  python -m experiments.run --config=configs/tiny_stream.py
  python -m experiments.run --config=configs/tiny_stream.py --config.n_predict=64 --config.kv=plain

(from the repository root). Most fields are `kvjax.api` parameters of the same name (ctx_size
is the API's max_tokens; `experiments/run.py`, `CONFIG_FIELD_OF`); errors name the field.

Fields (0 / "" mean "not set"):
  model          'tiny', 'tiny:SEED' or a GGUF path
  preset         a `kvjax.config` preset name: random weights drawn on the device
                 (no tokenizer: use prompt_tokens); overrides `model`
  prompt         prompt text (tokenized with the model's tokenizer)
  prompt_tokens  > 0: that many seeded random token ids instead of `prompt`
  attn_impl      'auto', 'reference' or a Pallas kernel (interpreted without a GPU: slow)
  kv             'streamed' or 'plain'
  arena_mib      > 0: streamed pool = arena - measured decode workspace
  pool_pages     > 0: streamed pool size in pages (used when arena_mib is 0)
  tensor_parallel  shard the model over this many devices (`kvjax.parallel`); arena_mib and
                 pool_pages are then per device
  compare_plain  streamed runs also run the plain cache and report tokens_match
  warmup         run each generation once before the measured run (excludes compile time;
                 without it, compile_ms says how much of the timings was compilation)
  prompt_source  'corpus': prompt_tokens cut from the stdlib corpus (kvjax.corpus.prompt_tokens)
                 when the model has a tokenizer; 'random': seeded random ids
  spec_*         speculative decoding (kvjax.api.SpecConfig: spec_type is its draft, the rest its
                 fields of the same name, `kvjax.spec_config.config_key`); with compare_plain the
                 tokens are checked against plain greedy on the plain cache. Metrics:
                 draft_generated / draft_accepted, acceptance_by_position, realized_verify_width
                 (tokens a verify), verify_ms_by_width, mtp_lease_bytes_per_round,
                 rollback_d2h_bytes / rollback_h2d_bytes

  python -m experiments.run --config=configs/tiny_stream.py --config.spec_type=oracle \
      --config.spec_oracle_acceptance=0.9 --config.prompt_tokens=100
"""

import ml_collections

from kvjax import spec_config


def get_config():
  c = ml_collections.ConfigDict()
  c.name = "tiny_stream"
  c.model = "tiny"
  c.preset = ""
  c.dtype = "float32"
  c.k_type = "q8_0"
  c.v_type = "q4_0"
  c.page_tokens = 64
  c.attn_impl = "reference"
  c.block_pages = 1
  c.prompt = ("The history lives on the host, where every page is written once and read many times. "
              "A streamed cache keeps some pages on the device and brings the others back through a ring.")
  c.prompt_tokens = 0
  c.n_predict = 32
  c.ubatch = 64
  c.ctx_size = 0          # 0 = prompt + n_predict
  c.temperature = 0.0
  c.top_k = 0
  c.seed = 0
  c.ignore_eos = True
  c.kv = "streamed"
  c.arena_mib = 0.0
  c.pool_pages = 6
  c.copy_pages = 8
  c.tensor_parallel = 1   # devices the model is sharded over (arena / pool per device)
  c.compare_plain = True
  c.warmup = False
  c.prompt_source = "corpus"  # prompt_tokens from the stdlib corpus (models with a tokenizer) or "random"
  # speculative: every `SpecConfig` field by its config key, at its default: spec_type "none" (or "mtp",
  # "ngram", "ngram+mtp", "oracle"), spec_n_max, spec_p_min, spec_ngram_n, spec_ngram_m (0 = spec_n_max),
  # spec_oracle_acceptance, spec_oracle_seed, spec_rollback, spec_oracle_mtp
  c.update(spec_config.config_defaults())
  c.out_dir = "runs/"
  return c
