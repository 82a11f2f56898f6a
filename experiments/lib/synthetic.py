"""Synthetic KV histories for long-context benchmarks (no prefill needed).

Researchers measure decode cost at 128K tokens without paying a 128K-token
prefill: the histories are filled with validly encoded random pages (real
Q8_0/Q4_0 blocks, finite scales). Attention cost and copy traffic are the
same as for real content; the logits are not meaningful.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax_pallas import ggml_codec
from kvjax_pallas.page_layout import PageLayout


def synthetic_pages(layout: PageLayout, n_distinct: int = 4, seed: int = 0) -> np.ndarray:
  """`[n_distinct, page_bytes]` uint8 of encoded random K/V rows."""
  rng = np.random.default_rng(seed)
  t, g, d = layout.page_tokens, layout.num_kv_heads, layout.head_dim
  out = np.zeros((n_distinct, layout.page_bytes), np.uint8)
  for i in range(n_distinct):
    k = rng.standard_normal((t, g, d)).astype(np.float32)
    v = rng.standard_normal((t, g, d)).astype(np.float32)
    out[i, :layout.k_plane_bytes] = np.asarray(ggml_codec.encode_rows(jnp.asarray(k), layout.k_type)).reshape(-1)
    out[i, layout.v_offset:layout.v_offset + layout.v_plane_bytes] = np.asarray(ggml_codec.encode_rows(jnp.asarray(v), layout.v_type)).reshape(-1)
  return out


def tile_pages(pages: np.ndarray, n_pages: int) -> np.ndarray:
  reps = -(-n_pages // pages.shape[0])
  return np.tile(pages, (reps, 1))[:n_pages]


def fill_streamed(kv, tokens: int, seed: int = 0) -> None:
  """Give every layer of a `StreamedKV` `tokens` committed synthetic tokens (host history only)."""
  pages = tile_pages(synthetic_pages(kv.layout, seed=seed), kv.layout.pages_for(tokens))
  for hist in kv.histories.values():
    hist.pages_lpn[:, :pages.shape[0]] = pages[None]
    hist.tokens[:] = tokens
    hist.generation += 1
  kv.resident_valid[:] = 0


def fill_plain(kv, tokens: int, seed: int = 0) -> None:
  """Same for a `PlainKV` (all pages resident on the device)."""
  n = kv.layout.pages_for(tokens)
  pages = tile_pages(synthetic_pages(kv.layout, seed=seed), n)
  pool = np.asarray(kv.pool_pn).copy()
  for layer in range(kv.n_layers):
    first = layer * kv.pages_per_layer
    pool[first:first + n] = pages
  kv.pool_pn = jnp.asarray(pool)
