"""Pieces every span-attention kernel wrapper shares: argument checks, views of the page pool,
Triton compiler parameters and the whole-span call built from a partial.

Shapes as in `reference.py`: q_shd [S, H, D], pool_pn [P, page_bytes] uint8 (or its uint16
halfword view), page_table_t [T] int32.
"""

from __future__ import annotations

from typing import Callable, Optional

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


def check_operands(q_shd, pool_pn, layout: PageLayout, num_q_heads: Optional[int] = None,
                   page_table_t=None, q_pos_s=None):
  """Raise ValueError for operands no implementation takes (the reference's too): q [S, H, D]
  with D the layout's head_dim and H a multiple of its KV heads, the pool's bytes, an integer 1-D
  page table, one position a query row."""
  if len(q_shd.shape) != 3:
    raise ValueError(f"q must be [rows, heads, head_dim], got shape {tuple(q_shd.shape)}")
  s, h, d = q_shd.shape
  g = layout.num_kv_heads
  if d != layout.head_dim:
    raise ValueError(f"query head_dim {d} != layout head_dim {layout.head_dim}")
  if h % g:
    raise ValueError(f"{h} query heads are not a multiple of {g} KV heads")
  if num_q_heads is not None and h != num_q_heads:
    raise ValueError(f"q has {h} heads but num_q_heads={num_q_heads}")
  if page_table_t is not None and (len(page_table_t.shape) != 1 or not jnp.issubdtype(page_table_t.dtype, jnp.integer)):
    raise ValueError(f"page table must be integer [logical pages], got {page_table_t.dtype} {tuple(page_table_t.shape)}")
  if q_pos_s is not None and tuple(q_pos_s.shape) != (s,):
    raise ValueError(f"q_pos must be [{s}] (one position a query row), got shape {tuple(q_pos_s.shape)}")
  if pool_pn.dtype == jnp.uint16:  # a halfword view of the pool (no bitcast in the call)
    if pool_pn.ndim != 2 or pool_pn.shape[1] * 2 != layout.page_bytes:
      raise ValueError(f"uint16 pool must be [pages, {layout.page_bytes // 2}], got "
                       f"{pool_pn.shape}")
  elif pool_pn.dtype != jnp.uint8 or pool_pn.ndim != 2 or pool_pn.shape[1] != layout.page_bytes:
    raise ValueError(f"pool must be uint8 [pages, {layout.page_bytes}] (or its uint16 view), "
                     f"got {pool_pn.dtype} {pool_pn.shape}")


def check_call(q_shd, pool_pn, layout: PageLayout, num_q_heads: int, block_pages: int,
               layout_check: Callable[[PageLayout, int], None]):
  """Raise ValueError for arguments no kernel takes; `layout_check(layout, head_dim)` is the
  kernel's own check of the page layout (K/V pair, head_dim, page geometry)."""
  layout_check(layout, q_shd.shape[-1])
  check_operands(q_shd, pool_pn, layout, num_q_heads)
  if block_pages < 1:
    raise ValueError(f"block_pages must be >= 1, got {block_pages}")


def pages_from_kv(k_tgd, v_tgd, layout: PageLayout):
  """K and V of a history, float [T, KV heads, head_dim] each -> uint8 [pages, page_bytes]: the
  rows encoded as the layout's K / V types (`ggml_codec`), page i holding tokens i*page_tokens..
  (a last page past T zero-filled): a pool for `span_attention` with the page table
  arange(pages)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from kvjax_pallas import ggml_codec  # pylint: disable=import-outside-toplevel
  t, g, d = k_tgd.shape
  if tuple(v_tgd.shape) != (t, g, d) or (g, d) != (layout.num_kv_heads, layout.head_dim):
    raise ValueError(f"k and v must both be [tokens, {layout.num_kv_heads}, {layout.head_dim}], got "
                     f"{tuple(k_tgd.shape)} and {tuple(v_tgd.shape)}")
  n, pt = layout.pages_for(t), layout.page_tokens
  pad = [(0, n * pt - t), (0, 0), (0, 0)]
  k_rows = np.asarray(ggml_codec.encode_rows(jnp.pad(jnp.asarray(k_tgd, jnp.float32), pad), layout.k_type))
  v_rows = np.asarray(ggml_codec.encode_rows(jnp.pad(jnp.asarray(v_tgd, jnp.float32), pad), layout.v_type))
  pages = np.zeros((n, layout.page_bytes), np.uint8)
  pages[:, :layout.k_plane_bytes] = k_rows.reshape(n, -1)
  pages[:, layout.v_offset:layout.v_offset + layout.v_plane_bytes] = v_rows.reshape(n, -1)
  return jnp.asarray(pages)


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
