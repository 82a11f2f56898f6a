"""Compile ahead: every program a generation on a cache can run, before the generation is timed.

A generation compiles a fixed set of programs (the layer steps take page counts, offsets and spans as
traced arrays, and staged pages come in a fixed set of shapes: `kvjax.streaming.staging`), but
not all of them run in a short generation: copy waves start only when a layer's streamed pages
outgrow the ring, and staged pieces of more copy units appear as the history grows. `compile_cache`
compiles those too, with inert arguments (no page placed, no row written), so that once it has
run nothing compiles while a generation runs (counted: `kvjax.generate.CompileClock`, the
`compiles` metrics).

`kvjax.api.generate` runs `compile_cache` as it enters the prefill and the decode (inside the
prefill's timing: it is part of the time to the first token); `kvjax.api.warmup` runs short generations through the cache (prefill
chunk, decode and, with speculation, verify and MTP forwards), so that a timed generation after it
compiles nothing.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from kvjax.engine import Runner, default_device, zeros_on_device
from kvjax.streaming import relocate


def _streamed(provider):
  """The streamed provider behind a cache (a phased cache's, in its current phase), or None."""
  from kvjax.streaming.phases import PhasedKV
  from kvjax.streaming.provider import StreamedKV
  if isinstance(provider, PhasedKV):
    provider = provider.kv
  return provider if isinstance(provider, StreamedKV) else None


def compile_cache(runner: Runner, provider, rows: Iterable[Tuple[int, bool, bool]], mtp_lease: bool = False,
                  inert_rows: Optional[Iterable[Tuple[int, bool, bool]]] = None) -> int:
  """Compile, where the cache can stream, the staged-page placements of every staged shape and,
  where it can stream a layer in copy waves (`mtp_lease`: with the MTP layer's ring lease taken),
  the wave programs of every forward shape in `rows` ((rows, chunked, capture) triples), and run
  the forwards `inert_rows` (default `rows`) once each with inert arguments -> the number of
  program calls made (0 when they ran on this provider, in this phase, before). A phased cache has
  a pool of its own in each phase: call it in each. `kvjax.api.generate` calls it as each phase
  starts, with that phase's forwards as `inert_rows` (the decode's run once the prefill is over,
  their programs compiling behind it: `prepare`)."""
  kv = _streamed(provider)
  done = provider.__dict__.setdefault("programs_compiled", set())
  ran = provider.__dict__.setdefault("forwards_run", set())
  phase = getattr(provider, "phase", None)
  rows = tuple(rows)
  inert = [r for r in dict.fromkeys(rows if inert_rows is None else inert_rows) if (phase, r) not in ran]
  calls = _run_forwards(runner, provider, kv, inert)
  ran.update((phase, r) for r in inert)
  if phase in done:
    return calls
  if kv is None or not kv.may_stream():
    done.add(phase)
    return calls
  pool = kv.pool_pn
  pb = kv.layout.page_bytes
  if kv.may_resplit():   # a new split of the same pool moves the resident pages (`relocate`)
    window = relocate.window_pages(kv.layout.page_bytes, int(pool.shape[0]))
    inert = zeros_on_device((relocate.max_windows(int(pool.shape[0]), kv.n_layers, window), 5), np.int32)
    pool = relocate.move_runs(pool, inert, window)
    calls += 1
  for pages, k in kv.staged_shapes():
    pool = runner.place_step(pool, zeros_on_device((pages, pb), np.uint8),
                             zeros_on_device((k, 3), np.int32))   # lo == hi: nothing placed
    calls += 1
  if kv.may_wave(mtp_lease):
    table = zeros_on_device((kv.max_pages,), np.int32)
    for s, chunked, capture in rows:
      pool = _compile_waves(runner, pool, table, s, chunked, capture, kv=provider)
      calls += 1
  kv.pool_pn = pool
  done.add(phase)
  return calls


def _compile_waves(runner: Runner, pool_pn, table_t, rows: int, chunked: bool, capture: bool = False, kv=None):
  """The copy-wave programs of a forward of `rows` rows on `kv` (`Runner._waves`: the group up to
  its attention, a wave (one program for all: the first folds into the empty carry), the rest) run
  with inert arguments: no valid row, nothing written to the pool. -> the pool (donated through)."""
  k = next((g for g, a in enumerate(runner.attn_index) if a is not None), None)
  if k is None:
    return pool_pn
  gdef, gstate = runner.groups[k]
  x = zeros_on_device((rows, runner.cfg.hidden_size), runner.token_embd.dtype)
  zero = jnp.int32(0)
  x_in, _, q, gate, kv_rows, carry = runner.group_attn_begin(gdef, gstate, x, runner.zero_states()[k], zero, zero,
                                                             layout=runner.layout, chunked=chunked, capture=capture)
  pool_pn, carry = runner.wave_step(pool_pn, table_t, kv_rows, q, carry, zero, zero, zero, zero,
                                    layout=runner.layout, opts=runner.call_opts(rows, kv))
  runner.group_attn_end(gdef, gstate, x_in, carry, gate)
  return pool_pn


def _run_forwards(runner: Runner, provider, kv, rows) -> int:
  """The forwards `rows` once each with inert arguments (`Runner.run_inert`: their programs
  compiled or loaded, and their kernels on the device, before the phase's first forward) -> calls."""
  if kv is not None:
    table = zeros_on_device((kv.max_pages,), np.int32)
    for s, chunked, capture in rows:
      kv.pool_pn = runner.run_inert(kv.pool_pn, table, s, chunked, capture, kv=provider)
      if not chunked:      # a decode or verify forward's rows leave packed
        kv.pack_inert(s)
  elif hasattr(provider, "tables_lt"):     # the plain cache
    for s, chunked, capture in rows:
      provider.pool_pn = runner.run_inert(provider.pool_pn, provider.tables_lt[0], s, chunked, capture, kv=provider)
  else:
    return 0
  return len(rows)


def forward_shapes(ubatch: int, verify_rows: int = 1, phase: Optional[str] = None,
                   verify_capture=True) -> Tuple[Tuple[int, bool, bool], ...]:
  """(rows, chunked, capture) of the forwards a generation runs: prefill chunks, decode and, with
  speculation, the verify forward (scan form, `verify_capture`: the rollback's capture); those of
  one `phase` of a phased cache ("prefill": the chunks; "decode": the rest), whose pool has a shape
  of its own."""
  prefill = [(int(ubatch), ubatch > 1, False)]
  decode = [(1, False, False)] + ([(int(verify_rows), False, verify_capture)] if verify_rows > 1 else [])
  out = prefill if phase == "prefill" else decode if phase == "decode" else prefill + decode
  return tuple(dict.fromkeys(out))


def short_prompts(max_tokens: int, ubatch: int, n_predict: int) -> list:
  """Prompts whose prefill runs each form a generation's can: one of `ubatch` tokens (a forward of
  one micro-batch, whose rows leave packed: `staging.pack_rows`) and one of `ubatch` + 1 (a block
  of two, group-major), each leaving room for `n_predict` tokens (fewer where the cache is short)."""
  room = max(1, max_tokens - n_predict - 1)
  return [[int(t) for t in np.arange(n) % 7 + 1] for n in dict.fromkeys((min(ubatch, room), min(ubatch + 1, room)))]


def _spec(shape, dtype):
  """An argument's shape for preparing a step, placed as the runner's arrays are (`on_device`)."""
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=SingleDeviceSharding(default_device()))


def _pools(provider):
  """(phase, pool shape, table length) of every phase a generation on `provider` runs (phase None:
  one pool for all)."""
  if hasattr(provider, "pool_pages") and hasattr(provider, "kv"):     # a phased cache: a pool a phase
    kv = provider.kv
    return [(p, (pages, kv.layout.page_bytes), kv.max_pages) for p, pages in provider.pool_pages.items()]
  kv = _streamed(provider)
  if kv is not None:
    return [(None, tuple(kv.pool_pn.shape), kv.max_pages)]
  return [(None, tuple(provider.pool_pn.shape), int(provider.pages_per_layer))]


def prepare(runner: Runner, provider, ubatch: int, verify_rows: int = 1, verify_capture=True,
            mtp_lease: bool = False) -> int:
  """Make ready, without running them, the steps of a generation's forwards (`forward_shapes`) on
  `provider`'s pool of each phase (`kvjax.executables.StoredStep.prepare`): each loaded from the
  store, or lowered here and compiled on worker threads, side by side, while the caller goes on (a
  call waits for its own). `kvjax.api.generate` prepares the prefill's and the decode's programs as
  it enters the prefill: the decode's compile runs behind the prefill.
  -> the number of steps prepared (0 with the store off: the calls compile as they come)."""
  from kvjax import executables
  if not executables.ahead() or not hasattr(runner.group_step, "prepare"):   # a mesh's steps: plain jit
    return 0
  states = jax.eval_shape(runner.zero_states)
  kv = _streamed(provider)
  waves = kv is not None and kv.may_wave(mtp_lease)
  staged = list(kv.staged_shapes()) if kv is not None and kv.may_stream() else []
  groups = runner.distinct_groups()
  n, first = 0, None
  for phase, pool_shape, table_pages in _pools(provider):   # in the order the generation calls them
    pool, table = _spec(pool_shape, jnp.uint8), _spec((table_pages,), jnp.int32)
    for i, (s, chunked, capture) in enumerate(forward_shapes(ubatch, verify_rows, phase, verify_capture)):
      # the first forward shape's steps (with the placements) compile first, the others after them
      with executables.stage(after=first or ()) as started:
        if i == 0:
          for pages, k in staged:
            runner.place_step.prepare(pool, _spec((pages, kv.layout.page_bytes), jnp.uint8),
                                      _spec((k, 3), jnp.int32))
            n += 1
        n += _prepare_forward(runner, provider, groups, states, pool, table, s, chunked, capture, waves)
      first = tuple(started) if first is None else first
  return n


def _prepare_forward(runner, provider, groups, states, pool, table, s, chunked, capture, waves) -> int:
  """`prepare`'s steps of one forward shape on one pool -> how many."""
  cfg, n = runner.cfg, 0
  scalar = _spec((), jnp.int32)
  opts = runner.call_opts(s, provider)
  x = _spec((s, cfg.hidden_size), runner.token_embd.dtype)
  for g, structure, leaves, a in groups:
    if waves and a is not None:
      x_in, _, q, gate, kv_rows, carry = runner.group_attn_begin.prepare(
          structure, leaves, x, states[g], scalar, scalar, layout=runner.layout, chunked=chunked, capture=capture)
      runner.wave_step.prepare(pool, table, kv_rows, q, carry, scalar, scalar, scalar, scalar,
                               layout=runner.layout, opts=opts)
      runner.group_attn_end.prepare(structure, leaves, x_in, carry, gate)
      n += 3
  from kvjax import executables
  step = runner.step_for(executables.donate_states(), capture)   # as `SequenceState.forward` runs them
  for g, structure, leaves, a in groups:
    step.prepare(structure, leaves, x, states[g], pool if a is not None else None, table if a is not None else None,
                 scalar, scalar, layout=runner.layout, opts=opts, chunked=chunked, capture=capture)
    n += 1
  runner.prepare_ends(_spec((s,), jnp.int32), x, _spec((1,), jnp.int32))
  return n + 3
