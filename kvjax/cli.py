"""The `kvjax` console script: `generate`, `logits` and `memory` subcommands.

    kvjax generate --model tiny --prompt "Hello" --n-predict 32
    kvjax generate --model model.gguf --prompt-tokens 1,2,3 --kv-stream-arena-mib 2240 --json
    kvjax logits   --model tiny --tokens 1,2,3,4 --out logits.npy [--mtp]
    kvjax memory   --config=configs/memory_27b.py [--config.mtp_depth=5]

Flags use llama.cpp's dashed names where one exists (`--n-predict`,
`--ctx-size`, `--cache-type-k`, `--ubatch-size`, ...). Each subcommand parses
its own flags into a fresh `absl.flags.FlagValues`, so `main(argv)` can be
called repeatedly in one process (tests, notebooks) without flag clashes.

Errors a user can cause (bad flags, a missing or malformed GGUF, a KV pool
too small for the context) are printed as one line `kvjax: error: ...` on
stderr, without a traceback; the exit status is 2 for usage errors (unknown
subcommand or flag, bad flag values) and 1 for the rest.

The helpers below (`load_runner`, `make_kv`, `decode_workspace_bytes`,
`teacher_forced_logits`) are what the experiment scripts and the quickstart
notebook use too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from absl import flags

PROG = "kvjax"
SUBCOMMANDS = ("generate", "logits", "memory")

USAGE = f"""\
usage: {PROG} <subcommand> [flags]

subcommands:
  generate  prefill a prompt and decode tokens (plain or streamed KV cache)
  logits    write teacher-forced float32 logits of a token sequence to a .npy file
  memory    byte accounting of the streamed KV cache for a model (ml_collections config)

'{PROG} <subcommand> --help' lists a subcommand's flags.
"""


class UsageError(ValueError):
  """Bad command line (exit status 2)."""


# ---------------------------------------------------------------------------
# flag sets (one fresh FlagValues per invocation)
# ---------------------------------------------------------------------------

def _model_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("model", "tiny", "GGUF path, or 'tiny' / 'tiny:SEED' for the built-in tiny model "
                      "(random weights, its own tokenizer)", flag_values=fv)
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weight and activation dtype",
                    flag_values=fv)
  flags.DEFINE_string("cache-type-k", "q8_0", "K cache type: q8_0, q4_0, f16, bf16, f32", flag_values=fv)
  flags.DEFINE_string("cache-type-v", "q4_0", "V cache type: q8_0, q4_0, f16, bf16, f32", flag_values=fv)
  flags.DEFINE_integer("kv-page-tokens", 256, "token positions per KV page", flag_values=fv)
  flags.DEFINE_integer("ubatch-size", 256, "prefill micro-batch (rows per forward)", flag_values=fv)
  flags.DEFINE_string("attn-impl", "auto", "span attention implementation: auto (on an NVIDIA GPU "
                      "mosaic for each call it takes: decode, verify, prefill chunks; triton for the rest; "
                      "reference elsewhere) | reference | triton | mosaic",
                      flag_values=fv)
  flags.DEFINE_string("attn-block-pages", "auto", "pages per logical partition of the attention "
                      "core (an int >= 1), or auto (sized to the table and the GPU)", flag_values=fv)


def _generate_flags(fv: flags.FlagValues) -> None:
  _model_flags(fv)
  flags.DEFINE_string("prompt", None, "prompt text (tokenized with the model's tokenizer)", flag_values=fv)
  flags.DEFINE_string("prompt-tokens", None, "prompt as comma-separated token ids, e.g. 1,2,3",
                      flag_values=fv)
  flags.DEFINE_integer("n-predict", 32, "tokens to generate", flag_values=fv)
  flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy)", flag_values=fv)
  flags.DEFINE_integer("top-k", 0, "top-k sampling (0 = whole vocabulary)", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv)
  flags.DEFINE_integer("ctx-size", 0, "KV capacity in tokens (0 = prompt + n-predict)", flag_values=fv)
  flags.DEFINE_bool("ignore-eos", False, "keep generating past the end-of-sequence token", flag_values=fv)
  flags.DEFINE_bool("json", False, "print one JSON line {tokens, text, metrics} instead of the text",
                    flag_values=fv)
  flags.DEFINE_bool("warmup", False, "run the whole generation once before the measured run "
                    "(so tok/s exclude compilation)", flag_values=fv)
  flags.DEFINE_float("kv-stream-arena-mib", None, "stream the KV cache within this device arena (MiB): "
                     "pool = arena - decode workspace (XLA memory analysis), in whole pages",
                     flag_values=fv)
  flags.DEFINE_integer("kv-stream-pool-pages", None, "stream the KV cache through a device pool of this "
                       "many pages (resident + ring)", flag_values=fv)
  flags.DEFINE_integer("kv-stream-copy-pages", 32, "host->device copy unit in pages (a power of two)",
                       flag_values=fv)
  flags.DEFINE_enum("spec-type", "none", ["none", "draft-mtp", "ngram-simple"],
                    "speculative decoding (greedy only): drafts from the attached MTP head or from the "
                    "sequence's own n-grams, verified by the target with recurrent-state rollback",
                    flag_values=fv)
  flags.DEFINE_integer("spec-draft-n-max", 3, "drafts per round (verify width 1 + n)", flag_values=fv)
  flags.DEFINE_float("spec-draft-p-min", 0.0, "MTP drafting stops below this top-1 probability",
                     flag_values=fv)
  flags.DEFINE_integer("spec-ngram-size-n", 12, "ngram-simple match key length", flag_values=fv)
  flags.DEFINE_enum("kv-stream-policy", "fixed", ["fixed", "adaptive"],
                    "resident/ring split: fixed, or adaptive (kvjax.policy, re-evaluated every forward)",
                    flag_values=fv)
  flags.DEFINE_bool("kv-stream-phased", False, "lay the arena out per phase (prefill: larger workspace, "
                    "decode: larger KV pool); needs --kv-stream-arena-mib", flag_values=fv)


def _logits_flags(fv: flags.FlagValues) -> None:
  _model_flags(fv)
  flags.DEFINE_string("tokens", None, "comma-separated token ids, e.g. 1,2,3", flag_values=fv)
  flags.DEFINE_string("prompt", None, "text instead of --tokens (tokenized with the model's tokenizer)",
                      flag_values=fv)
  flags.DEFINE_string("out", None, "output .npy file", flag_values=fv)
  flags.DEFINE_bool("mtp", False, "write the MTP head's teacher-forced logits [n_tokens - 1, vocab] "
                    "(row t predicts token t + 2)", flag_values=fv)


def _memory_flags(fv: flags.FlagValues, args: Sequence[str] = ()) -> None:
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  # config_flags registers the `--config.FIELD=value` override flags from the argument list it is given
  config_flags.DEFINE_config_file("config", None, "memory report config, e.g. configs/memory_27b.py",
                                  flag_values=fv, sys_argv=[f"{PROG} memory"] + list(args))
  flags.DEFINE_bool("json", False, "print the report as one JSON line", flag_values=fv)


_FLAG_SETS = {"generate": _generate_flags, "logits": _logits_flags, "memory": _memory_flags}


# ---------------------------------------------------------------------------
# helpers shared with experiments/ and notebooks/
# ---------------------------------------------------------------------------

def parse_token_list(text: str, vocab_size: int, what: str = "--tokens") -> List[int]:
  """'1,2,3' -> [1, 2, 3], every id checked against the vocabulary."""
  try:
    ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
  except ValueError:
    raise UsageError(f"{what} {text!r}: expected comma-separated integer token ids") from None
  if not ids:
    raise UsageError(f"{what}: at least one token id is needed")
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise UsageError(f"{what}: token id {bad[0]} is outside the vocabulary of {vocab_size} tokens")
  return ids


@dataclasses.dataclass
class Loaded:
  """A model ready to run: its runner, tokenizer (None for a random-weight preset) and load time."""
  runner: Any
  tokenizer: Any
  cfg: Any
  load_s: float


def parse_block_pages(value):
  """--attn-block-pages: "auto" or an int >= 1 (ints may come as text)."""
  if isinstance(value, str) and value.strip() == "auto":
    return "auto"
  try:
    n = int(value)
  except (TypeError, ValueError):
    raise UsageError(f"--attn-block-pages must be auto or an int >= 1, got {value!r}") from None
  if n < 1 or str(n) != str(value).strip():
    raise UsageError(f"--attn-block-pages must be auto or an int >= 1, got {value!r}")
  return n


def load_runner(model: str = "tiny", *, preset: Optional[str] = None, dtype: str = "float32",
                k_type: str = "q8_0", v_type: str = "q4_0", page_tokens: int = 256,
                attn_impl: str = "reference", block_pages="auto", weight_seed: int = 0) -> Loaded:
  """Build `engine.Runner` for `model` ('tiny', 'tiny:SEED' or a GGUF path), or, when `preset` is
  given, for that `kvjax.config` preset with deterministic random weights drawn on the device."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from kvjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from kvjax import engine, tiny, weights  # pylint: disable=import-outside-toplevel
  from kvjax.model import AttentionOptions  # pylint: disable=import-outside-toplevel
  from kvjax_pallas.page_layout import PageLayout  # pylint: disable=import-outside-toplevel
  from kvjax_pallas.span_attention.api import IMPLEMENTATIONS, resolve_implementation  # pylint: disable=import-outside-toplevel

  if dtype not in ("float32", "bfloat16"):
    raise UsageError(f"--dtype {dtype!r}: expected float32 or bfloat16")
  if attn_impl not in IMPLEMENTATIONS + ("auto",):
    raise UsageError(f"--attn-impl {attn_impl!r}: expected auto or one of {', '.join(IMPLEMENTATIONS)}")
  if attn_impl != "auto" or jax.default_backend() != "gpu":
    attn_impl = resolve_implementation(attn_impl)   # on a GPU "auto" stays: each call picks
  if page_tokens < 1:
    raise UsageError(f"--kv-page-tokens must be >= 1, got {page_tokens}")
  block_pages = parse_block_pages(block_pages)
  jdtype = jnp.dtype(dtype)
  t0 = time.perf_counter()
  if preset is not None:
    cfg = config_lib.preset(preset)
    model_ = engine.build_model(cfg, weights.iter_random_device_tensors(cfg, weight_seed, dtype), dtype=jdtype,
                                names=config_lib.gguf_tensor_shapes(cfg))
    tok = None
  else:
    cfg, tensors, tok = tiny.load_model_source(model, seed=weight_seed, dtype=np.float32)
    model_ = engine.build_model(cfg, tensors, dtype=jdtype)
    cfg = model_.cfg
  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, k_type, v_type, page_tokens)
  runner = engine.Runner(model_, layout, AttentionOptions(attn_impl, block_pages))
  jax.block_until_ready(runner.token_embd)
  return Loaded(runner, tok, cfg, time.perf_counter() - t0)


def decode_workspace_bytes(runner, max_tokens: int) -> int:
  """Device scratch of one decode forward (`engine.group_step_workspace_bytes` with 1 row)."""
  from kvjax import engine  # pylint: disable=import-outside-toplevel
  return engine.group_step_workspace_bytes(runner, 1, max_tokens)


def make_kv(runner, max_tokens: int, *, arena_mib: Optional[float] = None, pool_pages: Optional[int] = None,
            copy_pages: int = 32, policy: str = "fixed", phased: bool = False,
            ubatch: int = 256) -> Tuple[Any, Dict[str, Any]]:
  """-> (KV provider, info). Plain (`engine.PlainKV`) unless `arena_mib` or `pool_pages` is given,
  then `StreamedKV` with the fixed split of `stream_config_from_budget`, or with
  `policy="adaptive"` the policy-driven `AdaptiveStreamedKV`; `phased=True` (needs `arena_mib`)
  puts the pool in a two-layout phase arena (`PhasedKV`: prefill / decode workspaces measured
  from the compiled group steps); its `enter(phase)` is the generation loop's `on_phase` hook."""
  if policy not in ("fixed", "adaptive"):
    raise UsageError(f"--kv-stream-policy must be 'fixed' or 'adaptive', got {policy!r}")
  if phased and arena_mib is None:
    raise UsageError("--kv-stream-phased needs --kv-stream-arena-mib (the arena it lays out)")
  if phased and policy != "fixed":
    raise UsageError("--kv-stream-phased uses the fixed split per phase; drop --kv-stream-policy=adaptive")
  from kvjax import engine  # pylint: disable=import-outside-toplevel
  from kvjax.streaming import (StreamedKV, staging_reserve_pages,  # pylint: disable=import-outside-toplevel
                               stream_config_from_budget)
  if arena_mib is not None and pool_pages is not None:
    raise UsageError("give only one of --kv-stream-arena-mib and --kv-stream-pool-pages")
  if copy_pages < 1 or copy_pages & (copy_pages - 1):
    raise UsageError(f"--kv-stream-copy-pages must be a power of two >= 1, got {copy_pages}")
  if max_tokens < 1:
    raise UsageError(f"KV capacity must be >= 1 token, got {max_tokens}")
  cfg, layout = runner.cfg, runner.layout
  info: Dict[str, Any] = {"kv": "plain", "ctx_size": max_tokens, "page_tokens": layout.page_tokens,
                          "kv_layout": layout.describe()}
  if arena_mib is None and pool_pages is None:
    return engine.PlainKV(cfg, layout, max_tokens), info
  if pool_pages is not None and pool_pages < 1:
    raise UsageError(f"--kv-stream-pool-pages must be >= 1, got {pool_pages}")
  if arena_mib is not None and not arena_mib > 0:
    raise UsageError(f"--kv-stream-arena-mib must be > 0, got {arena_mib}")
  info["kv"] = "streamed"
  if arena_mib is not None:
    ws = decode_workspace_bytes(runner, max_tokens)
    info["arena_mib"] = arena_mib
    info["decode_workspace_mib"] = ws / 2**20
    stream = stream_config_from_budget(cfg, layout, max_tokens, arena_bytes=int(arena_mib * 2**20),
                                       workspace_bytes=ws, copy_pages=copy_pages)
  else:
    stream = stream_config_from_budget(cfg, layout, max_tokens, pool_pages=pool_pages, copy_pages=copy_pages)
  info["resident_pages_per_layer"] = list(stream.resident_pages_per_layer)
  info["staging_reserve_mib"] = (staging_reserve_pages(stream, max_tokens, layout)
                                 * layout.page_bytes / 2**20)
  info["copy_pages"] = copy_pages
  info["kv_policy"] = policy
  if policy == "adaptive":
    from kvjax.streaming import (adaptive_staging_reserve_pages,  # pylint: disable=import-outside-toplevel
                                 fit_adaptive_pool)
    from kvjax.streaming.phases import AdaptiveStreamedKV  # pylint: disable=import-outside-toplevel
    pool = stream.pool_pages
    if arena_mib is not None:   # the staging of ANY split the policy may pick fits beside the pool
      pool = fit_adaptive_pool((int(arena_mib * 2**20) - ws) // layout.page_bytes, max_tokens, layout,
                               copy_pages)
    kv = AdaptiveStreamedKV(cfg, layout, max_tokens, pool, copy_pages)
    info["resident_pages_per_layer"] = list(kv.stream.resident_pages_per_layer)
    info["staging_reserve_mib"] = (adaptive_staging_reserve_pages(pool, max_tokens, layout, copy_pages)
                                   * layout.page_bytes / 2**20)
    return kv, info
  kv = StreamedKV(cfg, layout, max_tokens, stream)
  if phased:
    from kvjax.streaming.phases import PhasedKV  # pylint: disable=import-outside-toplevel
    ws_prefill = engine.group_step_workspace_bytes(runner, ubatch, max_tokens)
    kv = PhasedKV(kv, int(arena_mib * 2**20), ws_prefill, ws, max_tokens)
    info["kv"] = "streamed+phased"
    info["prefill_workspace_mib"] = ws_prefill / 2**20
  return kv, info


def teacher_forced_logits(runner, kv, tokens: Sequence[int], ubatch: int = 256, mtp: bool = False):
  """float32 logits of every row of `tokens` [n, V] (fed in micro-batches of `ubatch`); with `mtp`, the
  MTP head's logits [n - 1, V]: row t from the target's post-norm hidden at t and token t + 1."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  tokens = [int(t) for t in tokens]
  n = len(tokens)
  if mtp and n < 2:
    raise UsageError(f"--mtp needs at least 2 tokens, got {n}")
  states = runner.zero_states()
  logits, hidden = [], []
  for i in range(0, n, ubatch):
    chunk = tokens[i:i + ubatch]
    m = len(chunk)
    s = ubatch if n > 1 else m
    toks = np.zeros((s,), np.int32)
    toks[:m] = chunk
    out = runner.forward(toks, i, m, states, kv, logits_rows=np.arange(m))
    states = out.rec_states
    logits.append(np.asarray(out.logits_rv, np.float32))
    hidden.append(out.hn_se[:m])
  if not mtp:
    return np.concatenate(logits, 0)
  hn_se = jnp.concatenate(hidden, 0)
  rows = []
  for i in range(0, n - 1, ubatch):
    m = min(ubatch, n - 1 - i)
    s = ubatch if n - 1 > 1 else m
    h = jnp.zeros((s, hn_se.shape[1]), hn_se.dtype).at[:m].set(hn_se[i:i + m])
    nxt = np.zeros((s,), np.int32)
    nxt[:m] = tokens[i + 1:i + 1 + m]
    lg, _ = runner.mtp_forward(h, nxt, i, m, kv)
    rows.append(np.asarray(lg, np.float32)[:m])
  return np.concatenate(rows, 0)


# ---------------------------------------------------------------------------
# subcommands
# ---------------------------------------------------------------------------

def _load_from_flags(fv: flags.FlagValues) -> Loaded:
  return load_runner(fv["model"].value, dtype=fv["dtype"].value, k_type=fv["cache-type-k"].value,
                     v_type=fv["cache-type-v"].value, page_tokens=fv["kv-page-tokens"].value,
                     attn_impl=fv["attn-impl"].value, block_pages=fv["attn-block-pages"].value)


def _prompt_ids(fv: flags.FlagValues, loaded: Loaded, tokens_flag: str) -> List[int]:
  text, ids = fv["prompt"].value, fv[tokens_flag].value
  if (text is None) == (ids is None):
    raise UsageError(f"give exactly one of --prompt and --{tokens_flag}")
  if ids is not None:
    return parse_token_list(ids, loaded.cfg.vocab_size, f"--{tokens_flag}")
  out = loaded.tokenizer.encode(text)
  if not out:
    raise UsageError("--prompt is empty: at least one token is needed")
  return out


def cmd_generate(fv: flags.FlagValues, out=None) -> int:
  """`kvjax generate`: prints the generated text, or one JSON line with `--json`."""
  out = out or sys.stdout
  from kvjax import generate as gen_lib  # pylint: disable=import-outside-toplevel
  n_predict = fv["n-predict"].value
  if n_predict < 1:
    raise UsageError(f"--n-predict must be >= 1, got {n_predict}")
  if fv["ubatch-size"].value < 1:
    raise UsageError(f"--ubatch-size must be >= 1, got {fv['ubatch-size'].value}")
  sampling = gen_lib.SamplingParams(fv["temperature"].value, fv["top-k"].value, fv["seed"].value)
  # streaming flags are checked before the (possibly long) model load; make_kv checks them again
  copy_pages = fv["kv-stream-copy-pages"].value
  if copy_pages < 1 or copy_pages & (copy_pages - 1):
    raise UsageError(f"--kv-stream-copy-pages must be a power of two >= 1, got {copy_pages}")
  arena_mib, pool_pages = fv["kv-stream-arena-mib"].value, fv["kv-stream-pool-pages"].value
  if arena_mib is not None and pool_pages is not None:
    raise UsageError("give only one of --kv-stream-arena-mib and --kv-stream-pool-pages")
  if pool_pages is not None and pool_pages < 1:
    raise UsageError(f"--kv-stream-pool-pages must be >= 1, got {pool_pages}")
  if arena_mib is not None and not arena_mib > 0:
    raise UsageError(f"--kv-stream-arena-mib must be > 0, got {arena_mib}")
  loaded = _load_from_flags(fv)
  prompt = _prompt_ids(fv, loaded, "prompt-tokens")
  need = len(prompt) + n_predict
  ctx = fv["ctx-size"].value or need
  if ctx < need:
    raise UsageError(f"--ctx-size {ctx} is too small: prompt {len(prompt)} + n-predict {n_predict} "
                     f"needs {need} tokens ({need - ctx} more)")
  eos = None if (fv["ignore-eos"].value or loaded.tokenizer is None) else loaded.tokenizer.eos_id

  ubatch = fv["ubatch-size"].value

  def new_kv():
    return make_kv(loaded.runner, ctx, arena_mib=arena_mib, pool_pages=pool_pages, copy_pages=copy_pages,
                   policy=fv["kv-stream-policy"].value, phased=fv["kv-stream-phased"].value, ubatch=ubatch)

  spec_type = fv["spec-type"].value
  if spec_type != "none":
    from kvjax import speculative  # pylint: disable=import-outside-toplevel
    if sampling.temperature != 0.0:
      raise UsageError("--spec-type verifies greedily: use --temperature 0")
    if fv["kv-stream-phased"].value:
      raise UsageError("--spec-type with --kv-stream-phased is not supported yet")
    draft = speculative.DraftParams("mtp" if spec_type == "draft-mtp" else "ngram",
                                    fv["spec-draft-n-max"].value, fv["spec-draft-p-min"].value,
                                    fv["spec-ngram-size-n"].value)
    ctx = max(ctx, len(prompt) + n_predict + draft.n_max)  # verify rows may run past the last token

  def run_once(kv):
    if spec_type != "none":
      return speculative.generate_speculative(loaded.runner, kv, prompt, n_predict, draft, ubatch=ubatch,
                                              eos_id=eos)
    return gen_lib.generate(loaded.runner, kv, prompt, n_predict, sampling=sampling, ubatch=ubatch,
                            eos_id=eos, on_phase=getattr(kv, "enter", None))

  kv, info = new_kv()
  if fv["warmup"].value:
    run_once(kv)
    del kv
    kv, info = new_kv()
  res = run_once(kv)
  text = loaded.tokenizer.decode(res.tokens) if loaded.tokenizer is not None else ""
  if fv["json"].value:
    metrics = dict(res.metrics)
    metrics.update(info)
    metrics["load_s"] = loaded.load_s
    metrics["attn_impl"] = loaded.runner.opts.implementation
    print(json.dumps({"tokens": [int(t) for t in res.tokens], "text": text, "metrics": metrics},
                     default=_json_default), file=out, flush=True)
  else:
    print(text, file=out, flush=True)
  return 0


def cmd_logits(fv: flags.FlagValues, out=None) -> int:
  """`kvjax logits`: float32 teacher-forced logits -> .npy (target [n, V] or MTP [n - 1, V])."""
  out = out or sys.stdout
  import numpy as np  # pylint: disable=import-outside-toplevel
  from kvjax import engine  # pylint: disable=import-outside-toplevel
  path = fv["out"].value
  if not path:
    raise UsageError("--out FILE.npy is required")
  if fv["ubatch-size"].value < 1:
    raise UsageError(f"--ubatch-size must be >= 1, got {fv['ubatch-size'].value}")
  loaded = _load_from_flags(fv)
  tokens = _prompt_ids(fv, loaded, "tokens")
  if fv["mtp"].value and not loaded.cfg.has_mtp:
    raise UsageError(f"--mtp: model {fv['model'].value!r} has no MTP head (nextn_predict_layers = 0)")
  kv = engine.PlainKV(loaded.cfg, loaded.runner.layout, len(tokens))
  arr = teacher_forced_logits(loaded.runner, kv, tokens, fv["ubatch-size"].value, mtp=fv["mtp"].value)
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    raise FileNotFoundError(f"--out {path!r}: directory {parent!r} does not exist")
  np.save(path, arr)
  print(f"wrote {path}: float32 {list(arr.shape)} ({'MTP' if fv['mtp'].value else 'target'} logits)",
        file=out, flush=True)
  return 0


def cmd_memory(fv: flags.FlagValues, out=None) -> int:
  """`kvjax memory --config=...`: `kvjax.memory_report` for an ml_collections config."""
  out = out or sys.stdout
  from kvjax import memory_report  # pylint: disable=import-outside-toplevel
  cfg = fv["config"].value
  if cfg is None:
    raise UsageError("--config is required, e.g. --config=configs/memory_27b.py")
  report = memory_report.report_from_config(cfg)
  if fv["json"].value:
    print(json.dumps(report, default=_json_default), file=out, flush=True)
  else:
    print(memory_report.format_table(report), file=out, flush=True)
  return 0


_COMMANDS = {"generate": cmd_generate, "logits": cmd_logits, "memory": cmd_memory}


def _json_default(x):
  import numpy as np  # pylint: disable=import-outside-toplevel
  if isinstance(x, np.generic):
    return x.item()
  raise TypeError(f"not JSON serializable: {type(x).__name__}")


def _error(msg: str) -> None:
  msg = " ".join(str(msg).split())  # one line
  print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)


def _missing_config_file(args: Sequence[str]) -> Optional[str]:
  """The `--config` path when it names no file (config_flags would only fail on first access)."""
  for i, a in enumerate(args):
    if a.startswith("--config="):
      path = a[len("--config="):]
    elif a == "--config" and i + 1 < len(args):
      path = args[i + 1]
    else:
      continue
    path = path.split(":", 1)[0]  # config_flags allows 'file.py:arg'
    return None if os.path.isfile(path) else path
  return None


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Run one subcommand; `argv` is the argument list WITHOUT the program name
  (default `sys.argv[1:]`). Returns the exit status (0 ok, 1 runtime error, 2 usage error)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(USAGE, file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2
  sub, rest = argv[0], argv[1:]
  if sub not in _COMMANDS:
    print(USAGE, file=sys.stderr)
    _error(f"unknown subcommand {sub!r}; expected one of {', '.join(SUBCOMMANDS)}")
    return 2
  fv = flags.FlagValues()
  if sub == "memory":
    _memory_flags(fv, rest)
  else:
    _FLAG_SETS[sub](fv)
  if sub == "memory":
    missing = _missing_config_file(rest)
    if missing:
      _error(f"--config {missing!r}: no such file (expected e.g. configs/memory_27b.py)")
      return 2
  if any(a in ("-h", "--help", "-help", "--helpfull") for a in rest):
    print(f"usage: {PROG} {sub} [flags]\n\n{fv.get_help()}")
    return 0
  try:
    leftover = fv([f"{PROG} {sub}"] + rest)
    if len(leftover) > 1:
      raise UsageError(f"unexpected argument {leftover[1]!r} (flags take the form --name=value)")
  except flags.Error as e:
    _error(e)
    return 2
  except UsageError as e:
    _error(e)
    return 2
  from kvjax.gguf_io import GGUFError  # pylint: disable=import-outside-toplevel
  from kvjax.streaming import StreamBudgetError  # pylint: disable=import-outside-toplevel
  try:
    return _COMMANDS[sub](fv)
  except UsageError as e:
    _error(e)
    return 2
  except (GGUFError, StreamBudgetError, ValueError, OSError, flags.Error) as e:
    # FileNotFoundError's str() already names the path
    _error(e)
    return 1


def run() -> None:
  """Console-script entry point (`kvjax = "kvjax.cli:run"`)."""
  sys.exit(main())


if __name__ == "__main__":
  run()
