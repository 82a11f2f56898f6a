"""The Python API of kvjax: load a model, make a KV cache from a budget, generate, teacher-forced logits.

    from kvjax import api

    model = api.load_model("tiny", page_tokens=64)           # or a GGUF path
    kv = api.make_kv(model, 160, pool_pages=6)                # streamed through a 6-page device pool
    res = api.generate(model, kv, prompt="Hello", n_predict=32, warmup=True)
    print(res.text, res.metrics["decode_tps"])
    logits = api.teacher_forced_logits(model, res.tokens)     # float32 [n, vocab]

This module puts the pieces together (the `kvjax.engine` runner, the KV providers, the `kvjax.generate` /
`kvjax.speculative` loops); the CLI, the experiments and the notebooks go through it. The KV page layout and
the attention implementation are fixed when a model is loaded (the compiled steps are specialised to them).
`warmup(model, kv)` compiles every program a generation on `kv` can run; JAX's persistent compilation cache
keeps them for the next process (`compile_cache`).

Errors. A bad argument raises `ParameterError` (a `ValueError`) whose message names the parameter of this API,
e.g. "copy_pages must be a power of two >= 1, got 3"; its `params` lists the parameters the message names, so a
front end can rename them (`kvjax.cli` writes `--kv-stream-copy-pages`). A missing model file raises
`ModelNotFoundError` (a `ParameterError`). A budget given to `make_kv` that cannot hold the cache raises
`KVBudgetError` (a `ParameterError` naming `arena_mib` or `pool_pages`, and a `kvjax.streaming.StreamBudgetError`);
a forward that outgrows it later, `StreamBudgetError`; a malformed GGUF file `kvjax.gguf_io.GGUFError`. Each
message says what is missing or wrong.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import checks, compile_cache as cache_lib, config as config_lib, executables, model as model_lib
from kvjax import engine, fused, generate as gen_lib, kv_build, parallel, spec_config, speculative, text as text_lib, tiny, \
    warmup as warm_lib, qweights, weights as weights_lib
from kvjax.generate import GenerationResult
from kvjax.memory_report import available_memory
from kvjax.model import AttentionOptions
from kvjax.spec_config import SpecConfig   # one class from the command line to the round
from kvjax.streaming import StreamBudgetError
from kvjax.streaming.arena import CapacityError   # a phased arena too small for its workspaces
from kvjax.streaming.plan import KVPlan
from kvjax_pallas.page_layout import BLOCK_FORMATS, PageLayout
from kvjax_pallas.span_attention.api import IMPLEMENTATIONS, check_page_tokens, resolve_implementation
from kvjax_pallas.span_attention.triton import MAX_QUERY_ROWS

DTYPES = ("float32", "bfloat16")
POLICIES = ("fixed", "adaptive")
DRAFTS = spec_config.DRAFTS   # SpecConfig.draft's values

__all__ = ["ParameterError", "ModelNotFoundError", "LoadedModel", "KVCache", "SpecConfig", "GenerationResult",
           "load_model", "make_kv", "check_kv_budget", "check_generation", "check_context_length", "check_kv_memory",
           "available_memory", "kv_bytes", "encode", "prompt_ids",
           "context_tokens", "generate", "warmup", "teacher_forced_logits", "parse_block_pages", "printable"]


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------

class ParameterError(ValueError):
  """A bad argument. The message names it by its parameter in this API; `params` lists the parameters the message
  names (dotted for fields, e.g. "spec.n_max")."""

  def __init__(self, message: str, *params: str):
    super().__init__(message)
    self.params = params

  def renamed(self, names: Mapping[str, str]) -> str:
    """The message with each parameter of `params` written as `names[param]` (e.g. its flag)."""
    keys = sorted((p for p in self.params if p in names), key=len, reverse=True)
    if not keys:
      return str(self)
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, keys)) + r")(?!\w|\.\w)")
    return pattern.sub(lambda m: names[m.group(1)], str(self))


class ModelNotFoundError(ParameterError):
  """`source` names no file (and is not a built-in model)."""


# ---------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class LoadedModel:
  """A model ready to run: `runner` (`engine.Runner`, with its KV page layout and attention options),
  `tokenizer` (None for a preset's random weights), `cfg` (`kvjax.config.ModelConfig`), `load_s`
  (seconds to build it) and `source` (what was loaded)."""
  runner: engine.Runner
  tokenizer: Any
  cfg: config_lib.ModelConfig
  load_s: float
  source: str
  weights: str = "dequantized"      # "quantized": matrices kept in their GGUF block format
  weights_impl: str = "xla"         # the quantized matrices' product ("none": nothing kept quantized)
  joined_products: int = 0          # matrices joined from a block's same-input parts (`kvjax.fused`)
  gdn_impl: str = "xla"             # the Gated DeltaNet's prefill form run (`kvjax.model.CHUNK_FORMS`)

  @property
  def layout(self) -> PageLayout:
    return self.runner.layout


def weight_bytes(model: LoadedModel) -> int:
  """Device bytes of the model's weights (quantized matrices at their stored size; a tied output projection once)."""
  if not isinstance(model, LoadedModel):
    raise ParameterError(f"model must be a LoadedModel (api.load_model's), got {type(model).__name__}", "model")
  return qweights.runner_bytes(model.runner)


def parse_block_pages(value) -> Union[int, str]:
  """`block_pages`: "auto" or an int >= 1 (ints may come as text)."""
  if isinstance(value, str) and value.strip() == "auto":
    return "auto"
  try:
    n = int(value)
  except (TypeError, ValueError):
    raise ParameterError(f"block_pages must be auto or an int >= 1, got {value!r}", "block_pages") from None
  if n < 1 or str(n) != str(value).strip():
    raise ParameterError(f"block_pages must be auto or an int >= 1, got {value!r}", "block_pages")
  return n


def load_model(source: str = "tiny", *, preset: Optional[str] = None, dtype: str = "float32",
               page_tokens: int = 256, k_type: str = "q8_0", v_type: str = "q4_0", attn_impl: str = "auto",
               block_pages: Union[int, str] = "auto", weight_seed: int = 0,
               tensor_parallel: int = 1, compile_cache: Union[bool, str, None] = None,
               weights: Optional[str] = None, weights_impl: str = "auto",
               weight_type: Optional[str] = None, fuse: bool = True, gdn_impl: str = "auto") -> LoadedModel:
  """Build a model and its runner.

  Args:
    source: "tiny" / "tiny:SEED" (the built-in tiny model: random weights of SEED, its own
      tokenizer), "code-tiny" (the packaged model trained on the Python standard library) or the
      path of a GGUF file.
    preset: instead of `source`, a `kvjax.config` preset name (e.g. "qwen38_27b") with deterministic
      random weights (`weight_seed`) drawn on the device; it has no tokenizer.
    dtype: weight and activation dtype, "float32" or "bfloat16".
    page_tokens: token positions per KV page.
    k_type, v_type: KV cache types (q8_0, q4_0, f16, bf16, f32).
    attn_impl: "auto" (on an NVIDIA GPU each attention call picks its kernel; "reference"
      elsewhere), "reference", or a kernel of `kvjax_pallas.span_attention.api.IMPLEMENTATIONS`.
      Without a GPU a kernel runs in Pallas interpret mode (slow; for checking the kernel).
    block_pages: pages per logical partition of the attention core, an int >= 1 or "auto".
    tensor_parallel: shard the model over this many devices (`kvjax.parallel`: attention and Gated
      DeltaNet heads and FFN columns split, each device holding its own KV heads); it must divide the
      model's KV heads, Gated DeltaNet key heads and FFN width.
    compile_cache: JAX's persistent compilation cache (`kvjax.compile_cache`): None or True the
      default directory (`KVJAX_COMPILE_CACHE_DIR`, else ~/.cache/kvjax/jax), a path, or False (off).
    weights: "quantized" (a GGUF's matrices in Q8_0, Q4_0, Q4_K, Q5_K or Q6_K stay in their blocks
      on the device and are dequantized as they are read: `kvjax.qweights`; other block types are
      dequantized at load, with a notice), "dequantized" (every weight in `dtype`), or None: quantized
      for a GGUF file on one device, else dequantized.
    weights_impl: the quantized product: "auto" ("planar" on a GPU, else "xla"), "xla" (dequantize, then the
      dequantized weight's product: the same logits), "fused" (decode rows as one multiply-and-sum), "pallas" /
      "pallas_gemv" (kernels), "planar" (Q8_0 / Q4_0 / Q4_K / Q6_K repacked into planes at load; `kvjax.qweights`).
    weight_type: with `preset`, draw the matrices that may stay quantized as random blocks of this
      format (q8_0, q4_0, q4_k, q5_k, q6_k), kept quantized: the preset benchmarks as a quantized
      file of its geometry runs.
    fuse: join the matrices a block multiplies by the same input (FFN gate / up, attention q / k / v,
      Gated DeltaNet qkv / z / beta / alpha) into one product each (`kvjax.fused`; one device only):
      fewer, larger weight reads a decoded token.
    gdn_impl: the Gated DeltaNet's prefill form: "xla", "triton" (Pallas) or "auto" (triton on one GPU if it fits).
  """
  checks.check_types(preset=(preset, "str?"), page_tokens=(page_tokens, "int"), weight_seed=(weight_seed, "int"),
                     fuse=(fuse, "bool"))
  if dtype not in DTYPES:
    raise ParameterError(f"dtype {dtype!r}: expected float32 or bfloat16", "dtype")
  if attn_impl not in IMPLEMENTATIONS + ("auto",):
    raise ParameterError(f"attn_impl {attn_impl!r}: expected auto or one of {', '.join(IMPLEMENTATIONS)}", "attn_impl")
  if gdn_impl not in ("auto",) + model_lib.CHUNK_FORMS:
    raise ParameterError(f"gdn_impl {gdn_impl!r}: expected auto, {' or '.join(model_lib.CHUNK_FORMS)}", "gdn_impl")
  if page_tokens < 1:
    raise ParameterError(f"page_tokens must be >= 1, got {page_tokens}", "page_tokens")
  for name, kind in (("k_type", k_type), ("v_type", v_type)):
    if kind not in BLOCK_FORMATS:
      raise ParameterError(f"{name} {kind!r}: expected one of {', '.join(BLOCK_FORMATS)}", name)
  block_pages = parse_block_pages(block_pages)
  if weights not in (None,) + qweights.WEIGHTS:
    raise ParameterError(f"weights {weights!r}: expected {' or '.join(qweights.WEIGHTS)}", "weights")
  if weights_impl not in ("auto",) + qweights.IMPLEMENTATIONS:
    raise ParameterError(f"weights_impl {weights_impl!r}: expected auto, {' or '.join(qweights.IMPLEMENTATIONS)}",
                         "weights_impl")
  if qweights.request_error(weights, weight_type, preset, tensor_parallel):
    raise ParameterError(*qweights.request_error(weights, weight_type, preset, tensor_parallel))
  if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
    raise ParameterError(f"tensor_parallel must be an int >= 1, got {tensor_parallel!r}", "tensor_parallel")
  if preset is None and not tiny.is_builtin(source) and not os.path.exists(source):
    raise ModelNotFoundError(tiny.not_found(source, preset_arg=True), "source")
  cache_lib.enable(compile_cache)
  backend = jax.default_backend()
  weights_impl = qweights.resolve_impl(weights_impl, backend)
  if attn_impl != "auto" or backend != "gpu":
    attn_impl = resolve_implementation(attn_impl)   # on a GPU "auto" stays: each call picks
  try:   # what the attention implementation takes ("auto" on a GPU may give any call to Triton)
    check_page_tokens(page_tokens, "triton" if attn_impl == "auto" else attn_impl)
  except ValueError as e:
    raise ParameterError(f"page_tokens {page_tokens}: {e}", "page_tokens") from None
  # the Pallas kernels compile for NVIDIA GPUs only; elsewhere they run in interpret mode
  interpret = attn_impl not in ("auto", "reference") and backend != "gpu"
  jdtype = jnp.dtype(dtype)
  t0 = time.perf_counter()
  if preset is not None:
    try:
      cfg = config_lib.preset(preset)
    except ValueError as e:
      raise ParameterError(f"preset: {e}", "preset") from None
    gdn_impl = _check_model(cfg, tensor_parallel, gdn_impl, backend, weight_type)
    shapes = config_lib.gguf_tensor_shapes(cfg)
    mem = qweights.memory_shapes(shapes, jdtype.itemsize, weight_type, weights_impl) if weight_type else shapes
    checks.check_model_fits(cfg, page_tokens, "preset", preset, mem, jdtype, tensor_parallel)
    weights = "quantized" if weight_type else "dequantized"
    model = engine.build_model(cfg, weights_lib.iter_random_device_tensors(cfg, weight_seed, dtype,
                                                                           weight_type=weight_type,
                                                                           weights_impl=weights_impl), dtype=jdtype,
                               names=config_lib.gguf_tensor_shapes(cfg))
    tok = None
  else:
    try:
      asked, weights = weights, weights or ("quantized" if tensor_parallel == 1 else "dequantized")
      cfg, tensors, tok = tiny.load_model_source(source, seed=weight_seed, dtype=np.float32, weights=weights,
                                                 weights_impl=weights_impl)
    except FileNotFoundError as e:
      raise ModelNotFoundError(str(e), "source") from None
    except ValueError as e:
      if tiny.is_builtin(source):
        raise ParameterError(str(e), "source") from None
      raise
    gdn_impl = _check_model(cfg, tensor_parallel, gdn_impl, backend)
    shapes = config_lib.gguf_tensor_shapes(cfg, False)
    checks.check_model_fits(cfg, page_tokens, "source", source, qweights.memory_shapes(shapes, jdtype.itemsize)
                            if weights == "quantized" else shapes, jdtype, tensor_parallel)
    model = engine.build_model(cfg, tensors, dtype=jdtype)
    cfg = model.cfg
    if not any(qweights.is_quantized(x) for x in
               jax.tree_util.tree_leaves(nnx.state(model), is_leaf=qweights.is_quantized)):
      if asked == "quantized":
        raise ParameterError(f"weights 'quantized': {source} has no matrix in a kept block format "
                             f"({', '.join(f.upper() for f in qweights.FORMATS)})", "weights")
      weights = "dequantized"     # nothing was stored in a kept block format
  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, k_type, v_type, page_tokens)
  opts = AttentionOptions(attn_impl, block_pages, interpret)
  rows_form = executables.gdn_rows_form() or ("fused" if gdn_impl == "triton" and backend == "gpu" else None)
  model_lib.set_chunk_form(model, gdn_impl, interpret=backend != "gpu", rows=rows_form)
  joined = 0
  if tensor_parallel > 1:
    runner = parallel.ShardedRunner(model, layout, opts, tensor_parallel)
    del model   # the shards hold what each device needs
  else:
    joined = fused.fuse_projections(model) if fuse else 0   # in place: the parts go as the joins come
    runner = engine.Runner(model, layout, opts)
  jax.block_until_ready(runner.token_embd)
  return LoadedModel(runner, tok, cfg, time.perf_counter() - t0, preset or source, weights or "dequantized",
                     weights_impl if weights == "quantized" else "none", joined, gdn_impl)


def _check_model(cfg: config_lib.ModelConfig, n: int, gdn_impl: str, backend: str, weight_type=None) -> str:
  for param, check in (("tensor_parallel", lambda: parallel.check_tensor_parallel(cfg, n)),   # before the weights
                       ("gdn_impl", lambda: model_lib.check_chunk_form(cfg, gdn_impl, backend, n)),   # are placed
                       (executables.GDN_ROWS_ENV, lambda: executables.check_gdn_rows_form(cfg)),
                       ("weight_type", lambda: qweights.check_rows(config_lib.gguf_tensor_shapes(cfg), weight_type))):
    try:
      gdn_impl = check() or gdn_impl
    except ValueError as e:
      raise ParameterError(str(e), param) from None
  return gdn_impl


def tensor_parallel(model: LoadedModel) -> int:
  return getattr(model.runner, "tensor_parallel", 1)   # the devices `model` is sharded over (1: not sharded)

# ---------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------

def check_kv_budget(*, arena_mib: Optional[float] = None, pool_pages: Optional[int] = None,
                    copy_pages: int = 8, policy: str = "fixed", phased: bool = False) -> None:
  """The checks of `make_kv` that need no model (a front end can run them before a long load)."""
  checks.check_types(arena_mib=(arena_mib, "real?"), pool_pages=(pool_pages, "int?"), copy_pages=(copy_pages, "int"))
  if policy not in POLICIES:
    raise ParameterError(f"policy must be 'fixed' or 'adaptive', got {policy!r}", "policy")
  if phased and arena_mib is None:
    raise ParameterError("phased needs arena_mib (the arena it lays out)", "phased", "arena_mib")
  if arena_mib is not None and pool_pages is not None:
    raise ParameterError("give only one of arena_mib and pool_pages", "arena_mib", "pool_pages")
  if copy_pages < 1 or copy_pages & (copy_pages - 1):
    raise ParameterError(f"copy_pages must be a power of two >= 1, got {copy_pages}", "copy_pages")
  if pool_pages is not None and pool_pages < 1:
    raise ParameterError(f"pool_pages must be >= 1, got {pool_pages}", "pool_pages")
  if arena_mib is not None and not 0 < arena_mib < float("inf"):
    raise ParameterError(f"arena_mib must be > 0 and finite, got {arena_mib}", "arena_mib")
  checks.check_arena_memory(arena_mib)   # before a model is loaded (make_kv checks a sharded model's arenas)


MAX_POSITIONS = checks.MAX_POSITIONS   # token positions are int32 in the compiled steps


def check_context_length(model: LoadedModel, max_tokens: int, exceed_context_length: bool = False,
                         param: str = "max_tokens") -> None:
  """`max_tokens` (named `param` in errors) within the model's trained context (`cfg.context_length`) unless
  `exceed_context_length`, and within int32 positions always."""
  if max_tokens > MAX_POSITIONS:
    raise ParameterError(f"{param} {max_tokens} is beyond the {MAX_POSITIONS} token positions the model "
                         f"indexes (int32)", param)
  limit = model.cfg.context_length
  if max_tokens > limit and not exceed_context_length:
    raise ParameterError(f"{param} {max_tokens} is beyond the model's context length of {limit} positions "
                         f"({max_tokens - limit} more; exceed_context_length allows it)", param,
                         "exceed_context_length")


def generation_tokens(model: LoadedModel, n_prompt: int, n_predict: int, spec: Optional[SpecConfig] = None,
                      exceed_context_length: bool = False) -> int:
  """The KV capacity a generation sizes for itself (`context_tokens`), refused past the model's context length in
  the terms the caller chose: the prompt's length and n_predict."""
  need = context_tokens(n_prompt, n_predict, spec)
  limit = model.cfg.context_length
  if need > limit and not exceed_context_length:
    verify = f" + {need - n_prompt - n_predict} verify rows (spec)" if need > n_prompt + n_predict else ""
    raise ParameterError(f"a prompt of {n_prompt} tokens + n_predict {n_predict}{verify} needs {need} positions, "
                         f"beyond the model's context length of {limit} ({need - limit} more; a shorter prompt, "
                         f"a smaller n_predict, or exceed_context_length)", "n_predict", "exceed_context_length")
  return need


def kv_bytes(model: LoadedModel, max_tokens: int) -> int:
  """Bytes of every cache layer's pages for `max_tokens` positions (the plain cache on the device;
  the host history of a streamed cache), summed over the devices of a sharded model."""
  layers, layout = model.cfg.num_attention_layers + (1 if model.cfg.has_mtp else 0), model.layout
  return layers * layout.pages_for(max_tokens) * layout.page_bytes * tensor_parallel(model)


def check_kv_memory(model: LoadedModel, max_tokens: int, streamed: bool = False,
                    available: Optional[Dict[str, Optional[int]]] = None) -> None:
  """The KV bytes of `max_tokens` positions fit the memory they live in: a plain cache's pages on the device (host
  memory on a CPU), a streamed cache's history on the host (twice: the pages and their pinned mirrors). Refused
  with the bytes needed and available."""
  avail = available_memory() if available is None else available
  need = kv_bytes(model, max_tokens)
  checks = []
  if streamed or avail.get("device") is None:
    checks.append(("host", need * (2 if streamed else 1)))
  if not streamed and avail.get("device") is not None:
    checks.append(("device", need // tensor_parallel(model)))   # each device holds its own KV heads
  for where, n in checks:
    have = avail.get(where)
    if have is not None and n > have:
      raise ParameterError(f"max_tokens {max_tokens}: the KV cache needs {n / 2**20:,.1f} MiB of {where} memory "
                           f"({model.layout.pages_for(max_tokens)} pages of {model.layout.page_bytes} B per "
                           f"cache layer), {have / 2**20:,.1f} MiB available", "max_tokens")


class KVBudgetError(ParameterError, StreamBudgetError):
  """`make_kv`'s budget (`arena_mib` or `pool_pages`) cannot hold the cache; the message says how much is missing."""


class KVCache:
  """A KV cache made by `make_kv`: `plan` (its budget decided: `kvjax.streaming.plan.KVPlan`, every
  size in pages and bytes), `provider` (what the runner reads and writes, built from the plan:
  `engine.PlainKV`, `StreamedKV`, `AdaptiveStreamedKV` or `PhasedKV`) and `info` (the plan as a flat
  dict for metrics: "kv" plain / streamed / "all pages resident" (a budget that holds every page of
  the context: nothing streams), the last two with "+phased" for the phase arena; "ctx_size", the
  page layout, for a budgeted cache the pool split and "all_pages_resident"). A cache holds one
  sequence: `generate` resets a used cache (`reset`: a fresh one from the same plan)."""

  def __init__(self, plan: KVPlan, build: Callable[[KVPlan], Any]):
    self.plan = plan
    self._build = build
    self.provider = build(plan)
    self.used = False

  @property
  def info(self) -> Dict[str, Any]:
    return self.plan.info()

  @property
  def max_tokens(self) -> int:
    """The capacity asked for (a plain cache rounds it up to whole pages)."""
    return self.plan.max_tokens

  def reset(self) -> None:
    self.provider = None   # the old pool goes before the new one is allocated
    self.provider = self._build(self.plan)
    self.used = False

  def metrics(self) -> Dict[str, Any]:
    return dict(self.provider.metrics()) if hasattr(self.provider, "metrics") else {}


def make_kv(model: LoadedModel, max_tokens: int, *, arena_mib: Optional[float] = None,
            pool_pages: Optional[int] = None, copy_pages: int = 8, policy: str = "fixed",
            phased: bool = False, ubatch: int = 256, prefill_block: Union[int, str] = "auto",
            exceed_context_length: bool = False, spec: Optional[SpecConfig] = None) -> KVCache:
  """A KV cache of `max_tokens` token positions for `model` (its page layout).

  Plain (every page on the device) unless a budget is given; streamed (the history on the host,
  a device pool of resident pages + a ring the older pages stream through) with
    arena_mib: a device arena in MiB: the pool is what is left after the measured decode
      workspace and the staging of in-flight uploads, in whole pages; or
    pool_pages: a device pool of this many pages.
  copy_pages: host -> device copy unit in pages (a power of two).
  policy: "fixed" (a uniform resident prefix per layer, `kvjax.streaming.plan.plan_kv`) or "adaptive"
    (`kvjax.streaming.policy` re-splits the pool every forward).
  A model sharded over N devices gets one cache per device (its own KV heads; `arena_mib`, `pool_pages` per device).
  phased: lay the arena out per phase (prefill: the larger workspace of `ubatch` rows; decode: a
    larger pool; the adaptive policy rebinds on each); needs `arena_mib`; `generate` must then use
    this `ubatch`.
  prefill_block: tokens of the prefill's block, the micro-batches a forward runs group-major so that a
    streamed layer's history is uploaded once a block (`kvjax.generate.prefill`): "auto" (the
    pool's bytes of hidden rows, at most 16,384 tokens; `KVCache.info["prefill_block"]`), or a
    count rounded down to whole micro-batches (0: one micro-batch a forward).
  exceed_context_length: allow more than the model's trained context (`cfg.context_length`).
  spec: the speculative decoding the cache will serve (`SpecConfig`): the arena then holds, beside
    the pool, the scratch of a verify forward of `verify_rows(spec)` rows and the recurrent states
    it captures (`kvjax.speculative.verify_state_bytes`); `generate` refuses a spec whose verify the
    cache's arena was not measured for.

  Refused before anything is allocated (`ParameterError`): a capacity beyond the model's context
  length, or KV bytes beyond the host's available memory or the device's (where it reports it);
  a budget that cannot hold the cache (`KVBudgetError`, also a `StreamBudgetError`).
  """
  checks.check_types(max_tokens=(max_tokens, "int"), ubatch=(ubatch, "int"))
  check_kv_budget(arena_mib=arena_mib, pool_pages=pool_pages, copy_pages=copy_pages, policy=policy, phased=phased)
  for name, value in (("max_tokens", max_tokens), ("ubatch", ubatch)):
    if value < 1:
      raise ParameterError(f"{name} must be >= 1, got {value}", name)
  if prefill_block != "auto" and not (isinstance(prefill_block, int) and prefill_block >= 0):
    raise ParameterError(f"prefill_block must be 'auto' or tokens >= 0, got {prefill_block!r}", "prefill_block")
  check_context_length(model, max_tokens, exceed_context_length)
  if tensor_parallel(model) > 1 and (policy != "fixed" or phased):
    raise ParameterError(f"tensor_parallel {tensor_parallel(model)} runs the fixed split without phases (every "
                         f"device the same layout): use policy 'fixed' and no phased", "policy", "phased")
  check_kv_memory(model, max_tokens, streamed=arena_mib is not None or pool_pages is not None)
  checks.check_budget_memory(arena_mib, pool_pages, model.layout.page_bytes, tensor_parallel(model))
  try:   # the budget decided before anything is allocated (`plan_kv`), then the cache built from it
    plan = kv_build.plan(model.runner, max_tokens, arena_mib, pool_pages, copy_pages, policy, phased, ubatch, spec,
                         prefill_block)
  except (StreamBudgetError, CapacityError) as e:   # the budget cannot hold the cache: named by its parameter
    name, value = ("arena_mib", arena_mib) if arena_mib is not None else ("pool_pages", pool_pages)
    raise KVBudgetError(checks.budget_error(name, value, e), name) from None
  return KVCache(plan, lambda p: kv_build.build_from_plan(model.runner, p))


# ---------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------

MAX_ROWS = MAX_QUERY_ROWS   # query rows of a verify forward (one span-attention call)
MAX_UBATCH = 2048           # rows of a prefill micro-batch (its attention runs in calls of MAX_ROWS rows)


def verify_rows(spec: Optional[SpecConfig]) -> int:
  """Rows of a verify forward of `spec` (1 + the widest draft its drafters can make); 1 without."""
  return 1 if spec is None else spec.verify_width


def check_generation(*, n_predict: int = 32, temperature: float = 0.0, top_k: int = 0, ubatch: int = 256,
                     spec: Optional[SpecConfig] = None, phased: bool = False, top_p: float = 1.0) -> None:
  """The checks of `generate` that need no model (a front end can run them before a long load)."""
  checks.check_types(n_predict=(n_predict, "int"), temperature=(temperature, "real"), top_k=(top_k, "int"),
                     top_p=(top_p, "real"), ubatch=(ubatch, "int"))
  for ok, name, need in ((n_predict >= 1, "n_predict", ">= 1"), (ubatch >= 1, "ubatch", ">= 1"),
                         (0.0 < top_p <= 1.0, "top_p", "in (0, 1] (1: off)"),
                         (ubatch <= MAX_UBATCH, "ubatch", f"<= {MAX_UBATCH}"),
                         (temperature >= 0.0, "temperature", ">= 0"), (top_k >= 0, "top_k", ">= 0")):
    if not ok:
      raise ParameterError(f"{name} must be {need}, got {locals()[name]}", name)
  if spec is not None:   # its fields were checked when it was made (`SpecConfig`)
    if temperature != 0.0:
      raise ParameterError("spec verifies greedily: use temperature 0", "spec", "temperature")
    if phased:
      raise ParameterError("spec and phased cannot be combined yet", "spec", "phased")
    if verify_rows(spec) > MAX_ROWS:
      raise ParameterError(f"spec.n_max {spec.n_max} / spec.ngram_m {spec.ngram_m}: the verify of 1 + the widest "
                           f"draft is {verify_rows(spec)} rows, at most {MAX_ROWS} rows a call: the widest draft "
                           f"must be <= {MAX_ROWS - 1}", "spec.n_max", "spec.ngram_m")
    try:
      speculative.check_ubatch(spec, ubatch)
    except ValueError as e:
      raise ParameterError(str(e), "ubatch", "spec.n_max") from None


def encode(model: LoadedModel, text: str, param: str = "prompt") -> List[int]:
  """`text` in the model's tokenizer (at least one token)."""
  checks.check_types(**{param: (text, "str")})
  if model.tokenizer is None:
    raise ParameterError(f"{param}: {model.source!r} has no tokenizer (random preset weights, or a GGUF without "
                         f"tokenizer.ggml.tokens); give token ids", param)
  ids = model.tokenizer.encode(text)
  if not ids:
    raise ParameterError(f"{param} is empty: at least one token is needed", param)
  return ids


def _token_ids(model: LoadedModel, ids: Sequence[int], param: str) -> List[int]:
  checks.check_token_ids(param, ids)
  ids = [int(t) for t in ids]
  if not ids:
    raise ParameterError(f"{param}: at least one token id is needed", param)
  bad = [t for t in ids if not 0 <= t < model.cfg.vocab_size]
  if bad:
    raise ParameterError(f"{param}: token id {bad[0]} is outside the vocabulary of {model.cfg.vocab_size} "
                         f"tokens", param)
  return ids


def prompt_ids(model: LoadedModel, prompt: Optional[str] = None,
               prompt_tokens: Optional[Sequence[int]] = None) -> List[int]:
  """The prompt as token ids: exactly one of `prompt` (text) and `prompt_tokens` (ids)."""
  if (prompt is None) == (prompt_tokens is None):
    raise ParameterError("give exactly one of prompt and prompt_tokens", "prompt", "prompt_tokens")
  if prompt_tokens is not None:
    return _token_ids(model, prompt_tokens, "prompt_tokens")
  return encode(model, prompt, "prompt")


def context_tokens(n_prompt: int, n_predict: int, spec: Optional[SpecConfig] = None, max_tokens: int = 0) -> int:
  """KV capacity for a generation: `max_tokens` (0: prompt + n_predict), refused when smaller than
  prompt + n_predict; with `spec`, at least n_max more (verify rows may run past the last token)."""
  need = n_prompt + n_predict
  if max_tokens < 0:
    raise ParameterError(f"max_tokens must be >= 0 (0: prompt + n_predict), got {max_tokens}", "max_tokens")
  if not max_tokens and need > MAX_POSITIONS:
    raise ParameterError(f"prompt {n_prompt} + n_predict {n_predict} needs {need} token positions, beyond the "
                         f"{MAX_POSITIONS} the model indexes (int32)", "n_predict")
  if max_tokens and max_tokens < need:
    raise ParameterError(f"max_tokens {max_tokens} is too small: prompt {n_prompt} + n_predict {n_predict} "
                         f"needs {need} tokens ({need - max_tokens} more)", "max_tokens", "n_predict")
  cap = max_tokens or need
  return max(cap, need + spec.verify_width - 1) if spec is not None else cap


def generate(model: LoadedModel, kv: Optional[KVCache] = None, *, prompt: Optional[str] = None,
             prompt_tokens: Optional[Sequence[int]] = None, n_predict: int = 32, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, ignore_eos: bool = False, spec: Optional[SpecConfig] = None,
             ubatch: int = 256, warmup: bool = False, on_token: Optional[Callable[[int], None]] = None,
             on_logits: Optional[Callable[[int, Any], None]] = None,
             exceed_context_length: bool = False, top_p: float = 1.0,
             on_prefill: Optional[Callable[[int, int], None]] = None) -> GenerationResult:
  """Prefill a prompt (`prompt` text or `prompt_tokens` ids) and generate up to `n_predict` tokens.

  kv: a cache from `make_kv` (reset first when used); None = a plain cache of `context_tokens`.
  temperature / top_k / top_p / seed: sampling (temperature 0 = greedy; top_k 0 = whole vocabulary;
    top_p < 1: nucleus, the most probable tokens up to that probability, before temperature).
  ignore_eos: keep generating past the tokenizer's end-of-sequence token.
  spec: speculative decoding (`SpecConfig`, greedy), output equal to greedy decoding.
  ubatch: prefill micro-batch (rows per forward).
  warmup: compile first (`warmup`: every program the generation can run), so the timings of the
    returned run exclude compilation (otherwise `compile_ms` says how much of them it is).
  on_token: called with each generated token as it is committed (plain generation only).
  on_logits: called as `on_logits(step, logits)` with each logits row a token is sampled from (plain only).
  on_prefill: called as `on_prefill(done_tokens, total_tokens)` after each prefill block (progress).
  exceed_context_length: with kv None, allow a cache beyond the model's context length.

  -> `GenerationResult(tokens, metrics, text)`. metrics: prompt_tokens, decode_tokens, prompt_ms,
  predicted_ms, prefill_tps, decode_tps, compile_ms (prompt_compile_ms + predicted_compile_ms: jax
  tracing and compiling inside those times), compiles (prompt_compiles + first_token_compiles +
  predicted_compiles: programs compiled in the prefill, up to the first decoded token, after it),
  warmup (warmup_compiles, ...), compile_cache_dir, spec_type ("none", "mtp", "ngram", "ngram+mtp",
  "oracle"; speculative runs add the metrics of `kvjax.speculative.generate_speculative`), the
  cache's counters and budget (`KVCache.info`), load_s, attn_impl, attn_interpret, weights,
  weights_impl, joined_products, gdn_impl.
  """
  checks.check_types(prompt=(prompt, "str?"), seed=(seed, "int"), prompt_tokens=(prompt_tokens, "ids?"))
  check_generation(n_predict=n_predict, temperature=temperature, top_k=top_k, ubatch=ubatch, spec=spec,
                   phased=kv is not None and kv.info["kv"].endswith("+phased"), top_p=top_p)
  if spec is not None and tensor_parallel(model) > 1:
    raise ParameterError(f"spec and tensor_parallel {tensor_parallel(model)} cannot be combined yet", "spec",
                         "tensor_parallel")
  for name, hook in (("on_token", on_token), ("on_logits", on_logits)):
    if spec is not None and hook is not None:
      raise ParameterError(f"{name} is called by plain generation only: drop spec or {name}", name, "spec")
  if top_k > model.cfg.vocab_size:
    raise ParameterError(f"top_k {top_k} is larger than the vocabulary of {model.cfg.vocab_size} tokens", "top_k")
  ids = prompt_ids(model, prompt, prompt_tokens)
  need = context_tokens(len(ids), n_predict, spec)
  if kv is None:
    need = generation_tokens(model, len(ids), n_predict, spec, exceed_context_length)
    kv = make_kv(model, need, ubatch=ubatch, exceed_context_length=exceed_context_length, spec=spec)
  elif kv.max_tokens < need:
    raise ParameterError(f"kv holds {kv.max_tokens} tokens: prompt {len(ids)} + n_predict {n_predict}"
                         f"{f' + spec.n_max {spec.n_max}' if spec is not None else ''} needs {need} "
                         f"({need - kv.max_tokens} more)", "kv", "n_predict", *(("spec.n_max",) if spec else ()))
  if spec is not None and "decode_rows" in kv.info:     # an arena: was this verify measured into it?
    need = speculative.verify_state_bytes(model.runner, spec)
    if kv.info["decode_rows"] < verify_rows(spec) or kv.info["verify_states_bytes"] < need:
      raise ParameterError(f"spec verifies {verify_rows(spec)} rows a forward and captures {need / 2**20:.1f} MiB of "
                           f"recurrent states; the cache's arena was measured for {kv.info['decode_rows']} rows and "
                           f"{kv.info['verify_states_bytes'] / 2**20:.1f} MiB: make_kv(..., spec=spec)", "kv", "spec")
  if kv.info.get("ubatch", ubatch) != ubatch:
    raise ParameterError(f"ubatch {ubatch} differs from the {kv.info['ubatch']} rows the phased cache's prefill "
                         f"layout was measured for", "ubatch")
  if spec is not None and spec.uses_mtp and not model.cfg.has_mtp:
    raise ParameterError(f"spec.draft 'mtp': {model.source!r} has no MTP head (nextn_predict_layers = 0); "
                         f"use draft 'ngram'", "spec.draft")
  eos = None if (ignore_eos or model.tokenizer is None) else model.tokenizer.eos_id
  runner = model.runner
  sampling = gen_lib.SamplingParams(temperature, top_k, seed, top_p)

  capture = speculative.ROLLBACKS[spec.rollback].capture if spec else True

  def on_phase(phase):   # in each phase first the placements and copy waves later forwards may run
    phased = hasattr(kv.provider, "enter")   # a pool of its own a phase: that phase's forwards
    if phased:
      kv.provider.enter(phase)
    if phase == "prefill":   # every phase's programs loaded or compiling side by side (`warmup.prepare`)
      warm_lib.prepare(runner, kv.provider, ubatch, verify_rows(spec), capture, spec is not None and spec.uses_mtp)
    warm_lib.compile_cache(runner, kv.provider,
                           warm_lib.forward_shapes(ubatch, verify_rows(spec), phase if phased else None, capture),
                           mtp_lease=spec is not None and spec.uses_mtp,
                           inert_rows=warm_lib.forward_shapes(ubatch, verify_rows(spec), phase, capture))

  def run_once(on_logits=None):
    if kv.used:
      kv.reset()
    kv.used = True
    if spec is not None:
      return speculative.generate_speculative(runner, kv.provider, ids, n_predict, spec,
                                              ubatch=ubatch, eos_id=eos, on_phase=on_phase)
    return gen_lib.generate(runner, kv.provider, ids, n_predict, sampling=sampling, ubatch=ubatch, eos_id=eos,
                            on_token=on_token, on_phase=on_phase, on_logits=on_logits)

  warm = _compile_ahead(model, kv, ubatch=ubatch, spec=spec) if warmup else {}
  with gen_lib.prefill_progress(on_prefill):
    res = run_once(on_logits)
  metrics = dict(res.metrics)
  metrics.setdefault("spec_type", "none")
  metrics["warmup"] = warmup
  metrics.update({f"warmup_{k}": v for k, v in warm.items()})
  metrics["compile_cache_dir"] = cache_lib.active() or ""
  metrics.update(kv.info)
  metrics.update(load_s=model.load_s, attn_impl=runner.opts.implementation, attn_interpret=runner.opts.interpret,
                 weights=model.weights, weights_impl=model.weights_impl, joined_products=model.joined_products,
                 gdn_impl=model.gdn_impl)
  text = model.tokenizer.decode(res.tokens) if model.tokenizer is not None else ""
  return GenerationResult([int(t) for t in res.tokens], metrics, text)


def warmup(model: LoadedModel, kv: KVCache, *, ubatch: int = 256,
           spec: Optional[SpecConfig] = None) -> Dict[str, float]:
  """Compile every program a generation on `kv` can run (`kvjax.warmup`: short generations through
  the cache, a prefill of one micro-batch and one of two, then what they did not reach). -> {"compiles": programs, "compile_ms", "executables_loaded"
  (compiled steps read from the cache's folder instead: `kvjax.executables`), "s": seconds}."""
  check_generation(n_predict=2, ubatch=ubatch, spec=spec, phased=kv.info["kv"].endswith("+phased"))
  n_predict = 2 + (0 if spec is None else 2 * spec.n_max)
  t0 = time.perf_counter()
  with gen_lib.CompileClock() as clock:
    for ids in warm_lib.short_prompts(kv.max_tokens, ubatch, n_predict + verify_rows(spec)):
      generate(model, kv, prompt_tokens=ids, n_predict=n_predict, ignore_eos=True, spec=spec, ubatch=ubatch)
  return {"compiles": clock.programs, "compile_ms": clock.seconds * 1e3, "executables_loaded": clock.loaded,
          "s": time.perf_counter() - t0}


_compile_ahead = warmup   # `generate`'s flag of the same name hides the function there


def teacher_forced_logits(model: LoadedModel, tokens: Sequence[int], *, mtp: bool = False,
                          ubatch: int = 256, exceed_context_length: bool = False) -> np.ndarray:
  """float32 logits of every row of `tokens` [n, vocab], fed in micro-batches of `ubatch` through a plain cache; with
  `mtp`, the MTP head's logits [n - 1, vocab]: row t from the target's post-norm hidden at t and token t + 1 (it
  predicts token t + 2). More tokens than the model's context length need `exceed_context_length`."""
  ids = _token_ids(model, tokens, "tokens")
  if ubatch < 1:
    raise ParameterError(f"ubatch must be >= 1, got {ubatch}", "ubatch")
  if mtp and not model.cfg.has_mtp:
    raise ParameterError(f"mtp: {model.source!r} has no MTP head (nextn_predict_layers = 0)", "mtp")
  if mtp and len(ids) < 2:
    raise ParameterError(f"mtp needs at least 2 tokens, got {len(ids)}", "mtp")
  check_context_length(model, len(ids), exceed_context_length, param="tokens")
  check_kv_memory(model, len(ids))
  kv = kv_build.build_from_plan(model.runner, kv_build.plan(model.runner, len(ids), ubatch=ubatch))
  return gen_lib.teacher_forced_logits(model.runner, kv, ids, ubatch, mtp=mtp)


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------

def train(config, out: str, *, resume: bool = False, progress: bool = True) -> Dict[str, Any]:
  """Train a model per `config` (`kvjax.train.base_config()` fields, e.g. configs/train_code_tiny.py);
  its log, checkpoint, GGUF and loss plot go under `out` (`kvjax.train.run`) -> the summary."""
  from kvjax import train as train_lib
  if not out:
    raise ParameterError("out: an output folder is needed", "out")
  return train_lib.run(config, out, resume=resume, progress=progress)


# ---------------------------------------------------------------------------
# text for a terminal
# ---------------------------------------------------------------------------

printable = text_lib.printable   # generated text safe for a terminal (newlines and tabs stay)
