"""Injected host-to-device copy failures, and a runner that retries the failed forward.

    with copy_faults(every=37) as faults:           # every 37th copy raises CopyFault
      runner = RetryingRunner(model.runner)          # forward / mtp_forward retried on CopyFault
      ...
    print(faults.injected, runner.retries)

The copies are `kvjax.streaming.staging.to_device` (every upload of a streamed cache); a retry
calls the same forward again with the same arguments on the same provider, which must then give
the same result (nothing of the failed forward is kept: `StreamedKV.begin_forward`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from kvjax.streaming import staging as staging_lib


class CopyFault(RuntimeError):
  """An injected failure of a host-to-device copy."""


class FaultCounter:
  def __init__(self, fail: Callable[[int], bool]):
    self.fail, self.calls, self.injected = fail, 0, 0


@contextlib.contextmanager
def copy_faults(every: Optional[int] = None, fail: Optional[Callable[[int], bool]] = None
                ) -> Iterator[FaultCounter]:
  """Make copies raise `CopyFault`: the copy numbered n (1, 2, ...) where `fail(n)`, or with
  `every`, each copy that follows `every` - 1 successful ones (so a retried forward of fewer than
  `every` copies completes)."""
  counter = FaultCounter(fail or (lambda n: False))
  real = staging_lib.to_device
  since = [0]

  def flaky(src):
    counter.calls += 1
    since[0] += 1
    if (every and since[0] >= every) or counter.fail(counter.calls):
      since[0] = 0
      counter.injected += 1
      raise CopyFault(f"injected failure of copy {counter.calls}")
    return real(src)

  staging_lib.to_device = flaky
  try:
    yield counter
  finally:
    staging_lib.to_device = real


class RetryingRunner:
  """`engine.Runner` whose `forward` / `mtp_forward` are retried after a `CopyFault` (at most
  `max_retries` times in a row); everything else is the runner's."""

  def __init__(self, runner, max_retries: int = 8):
    self._runner, self.max_retries, self.retries = runner, max_retries, 0

  def __getattr__(self, name):
    return getattr(self._runner, name)

  def _retry(self, fn, *a, **k):
    for attempt in range(self.max_retries + 1):
      try:
        return fn(*a, **k)
      except CopyFault:
        if attempt == self.max_retries:
          raise
        self.retries += 1
    raise AssertionError("unreachable")

  def forward(self, *a, **k):
    return self._retry(self._runner.forward, *a, **k)

  def mtp_forward(self, *a, **k):
    return self._retry(self._runner.mtp_forward, *a, **k)
