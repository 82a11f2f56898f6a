"""kvjax.streaming.relocate: resident prefixes moved inside the pool when the split changes."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.streaming import relocate


def _random_split(rng, layers, pool):
  """Capacities of `layers` regions inside `pool` pages (some zero), in layer order."""
  cuts = np.sort(rng.integers(0, pool + 1, layers))
  caps = np.diff(np.concatenate([[0], cuts]))
  return caps


def _case(rng, layers, pool, window):
  old, new = _random_split(rng, layers, pool), _random_split(rng, layers, pool)
  valid = np.array([rng.integers(0, c + 1) for c in old])
  old_base = np.concatenate([[0], np.cumsum(old)[:-1]])
  new_base = np.concatenate([[0], np.cumsum(new)[:-1]])
  keep = np.minimum(valid, new)
  moves = relocate.region_moves(old_base, new_base, keep)
  windows = relocate.plan_moves(moves, pool, window, relocate.max_windows(pool, layers, window))
  return moves, windows


@pytest.mark.parametrize("seed", range(6))
def test_moves_in_place_equal_a_copy_from_the_old_pool(seed):
  """Random old and new splits of a pool (regions grow, shrink, vanish), windows smaller and
  larger than the runs: every kept page is at its new place with its old bytes, in one program
  of fixed shape."""
  rng = np.random.default_rng(seed)
  layers, pool, window = int(rng.integers(2, 9)), int(rng.integers(8, 80)), int(rng.integers(1, 9))
  page_bytes = 12
  for _ in range(4):
    moves, windows = _case(rng, layers, pool, window)
    pool_pn = rng.integers(0, 256, (pool, page_bytes), dtype=np.uint8)
    want = relocate.move_reference(pool_pn, moves)
    got = np.asarray(relocate.move_runs(jnp.asarray(pool_pn), jnp.asarray(windows), window))
    for s, d, n in moves:
      np.testing.assert_array_equal(got[d:d + n], want[d:d + n], err_msg=f"run {(s, d, n)} of {moves}")
    untouched = np.ones((pool,), bool)
    for _, d, n in moves:
      untouched[d:d + n] = False
    # pages that are no destination keep their bytes or hold a moved page's (never garbage)
    assert all(any((got[i] == pool_pn[j]).all() for j in range(pool)) for i in np.flatnonzero(untouched))


def test_a_window_that_would_pass_the_pool_end_is_shifted_and_rolled():
  """A run near the pool's end moved far down: its windows start inside the pool and the source
  rows are rolled onto the destination's (the case a plain aligned window gets wrong)."""
  pool, window = 20, 8
  moves = [(15, 0, 5)]
  windows = relocate.plan_moves(moves, pool, window, relocate.max_windows(pool, 1, window))
  assert windows[0].tolist() == [12, 0, -3, 0, 5]
  pool_pn = np.arange(pool * 4, dtype=np.uint8).reshape(pool, 4)
  got = np.asarray(relocate.move_runs(jnp.asarray(pool_pn), jnp.asarray(windows), window))
  np.testing.assert_array_equal(got[0:5], pool_pn[15:20])
  np.testing.assert_array_equal(got[5:], pool_pn[5:])


def test_more_windows_than_the_program_holds_is_refused():
  with pytest.raises(ValueError, match="3 move windows, more than the 2"):
    relocate.plan_moves([(10, 0, 3)], 20, 1, 2)
