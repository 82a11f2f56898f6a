"""Staged copy units placed into a layer's device pool: pure jnp over the donated pool, traced page ranges, so one
compiled step places any range wherever the ring puts it (`kvjax.engine.place_staged` calls it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def place_rows(pool_pn, rows_rn, base, lo, hi):
  """pool[base + j] = rows[j] for lo <= j < hi; every other pool row unchanged.

  `base`, `lo`, `hi` are traced int32 scalars, so one compiled step places any page range of a staged copy unit
  (`rows_rn [c, page_bytes]`) wherever the ring puts it. A window of min(c, pool pages) rows that covers the
  destination is read, the staged rows selected into it, and the window written back in place (the pool is donated
  to the step that calls this). Requires 0 <= base + lo and base + hi <= pool pages (hi - lo <= c)."""
  n_pool, c = pool_pn.shape[0], rows_rn.shape[0]
  w = min(c, n_pool)
  start = jnp.clip(base + lo, 0, n_pool - w)
  j_w = start + jnp.arange(w, dtype=jnp.int32) - base          # staged row for window row i
  take_w = (j_w >= lo) & (j_w < hi)
  src_wn = rows_rn[jnp.clip(j_w, 0, c - 1)]
  window_wn = jax.lax.dynamic_slice(pool_pn, (start, 0), (w, pool_pn.shape[1]))
  return jax.lax.dynamic_update_slice(pool_pn, jnp.where(take_w[:, None], src_wn, window_wn),
                                      (start, 0))


def place_pages(pool_pn, stage, pieces_sk3):
  """Place staged copy units into the pool: `stage[i]` is a `[c_i, page_bytes]` array and `pieces_sk3[i, k] = (base, lo,
  hi)` one contiguous destination run of its rows (see `place_rows`; an empty run has lo == hi). No stage, no change."""
  for i, rows_rn in enumerate(stage):
    for k in range(pieces_sk3.shape[1]):
      base, lo, hi = pieces_sk3[i, k, 0], pieces_sk3[i, k, 1], pieces_sk3[i, k, 2]
      pool_pn = place_rows(pool_pn, rows_rn, base, lo, hi)
  return pool_pn
