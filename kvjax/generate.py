"""Prefill + decode loop, the same for the plain ("stock") cache and the streamed cache.

Read top to bottom:

1. prefill the prompt in micro-batches of `ubatch` rows (the last one padded;
   padding rows are inert: dropped KV writes, no-op recurrent updates);
2. sample the first token from the last prompt row;
3. decode one token at a time until `n_predict` tokens or EOS.

The KV cache is whatever `KVProvider` is passed in (see `kvjax.engine`).
`teacher_forced_logits` runs the same micro-batched prefill with every row's logits kept (and,
for the MTP head, `mtp_rows` over the target's hidden states). Timings come with the seconds jax
spent tracing and compiling inside them (`CompileClock`): a first, cold run is mostly compilation.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import gc
import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import executables
from kvjax.engine import KVProvider, Runner


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 = greedy; top_k 0 = whole vocabulary; top_p < 1 keeps the most probable tokens
  up to that probability (nucleus, on the logits before temperature, as llama.cpp). Seeded and
  reproducible."""
  temperature: float = 0.0
  top_k: int = 0
  seed: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not (self.temperature >= 0.0):
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def _sample_jax(logits_v, key, temperature: float, top_k: int, top_p: float = 1.0):
  raw = logits_v.astype(jnp.float32)
  logits_v = raw / temperature
  if top_k:
    kth = jax.lax.top_k(logits_v, top_k)[0][-1]
    logits_v = jnp.where(logits_v < kth, -jnp.inf, logits_v)
  if top_p < 1.0:   # the smallest set of top tokens whose probability reaches top_p (at least one)
    kept = jnp.where(jnp.isneginf(logits_v), -jnp.inf, raw)
    desc = jnp.sort(kept)[::-1]
    p = jax.nn.softmax(desc)
    n = jnp.maximum(jnp.sum(jnp.cumsum(p) - p < top_p), 1)
    logits_v = jnp.where(kept < desc[n - 1], -jnp.inf, logits_v)
  return jax.random.categorical(key, logits_v)


_sample_jit = jax.jit(_sample_jax, static_argnames=("temperature", "top_k", "top_p"))


def sample_token(logits_v, params: SamplingParams, step: int) -> int:
  """Pick the next token from one row of logits (step = index of the generated token)."""
  if params.temperature == 0.0:
    return int(jnp.argmax(logits_v))
  key = jax.random.fold_in(jax.random.PRNGKey(params.seed), step)
  return int(_sample_jit(logits_v, key, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p))


@dataclasses.dataclass
class GenerationResult:
  """What a generation returns (`generate`, `kvjax.api.generate`, speculative decoding).

  tokens: the generated token ids, prompt excluded; the first one is sampled from the prompt's
    last row, so `len(tokens)` is at most `n_predict` (fewer where EOS ended the generation).
  metrics: the generation's numbers (`generation_metrics`), main keys:
    prompt_tokens, decode_tokens (= len(tokens));
    prompt_ms (the prefill and the first token's sampling), predicted_ms (the decode after it);
    prefill_tps (prompt tokens over prompt_ms), decode_tps (the tokens after the first over
      predicted_ms);
    compile_ms = prompt_compile_ms + predicted_compile_ms (jax tracing and compiling inside those
      timings; by stage compile_trace_ms, compile_lower_ms, compile_backend_ms),
      compiles = prompt_compiles + first_token_compiles + predicted_compiles (programs compiled in
      the prefill, up to the first decoded token, after it), compile_cache_hits,
      executables_loaded (compiled steps loaded untraced: `kvjax.executables`);
    a streamed cache's counters: h2d_bytes, h2d_calls, d2h_bytes, streamed_pages, waves, forwards,
      ring_wraps, readiness_misses, pool_pages, resident_pages, ring_slots.
    `kvjax.api.generate` adds warmup (and warmup_*), compile_cache_dir, spec_type, the cache's
    `KVCache.info` (kv, ctx_size, page_tokens, all_pages_resident, ...), load_s, attn_impl,
    attn_interpret; speculative decoding adds draft_generated, draft_accepted, draft_acceptance,
    verify_forwards (`kvjax.speculative.generate_speculative`).
  text: the tokens decoded by the model's tokenizer (filled by `kvjax.api.generate`; "" without
    a tokenizer).
  """
  tokens: List[int]                 # generated ids (prompt excluded)
  metrics: Dict[str, float]
  text: str = ""                    # the tokens decoded (filled by `kvjax.api.generate`)


# top-level jit tracing, lowering to MLIR and backend compilation (jax records each once per
# compiled program, nested traces excluded), as reported through `jax.monitoring`
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


BACKEND_COMPILE_EVENT = COMPILE_EVENTS[2]


class CompileClock:
  """Seconds jax spends tracing and compiling while the clock is entered (`seconds`), and the
  programs it compiled (`programs`: backend compilations, a persistent-cache hit included; the
  eager operations jax compiles for itself count too), and by program name (`by_program`:
  {"jit(name)": [backend compilations, their seconds]}).

      with CompileClock() as clock:
        ...
      clock.seconds, clock.programs
  """

  def __init__(self):
    self.seconds = 0.0
    self.programs = 0
    self.by_stage = dict.fromkeys(("trace", "lower", "backend"), 0.0)   # seconds of each
    self.cache_hits = 0   # programs the persistent compilation cache gave (`kvjax.compile_cache`)
    self.loaded = 0       # compiled steps loaded whole, untraced (`kvjax.executables`; not programs)
    self.by_program: Dict[str, List[float]] = {}

  def _listen(self, event: str, duration: float, fun_name: str = "?", **_):
    if threading.get_ident() != self._thread:   # a prepared step compiling on a worker thread: the
      return                                    # caller's clock counts the wait (`WAIT_EVENT`)
    if event in COMPILE_EVENTS:
      self.seconds += duration
      if event == BACKEND_COMPILE_EVENT:
        self.programs += 1
        entry = self.by_program.setdefault(str(fun_name), [0, 0.0])
        entry[0] += 1
        entry[1] += duration
      self.by_stage[("trace", "lower", "backend")[COMPILE_EVENTS.index(event)]] += duration
    elif event == executables.WAIT_EVENT:   # a prepared step's compile, counted at its first call
      self.seconds += duration
      self.by_stage["backend"] += duration
      self.programs += 1
      entry = self.by_program.setdefault(f"prepared {fun_name}", [0, 0.0])
      entry[0] += 1
      entry[1] += duration

  def _count(self, event: str, **_):
    self.cache_hits += event == "/jax/compilation_cache/cache_hits"
    self.loaded += event == executables.LOADED_EVENT

  def __enter__(self) -> "CompileClock":
    self._thread = threading.get_ident()
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    jax.monitoring.register_event_listener(self._count)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listen)
    jax.monitoring.unregister_event_listener(self._count)


class SequenceState:
  """One sequence's state: position, recurrent states, and its KV provider."""

  def __init__(self, runner: Runner, kv: KVProvider):
    self.runner, self.kv = runner, kv
    self.pos = 0
    self.rec_states = runner.zero_states()

  def prime(self) -> None:
    """A forward of no valid row at the current position: nothing written, states and position
    kept, but the cache lays out a forward here and uploads what it needs, so that a pool of a new
    phase refills its resident pages now (on an H100 at 128K the first decode forward of the phase
    arena took 0.38-1.65 s refilling them, 10-40x a token) rather than in the next forward."""
    out = self.runner.forward(np.zeros((1,), np.int32), self.pos, 0, self.rec_states, self.kv,
                              logits_rows=np.zeros((1,), np.int64), with_hidden=False,
                              donate=executables.donate_states())
    self.rec_states = out.rec_states   # a forward of no valid row leaves every state as it was

  def forward(self, tokens: Sequence[int], pad_to: Optional[int] = None, all_logits: bool = False,
              with_hidden: bool = False, chunk_rows: Optional[int] = None):
    """Append `tokens`; -> logits of the last row [V] (or of every row [S, V]); with `with_hidden`,
    also the post-norm hidden of the forward's rows (what the MTP head consumes): [S, E], or with
    `chunk_rows` one [chunk_rows, E] a chunk holding a token (`Runner.forward`); rows past
    len(tokens) are padding, not sliced off, so that the shapes do not follow the prompt."""
    n = len(tokens)
    s = pad_to or n
    toks = np.zeros((s,), np.int32)
    toks[:n] = tokens
    rows = np.arange(n) if all_logits else np.array([n - 1])
    out = self.runner.forward(toks, self.pos, n, self.rec_states, self.kv, logits_rows=rows,
                              chunk_rows=chunk_rows, with_hidden=with_hidden, donate=executables.donate_states())
    self.rec_states = out.rec_states
    self.pos += n
    logits = out.logits_rv if all_logits else pick_row(out.logits_rv, 0)   # jitted: not jax's Python indexing
    if not with_hidden:
      return logits
    return logits, (out.hn_chunks if chunk_rows else out.hn_se)


_ON_PREFILL: contextvars.ContextVar = contextvars.ContextVar("kvjax_on_prefill", default=None)


@contextlib.contextmanager
def heap_frozen():
  """Python's garbage collector walks only what the decode makes: the objects alive as the decode
  starts (the model, the compiled programs, what tracing left) move to the permanent generation
  (`gc.freeze`) and back to the oldest one after (`gc.unfreeze`). A full collection in the decode
  otherwise walks the whole heap in one pause between two tokens (200-430 ms measured after a
  prefill on a 2-core CPU). Left alone when the caller froze objects itself or turned the
  collector off."""
  if gc.get_freeze_count() or not gc.isenabled():
    yield
    return
  gc.freeze()
  try:
    yield
  finally:
    gc.unfreeze()


@contextlib.contextmanager
def prefill_progress(callback: Optional[Callable[[int, int], None]]):
  """While entered, `prefill` calls `callback(done_tokens, total_tokens)` at its start (0 done) and
  after each block it has run (waiting for the block's result first); None: no calls."""
  token = _ON_PREFILL.set(callback)
  try:
    yield
  finally:
    _ON_PREFILL.reset(token)


def prefill(seq: SequenceState, prompt: Sequence[int], ubatch: int = 256, with_hidden: bool = False,
            all_logits: bool = False, block: Optional[int] = None):
  """Feed the prompt in micro-batches of `ubatch` rows; -> logits of its last row [V] (with
  `all_logits`, of every row [len(prompt), V]); with `with_hidden`, also the post-norm hidden of
  the prompt's rows as `HiddenRows` (the micro-batches' padded rows and counts: shapes that do not
  follow the prompt).

  `block` (tokens, rounded down to a multiple of `ubatch`; default the cache's `prefill_block`, set
  by `kvjax.api.make_kv` from its budget, else one micro-batch): the micro-batches go in
  forwards of up to `block` tokens, each run group-major (`Runner.forward(chunk_rows=ubatch)`): the
  same programs and bits as one forward a micro-batch, but a streamed layer's history is uploaded
  once a block instead of once a micro-batch, so a long prompt's uploads grow with its length over
  `block` rather than over `ubatch`."""
  if not prompt:
    raise ValueError("empty prompt: at least one token is needed")
  cap = getattr(seq.kv, "max_tokens", None)
  if cap is not None and seq.pos + len(prompt) > cap:
    need = seq.pos + len(prompt)
    raise ValueError(f"context full: {need} tokens needed, cache holds {cap} ({need - cap} more; "
                     f"raise --ctx-size)")
  block = max(ubatch, (block or getattr(seq.kv, "prefill_block", None) or ubatch) // ubatch * ubatch)
  report = _ON_PREFILL.get()
  if report is not None:
    report(0, len(prompt))
  logits, hidden = [], []
  for i in range(0, len(prompt), block):
    part = prompt[i:i + block]
    chunks = -(-len(part) // ubatch)
    out = seq.forward(part, pad_to=chunks * ubatch if len(prompt) > 1 else None, all_logits=all_logits,
                      with_hidden=with_hidden, chunk_rows=ubatch if len(prompt) > 1 and chunks > 1 else None)
    if with_hidden:
      out, hn = out
      hn = hn if isinstance(hn, tuple) else (hn,)
      hidden.extend((h, min(ubatch, len(part) - j * ubatch)) for j, h in enumerate(hn))
    if all_logits:
      logits.append(out)
    else:
      logits = [out]
    if report is not None:   # the block done, not only dispatched
      jax.block_until_ready(out)
      report(min(i + block, len(prompt)), len(prompt))
  logits = jnp.concatenate(logits, axis=0) if all_logits else logits[0]
  return (logits, HiddenRows(tuple(hidden))) if with_hidden else logits


class HiddenRows(NamedTuple):
  """Post-norm hidden rows of a prefill, as its micro-batches made them: (hn_se [S, E], valid rows)
  each, the rows past the valid ones padding."""
  chunks: Tuple[Tuple[jax.Array, int], ...]

  def rows(self) -> jax.Array:
    """Every valid row [n, E] (a concatenation whose shape follows the prompt)."""
    return jnp.concatenate([h[:n] for h, n in self.chunks], axis=0)


@functools.partial(jax.jit, static_argnames=("keepdims",))
def _pick_row(x, i, keepdims=False):
  return jax.lax.dynamic_index_in_dim(x, i, keepdims=keepdims)


def pick_row(x, i: int, keepdims: bool = False):
  """x[i] (x[i:i + 1] with `keepdims`) with i traced: one compiled program for every row."""
  return _pick_row(x, executables.int32_arg(i), keepdims=keepdims)


def mtp_rows(runner: Runner, kv: KVProvider, hn_se, next_tokens: Sequence[int], mtp_pos: int, ubatch: int,
             all_logits: bool = False) -> Tuple[jax.Array, jax.Array]:
  """MTP rows (hn_se[i], next_tokens[i]) at MTP cache positions mtp_pos + i, in micro-batches of up
  to `ubatch` rows (`hn_se` a `HiddenRows`: its micro-batches as they are, padded; or an array
  [n, E]). -> (logits of the last row [V], or with `all_logits` of every row [n, V]; the MTP's own
  hidden of the last row [1, E], what its next draft step feeds back)."""
  n = len(next_tokens)
  if isinstance(hn_se, HiddenRows):
    chunks, offsets = hn_se.chunks, np.cumsum([0] + [m for _, m in hn_se.chunks])
  else:
    offsets = list(range(0, n, ubatch))
    chunks = [(hn_se[i:i + ubatch], min(ubatch, n - i)) for i in offsets]
  logits, last = [], None
  for (h, m), i in zip(chunks, offsets):
    m = min(m, n - i)
    if m <= 0:
      break
    toks = np.zeros((h.shape[0],), np.int32)
    toks[:m] = next_tokens[i:i + m]
    lg, hm = runner.mtp_forward(h, toks, mtp_pos + int(i), m, kv)
    if all_logits:
      logits.append(lg[:m])
    last = (lg, hm, m)
  lg, hm, m = last
  return (jnp.concatenate(logits, axis=0) if all_logits else pick_row(lg, m - 1)), pick_row(hm, m - 1, True)


def teacher_forced_logits(runner: Runner, kv: KVProvider, tokens: Sequence[int], ubatch: int = 256,
                          mtp: bool = False) -> np.ndarray:
  """float32 logits of every row of `tokens` [n, V] (`prefill` with every row kept); with `mtp`,
  the MTP head's logits [n - 1, V]: row t from the target's post-norm hidden at t and token t + 1
  (it predicts token t + 2)."""
  tokens = [int(t) for t in tokens]
  if mtp and len(tokens) < 2:
    raise ValueError(f"MTP logits need at least 2 tokens, got {len(tokens)}")
  logits, hidden = prefill(SequenceState(runner, kv), tokens, ubatch, with_hidden=True, all_logits=True)
  if mtp:
    logits, _ = mtp_rows(runner, kv, hidden.rows()[:-1], tokens[1:], 0, ubatch, all_logits=True)
  return np.asarray(logits, np.float32)


def generation_metrics(kv: KVProvider, n_prompt: int, n_out: int, t0: float, t1: float,
                       t2: float, compile_s: Tuple[float, float] = (0.0, 0.0),
                       compiles: Tuple[int, int, int] = (0, 0, 0),
                       clocks: Tuple[CompileClock, ...] = ()) -> Dict[str, float]:
  """Timing metrics of a generation (prefill t0..t1, decode t1..t2; `compile_s` the seconds of
  each spent tracing and compiling; `compiles` the programs compiled in the prefill, in the decode
  up to its first token, and after it; `clocks` whose seconds by stage are reported:
  compile_trace_ms, compile_lower_ms, compile_backend_ms) plus the provider's counters."""
  n_dec = max(n_out - 1, 0)
  metrics = {
      "prompt_tokens": n_prompt, "decode_tokens": n_out,
      "prompt_ms": (t1 - t0) * 1e3, "predicted_ms": (t2 - t1) * 1e3,
      "prefill_tps": n_prompt / max(t1 - t0, 1e-9),
      "decode_tps": n_dec / max(t2 - t1, 1e-9) if n_dec else 0.0,
      "prompt_compile_ms": compile_s[0] * 1e3, "predicted_compile_ms": compile_s[1] * 1e3,
      "compile_ms": (compile_s[0] + compile_s[1]) * 1e3,
      "prompt_compiles": compiles[0], "first_token_compiles": compiles[1], "predicted_compiles": compiles[2],
      "compiles": sum(compiles),
  }
  for stage in ("trace", "lower", "backend"):
    metrics[f"compile_{stage}_ms"] = sum(c.by_stage[stage] for c in clocks) * 1e3
  metrics["compile_cache_hits"] = sum(c.cache_hits for c in clocks)
  metrics["executables_loaded"] = sum(c.loaded for c in clocks)
  by_program: Dict[str, List[float]] = {}
  for c in clocks:
    for name, (n, sec) in c.by_program.items():
      e = by_program.setdefault(name, [0, 0.0])
      e[0] += n
      e[1] += sec
  # {program: [compilations, backend ms]}, the costliest first
  metrics["compile_by_program"] = {k: [int(n), round(sec * 1e3, 1)] for k, (n, sec) in
                                   sorted(by_program.items(), key=lambda kv_: -kv_[1][1])}
  if hasattr(kv, "metrics"):
    metrics.update(kv.metrics())
  return metrics


def generate(runner: Runner, kv: KVProvider, prompt: Sequence[int], n_predict: int,
             sampling: SamplingParams = SamplingParams(), ubatch: int = 256, eos_id: Optional[int] = None,
             on_token: Optional[Callable[[int], None]] = None,
             on_phase: Optional[Callable[[str], None]] = None,
             on_logits: Optional[Callable[[int, jax.Array], None]] = None) -> GenerationResult:
  """Prefill `prompt`, then decode up to `n_predict` tokens.

  `on_phase("prefill" | "decode")` runs before each phase (the phase arena's
  layout change hooks in here). `on_logits(step, logits_v)` sees the logits row each generated
  token is sampled from (step 0: the prompt's last row), e.g. to compare two caches bit for bit.
  """
  seq = SequenceState(runner, kv)
  with CompileClock() as prefill_clock:
    t0 = time.perf_counter()
    if on_phase:
      on_phase("prefill")
    logits = prefill(seq, list(prompt), ubatch)
    if on_logits:
      on_logits(0, logits)
    tok = sample_token(logits, sampling, 0)
    if on_phase:
      on_phase("decode")
      if getattr(kv, "phase", None) == "decode":   # a new pool: its resident pages before the first token
        seq.prime()
    t1 = time.perf_counter()
  out = []
  first_programs = 0
  with CompileClock() as decode_clock, heap_frozen():
    for step in range(n_predict):
      out.append(tok)
      if on_token:
        on_token(tok)
      if (eos_id is not None and tok == eos_id) or step == n_predict - 1:
        break
      logits = seq.forward([tok])
      if on_logits:
        on_logits(step + 1, logits)
      tok = sample_token(logits, sampling, step + 1)
      if step == 0:
        first_programs = decode_clock.programs
    t2 = time.perf_counter()
  compiles = (prefill_clock.programs, first_programs, decode_clock.programs - first_programs)
  return GenerationResult(out, generation_metrics(kv, len(prompt), len(out), t0, t1, t2,
                                                  (prefill_clock.seconds, decode_clock.seconds), compiles,
                                                  (prefill_clock, decode_clock)))
