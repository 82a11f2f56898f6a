"""Resident pages moved on the device when the split changes, instead of uploaded again.

A new split of the same pool (the adaptive policy's capacities change as the history grows: in a
decode, at page boundaries) moves every layer's resident region: region a starts at the sum of
the capacities before it. The pages a layer keeps (its valid prefix, up to its new capacity) are
already on the device, at `old_base + p`; they go to `new_base + p` in one compiled program
(`move_runs`) that copies them inside the pool, window by window, so the pool's memory is not
doubled and nothing crosses the host link. Before, a rebind invalidated the mirror and every
resident page was uploaded again from the host history (docs/PERFORMANCE.md has the cost).

The runs keep their order in the pool (layer a's region before layer a + 1's, old and new), so
they can move in place: first the runs that move down (destination below source), in ascending
order, then those that move up, in descending order; within a run, windows in the same direction.
No window then reads a page that an earlier window overwrote (`plan_moves`, tested against a
numpy copy with random splits).

`plan_moves(moves, pool_pages, window, n_windows)` -> int32 [M, 5] windows (src, dst, shift, lo,
hi): of the `window` pages at src, rolled down by `shift`, rows [lo, hi) go to the same rows of
the window at dst (both windows inside the pool); M is fixed by the pool and the layer count
(`max_windows`), so `move_runs` compiles once a pool shape. Pure numpy; JAX only in `move_runs`.
"""

from __future__ import annotations

import functools
from typing import List, Sequence, Tuple

import numpy as np

MOVE_WINDOW_BYTES = 8 << 20    # a window's pages: a copy this size runs near the device's bandwidth


def window_pages(page_bytes: int, pool_pages: int) -> int:
  """Pages a window copies: about `MOVE_WINDOW_BYTES`, at most the pool."""
  return max(1, min(int(pool_pages), MOVE_WINDOW_BYTES // max(1, int(page_bytes))))


def max_windows(pool_pages: int, n_runs: int, window: int) -> int:
  """The most windows any set of `n_runs` disjoint runs in a pool of `pool_pages` needs."""
  return -(-int(pool_pages) // int(window)) + int(n_runs)


def plan_moves(moves: Sequence[Tuple[int, int, int]], pool_pages: int, window: int,
               n_windows: int) -> np.ndarray:
  """Windows that move runs `moves` = [(src, dst, pages)] (in pool order: src and dst both
  increasing, runs disjoint) in place -> int32 [n_windows, 5] (src, dst, shift, lo, hi), the
  unused rows inert (lo == hi)."""
  w, p = int(window), int(pool_pages)
  down = [(s, d, n) for s, d, n in moves if n > 0 and d < s]
  up = [(s, d, n) for s, d, n in moves if n > 0 and d > s]
  out: List[Tuple[int, int, int, int, int]] = []

  def window_at(s, d, off, m):
    """The windows that copy run pages [off, off + m) (m <= w): each starts at its page, or
    ends inside the pool where it would pass the pool's end; the source window's rows are rolled
    to the destination window's."""
    s0, d0 = min(s + off, p - w), min(d + off, p - w)
    a, b = s + off - s0, d + off - d0
    return (s0, d0, b - a, b, b + m)

  for s, d, n in down:                          # ascending runs, ascending windows
    for off in range(0, n, w):
      out.append(window_at(s, d, off, min(w, n - off)))
  for s, d, n in reversed(up):                  # descending runs, descending windows
    offs = list(range(0, n, w))
    for off in reversed(offs):
      out.append(window_at(s, d, off, min(w, n - off)))
  if len(out) > n_windows:
    raise ValueError(f"{len(out)} move windows, more than the {n_windows} the program has")
  arr = np.zeros((n_windows, 5), np.int32)
  if out:
    arr[:len(out)] = out
  return arr


def region_moves(old_base: Sequence[int], new_base: Sequence[int], keep: Sequence[int]):
  """[(src, dst, pages)] of every layer's kept resident prefix (in layer order: pool order)."""
  return [(int(o), int(n), int(k)) for o, n, k in zip(old_base, new_base, keep) if k > 0 and o != n]


@functools.lru_cache(maxsize=None)
def _mover(window: int):
  import jax
  import jax.numpy as jnp
  from jax import lax

  @functools.partial(jax.jit, donate_argnames=("pool_pn",))
  def move_runs(pool_pn, windows_m5):
    """pool_pn [P, page_bytes] with the windows' rows copied in order (`plan_moves`)."""
    rows = jnp.arange(window)[:, None]

    def body(i, pool):
      s, d, shift, lo, hi = (windows_m5[i, j] for j in range(5))
      src = jnp.roll(lax.dynamic_slice_in_dim(pool, s, window, 0), shift, axis=0)
      cur = lax.dynamic_slice_in_dim(pool, d, window, 0)
      new = jnp.where((rows >= lo) & (rows < hi), src, cur)
      return lax.dynamic_update_slice_in_dim(pool, new, d, 0)

    return lax.fori_loop(0, windows_m5.shape[0], body, pool_pn)

  return move_runs


def move_runs(pool_pn, windows_m5, window: int):
  """The pool with the planned windows copied (one compiled program a pool shape and window)."""
  return _mover(int(window))(pool_pn, windows_m5)


def keep_prefixes(pool_pn, old_base, new_base, keep, page_bytes: int):
  """The pool with each layer's first `keep` resident pages moved from `old_base` to `new_base`
  (one `move_runs` call, none when nothing moves) -> (pool, pages moved)."""
  moves = region_moves(old_base, new_base, keep)
  if not moves:
    return pool_pn, 0
  import jax
  pool = int(pool_pn.shape[0])
  window = window_pages(page_bytes, pool)
  plan = plan_moves(moves, pool, window, max_windows(pool, len(keep), window))
  return move_runs(pool_pn, jax.device_put(plan, next(iter(pool_pn.devices()))), window), sum(n for _, _, n in moves)


def move_reference(pool: np.ndarray, moves: Sequence[Tuple[int, int, int]]) -> np.ndarray:
  """What `move_runs` must give: each run's pages at their destination, read from the pool as it
  was (numpy; the tests' reference)."""
  out = pool.copy()
  for s, d, n in moves:
    out[d:d + n] = pool[s:s + n]
  return out
