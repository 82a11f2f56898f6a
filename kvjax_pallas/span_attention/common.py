"""Pieces every span-attention kernel wrapper shares: argument checks, views of the page pool,
Triton compiler parameters and the whole-span call built from a partial.

Shapes as in `reference.py`: q_shd [S, H, D], pool_pn [P, page_bytes] uint8 (or its uint16
halfword view), page_table_t [T] int32.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax

try:  # jax 0.10 / 0.11: the Triton compiler params live here (the Triton backend, deprecated in
  # jax 0.11 with no replacement for these kernels: the Triton span kernel and the combine that
  # every kernel's partials go through; Mosaic GPU has none of its own yet)
  from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover
  _pltriton = None

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import reference as _ref


def check_call(q_shd, pool_pn, layout: PageLayout, num_q_heads: int, block_pages: int,
               layout_check: Callable[[PageLayout, int], None]):
  """Raise ValueError for arguments no kernel takes; `layout_check(layout, head_dim)` is the
  kernel's own check of the page layout (K/V pair, head_dim, page geometry)."""
  _, h, d = q_shd.shape
  g = layout.num_kv_heads
  layout_check(layout, d)
  if h % g:
    raise ValueError(f"{h} query heads are not a multiple of {g} KV heads")
  if h != num_q_heads:
    raise ValueError(f"q has {h} heads but num_q_heads={num_q_heads}")
  if block_pages < 1:
    raise ValueError(f"block_pages must be >= 1, got {block_pages}")
  if pool_pn.dtype == jnp.uint16:  # a halfword view of the pool (no bitcast in the call)
    if pool_pn.ndim != 2 or pool_pn.shape[1] * 2 != layout.page_bytes:
      raise ValueError(f"uint16 pool must be [pages, {layout.page_bytes // 2}], got "
                       f"{pool_pn.shape}")
  elif pool_pn.dtype != jnp.uint8 or pool_pn.ndim != 2 or pool_pn.shape[1] != layout.page_bytes:
    raise ValueError(f"pool must be uint8 [pages, {layout.page_bytes}] (or its uint16 view), "
                     f"got {pool_pn.dtype} {pool_pn.shape}")


def halfword_view(pool_pn):
  """uint8 [P, page_bytes] -> uint16 [P, page_bytes // 2] (little-endian halfwords).

  XLA may materialise this as a copy of the pool; callers that keep a pool for
  many calls can convert it once and pass the uint16 view instead.
  """
  p, nbytes = pool_pn.shape
  return lax.bitcast_convert_type(pool_pn.reshape(p, nbytes // 2, 2), jnp.uint16)


def byte_view(pool):
  """uint8 [P, page_bytes] (as is) or uint16 [P, page_bytes // 2] -> uint8 [P, page_bytes]."""
  if pool.dtype == jnp.uint8:
    return pool
  p, nhw = pool.shape
  return lax.bitcast_convert_type(pool, jnp.uint8).reshape(p, 2 * nhw)


def triton_params(num_warps: int, num_stages: int, interpret: bool):
  """Compiler parameters of a Pallas Triton call (None in interpret mode)."""
  if interpret or _pltriton is None:
    return None
  return _pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def whole_span(partial: Callable[..., _ref.Carry], q_shd, pool_pn, page_table_t, kv_len, q_pos_s,
               **kw):
  """o_shd [S, H, D] float32: `partial` (a kernel's `span_attention_partial_*`) over every
  logical page of the table from the empty carry (carry=None), then `reference.finalize`."""
  h = q_shd.shape[1]
  carry = partial(q_shd, pool_pn, page_table_t, jnp.asarray(kv_len, jnp.int32), q_pos_s, None,
                  jnp.int32(0), jnp.int32(page_table_t.shape[0]), num_q_heads=h, **kw)
  return _ref.finalize(carry, h)
