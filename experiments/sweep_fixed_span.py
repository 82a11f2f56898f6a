"""Sweep the streamed (fixed resident/ring split) path over context capacities x KV budgets
(x MTP draft lengths with speculative decoding).

For each context capacity C and each budget (an arena in MiB, from which the
measured decode workspace is taken, or a pool size in pages), it fills the
context with a prompt of C - decode_tokens - (max draft length + 1) tokens (cut
from the stdlib corpus when the model has a tokenizer, seeded random ids
otherwise), prefills it through `StreamedKV`, decodes `decode_tokens` tokens
greedily, and records one row. With `--spec_type` (mtp, ngram, ngram+mtp,
oracle) each (context, budget) runs once for every `--mtp_lengths` value: 0 is
plain decoding (the tokens the others must equal: `tokens_match`), n > 0
speculative decoding with n_max = n. Column names follow the reference
benchmark where they apply:

  context_capacity, prompt_tokens, decode_tokens, arena_mib, prefill_tps,
  decode_tps, prompt_ms, predicted_ms, wall_seconds, decode_kv_pool_mib,
  resident_pages, ring_slots, active_pages, h2d_mib_per_token, h2d_calls_per_token

plus pool_pages, decode_workspace_mib, all_pages_resident, ring_wraps,
readiness_misses, error, and for speculative rows mtp_length, spec_type,
mtp_draft_generated, mtp_draft_accepted, mtp_acceptance_pct,
acceptance_by_position, realized_verify_width (tokens per verify forward), verify_rows_mean,
verify_ms_by_width (JSON), mtp_lease_bytes_per_round, rollback_d2h_bytes,
rollback_h2d_bytes, tokens_match. `tokens_match` compares a speculative row's tokens with the plain
decoding of its (context, budget); with `--compare_plain` every row's with a greedy run of the
same prompt on the plain cache (one a context); a sweep that compares nothing has no such
column. `resident_pages` is the pool's resident region (all
cache layers), `active_pages` the pages one cache layer holds at the end, and
the per-token copy figures count decode forwards only; `all_pages_resident`
marks a budget that holds the whole context resident (nothing streams). A
budget too small for a context is recorded with its error message and the
sweep goes on; a context, budget or draft length that is not a positive count
(draft lengths: >= 0) is refused at once, in one line (exit status 2).

Writes `<out>/results.csv`, `<out>/results.jsonl` and, when matplotlib is
installed, a 2x2 plot `<out>/results.png` with one line per budget the sweep
was given (an arena's pool may change with the context; it stays one line).
Run from the repository root:

  python -m experiments.sweep_fixed_span --model=tiny --contexts=256,512 --arena_mib=0.2,0.5 \\
      --page_tokens=64 --decode_tokens=16 --out=runs/sweep_tiny                      # CPU, a minute
  python -m experiments.sweep_fixed_span --preset=qwen38_27b --dtype=bfloat16 \\
      --contexts=32768,65536,131072 --arena_mib=2240                                  # GPU
  python -m experiments.sweep_fixed_span --preset=qwen38_27b --dtype=bfloat16 --arena_mib=2240 \\
      --contexts=32768,131072,262144 --spec_type=oracle --mtp_lengths=0,3,5 --spec_oracle_acceptance=0.75
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import os
import sys
import time

from absl import app, flags
from tqdm import tqdm

from kvjax import spec_config


def define_flags():
  """The flags, defined when the module runs as a program (see experiments/acceptance.py)."""
  flags.DEFINE_string("model", "tiny", "'tiny', 'tiny:SEED' or a GGUF path")
  flags.DEFINE_string("preset", None, "kvjax.config preset with random device weights (overrides --model)")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weight/activation dtype")
  flags.DEFINE_list("contexts", ["256", "512"], "context capacities (tokens): prompt + decode")
  flags.DEFINE_list("arena_mib", [], f"device arena budgets (MiB); {DEFAULT_ARENA_MIB} when no --pool_pages is given")
  flags.DEFINE_list("pool_pages", [], "KV pool budgets in pages (instead of / besides --arena_mib)")
  flags.DEFINE_integer("decode_tokens", 16, "tokens decoded per run")
  flags.DEFINE_integer("page_tokens", 64, "tokens per KV page")
  flags.DEFINE_integer("copy_pages", 8, "host copy unit (pages, a power of two)")
  flags.DEFINE_integer("ubatch", 64, "prefill micro-batch")
  flags.DEFINE_string("k_type", "q8_0", "K cache type")
  flags.DEFINE_string("v_type", "q4_0", "V cache type")
  flags.DEFINE_string("attn_impl", "reference", "span attention implementation")
  flags.DEFINE_string("block_pages", "auto", "pages per logical partition (an int) or auto")
  flags.DEFINE_integer("seed", 0, "prompt seed")
  flags.DEFINE_bool("warmup", True, "run each configuration once before the measured run (compile)")
  flags.DEFINE_list("mtp_lengths", ["0"], "draft lengths (n_max) per context and budget; 0 = no speculation")
  # --spec_type, --spec_p_min, ...: the other `SpecConfig` fields by their config keys
  spec_config.define_flags(flags.FLAGS, spec_config.config_key, [spec_config.NONE, *spec_config.DRAFTS],
                           skip=("n_max",))
  flags.DEFINE_bool("compare_plain", False, "also decode each context's prompt on the plain cache and "
                    "record in tokens_match whether every row's tokens equal it")
  flags.DEFINE_string("out", "runs/sweep_fixed_span", "output folder")


FLAGS = flags.FLAGS

DEFAULT_ARENA_MIB = "0.25"   # the budget of a sweep given none (the tiny model's 256-1,024-token contexts)
COLUMNS = ["context_capacity", "prompt_tokens", "decode_tokens", "arena_mib", "pool_pages", "prefill_tps",
           "decode_tps", "prompt_ms", "predicted_ms", "wall_seconds", "decode_kv_pool_mib",
           "decode_workspace_mib", "resident_pages", "ring_slots", "active_pages", "all_pages_resident",
           "h2d_mib_per_token", "h2d_calls_per_token", "streamed_pages_per_token", "waves_per_token",
           "ring_wraps", "readiness_misses", "error",
           "mtp_length", "spec_type", "mtp_draft_generated", "mtp_draft_accepted", "mtp_acceptance_pct",
           "acceptance_by_position", "realized_verify_width", "verify_rows_mean", "verify_ms_by_width",
           "mtp_lease_bytes_per_round", "rollback_d2h_bytes", "rollback_h2d_bytes", "tokens_match"]


def measure(runner, kv, prompt, decode_tokens, ubatch, spec=None, truth=None):
  """Prefill + greedy decode (speculative with `spec`, a `SpecConfig`: the oracle drafts from
  `truth`, plain greedy's tokens) with timings and decode-only copy counters. -> (row, tokens)."""
  import jax
  import jax.numpy as jnp
  from kvjax import generate, speculative
  seq = generate.SequenceState(runner, kv)
  use_mtp = spec is not None and spec.uses_mtp
  t0 = time.perf_counter()
  out = generate.prefill(seq, prompt, ubatch, with_hidden=use_mtp)
  tok = int(jnp.argmax(out[0] if use_mtp else out))
  mtp_next = speculative.mtp_catch_up(runner, kv, out[1], list(prompt[1:]) + [tok], 0, ubatch) if use_mtp else None
  t1 = time.perf_counter()
  before = dict(kv.counters)
  stats = {}
  if spec is None:
    toks = [tok]
    for _ in range(decode_tokens - 1):
      toks.append(int(jnp.argmax(seq.forward([toks[-1]]))))
  else:
    toks, stats = speculative.speculate(seq, tok, decode_tokens, spec, prompt, ubatch, oracle_tokens=truth,
                                        mtp_next=mtp_next)
  jax.block_until_ready(kv.pool_pn)
  t2 = time.perf_counter()
  n_dec = max(decode_tokens - 1, 1)
  c = kv.counters
  return _spec_columns(stats) | {
      "prompt_ms": (t1 - t0) * 1e3, "predicted_ms": (t2 - t1) * 1e3,
      "prefill_tps": len(prompt) / (t1 - t0),
      "decode_tps": (decode_tokens - 1) / (t2 - t1) if decode_tokens > 1 else 0.0,
      "wall_seconds": t2 - t0,
      "h2d_mib_per_token": (c["h2d_bytes"] - before["h2d_bytes"]) / 2**20 / n_dec,
      "h2d_calls_per_token": (c["h2d_calls"] - before["h2d_calls"]) / n_dec,
      "streamed_pages_per_token": (c["streamed_pages"] - before["streamed_pages"]) / n_dec,
      "waves_per_token": (c["waves"] - before["waves"]) / n_dec,
      "ring_wraps": c["ring_wraps"], "readiness_misses": c["readiness_misses"],
  }, toks


def _spec_columns(stats):
  """The reference benchmark's MTP columns (and kvjax's verify figures) from `speculate`'s stats."""
  if not stats:
    return {}
  gen, acc = stats["draft_generated"], stats["draft_accepted"]
  return {"spec_type": stats["spec_type"], "mtp_draft_generated": gen, "mtp_draft_accepted": acc,
          "mtp_acceptance_pct": 100.0 * acc / gen if gen else 0.0,
          "acceptance_by_position": json.dumps(stats["acceptance_by_position"]),
          "realized_verify_width": stats["realized_verify_width"], "verify_rows_mean": stats["verify_rows_mean"],
          "verify_ms_by_width": json.dumps(stats["verify_ms_by_width"]),
          "mtp_lease_bytes_per_round": stats.get("mtp_lease_bytes_per_round", 0.0),
          "rollback_d2h_bytes": stats["rollback_d2h_bytes"], "rollback_h2d_bytes": stats["rollback_h2d_bytes"]}


def spec_of(length: int):
  """The `SpecConfig` of one draft length of the sweep (None: plain decoding)."""
  if FLAGS.spec_type == spec_config.NONE or length == 0:
    return None
  return spec_config.SpecConfig(n_max=length, **{f: FLAGS[spec_config.config_key(f)].value
                                                 for f in spec_config.FIELDS if f != "n_max"})


def prompt_for(model, n_prompt):
  """`n_prompt` tokens of the stdlib corpus (a model with a tokenizer) or seeded random ids."""
  import numpy as np
  from kvjax import corpus
  if model.tokenizer is not None:
    return corpus.prompt_tokens(model.tokenizer, n_prompt)
  rng = np.random.default_rng(FLAGS.seed)
  return [int(t) for t in rng.integers(0, model.cfg.vocab_size, n_prompt)]


def plain_tokens(model, ctx):
  """Greedy decoding of the context's prompt on the plain cache (`--compare_plain`), or None where the
  context leaves no prompt."""
  from kvjax import api
  n_prompt = ctx - FLAGS.decode_tokens - (_longest() + 1)
  if n_prompt < 1:
    return None
  return api.generate(model, prompt_tokens=prompt_for(model, n_prompt), n_predict=FLAGS.decode_tokens,
                      ignore_eos=True, ubatch=FLAGS.ubatch).tokens


def _longest():
  return max(int(n) for n in FLAGS.mtp_lengths) if FLAGS.spec_type != "none" else -1


def sweep_row(model, ctx, budget, length=0, truth=None, plain=None):
  """One (context, budget, draft length) run of `measure` on a fresh streamed cache
  (`kvjax.api.make_kv`); `truth` the plain decoding of the same budget (what speculative rows must
  equal), `plain` the plain cache's tokens (`--compare_plain`). -> (row, generated tokens or None)."""
  from kvjax import api
  from kvjax.streaming import StreamBudgetError
  row = {k: "" for k in COLUMNS}
  n_prompt = ctx - FLAGS.decode_tokens - (_longest() + 1)
  row.update(context_capacity=ctx, prompt_tokens=n_prompt, decode_tokens=FLAGS.decode_tokens, **budget)
  if FLAGS.spec_type != "none":
    row["mtp_length"] = length
  if n_prompt < 1:
    row["error"] = f"context {ctx} leaves no prompt after {FLAGS.decode_tokens} decode tokens"
    return row, None
  prompt = prompt_for(model, n_prompt)
  spec = spec_of(length)
  if spec is not None and spec.draft == "oracle" and truth is None:
    row["error"] = "the oracle drafts plain greedy's tokens, and the plain run of this budget failed"
    return row, None
  try:
    for _ in range(2 if FLAGS.warmup else 1):
      kv = api.make_kv(model, ctx, copy_pages=FLAGS.copy_pages, ubatch=FLAGS.ubatch,
                       spec=spec, **budget)
      m, toks = measure(model.runner, kv.provider, prompt, FLAGS.decode_tokens, FLAGS.ubatch, spec, truth)
  except StreamBudgetError as e:
    row["error"] = " ".join(str(e).split())
    return row, None
  row.update(m)
  if plain is not None:
    row["tokens_match"] = toks == plain
  elif spec is not None and truth is not None:
    row["tokens_match"] = toks == truth
  metrics = kv.metrics()
  row.update(decode_kv_pool_mib=metrics["pool_mib"], pool_pages=metrics["pool_pages"],
             resident_pages=metrics["resident_pages"], ring_slots=metrics["ring_slots"],
             active_pages=model.layout.pages_for(ctx), all_pages_resident=kv.info["all_pages_resident"],
             decode_workspace_mib=kv.info.get("decode_workspace_mib", ""))
  return row, toks


def series_of(rows):
  """Plot lines: {label: rows sorted by context}, one per budget the sweep was given (an arena's
  rows stay together although its pool may differ per context); error rows are left out."""
  out = {}
  for r in rows:
    if r["error"]:
      continue
    label = f"arena {r['arena_mib']} MiB" if r["arena_mib"] != "" else f"pool {r['pool_pages']} pages"
    if r.get("mtp_length") not in ("", None):
      label += f", MTP {r['mtp_length']}"
    out.setdefault(label, []).append(r)
  return {k: sorted(v, key=lambda r: r["context_capacity"]) for k, v in out.items()}


def plot_pools(rows, path, plt):
  """Pages streamed and copy waves per decode token against the pool size (pages), one line per
  context capacity (the `--pool_pages` budgets)."""
  rows = [r for r in rows if r.get("pool_pages") not in ("", None) and not r.get("error")]
  if not rows:
    return
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  for ax, (key, title) in zip(axes, [("streamed_pages_per_token", "pages streamed per decode token"),
                                     ("waves_per_token", "copy waves per decode token")]):
    for ctx in sorted({r["context_capacity"] for r in rows}):
      sel = sorted((r for r in rows if r["context_capacity"] == ctx), key=lambda r: int(r["pool_pages"]))
      ax.plot([int(r["pool_pages"]) for r in sel], [r[key] for r in sel], marker="o", label=f"{ctx} tokens")
    ax.set_title(title)
    ax.set_xlabel("KV pool (pages)")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def plot(rows, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  series = series_of(rows)
  fig, axes = plt.subplots(2, 2, figsize=(10, 7))
  panels = [("decode_tps", "decode tok/s"), ("prefill_tps", "prefill tok/s"),
            ("h2d_mib_per_token", "H2D MiB per decode token"), ("ring_slots", "ring slots")]
  for ax, (key, title) in zip(axes.ravel(), panels):
    for label, sel in series.items():
      ax.plot([r["context_capacity"] for r in sel], [r[key] for r in sel], marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel("context capacity (tokens)")
    ax.grid(alpha=0.3)
  axes[0, 0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plot_pools(rows, os.path.join(os.path.dirname(path), "pools.png"), plt)
  plt.close(fig)
  return True


PROG = "sweep_fixed_span"


def counts(flag: str, values, kind=int, least=1):
  """The values of a list flag as `kind`, each >= `least` (else one line and exit status 2)."""
  from kvjax import checks
  return checks.list_values(PROG, flag, values, kind, least)


def main(argv):
  from kvjax import checks
  if len(argv) > 1:
    checks.fail(PROG, f"unexpected arguments: {argv[1:]}")
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)   # its backend probe: "Unable to initialize backend 'tpu'"
  from kvjax import api
  contexts = counts("contexts", FLAGS.contexts)
  arenas = FLAGS.arena_mib or ([] if FLAGS.pool_pages else [DEFAULT_ARENA_MIB])
  budgets = [{"arena_mib": a} for a in counts("arena_mib", arenas, float, 1e-300)] + \
            [{"pool_pages": p} for p in counts("pool_pages", FLAGS.pool_pages)]
  lengths = sorted(set(counts("mtp_lengths", FLAGS.mtp_lengths, least=0))) if FLAGS.spec_type != "none" else [0]
  counts("decode_tokens", [FLAGS.decode_tokens])
  if not contexts or not budgets:
    checks.fail(PROG, "need at least one --contexts value and one --arena_mib or --pool_pages value")
  if FLAGS.spec_type == "oracle" and 0 not in lengths:
    checks.fail(PROG, "--spec_type=oracle drafts plain greedy's tokens: --mtp_lengths must include 0")
  try:
    model = api.load_model(FLAGS.model, preset=FLAGS.preset, dtype=FLAGS.dtype, k_type=FLAGS.k_type,
                           v_type=FLAGS.v_type, page_tokens=FLAGS.page_tokens, attn_impl=FLAGS.attn_impl,
                           block_pages=FLAGS.block_pages)
  except api.ParameterError as e:   # this script's flags carry the API's parameter names, `source` aside
    checks.fail(PROG, e.renamed({**{p: f"--{p}" for p in e.params}, "source": "--model", "preset": "--preset"}))
  except ValueError as e:   # a bad GGUF file
    checks.fail(PROG, e, status=1)
  os.makedirs(FLAGS.out, exist_ok=True)
  columns = [c for c in COLUMNS if c != "tokens_match" or FLAGS.compare_plain or FLAGS.spec_type != "none"]
  plains = {ctx: plain_tokens(model, ctx) for ctx in contexts} if FLAGS.compare_plain else {}
  rows = []
  truths = {}
  with open(os.path.join(FLAGS.out, "results.jsonl"), "w") as jf:
    for ctx, budget, length in tqdm(list(itertools.product(contexts, budgets, lengths)), desc="sweep", unit="run",
                                     disable=not sys.stderr.isatty()):
      key = (ctx, json.dumps(budget))
      row, toks = sweep_row(model, ctx, budget, length, truths.get(key), plains.get(ctx))
      if length == 0:
        truths[key] = toks          # plain greedy: what the speculative rows must equal
      row = {c: row[c] for c in columns}
      rows.append(row)
      jf.write(json.dumps(row, default=float) + "\n")
      jf.flush()
      tqdm.write(json.dumps(row, default=float))
  with open(os.path.join(FLAGS.out, "results.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=columns)
    w.writeheader()
    w.writerows(rows)
  wrote = [os.path.join(FLAGS.out, n) for n in ("results.csv", "results.jsonl")]
  if plot(rows, os.path.join(FLAGS.out, "results.png")):
    wrote.append(os.path.join(FLAGS.out, "results.png"))
    if any(r["pool_pages"] not in ("", None) and not r["error"] for r in rows):   # as plot_pools
      wrote.append(os.path.join(FLAGS.out, "pools.png"))
  print(f"{PROG}: wrote {', '.join(wrote)}", flush=True)


if __name__ == "__main__":
  define_flags()
  from kvjax import checks
  app.run(main, flags_parser=checks.flags_parser(PROG))
