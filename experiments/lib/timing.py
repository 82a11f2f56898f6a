"""Wall-clock timing of device work for the benchmark scripts."""

import time


def median_ms(fn, reps: int) -> float:
  """Median milliseconds of `fn()` run to completion (`jax.block_until_ready` on what it returns),
  after one untimed call (compilation, first transfers)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(fn())
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t)
  return 1e3 * float(np.median(ts))
