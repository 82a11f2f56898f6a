"""Rows kept back from the host (`StreamedKV.defer_rows`): a speculative round's forwards end without
waiting for their rows, which are published once the round knows how many of them it keeps."""

from __future__ import annotations

import time
from typing import Callable, List, NamedTuple, Optional, Tuple

import jax


class Kept(NamedTuple):
  """An ended forward whose rows are kept back: every layer's rows packed on the device [layers, S,
  K + V bytes], the layers, their first position and count, and when the forward began."""
  packed_lsr: jax.Array
  layers: Tuple[int, ...]
  pos: int
  n: int
  t_begin: float

  def rows_below(self, below: Optional[int]) -> int:
    """Its rows before token `below` (None: all)."""
    return self.n if below is None else max(0, min(self.n, below - self.pos))


class KeptRows:
  """The kept-back forwards in the order they ended, and the wall clock of publication: a forward's
  elapsed time runs from its begin to its rows' publication, less what an earlier publication
  already counted (kept-back forwards overlap), so the policy's window sums wall time once."""

  def __init__(self):
    self.on = False
    self.items: List[Kept] = []
    self._t_published = 0.0

  def keep(self, item: Kept) -> bool:
    self.items.append(item)
    return True

  def take(self, cache_of: Callable[[int], str], cache: Optional[str] = None) -> List[Kept]:
    """Remove and return the kept forwards of `cache` (None: all), oldest first."""
    out = [k for k in self.items if cache is None or cache_of(k.layers[0]) == cache]
    self.items = [k for k in self.items if not (cache is None or cache_of(k.layers[0]) == cache)]
    return out

  def elapsed_ms(self, t_begin: float) -> float:
    """Wall time from `t_begin` to now not yet counted; now counts as published."""
    now = time.perf_counter()
    ms = max(0.0, now - max(t_begin, self._t_published)) * 1e3
    self._t_published = now
    return ms
