"""The `kvjax` console script: `generate`, `logits` and `memory` subcommands.

    kvjax generate --model tiny --prompt "Hello" --n-predict 32
    kvjax generate -m model.gguf -f prompt.txt -n 64 -c 4096 --kv-stream-arena-mib 2240 --json
    kvjax logits   --model tiny --tokens 1,2,3,4 --out logits.npy [--mtp]
    kvjax memory   --config=configs/memory_27b.py [--config.mtp_depth=5]

Flags use llama.cpp's dashed names where one exists (`--n-predict`,
`--ctx-size`, `--cache-type-k`, `--ubatch-size`, ...) and its short names
(`-m`, `-p`, `-f`, `-n`, `-c`, `-s`, `-ub`, `-ctk`, `-ctv`, `--temp`, `--top-p`). Each subcommand
parses its own flags into a fresh `absl.flags.FlagValues`, so `main(argv)` can
be called repeatedly in one process (tests, notebooks) without flag clashes.

The subcommands map flags onto `kvjax.api` (`FLAG_OF`: the API parameter of
each flag, used to name flags in the API's error messages). `kvjax memory`
imports no JAX: it is arithmetic (`kvjax.memory_report`).

`generate` echoes the prompt and streams the generated text to stdout as it is
generated, unprintable characters escaped (`kvjax.api.printable`); a prefill of
several blocks shows a progress bar on stderr (a terminal only); then on stderr
its timings (compilation excluded), a note of the compile time of a cold run,
and notes such as "all pages resident: nothing streams".

Errors a user can cause (bad flags, a missing or malformed GGUF, a KV pool
too small for the context) are printed as one line `kvjax: error: ...` on
stderr, without a traceback; the exit status is 2 for usage errors (unknown
subcommand or flag, bad flag values, sizes beyond the model's context length or
the machine's memory) and 1 for the rest; Ctrl-C prints one line and exits 130.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from absl import flags

from kvjax import compile_cache as compile_cache_lib, spec_config
from kvjax.text import one_line

PROG = "kvjax"
SUBCOMMANDS = ("generate", "warmup", "logits", "memory")

USAGE = f"""\
usage: {PROG} <subcommand> [flags]   ({PROG} --version: the package version)

subcommands:
  generate  prefill a prompt and decode tokens (plain or streamed KV cache)
  warmup    compile (or load) every program a generation with the same flags runs, ahead of it
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
  flags.DEFINE_string("model", "tiny", "GGUF path, 'tiny' / 'tiny:SEED' for the built-in tiny model "
                      "(random weights, its own tokenizer), 'code-tiny' (trained on the Python stdlib), or a "
                      "kvjax.config preset (qwen38_27b: random weights, no tokenizer)", flag_values=fv, short_name="m")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weight and activation dtype",
                    flag_values=fv)
  flags.DEFINE_enum("weights", "auto", ["auto", "quantized", "dequantized"], "quantized: a GGUF's Q8_0 / Q4_0 / "
                    "Q4_K / Q5_K / Q6_K matrices stay in their blocks on the device, dequantized as read (auto: "
                    "quantized for a GGUF on one device); dequantized: every weight in --dtype", flag_values=fv)
  flags.DEFINE_enum("weights-impl", "auto", ["auto", "xla", "fused", "pallas", "pallas_gemv", "planar"], "the "
                    "quantized product: auto (planar on a GPU, else xla), xla (dequantize, then the dense product: "
                    "the dequantized model's logits), fused "
                    "(decode rows as one multiply-and-sum), pallas / pallas_gemv (kernels), planar (Q8_0 / Q4_0 / "
                    "Q4_K / Q6_K repacked into planes at load; KVJAX_PLANAR_PRODUCT picks their product)", flag_values=fv)
  flags.DEFINE_bool("fuse", True, "join each block's same-input matrices into one product (--nofuse: apart)",
                    flag_values=fv)
  flags.DEFINE_string("weight-type", "", "with a preset (--model qwen38_27b): its matrices as random blocks of "
                      "this format, kept quantized (q8_0, q4_0, q4_k, q5_k, q6_k)", flag_values=fv)
  flags.DEFINE_string("cache-type-k", "q8_0", "K cache type: q8_0, q4_0, f16, bf16, f32", flag_values=fv,
                      short_name="ctk")
  flags.DEFINE_string("cache-type-v", "q4_0", "V cache type: q8_0, q4_0, f16, bf16, f32", flag_values=fv,
                      short_name="ctv")
  flags.DEFINE_integer("kv-page-tokens", 256, "token positions per KV page", flag_values=fv)
  flags.DEFINE_integer("ubatch-size", 256, "prefill micro-batch (rows per forward)", flag_values=fv,
                       short_name="ub")
  flags.DEFINE_string("attn-impl", "auto", "span attention implementation: auto (on an NVIDIA GPU "
                      "mosaic for each call it takes: decode, verify, prefill chunks; triton for the rest; "
                      "reference elsewhere) | reference | triton | mosaic; without a GPU a kernel runs in "
                      "Pallas interpret mode (slow)", flag_values=fv)
  flags.DEFINE_string("gdn-impl", "auto", "the Gated DeltaNet's prefill form: auto (triton on one NVIDIA GPU "
                      "where the kernels take the heads, else xla) | xla | triton (Pallas kernels; interpret mode "
                      "without a GPU)", flag_values=fv)
  flags.DEFINE_string("attn-block-pages", "auto", "pages per logical partition of the attention "
                      "core (an int >= 1), or auto (sized to the table and the GPU)", flag_values=fv)
  flags.DEFINE_string("compile-cache-dir", "", "JAX's persistent compilation cache: a folder ('' = "
                      "$KVJAX_COMPILE_CACHE_DIR, else ~/.cache/kvjax/jax), or 'off'", flag_values=fv)
  flags.DEFINE_integer("tensor-parallel", 1, "shard the model over this many devices (attention and Gated "
                       "DeltaNet heads, FFN columns; each device holds and streams its own KV heads, the KV "
                       "budget flags are per device); must divide the model's KV heads", flag_values=fv)


def _generate_flags(fv: flags.FlagValues) -> None:
  _model_flags(fv)
  flags.DEFINE_string("prompt", None, "prompt text (tokenized with the model's tokenizer)", flag_values=fv,
                      short_name="p")
  flags.DEFINE_string("file", None, "read the prompt text from this file (one trailing newline dropped)",
                      flag_values=fv, short_name="f")
  flags.DEFINE_string("prompt-tokens", None, "prompt as comma-separated token ids, e.g. 1,2,3",
                      flag_values=fv)
  flags.DEFINE_integer("n-predict", 32, "tokens to generate", flag_values=fv, short_name="n")
  flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy)", flag_values=fv, short_name="temp")
  flags.DEFINE_integer("top-k", 0, "top-k sampling (0 = whole vocabulary)", flag_values=fv)
  flags.DEFINE_float("top-p", 1.0, "nucleus sampling: the most probable tokens up to this probability "
                     "(1.0 = off)", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv, short_name="s")
  flags.DEFINE_integer("ctx-size", 0, "KV capacity in tokens (0 = prompt + n-predict); at most the model's "
                       "context length", flag_values=fv, short_name="c")
  flags.DEFINE_bool("exceed-context-length", False, "allow a KV capacity beyond the model's context length "
                    "(its GGUF context_length)", flag_values=fv)
  flags.DEFINE_bool("ignore-eos", False, "keep generating past the end-of-sequence token", flag_values=fv)
  flags.DEFINE_bool("json", False, "print one JSON line {tokens, text, metrics} instead of the text",
                    flag_values=fv)
  flags.DEFINE_bool("no-display-prompt", False, "do not echo the prompt before the generated text",
                    flag_values=fv)
  flags.DEFINE_bool("no-progress", False, "no prefill progress bar on stderr (shown on a terminal only)",
                    flag_values=fv)
  flags.DEFINE_bool("warmup", False, "compile every program of the generation before the measured "
                    "run (so the timings exclude compilation; without it the output says how much of "
                    "them was compilation)", flag_values=fv)
  flags.DEFINE_float("kv-stream-arena-mib", None, "stream the KV cache within this device arena (MiB): "
                     "pool = arena - decode workspace (XLA memory analysis), in whole pages",
                     flag_values=fv)
  flags.DEFINE_integer("kv-stream-pool-pages", None, "stream the KV cache through a device pool of this "
                       "many pages (resident + ring)", flag_values=fv)
  flags.DEFINE_integer("kv-stream-copy-pages", 8, "host->device copy unit in pages (a power of two; "
                       "halved until the ring holds it)", flag_values=fv)
  # --spec-type, --spec-draft-n-max, ...: one flag a `SpecConfig` field (`kvjax.spec_config.flag_name`)
  spec_config.define_flags(fv, spec_config.flag_name, [spec_config.NONE, *spec_config.LLAMA_CPP_DRAFTS])
  flags.DEFINE_enum("kv-stream-policy", "fixed", ["fixed", "adaptive"],
                    "resident/ring split: fixed, or adaptive (kvjax.streaming.policy, re-evaluated every forward)",
                    flag_values=fv)
  flags.DEFINE_bool("kv-stream-phased", False, "lay the arena out per phase (prefill: larger workspace, "
                    "decode: larger KV pool); needs --kv-stream-arena-mib", flag_values=fv)
  flags.DEFINE_string("kv-stream-prefill-block", "auto", "tokens a prefill forward runs group-major (a "
                      "streamed layer's history is uploaded once a block): auto (from the budget) or a count "
                      "(0: one micro-batch a forward)", flag_values=fv)


def _logits_flags(fv: flags.FlagValues) -> None:
  _model_flags(fv)
  flags.DEFINE_string("tokens", None, "comma-separated token ids, e.g. 1,2,3", flag_values=fv)
  flags.DEFINE_string("prompt", None, "text instead of --tokens (tokenized with the model's tokenizer)",
                      flag_values=fv, short_name="p")
  flags.DEFINE_string("out", None, "output .npy file", flag_values=fv)
  flags.DEFINE_bool("mtp", False, "write the MTP head's teacher-forced logits [n_tokens - 1, vocab] "
                    "(row t predicts token t + 2)", flag_values=fv)
  flags.DEFINE_bool("exceed-context-length", False, "allow more tokens than the model's context length",
                    flag_values=fv)


def _memory_flags(fv: flags.FlagValues, args: Sequence[str] = ()) -> None:
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  # config_flags registers the `--config.FIELD=value` override flags from the argument list it is given
  config_flags.DEFINE_config_file("config", None, "memory report config, e.g. configs/memory_27b.py",
                                  flag_values=fv, sys_argv=[f"{PROG} memory"] + list(args))
  flags.DEFINE_bool("json", False, "print the report as one JSON line", flag_values=fv)


_FLAG_SETS = {"generate": _generate_flags, "warmup": _generate_flags, "logits": _logits_flags,
              "memory": _memory_flags}


# ---------------------------------------------------------------------------
# flags -> kvjax.api
# ---------------------------------------------------------------------------

# the API parameter each flag sets: errors of `kvjax.api` name parameters, the command line names flags
FLAG_OF = {
    "source": "--model", "dtype": "--dtype", "page_tokens": "--kv-page-tokens", "k_type": "--cache-type-k",
    "v_type": "--cache-type-v", "attn_impl": "--attn-impl", "block_pages": "--attn-block-pages", "gdn_impl": "--gdn-impl",
    "prompt": "--prompt", "prompt_tokens": "--prompt-tokens", "tokens": "--tokens", "mtp": "--mtp",
    "n_predict": "--n-predict", "temperature": "--temperature", "top_k": "--top-k", "seed": "--seed",
    "top_p": "--top-p", "preset": "--model",
    "max_tokens": "--ctx-size", "ubatch": "--ubatch-size", "arena_mib": "--kv-stream-arena-mib",
    "pool_pages": "--kv-stream-pool-pages", "copy_pages": "--kv-stream-copy-pages",
    "policy": "--kv-stream-policy", "phased": "--kv-stream-phased",
    "prefill_block": "--kv-stream-prefill-block",
    **spec_config.names("--", spec_config.flag_name),     # "spec.n_max": "--spec-draft-n-max", ...
    "exceed_context_length": "--exceed-context-length", "tensor_parallel": "--tensor-parallel",
    "weights": "--weights", "weight_type": "--weight-type", "weights_impl": "--weights-impl", "fuse": "--fuse",
}


def parse_token_list(text: str, what: str = "--tokens") -> List[int]:
  """'1,2,3' -> [1, 2, 3] (the API checks them against the vocabulary)."""
  entries = text.replace(" ", "").split(",")
  if entries == [""]:
    raise UsageError(f"{what}: at least one token id is needed")
  bad = [i for i, t in enumerate(entries, 1) if not (t[1:] if t[:1] == "-" else t).isdigit()]
  if bad:
    raise UsageError(f"{what} {text!r}: expected comma-separated integer token ids (entry {bad[0]} is not)")
  return [int(t) for t in entries]


def parse_block_pages(value):
  """--attn-block-pages: "auto" or an int >= 1 (`kvjax.api.parse_block_pages`, errors named by flag)."""
  from kvjax import api  # pylint: disable=import-outside-toplevel
  try:
    return api.parse_block_pages(value)
  except api.ParameterError as e:
    raise UsageError(e.renamed(FLAG_OF)) from None


def _load(fv: flags.FlagValues):
  from kvjax import api, config as config_lib, tiny  # pylint: disable=import-outside-toplevel
  source = fv["model"].value
  preset = (source if source in config_lib.PRESETS and not tiny.is_builtin(source) and not os.path.exists(source)
            else None)   # e.g. qwen38_27b: random weights of that geometry
  return api.load_model(source, preset=preset, dtype=fv["dtype"].value, k_type=fv["cache-type-k"].value,
                        v_type=fv["cache-type-v"].value, page_tokens=fv["kv-page-tokens"].value,
                        attn_impl=fv["attn-impl"].value, block_pages=fv["attn-block-pages"].value,
                        tensor_parallel=fv["tensor-parallel"].value,
                        compile_cache=_compile_cache(fv["compile-cache-dir"].value),
                        weights=None if fv["weights"].value == "auto" else fv["weights"].value,
                        weight_type=fv["weight-type"].value or None, weights_impl=fv["weights-impl"].value,
                        fuse=fv["fuse"].value, gdn_impl=fv["gdn-impl"].value)


def _compile_cache(value: str):
  """--compile-cache-dir -> `api.load_model`'s compile_cache: None (the default folder), a folder, or
  False ('off')."""
  return False if value.strip().lower() in compile_cache_lib.OFF else (value or None)


def _spec(fv: flags.FlagValues):
  """The `SpecConfig` of the --spec-* flags, or None (--spec-type none)."""
  return spec_config.from_flags(lambda name: fv[name].value)


def _summary(m: Dict[str, Any]) -> List[str]:
  """The text output's report on stderr: timings and tok/s without the compilation inside them,
  the compile time of a cold run, notes."""
  pre_ms = max(m["prompt_ms"] - m["prompt_compile_ms"], 1e-6)
  dec_ms = max(m["predicted_ms"] - m["predicted_compile_ms"], 1e-6)
  n_dec = max(m["decode_tokens"] - 1, 0)   # the first token comes from the prefill's last row
  lines = [f"prefill {m['prompt_tokens']} tokens in {pre_ms:.1f} ms ({m['prompt_tokens'] / pre_ms * 1e3:.1f} tok/s), "
           f"decode {m['decode_tokens']} tokens in {dec_ms:.1f} ms ({n_dec / dec_ms * 1e3:.1f} tok/s)"]
  fresh = m.get("compiles", 0) - m.get("compile_cache_hits", 0)   # programs compiled, not loaded
  if not m["warmup"] and m["compile_ms"] >= 50 and fresh > 0:   # a warm run loads its programs: nothing to report
    lines.append(f"cold run: {m['compile_ms'] / 1e3:.1f} s of jax tracing and compiling (prefill "
                 f"{m['prompt_compile_ms'] / 1e3:.1f} s, decode {m['predicted_compile_ms'] / 1e3:.1f} s), not "
                 f"counted above; --warmup compiles first and times a warm run")
  if m["spec_type"] != "none":
    lines.append(f"speculative ({m['spec_type']} drafts): {m['draft_accepted']} of {m['draft_generated']} "
                 f"drafts accepted ({100 * m['draft_acceptance']:.0f}%), {m['verify_forwards']} verify forwards")
  if m.get("all_pages_resident"):
    lines.append(f"all pages resident: nothing streams (the KV budget holds all {m['ctx_size']} tokens of "
                 f"the context on the device)")
  return lines


PROGRESS_DELAY_S = 1.0   # a prefill shorter than this shows no bar


class _PrefillBar:
  """`on_prefill(done, total)` -> a tqdm bar on `err` (tokens, tok/s, time left), gone when done."""

  def __init__(self, err):
    self.err, self.bar = err, None

  def __call__(self, done: int, total: int) -> None:
    if self.bar is None:
      from tqdm import tqdm  # pylint: disable=import-outside-toplevel
      self.bar = tqdm(total=total, unit="tok", desc="prefill", file=self.err, leave=False, dynamic_ncols=True,
                      delay=PROGRESS_DELAY_S)
    self.bar.update(done - self.bar.n)
    if done >= total:
      self.close()

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
      self.bar = None


def _prefill_bar(fv: flags.FlagValues, err):
  """The prefill progress callback: a bar where stderr is a terminal, unless --no-progress."""
  if fv["no-progress"].value or not getattr(err, "isatty", lambda: False)():
    return None
  import importlib.util  # pylint: disable=import-outside-toplevel
  return _PrefillBar(err) if importlib.util.find_spec("tqdm") is not None else None


class _TextOut:
  """The text output: the prompt echoed (unless None), then the generated text streamed a token at a
  time (`on_token`; a character split over tokens waits for its last byte), escaped for a terminal."""

  def __init__(self, tokenizer, out, echo: Optional[str]):
    self.tok, self.out, self.echo = tokenizer, out, echo
    self.pending: List[int] = []
    self.streamed = False

  def _write(self, text: str) -> None:
    from kvjax.text import printable  # pylint: disable=import-outside-toplevel
    if self.echo is not None:
      text, self.echo = self.echo + text, None
    self.out.write(printable(text))
    self.out.flush()

  def on_token(self, token: int) -> None:
    self.streamed = True
    self.pending.append(token)
    text = self.tok.decode(self.pending)
    if text.endswith("\ufffd") and len(self.pending) < 4:   # an incomplete UTF-8 character: wait
      return
    self.pending = []
    self._write(text)

  def finish(self, text: str) -> None:
    """After the generation: what is left (all of `text` when nothing was streamed), a newline."""
    self._write((self.tok.decode(self.pending) if self.pending else "") if self.streamed else text)
    self.out.write("\n")
    self.out.flush()


def _prompt_text(fv: flags.FlagValues) -> Optional[str]:
  """--prompt, or the text of --file (exactly one of --prompt, --file and --prompt-tokens)."""
  given = [f"--{n}" for n in ("prompt", "file", "prompt-tokens") if fv[n].value is not None]
  if len(given) > 1:
    raise UsageError(f"give exactly one of --prompt, --file and --prompt-tokens (got {' and '.join(given)})")
  path = fv["file"].value
  if path is None:
    return fv["prompt"].value
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--file {path!r}: no such file")
  with open(path, encoding="utf-8", errors="replace") as f:
    text = f.read()
  return text[:-1] if text.endswith("\n") else text   # as llama.cpp's -f


def _kv_flags(fv: flags.FlagValues, spec, sampling=None):
  """The cache's flags, checked with the generation's before the (possibly long) model load ->
  (make_kv's budget arguments, prefill block)."""
  from kvjax import api  # pylint: disable=import-outside-toplevel
  budget = dict(arena_mib=fv["kv-stream-arena-mib"].value, pool_pages=fv["kv-stream-pool-pages"].value,
                copy_pages=fv["kv-stream-copy-pages"].value, policy=fv["kv-stream-policy"].value,
                phased=fv["kv-stream-phased"].value)
  api.check_generation(n_predict=fv["n-predict"].value, ubatch=fv["ubatch-size"].value, spec=spec,
                       phased=budget["phased"], **(sampling or {}))
  api.check_kv_budget(**budget)
  block = fv["kv-stream-prefill-block"].value
  if block != "auto":
    if not block.isdigit():
      raise api.ParameterError(f"--kv-stream-prefill-block must be auto or a token count >= 0, got {block!r}",
                               "prefill_block")
    block = int(block)
  return budget, block


def cmd_generate(fv: flags.FlagValues, out=None, err=None) -> int:
  """`kvjax generate`: echoes the prompt and streams the generated text (unprintable characters
  escaped; a prefill progress bar, timings and notes on stderr), or prints one JSON line
  {tokens, text, metrics} with `--json`."""
  out, err = out or sys.stdout, err or sys.stderr
  from kvjax import api  # pylint: disable=import-outside-toplevel
  spec = _spec(fv)
  sampling = dict(temperature=fv["temperature"].value, top_k=fv["top-k"].value, top_p=fv["top-p"].value)
  ubatch, n_predict = fv["ubatch-size"].value, fv["n-predict"].value
  budget, block = _kv_flags(fv, spec, sampling)
  text = _prompt_text(fv)
  ids = fv["prompt-tokens"].value
  if text is None and ids is None:
    raise UsageError("give one of --prompt, --file and --prompt-tokens")
  ids = None if ids is None else parse_token_list(ids, "--prompt-tokens")
  model = _load(fv)
  prompt = api.prompt_ids(model, text, ids)
  ctx = api.context_tokens(len(prompt), n_predict, spec, fv["ctx-size"].value) if fv["ctx-size"].value else \
      api.generation_tokens(model, len(prompt), n_predict, spec, fv["exceed-context-length"].value)
  kv = api.make_kv(model, ctx, ubatch=ubatch, exceed_context_length=fv["exceed-context-length"].value,
                   spec=spec, prefill_block=block, **budget)
  as_json, tok = fv["json"].value, model.tokenizer
  echo = None if fv["no-display-prompt"].value or tok is None else tok.decode(prompt)
  show = None if as_json else _TextOut(tok, out, echo)
  bar = _prefill_bar(fv, err)
  try:
    res = api.generate(model, kv, prompt_tokens=prompt, n_predict=n_predict, seed=fv["seed"].value,
                       ignore_eos=fv["ignore-eos"].value, spec=spec, ubatch=ubatch, warmup=fv["warmup"].value,
                       on_token=show.on_token if show and tok is not None and spec is None else None,
                       on_prefill=bar, **sampling)
  finally:
    if bar is not None:
      bar.close()
  if as_json:
    print(json.dumps({"tokens": res.tokens, "text": res.text, "metrics": res.metrics}, default=_json_default),
          file=out, flush=True)
  else:    # a model without a tokenizer (a preset): the generated ids, as --prompt-tokens takes them
    show.finish(res.text if tok is not None else ",".join(map(str, res.tokens)))
    for line in _summary(res.metrics):
      print(f"{PROG}: {line}", file=err, flush=True)
  return 0


def cmd_warmup(fv: flags.FlagValues, out=None) -> int:
  """`kvjax warmup`: the flags of a `kvjax generate` (its prompt optional, `--ctx-size` then
  required): every program that generation can run compiled, or loaded from the compilation cache,
  so that it compiles nothing; a line of what it cost (`--json`: the numbers)."""
  out = out or sys.stdout
  from kvjax import api  # pylint: disable=import-outside-toplevel
  spec = _spec(fv)
  ubatch, n_predict, ctx = fv["ubatch-size"].value, fv["n-predict"].value, fv["ctx-size"].value
  budget, block = _kv_flags(fv, spec)
  text, ids = _prompt_text(fv), fv["prompt-tokens"].value
  if text is None and ids is None and ctx <= 0:
    raise UsageError("--ctx-size is required without a prompt: the KV capacity of the generation to warm "
                     "(as `kvjax generate` sizes it: --ctx-size, else prompt + n-predict)")
  model = _load(fv)
  if text is not None or ids is not None:
    prompt = api.prompt_ids(model, text, None if ids is None else parse_token_list(ids, "--prompt-tokens"))
    ctx = api.context_tokens(len(prompt), n_predict, spec, ctx)
  kv = api.make_kv(model, ctx, ubatch=ubatch, exceed_context_length=fv["exceed-context-length"].value,
                   spec=spec, prefill_block=block, **budget)
  warm = api.warmup(model, kv, ubatch=ubatch, spec=spec)
  report = dict(warm, ctx_size=ctx, kv=kv.info.get("kv", ""), compile_cache_dir=compile_cache_lib.active() or "")
  if fv["json"].value:
    print(json.dumps(report, default=_json_default), file=out, flush=True)
  else:
    print(f"{PROG}: warm for {ctx} tokens ({report['kv']}): {warm['compiles']} programs compiled "
          f"({warm['compile_ms'] / 1e3:.1f} s of compiling), {warm['executables_loaded']} stored steps loaded, "
          f"in {warm['s']:.1f} s; compilation cache: {report['compile_cache_dir'] or 'off'}", file=out, flush=True)
  return 0


def cmd_logits(fv: flags.FlagValues, out=None) -> int:
  """`kvjax logits`: float32 teacher-forced logits -> .npy (target [n, V] or MTP [n - 1, V])."""
  out = out or sys.stdout
  import numpy as np  # pylint: disable=import-outside-toplevel
  from kvjax import api  # pylint: disable=import-outside-toplevel
  path = fv["out"].value
  if not path:
    raise UsageError("--out FILE.npy is required")
  if not path.endswith(".npy"):
    raise UsageError(f"--out {path!r}: the file name must end in .npy (numpy.save would add it)")
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    raise FileNotFoundError(f"--out {path!r}: directory {parent!r} does not exist")
  if fv["ubatch-size"].value < 1:
    raise UsageError(f"--ubatch-size must be >= 1, got {fv['ubatch-size'].value}")
  text, ids = fv["prompt"].value, fv["tokens"].value
  if (text is None) == (ids is None):
    raise UsageError("give exactly one of --prompt and --tokens")
  ids = None if ids is None else parse_token_list(ids, "--tokens")
  model = _load(fv)
  tokens = ids if ids is not None else api.encode(model, text)
  arr = api.teacher_forced_logits(model, tokens, mtp=fv["mtp"].value, ubatch=fv["ubatch-size"].value,
                                  exceed_context_length=fv["exceed-context-length"].value)
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
  try:
    report = memory_report.report_from_config(cfg)
  except ValueError as e:   # a config value out of range: a usage error, as the other subcommands' sizes
    raise UsageError(f"--config: {e}") from None
  if fv["json"].value:
    print(json.dumps(report, default=_json_default), file=out, flush=True)
  else:
    print(memory_report.format_table(report), file=out, flush=True)
  return 0


_COMMANDS = {"generate": cmd_generate, "warmup": cmd_warmup, "logits": cmd_logits, "memory": cmd_memory}


def _json_default(x):
  import numpy as np  # pylint: disable=import-outside-toplevel
  if isinstance(x, np.generic):
    return x.item()
  raise TypeError(f"not JSON serializable: {type(x).__name__}")


def _error(msg: str) -> None:
  msg = one_line(" ".join(str(msg).split()))  # one line, nothing from a file printed raw
  print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)


def version() -> str:
  """The installed package's version (`kvjax.__version__` where it is not installed)."""
  try:
    from importlib.metadata import version as dist_version  # pylint: disable=import-outside-toplevel
    return dist_version("kvjax")
  except Exception:  # pylint: disable=broad-except
    from kvjax import __version__  # pylint: disable=import-outside-toplevel
    return __version__


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Run one subcommand; `argv` is the argument list WITHOUT the program name
  (default `sys.argv[1:]`). Returns the exit status (0 ok, 1 runtime error, 2 usage error)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(USAGE, file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2
  if argv[0] == "--version":
    print(f"{PROG} {version()}")
    return 0
  sub, rest = argv[0], argv[1:]
  if sub not in _COMMANDS:
    print(USAGE, file=sys.stderr)
    _error(f"unknown subcommand {sub!r}; expected one of {', '.join(SUBCOMMANDS)}")
    return 2
  fv = flags.FlagValues()
  if sub == "memory":
    from kvjax import checks, memory_report  # pylint: disable=import-outside-toplevel
    bad = checks.config_error(rest, example="configs/memory_27b.py",   # a missing file, another command's
                              required=memory_report.CONFIG_FIELDS)    # config, an unknown field
    if bad:
      _error(bad)
      return 2
    _memory_flags(fv, rest)
  else:
    _FLAG_SETS[sub](fv)
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
  try:
    return _COMMANDS[sub](fv)
  except KeyboardInterrupt:
    _error("interrupted")
    return 130
  except UsageError as e:
    _error(e)
    return 2
  except ValueError as e:   # the API's ParameterError, StreamBudgetError, GGUFError, ...
    from kvjax import api  # pylint: disable=import-outside-toplevel
    if isinstance(e, api.ParameterError):
      _error(e.renamed(FLAG_OF))
      return 1 if isinstance(e, api.ModelNotFoundError) else 2
    _error(e)
    return 1
  except BrokenPipeError:    # the reader left (`| head`): stop quietly, as a pipe's writer does
    _quiet_stdout()
    return 141
  except (OSError, flags.Error) as e:
    # FileNotFoundError's str() already names the path
    _error(e)
    return 1


def _quiet_stdout() -> None:
  """stdout to the null device: the interpreter's last flush then has no closed pipe to fail on."""
  os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def run() -> None:
  """Console-script entry point (`kvjax = "kvjax.cli:run"`)."""
  code = main()
  try:
    sys.stdout.flush()
  except BrokenPipeError:
    _quiet_stdout()
    code = code or 141
  sys.exit(code)


if __name__ == "__main__":
  run()
