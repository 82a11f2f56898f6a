"""Compile ahead: every program a generation on a cache can run, before the generation is timed.

A generation compiles a fixed set of programs (the layer steps take page counts, offsets and spans as
traced arrays, and staged pages come in a fixed set of shapes: `kvjax.streaming.staging`), but
not all of them run in a short generation: copy waves start only when a layer's streamed pages
outgrow the ring, and staged pieces of more copy units appear as the history grows. `compile_cache`
compiles those too, with inert arguments (no page placed, no row written), so that once it has
run nothing compiles while a generation runs (counted: `kvjax.generate.CompileClock`, the
`compiles` metrics).

`kvjax.api.generate` runs `compile_cache` as it enters the prefill and the decode (inside the
prefill's timing: it is part of the time to the first token); `kvjax.api.warmup` runs a short generation through the cache (prefill
chunk, decode and, with speculation, verify and MTP forwards), so that a timed generation after it
compiles nothing.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from kvjax.engine import Runner, on_device
from kvjax.streaming import relocate


def _streamed(provider):
  """The streamed provider behind a cache (a phased cache's, in its current phase), or None."""
  from kvjax.streaming.phases import PhasedKV
  from kvjax.streaming.provider import StreamedKV
  if isinstance(provider, PhasedKV):
    provider = provider.kv
  return provider if isinstance(provider, StreamedKV) else None


def compile_cache(runner: Runner, provider, rows: Iterable[Tuple[int, bool, bool]], mtp_lease: bool = False) -> int:
  """Compile, where the cache can stream, the staged-page placements of every staged shape and,
  where it can stream a layer in copy waves (`mtp_lease`: with the MTP layer's ring lease taken),
  the wave programs of every forward shape in `rows` ((rows, chunked, capture) triples) -> the
  number of program calls made (0 when they ran on this provider, in this phase, before). A phased
  cache has a pool of its own in each phase: call it in each."""
  kv = _streamed(provider)
  done = provider.__dict__.setdefault("programs_compiled", set())
  phase = getattr(provider, "phase", None)
  if kv is None or phase in done or not kv.may_stream():
    done.add(phase)
    return 0
  calls = 0
  pool = kv.pool_pn
  pb = kv.layout.page_bytes
  if kv.may_resplit():   # a new split of the same pool moves the resident pages (`relocate`)
    window = relocate.window_pages(kv.layout.page_bytes, int(pool.shape[0]))
    inert = on_device(jnp.zeros((relocate.max_windows(int(pool.shape[0]), kv.n_layers, window), 5), jnp.int32))
    pool = relocate.move_runs(pool, inert, window)
    calls += 1
  for pages, k in kv.staged_shapes():
    pool = runner.place_step(pool, on_device(jnp.zeros((pages, pb), jnp.uint8)),
                             on_device(jnp.zeros((k, 3), jnp.int32)))   # lo == hi: nothing placed
    calls += 1
  if kv.may_wave(mtp_lease):
    table = on_device(jnp.zeros((kv.max_pages,), jnp.int32))
    for s, chunked, capture in rows:
      pool = runner.compile_waves(pool, table, s, chunked, capture, kv=provider)
      calls += 1
  kv.pool_pn = pool
  done.add(phase)
  return calls


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


def short_prompt(max_tokens: int, ubatch: int, n_predict: int) -> list:
  """A prompt that fills one prefill chunk and leaves room for `n_predict` tokens."""
  n = max(1, min(ubatch + 1, max_tokens - n_predict - 1))
  return [int(t) for t in np.arange(n) % 7 + 1]
