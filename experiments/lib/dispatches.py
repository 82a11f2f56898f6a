"""What the host issues in each phase of a speculative round: compiled-step calls (by step name),
the rollback's replay, `jax.device_put` and `jax.device_get` calls, counted while `kvjax.speculative.PhaseClock` names
the running phase (the CPU can count what a GPU run would dispatch: the counts do not depend on
the device).

    with dispatches.by_phase() as counts:
      speculative.speculate(...)
    counts["verify"]["device_put"]            # uploads issued during the verify phases
"""

from __future__ import annotations

import collections
import contextlib
from typing import Dict, Iterator


@contextlib.contextmanager
def by_phase() -> Iterator[Dict[str, collections.Counter]]:
  """Count while entered: phase name ("between" outside the round's phases) -> Counter of call names."""
  import jax  # pylint: disable=import-outside-toplevel
  from kvjax import executables, speculative  # pylint: disable=import-outside-toplevel
  counts: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  phase = ["between"]
  clock, step = speculative.PhaseClock, executables.StoredStep
  saved = (clock.start, clock.stop, step.__call__, jax.device_put, jax.device_get, speculative._replay)   # pylint: disable=protected-access
  start, stop, call, put, get, replay = saved

  def c_start(self, name):
    ms = start(self, name)
    phase[0] = name
    return ms

  def c_stop(self):
    phase[0] = "between"
    return stop(self)

  def c_call(self, *a, **k):
    counts[phase[0]][getattr(self, "name", "step")] += 1
    return call(self, *a, **k)

  def c_put(*a, **k):
    counts[phase[0]]["device_put"] += 1
    return put(*a, **k)

  def c_get(*a, **k):
    counts[phase[0]]["device_get"] += 1
    return get(*a, **k)

  def c_replay(*a, **k):
    counts[phase[0]]["replay"] += 1
    return replay(*a, **k)

  (clock.start, clock.stop, step.__call__, jax.device_put, jax.device_get,
   speculative._replay) = c_start, c_stop, c_call, c_put, c_get, c_replay   # pylint: disable=protected-access
  try:
    yield counts
  finally:
    (clock.start, clock.stop, step.__call__, jax.device_put, jax.device_get,
     speculative._replay) = saved   # pylint: disable=protected-access
