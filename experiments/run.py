"""Run one generation described by an ml_collections config; append its results to out_dir.

  python experiments/run.py --config=configs/tiny_stream.py
  python experiments/run.py --config=configs/tiny_stream.py --config.n_predict=64 --config.out_dir=runs/a
  python experiments/run.py --config=configs/qwen38_27b_stream.py          # GPU

The model is the config's `model` ('tiny', 'tiny:SEED' or a GGUF path) or,
when `preset` is set, that `kvjax.config` preset with random weights drawn
on the device. The KV cache is plain or streamed (`kv`); a streamed run with
`compare_plain` also runs the plain cache on the same prompt and records
whether the tokens match.

Writes one JSON line to `<out_dir>/<name>.jsonl` and one row to
`<out_dir>/<name>.csv` (the header grows if a later run adds columns), and
prints the JSON line.
"""

from __future__ import annotations

import csv
import json
import os
import time

from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", None, "experiment config, e.g. configs/tiny_stream.py")
FLAGS = flags.FLAGS


def prompt_of(cfg, loaded):
  """Token ids: `prompt_tokens` seeded random ids, or the tokenized `prompt` text."""
  import numpy as np
  if cfg.prompt_tokens > 0:
    rng = np.random.default_rng(cfg.seed)
    return [int(t) for t in rng.integers(0, loaded.cfg.vocab_size, cfg.prompt_tokens)]
  if loaded.tokenizer is None:
    raise ValueError(f"preset {cfg.preset!r} has no tokenizer: set --config.prompt_tokens=N (> 0)")
  ids = loaded.tokenizer.encode(cfg.prompt)
  if not ids:
    raise ValueError("config.prompt is empty and config.prompt_tokens is 0: no prompt")
  return ids


def run_config(cfg) -> dict:
  """Load the model, generate per `cfg`, -> the result row (flat dict)."""
  import jax
  from kvjax import cli, generate
  if cfg.kv not in ("plain", "streamed"):
    raise ValueError(f"config.kv {cfg.kv!r}: expected 'plain' or 'streamed'")
  loaded = cli.load_runner(cfg.model, preset=cfg.preset or None, dtype=cfg.dtype, k_type=cfg.k_type,
                           v_type=cfg.v_type, page_tokens=cfg.page_tokens, attn_impl=cfg.attn_impl,
                           block_pages=cfg.block_pages)
  prompt = prompt_of(cfg, loaded)
  ctx = cfg.ctx_size or len(prompt) + cfg.n_predict
  if ctx < len(prompt) + cfg.n_predict:
    raise ValueError(f"ctx_size {ctx} < prompt {len(prompt)} + n_predict {cfg.n_predict}")
  sampling = generate.SamplingParams(cfg.temperature, cfg.top_k, cfg.seed)
  eos = None if (cfg.ignore_eos or loaded.tokenizer is None) else loaded.tokenizer.eos_id

  def once(kind):
    budget = {}
    if kind == "streamed":
      if cfg.arena_mib > 0:
        budget["arena_mib"] = cfg.arena_mib
      elif cfg.pool_pages > 0:
        budget["pool_pages"] = cfg.pool_pages
      else:
        raise ValueError("kv='streamed' needs config.arena_mib > 0 or config.pool_pages > 0")
    runs = 2 if cfg.warmup else 1
    for _ in range(runs):
      kv, info = cli.make_kv(loaded.runner, ctx, copy_pages=cfg.copy_pages, **budget)
      t0 = time.perf_counter()
      res = generate.generate(loaded.runner, kv, prompt, cfg.n_predict, sampling=sampling, ubatch=cfg.ubatch,
                              eos_id=eos)
      wall = time.perf_counter() - t0
      del kv
    return res, info, wall

  res, info, wall = once(cfg.kv)
  row = {"name": cfg.name, "model": cfg.preset or cfg.model, "device": str(jax.devices()[0]),
         "dtype": cfg.dtype, "k_type": cfg.k_type, "v_type": cfg.v_type, "attn_impl": cfg.attn_impl,
         "n_predict": cfg.n_predict, "ubatch": cfg.ubatch, "wall_seconds": wall, "load_s": loaded.load_s}
  row.update(info)
  row["resident_pages_per_layer"] = ",".join(map(str, info.get("resident_pages_per_layer", [])))
  row.update(res.metrics)
  if cfg.kv == "streamed" and cfg.compare_plain:
    plain, _, _ = once("plain")
    row["tokens_match"] = plain.tokens == res.tokens
    row["plain_decode_tps"] = plain.metrics["decode_tps"]
  row["tokens"] = " ".join(map(str, res.tokens))
  if loaded.tokenizer is not None:
    row["text"] = loaded.tokenizer.decode(res.tokens)
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
    for r in rows + [row]:
      w.writerow(r)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = FLAGS.config
  if cfg is None:
    raise app.UsageError("--config is required, e.g. --config=configs/tiny_stream.py")
  row = run_config(cfg)
  append_results(cfg.out_dir, cfg.name, row)
  print(json.dumps(row, default=float), flush=True)


if __name__ == "__main__":
  app.run(main)
