"""Host-authoritative KV history of one logical cache.

Layout: `pages_lpn[layer, page, page_bytes]` (uint8, the page byte layout of
`kvjax_pallas.page_layout`), so the consecutive pages of one layer are one
contiguous slice and a span of pages is one copy.

Copy units. Pages are grouped in chunks of `copy_pages`. A chunk whose every
token is committed is *sealed* (immutable until a truncation reaches it). On
an accelerator, sealed chunks are mirrored once into `pinned_host` memory so
that host-to-device uploads run at pinned speed (about ten times the pageable
rate: docs/PERFORMANCE.md, "Host-to-device copies"); the open tail chunk uploads from the
numpy pages. The numpy pages remain the authoritative bytes.

Counters kept distinct (design rule 2): `cache_id` (identity), `generation`
(content generation: bumps on every write or truncation).
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Tuple

import jax
import numpy as np

from kvjax.engine import default_device
from kvjax_pallas.page_layout import PageLayout

_ids = itertools.count()


def pinned_available() -> bool:
  try:
    dev = jax.devices()[0]
    return dev.platform != "cpu" and any(m.kind == "pinned_host" for m in dev.addressable_memories())
  except Exception:  # pragma: no cover - backend without memories API
    return False


def _to_pinned(pages) -> jax.Array:
  """A host numpy array copied into pinned_host memory (the mirrors the uploads read)."""
  return jax.device_put(pages, jax.sharding.SingleDeviceSharding(default_device(), memory_kind="pinned_host"))


class HostHistory:
  """The authoritative KV history of one logical cache (`n_layers` attention layers)."""

  def __init__(self, name: str, layout: PageLayout, n_layers: int, max_pages: int, copy_pages: int = 32,
               pinned: Optional[bool] = None):
    if copy_pages < 1 or copy_pages & (copy_pages - 1):
      raise ValueError(f"copy_pages must be a power of two >= 1, got {copy_pages}")
    self.name = name
    self.cache_id = next(_ids)
    self.layout = layout
    self.n_layers = n_layers
    self.max_pages = max_pages
    self.copy_pages = copy_pages
    self.pages_lpn = np.zeros((n_layers, max_pages, layout.page_bytes), np.uint8)
    self.tokens = np.zeros((n_layers,), np.int64)  # committed tokens per layer
    self.generation = 0
    self.pinned = pinned_available() if pinned is None else pinned
    self._pinned_chunks: Dict[Tuple[int, int], Tuple[jax.Array, int]] = {}
    self._chunk_end = np.zeros((n_layers,), np.int64)   # 1 + the highest chunk mirrored, per layer
    # sealed pieces of streamed ranges, per layer: (lo, hi) -> array (kept while they do not overlap)
    self._pinned_blocks: List[Dict[Tuple[int, int], jax.Array]] = [{} for _ in range(n_layers)]
    self.d2h_bytes = 0

  @property
  def max_tokens(self) -> int:
    return self.max_pages * self.layout.page_tokens

  def write_rows(self, layer: int, pos: int, k_sn: np.ndarray, v_sn: np.ndarray) -> None:
    """Publish rows for positions pos..pos+S-1 of one layer (the KV writer's D2H tail)."""
    lay = self.layout
    s = k_sn.shape[0]
    if k_sn.shape != (s, lay.k_row_bytes) or v_sn.shape != (s, lay.v_row_bytes):
      raise ValueError(f"{self.name}: rows must be [S, {lay.k_row_bytes}] and [S, {lay.v_row_bytes}] bytes, "
                       f"got {k_sn.shape} and {v_sn.shape}")
    if pos + s > self.max_tokens:
      raise ValueError(f"{self.name}: history holds {self.max_tokens} tokens; writing up to {pos + s} "
                       f"needs {pos + s - self.max_tokens} more")
    if pos > self.tokens[layer]:
      raise ValueError(f"{self.name} layer {layer}: write at {pos} leaves a gap after {self.tokens[layer]} "
                       f"committed tokens")
    pt, kb, vb = lay.page_tokens, lay.k_row_bytes, lay.v_row_bytes
    i = 0
    while i < s:                      # one contiguous byte range per plane and page
      page, row = divmod(pos + i, pt)
      n = min(s - i, pt - row)
      self.pages_lpn[layer, page, row * kb:(row + n) * kb] = k_sn[i:i + n].reshape(-1)
      self.pages_lpn[layer, page, lay.v_offset + row * vb:lay.v_offset + (row + n) * vb] = \
          v_sn[i:i + n].reshape(-1)
      i += n
    self._drop_chunks(layer, pos)
    self.tokens[layer] = pos + s
    self.generation += 1
    self.d2h_bytes += k_sn.nbytes + v_sn.nbytes

  def truncate(self, tokens: int) -> None:
    """Forget every token >= `tokens` (rejected speculative rows): their bytes are zeroed, so the
    history is byte for byte the one a run that never wrote them holds."""
    if tokens < 0:
      raise ValueError(f"{self.name}: truncate to {tokens} tokens; the count must be >= 0")
    for layer in range(self.n_layers):
      if tokens < self.tokens[layer]:
        self._drop_chunks(layer, tokens)
        self._zero_rows(layer, tokens, int(self.tokens[layer]))
        self.tokens[layer] = tokens
    self.generation += 1

  def _zero_rows(self, layer: int, lo: int, hi: int) -> None:
    """Zero the K and V bytes of rows [lo, hi) of one layer (whole pages at once)."""
    lay = self.layout
    pt = lay.page_tokens
    first_whole = -(-lo // pt)
    if first_whole * pt < hi:
      self.pages_lpn[layer, first_whole:lay.pages_for(hi)] = 0
      hi = min(hi, first_whole * pt)
    if lo < hi:                       # the partial page before the whole ones
      page, rows = lo // pt, np.arange(lo % pt, (hi - 1) % pt + 1)
      kcols = rows[:, None] * lay.k_row_bytes + np.arange(lay.k_row_bytes)
      vcols = lay.v_offset + rows[:, None] * lay.v_row_bytes + np.arange(lay.v_row_bytes)
      self.pages_lpn[layer, page, kcols] = 0
      self.pages_lpn[layer, page, vcols] = 0

  def _drop_chunks(self, layer: int, from_token: int) -> None:
    """Forget pinned snapshots that cover any token >= from_token."""
    pt, c = self.layout.page_tokens, self.copy_pages
    for chunk in range(from_token // (c * pt), int(self._chunk_end[layer])):   # only chunks at or past it
      cached = self._pinned_chunks.get((layer, chunk))
      if cached is not None and (chunk * c + cached[1]) * pt > from_token:
        del self._pinned_chunks[(layer, chunk)]
    blocks = self._pinned_blocks[layer]
    for lo, hi in [k for k in blocks if k[1] * pt > from_token]:
      del blocks[(lo, hi)]

  def rows(self, layer: int, tokens: int) -> Tuple[np.ndarray, np.ndarray]:
    """(K bytes [tokens, k_row_bytes], V bytes [tokens, v_row_bytes]) of the first `tokens` rows."""
    lay = self.layout
    pages = self.pages_lpn[layer, :lay.pages_for(tokens)]
    k = pages[:, :lay.k_plane_bytes].reshape(-1, lay.k_row_bytes)[:tokens]
    v = pages[:, lay.v_offset:lay.v_offset + lay.v_plane_bytes].reshape(-1, lay.v_row_bytes)[:tokens]
    return k, v

  def chunk_sealed(self, layer: int, chunk: int) -> bool:
    end = (chunk + 1) * self.copy_pages * self.layout.page_tokens
    return self.tokens[layer] >= end

  def pinned_chunk(self, layer: int, chunk: int):
    """(pinned_host array [copy_pages, page_bytes], valid pages) for one copy unit, or (None, 0).

    A sealed chunk is mirrored once. The open (tail) chunk is mirrored up to its
    last *full* page and refreshed when another page fills (every page_tokens
    tokens), so only the partial tail page ever uploads from pageable memory.
    """
    if not self.pinned:
      return None, 0
    c, pt = self.copy_pages, self.layout.page_tokens
    full_pages = int(self.tokens[layer]) // pt
    valid = max(0, min(c, full_pages - chunk * c))
    if valid == 0:
      return None, 0
    key = (layer, chunk)
    cached = self._pinned_chunks.get(key)
    if cached is not None and cached[1] >= valid:
      return cached[0], cached[1]
    first = chunk * c
    host = self.pages_lpn[layer, first:first + c]
    if host.shape[0] < c:  # last chunk of a history whose max_pages is not a multiple of c
      host = np.concatenate([host, np.zeros((c - host.shape[0], host.shape[1]), np.uint8)])
    arr = _to_pinned(host)
    self._pinned_chunks[key] = (arr, valid)
    self._chunk_end[layer] = max(int(self._chunk_end[layer]), chunk + 1)
    return arr, valid

  def pinned_block(self, layer: int, lo: int, hi: int):
    """pinned_host array [hi - lo, page_bytes] of full pages [lo, hi) of one layer: a sealed piece
    of a streamed range as one copy. A layer keeps the blocks asked for while they do not overlap:
    a new block drops those it overlaps (pieces that merge as the history grows, a repartition)."""
    if not self.pinned:
      raise ValueError(f"{self.name}: no pinned host memory on this backend")
    pt = self.layout.page_tokens
    if not 0 <= lo < hi <= int(self.tokens[layer]) // pt:
      raise ValueError(f"{self.name} layer {layer}: block [{lo}, {hi}) is not within the "
                       f"{int(self.tokens[layer]) // pt} full pages")
    blocks = self._pinned_blocks[layer]
    cached = blocks.get((lo, hi))
    if cached is not None:
      return cached
    for key in [k for k in blocks if k[0] < hi and lo < k[1]]:   # free the overlapped blocks first
      del blocks[key]
    arr = _to_pinned(self.pages_lpn[layer, lo:hi])
    blocks[(lo, hi)] = arr
    return arr
