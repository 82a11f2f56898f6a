"""Shared by the read-ceiling probes (`probe_page_reads.py`, `probe_tma_reads.py`): the page
geometry flags and the timing of queued calls."""

import time

import numpy as np
from absl import flags

from kvjax_pallas.page_layout import PageLayout


def define_flags():
  """Page geometry (Q8_0 K / Q4_0 V pages) and timing flags of a probe."""
  flags.DEFINE_integer("kv_heads", 4, "KV heads")
  flags.DEFINE_integer("head_dim", 256, "head dim")
  flags.DEFINE_integer("page_tokens", 256, "tokens per page")
  flags.DEFINE_integer("dispatch_iters", 50, "dependent calls a round")
  flags.DEFINE_integer("rounds", 5, "rounds (median)")


def layout_from_flags() -> PageLayout:
  f = flags.FLAGS
  return PageLayout(f.kv_heads, f.head_dim, "q8_0", "q4_0", f.page_tokens)


def contexts(layout: PageLayout):
  """Print the run's header; yield (context tokens, pages, physical pages, bytes a call reads)
  of each `--contexts` entry. The pool has 8 pages more than the history, so a random page
  table is a permutation that skips some."""
  import jax  # pylint: disable=import-outside-toplevel
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}; {layout.describe()}", flush=True)
  for ctx in (int(c) for c in flags.FLAGS.contexts):
    n_pages = ctx // layout.page_tokens
    yield ctx, n_pages, n_pages + 8, ctx * layout.token_bytes


def time_calls(fn, iters: int, rounds: int) -> float:
  """Median seconds a call of `fn()` (no arguments), `iters` calls queued a round, after one
  warm-up call (compile)."""
  fn().block_until_ready()
  ts = []
  for _ in range(rounds):
    t = time.perf_counter()
    outs = [fn() for _ in range(iters)]
    outs[-1].block_until_ready()
    ts.append((time.perf_counter() - t) / iters)
  return float(np.median(ts))
