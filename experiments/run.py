"""Run one generation described by an ml_collections config; append its results to out_dir.

  python -m experiments.run --config=configs/tiny_stream.py
  python -m experiments.run --config=configs/tiny_stream.py --config.n_predict=64 --config.out_dir=runs/a
  python -m experiments.run --config=configs/qwen38_27b_stream.py          # GPU

(from the repository root). The model is the config's `model` ('tiny',
'tiny:SEED' or a GGUF path) or, when `preset` is set, that `kvjax.config`
preset with random weights drawn on the device. The KV cache is plain or
streamed (`kv`); a streamed run with `compare_plain` also runs the plain cache
on the same prompt and records whether the tokens match. Everything goes
through `kvjax.api`; its errors are reported with the config field names
(`CONFIG_FIELD_OF`).

Writes one JSON line to `<out_dir>/<name>.jsonl` and one row to
`<out_dir>/<name>.csv` (the header grows if a later run adds columns), and
prints the JSON line (and on stderr where it wrote the files). A bad config field, an unknown one
(with the closest field) or a missing config file is refused before the model loads, in one line
`run: error: ...` naming the field (exit status 2; 1 for a bad model file or budget).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from kvjax import spec_config


def define_flags():
  """The flags, defined when the module runs as a program (see experiments/acceptance.py)."""
  config_flags.DEFINE_config_file("config", None, "experiment config, e.g. configs/tiny_stream.py")


FLAGS = flags.FLAGS

# the `kvjax.api` parameter each config field sets (to name fields in the API's errors)
CONFIG_FIELD_OF = {
    "source": "config.model", "preset": "config.preset", "dtype": "config.dtype", "k_type": "config.k_type",
    "v_type": "config.v_type", "page_tokens": "config.page_tokens", "attn_impl": "config.attn_impl",
    "block_pages": "config.block_pages", "prompt": "config.prompt",
    "n_predict": "config.n_predict", "ubatch": "config.ubatch", "max_tokens": "config.ctx_size",
    "temperature": "config.temperature", "top_k": "config.top_k", "seed": "config.seed",
    "arena_mib": "config.arena_mib", "pool_pages": "config.pool_pages", "copy_pages": "config.copy_pages",
    "tensor_parallel": "config.tensor_parallel",
    **spec_config.names("config.", spec_config.config_key),    # "spec.n_max": "config.spec_n_max", ...
}


def prompt_of(cfg, model) -> list:
  """Token ids: `prompt_tokens` tokens (cut from the stdlib corpus when the model has a tokenizer
  and `prompt_source` is 'corpus', seeded random ids otherwise), or the tokenized `prompt` text."""
  import numpy as np
  from kvjax import api, corpus
  if cfg.prompt_tokens > 0:
    if model.tokenizer is not None and cfg.get("prompt_source", "corpus") == "corpus":
      return corpus.prompt_tokens(model.tokenizer, cfg.prompt_tokens)
    rng = np.random.default_rng(cfg.seed)
    return [int(t) for t in rng.integers(0, model.cfg.vocab_size, cfg.prompt_tokens)]
  return api.encode(model, cfg.prompt)


def check_config(cfg) -> None:
  """The checks that need no model (`kvjax.api.ParameterError`, named by the API's parameters)."""
  from kvjax import api
  if cfg.kv not in ("plain", "streamed"):
    raise api.ParameterError(f"config.kv {cfg.kv!r}: expected 'plain' or 'streamed'")
  if cfg.kv == "streamed" and not (cfg.arena_mib > 0 or cfg.pool_pages > 0):
    raise api.ParameterError("kv='streamed' needs config.arena_mib > 0 or config.pool_pages > 0")
  if cfg.prompt_tokens < 0 or cfg.ctx_size < 0:
    raise api.ParameterError(f"config.prompt_tokens and config.ctx_size must be >= 0 (0: not set), got "
                             f"{cfg.prompt_tokens} and {cfg.ctx_size}")
  if cfg.get("prompt_source", "corpus") not in ("corpus", "random"):
    raise api.ParameterError(f"config.prompt_source {cfg.prompt_source!r}: expected 'corpus' or 'random'")
  api.check_generation(n_predict=cfg.n_predict, temperature=cfg.temperature, top_k=cfg.top_k, ubatch=cfg.ubatch,
                       spec=spec_config.from_config(cfg))
  budget = {}
  if cfg.kv == "streamed":
    budget = {"arena_mib": cfg.arena_mib} if cfg.arena_mib > 0 else {"pool_pages": cfg.pool_pages}
  api.check_kv_budget(copy_pages=cfg.copy_pages, **budget)


def run_config(cfg) -> dict:
  """Load the model, generate per `cfg`, -> the result row (flat dict)."""
  import jax
  from kvjax import api
  check_config(cfg)
  model = api.load_model(cfg.model, preset=cfg.preset or None, dtype=cfg.dtype, k_type=cfg.k_type,
                         v_type=cfg.v_type, page_tokens=cfg.page_tokens, attn_impl=cfg.attn_impl,
                         block_pages=cfg.block_pages, tensor_parallel=cfg.get("tensor_parallel", 1))
  prompt = prompt_of(cfg, model)
  spec = spec_config.from_config(cfg)
  ctx = api.context_tokens(len(prompt), cfg.n_predict, spec, max_tokens=cfg.ctx_size)

  def once(kind, spec=None):
    budget = {}
    if kind == "streamed":
      budget = {"arena_mib": cfg.arena_mib} if cfg.arena_mib > 0 else {"pool_pages": cfg.pool_pages}
    kv = api.make_kv(model, ctx, copy_pages=cfg.copy_pages, ubatch=cfg.ubatch,
                     spec=spec, **budget)
    return api.generate(model, kv, prompt_tokens=prompt, n_predict=cfg.n_predict, temperature=cfg.temperature,
                        top_k=cfg.top_k, seed=cfg.seed, ignore_eos=cfg.ignore_eos, ubatch=cfg.ubatch,
                        warmup=cfg.warmup, spec=spec)

  res = once(cfg.kv, spec)
  m = res.metrics
  row = {"name": cfg.name, "model": cfg.preset or cfg.model, "device": str(jax.devices()[0]),
         "dtype": cfg.dtype, "k_type": cfg.k_type, "v_type": cfg.v_type, "n_predict": cfg.n_predict,
         "ubatch": cfg.ubatch, "tensor_parallel": cfg.get("tensor_parallel", 1),
         "wall_seconds": (m["prompt_ms"] + m["predicted_ms"]) / 1e3}
  row.update(m)
  row["resident_pages_per_layer"] = ",".join(map(str, m.get("resident_pages_per_layer", [])))
  if (cfg.kv == "streamed" or spec is not None) and cfg.compare_plain:
    plain = once("plain")            # the plain cache, no speculation: the tokens to match
    row["tokens_match"] = plain.tokens == res.tokens
    row["plain_decode_tps"] = plain.metrics["decode_tps"]
  row["tokens"] = " ".join(map(str, res.tokens))
  if model.tokenizer is not None:
    row["text"] = res.text
  return row


def append_results(out_dir: str, name: str, row: dict) -> None:
  """Append `row` to `<name>.jsonl` and `<name>.csv` (rewriting the CSV if the columns grew)."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, f"{name}.jsonl"), "a") as f:
    f.write(json.dumps(row, default=float) + "\n")
  path = os.path.join(out_dir, f"{name}.csv")
  rows = []
  if os.path.exists(path):
    with open(path, newline="") as f:
      rows = list(csv.DictReader(f))
  cols = list(rows[0].keys()) if rows else []
  cols += [k for k in row if k not in cols]
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    for r in rows + [row]:   # lists and dicts (acceptance by position, ms by width) as JSON cells
      w.writerow({k: json.dumps(v, default=float) if isinstance(v, (list, dict)) else v for k, v in r.items()})


def main(argv):
  from kvjax import checks
  if len(argv) > 1:
    checks.fail("run", f"unexpected arguments: {argv[1:]} (flags take the form --config.FIELD=value)")
  cfg = FLAGS.config
  if cfg is None:
    checks.fail("run", "--config is required, e.g. --config=configs/tiny_stream.py")
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)   # its backend probe: "Unable to initialize backend 'tpu'"
  from kvjax import api, text
  try:
    row = run_config(cfg)
  except (api.ParameterError, ValueError) as e:   # bad config fields, a bad GGUF, a budget too small
    msg = e.renamed(CONFIG_FIELD_OF) if isinstance(e, api.ParameterError) else str(e)
    print(f"run: error: {text.one_line(msg)}", file=sys.stderr, flush=True)
    sys.exit(2 if isinstance(e, api.ParameterError) else 1)
  append_results(cfg.out_dir, cfg.name, row)
  print(json.dumps(row, default=float), flush=True)
  base = os.path.join(cfg.out_dir, cfg.name)
  print(f"run: wrote {base}.jsonl and {base}.csv", file=sys.stderr, flush=True)


# the fields a run reads (configs/tiny_stream.py has them; a config without them is another command's)
CONFIG_FIELDS = ("model", "kv", "prompt", "prompt_tokens", "ctx_size", "n_predict", "ubatch", "arena_mib",
                 "pool_pages", "copy_pages", "page_tokens", "k_type", "v_type", "dtype", "preset", "attn_impl",
                 "block_pages", "temperature", "top_k", "seed", "out_dir", "name")


if __name__ == "__main__":
  define_flags()
  from kvjax import checks
  app.run(main, flags_parser=checks.flags_parser("run", "config", required=CONFIG_FIELDS))
