"""Span attention over paged KV: the plain-jnp reference.

The attention history of one layer is a sequence of logical pages (tiles of
`layout.page_tokens` tokens). `page_table_t[i]` names the physical page of the
pool holding logical page `i` — a resident page or a ring slot; the reference
(and the kernels) never care which. Tiles are visited in logical order with
one online softmax and normalised once at the end, so the result depends only
on the logical token order, never on physical placement.

Shapes (suffix letters as in docs/DESIGN.md):
  q_shd        [S, H, D]  float32, after q-norm and RoPE, not yet scaled
  pool_pn      [P, page_bytes] uint8 (layout: kvjax_pallas.page_layout)
  page_table_t [T] int32  logical page -> physical page (entries past the
                          active pages are ignored)
  kv_len       ()  int32  active tokens (history + new rows already written)
  q_pos_s      [S] int32  absolute position of each query row (causal mask:
                          key position <= q position)
  carry        (m_gm [G, S*R], l_gm [G, S*R], acc_gmd [G, S*R, D]) float32,
               rows folded as (token, head-within-group) — the 6 query heads
               sharing a KV head of the 27B become 6 rows per token.

`block_pages` is the logical partition: how many pages one online-softmax step
consumes. Calls that split the history into waves give bit-identical results
to one call when every wave boundary is a multiple of `block_pages` pages.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from kvjax_pallas import ggml_codec
from kvjax_pallas.page_layout import PageLayout

_HI = lax.Precision.HIGHEST


class Carry(NamedTuple):
  m_gm: jax.Array     # running max of scaled scores
  l_gm: jax.Array     # running softmax denominator
  acc_gmd: jax.Array  # running un-normalised output


def init_carry(num_kv_heads: int, rows: int, head_dim: int) -> Carry:
  return Carry(jnp.full((num_kv_heads, rows), -jnp.inf, jnp.float32),
               jnp.zeros((num_kv_heads, rows), jnp.float32),
               jnp.zeros((num_kv_heads, rows, head_dim), jnp.float32))


def merge_partials(carry, part, acc_transposed: bool = False):
  """Fold one partition's un-normalised (m, l, acc) into the running (m, l, acc).

  The one merge rule of every implementation (kernel bodies and jnp): rows
  broadcast over acc's last axis (acc_transposed: acc is [..., columns, rows] and the rows
  broadcast over its second-to-last axis: the same operations); an empty part
  (m=-inf, l=0, acc=0) is an exact no-op, and so is an empty carry folded into by the first part.
  """
  m_c, l_c, a_c = carry
  m_p, l_p, a_p = part
  m_new = jnp.maximum(m_c, m_p)
  m_use = jnp.where(m_new > -jnp.inf, m_new, 0.0)
  al_c = jnp.exp(m_c - m_use)
  al_p = jnp.exp(m_p - m_use)
  rows = (lambda x: x[..., None, :]) if acc_transposed else (lambda x: x[..., None])
  return m_new, l_c * al_c + l_p * al_p, a_c * rows(al_c) + a_p * rows(al_p)


def fold_query(q_shd, num_kv_heads: int):
  """[S, H, D] -> [G, S*R, D] (query heads of one KV head folded into rows)."""
  s, h, d = q_shd.shape
  r = h // num_kv_heads
  return q_shd.reshape(s, num_kv_heads, r, d).transpose(1, 0, 2, 3).reshape(num_kv_heads, s * r, d)


def unfold_output(o_gmd, num_q_heads: int):
  """[G, S*R, D] -> [S, H, D]."""
  g, m, d = o_gmd.shape
  r = num_q_heads // g
  return o_gmd.reshape(g, m // r, r, d).transpose(1, 0, 2, 3).reshape(m // r, num_q_heads, d)


def decode_page_kv(page_n, layout: PageLayout):
  """One page's bytes -> (k_tgd, v_tgd) float32 [page_tokens, G, D]."""
  t, g = layout.page_tokens, layout.num_kv_heads
  k_bytes = page_n[:layout.k_plane_bytes].reshape(t, layout.k_row_bytes)
  v_bytes = page_n[layout.v_offset:layout.v_offset + layout.v_plane_bytes].reshape(t, layout.v_row_bytes)
  k_tgd = ggml_codec.decode_rows(k_bytes, layout.k_type, g)
  v_tgd = ggml_codec.decode_rows(v_bytes, layout.v_type, g)
  return k_tgd, v_tgd


def finalize(carry: Carry, num_q_heads: int):
  """Final normalisation: carry -> o_shd [S, H, D] float32 (0 for rows that saw no key)."""
  l = carry.l_gm[..., None]
  o_gmd = jnp.where(l > 0, carry.acc_gmd / jnp.where(l > 0, l, 1.0), 0.0)
  return unfold_output(o_gmd, num_q_heads)


def _block_step(carry: Carry, qf_gmd, k_tgd, v_tgd, key_pos_t, kv_len, q_pos_m, sm_scale):
  s_gmt = jnp.einsum("gmd,tgd->gmt", qf_gmd, k_tgd, precision=_HI) * sm_scale
  mask_mt = (key_pos_t[None, :] < kv_len) & (key_pos_t[None, :] <= q_pos_m[:, None])
  s_gmt = jnp.where(mask_mt[None], s_gmt, -jnp.inf)
  m_new = jnp.maximum(carry.m_gm, jnp.max(s_gmt, axis=-1))
  m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  p_gmt = jnp.exp(s_gmt - m_use[..., None])
  alpha = jnp.exp(carry.m_gm - m_use)
  l_new = carry.l_gm * alpha + jnp.sum(p_gmt, axis=-1)
  acc_new = carry.acc_gmd * alpha[..., None] + jnp.einsum("gmt,tgd->gmd", p_gmt, v_tgd, precision=_HI)
  return Carry(m_new, l_new, acc_new)


@functools.partial(jax.jit, static_argnames=("layout", "num_q_heads", "block_pages", "sm_scale"))
def span_attention_partial_reference(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry: Carry,
                                     tile_begin, tile_end, *, layout: PageLayout, num_q_heads: int,
                                     block_pages: int = 1, sm_scale: Optional[float] = None) -> Carry:
  """Fold logical pages [tile_begin, tile_end) into `carry` (online softmax, logical order).

  `tile_begin` must be a multiple of `block_pages`; `tile_end` is clipped to
  the active pages `ceil(kv_len / page_tokens)`.
  """
  g, d, pt = layout.num_kv_heads, q_shd.shape[-1], layout.page_tokens
  r = num_q_heads // g
  scale = (1.0 / d ** 0.5) if sm_scale is None else sm_scale
  qf_gmd = fold_query(q_shd.astype(jnp.float32), g)
  q_pos_m = jnp.repeat(q_pos_s.astype(jnp.int32), r)
  n_active = (kv_len + pt - 1) // pt
  tile_end = jnp.minimum(tile_end, n_active)
  n_table = page_table_t.shape[0]
  n_blocks = (tile_end - tile_begin + block_pages - 1) // block_pages

  def body(b, c):
    first = tile_begin + b * block_pages
    logical_p = first + jnp.arange(block_pages)
    phys_p = page_table_t[jnp.clip(logical_p, 0, n_table - 1)]
    pages = pool_pn[phys_p]                         # [B, page_bytes]
    k_btgd, v_btgd = jax.vmap(lambda pg: decode_page_kv(pg, layout))(pages)
    k_tgd = k_btgd.reshape(block_pages * pt, g, d)
    v_tgd = v_btgd.reshape(block_pages * pt, g, d)
    key_pos_t = first * pt + jnp.arange(block_pages * pt)
    # pages past tile_end (inside the last block) are masked like future keys
    key_pos_t = jnp.where(key_pos_t < tile_end * pt, key_pos_t, jnp.iinfo(jnp.int32).max)
    # masked rows may hold junk bytes (NaN/inf after decoding): p = 0 there, but 0 * NaN = NaN
    v_tgd = jnp.where((key_pos_t < kv_len)[:, None, None], v_tgd, 0.0)
    return _block_step(c, qf_gmd, k_tgd, v_tgd, key_pos_t, kv_len, q_pos_m, scale)

  return lax.fori_loop(0, jnp.maximum(n_blocks, 0), body, carry)


def span_attention_reference(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, *, layout: PageLayout,
                             block_pages: int = 1, sm_scale: Optional[float] = None):
  """Attention of the query rows over all active pages -> o_shd [S, H, D] float32."""
  s, h, d = q_shd.shape
  carry = init_carry(layout.num_kv_heads, s * (h // layout.num_kv_heads), d)
  carry = span_attention_partial_reference(
      q_shd, pool_pn, page_table_t, jnp.asarray(kv_len, jnp.int32), q_pos_s, carry,
      jnp.int32(0), jnp.int32(page_table_t.shape[0]), layout=layout, num_q_heads=h,
      block_pages=block_pages, sm_scale=sm_scale)
  return finalize(carry, h)


def dense_attention_f64(q_shd, k_tgd, v_tgd, q_pos_s, kv_len):
  """float64 numpy oracle on contiguous decoded K/V (for tests)."""
  import numpy as np
  q = np.asarray(q_shd, np.float64)
  k = np.asarray(k_tgd, np.float64)[:kv_len]
  v = np.asarray(v_tgd, np.float64)[:kv_len]
  s_, h, d = q.shape
  g = k.shape[1]
  r = h // g
  out = np.zeros((s_, h, d))
  for i in range(s_):
    for hh in range(h):
      sc = k[:, hh // r, :] @ q[i, hh] / np.sqrt(d)
      sc[np.arange(kv_len) > q_pos_s[i]] = -np.inf
      if not np.isfinite(sc).any():
        continue
      p = np.exp(sc - sc.max())
      out[i, hh] = (p / p.sum()) @ v[:, hh // r, :]
  return out
