"""The KV page byte layout: the one contract between the KV cache and the kernels.

A page holds `page_tokens` consecutive token positions of ONE attention layer,
all KV heads. Bytes:

    [ K plane : page_tokens rows x k_row_bytes ] [pad to 128] [ V plane : page_tokens rows x v_row_bytes ] [pad to a whole K row]

A row is one token: for each KV head in order, the head's `head_dim` values
encoded as ggml blocks along the head dimension (32 values a block for Q8_0 /
Q4_0; plain little-endian scalars for F32 / F16 / BF16). This is exactly the
byte image of a ggml KV-cache row, so a page of host history, a resident page
and a ring slot are byte-for-byte the same thing.

The page ends padded to a whole number of K rows (`page_bytes % k_row_bytes == 0`), so a pool
of pages [P, page_bytes] is also a grid of K rows [P * page_bytes / k_row_bytes, heads, head
bytes]: the Mosaic GPU kernels copy one head's K rows of a key tile from that view with
one TMA box into a head-major SMEM tile, where a row stride of one head (272 B at D=256) puts
the 8 rows a load reads on 8 different bank groups (the token-major 1088-byte stride put them
on 2: 4-way shared-memory bank conflicts, docs/DESIGN.md). Pages of equal K and V rows need no
pad; Q8_0 K / Q4_0 V pages pay less than one K row.

For Q8_0 K / Q4_0 V, 4 KV heads x 256 and 256-token pages:
K row 1088 B, V row 576 B, K plane 278,528 B, V offset 278,528, page 426,496 B (425,984 B of
rows and 512 B of pad: 392 K rows).

This module imports nothing from `kvjax` (the kernels' package must stay
independent); `kvjax` imports it.
"""

from __future__ import annotations

import dataclasses

QK = 32  # values per ggml quant block

# kind -> (values per block, bytes per block)
BLOCK_FORMATS = {
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
}
QUANT_KINDS = ("q8_0", "q4_0")
V_ALIGN = 128
DEFAULT_PAGE_TOKENS = 256


def check_kind(kind: str) -> str:
  if kind not in BLOCK_FORMATS:
    raise ValueError(f"unsupported KV cache type {kind!r}; supported: {sorted(BLOCK_FORMATS)}")
  return kind


def row_bytes(kind: str, n_values: int) -> int:
  """Bytes of `n_values` consecutive values encoded as `kind`."""
  per_block, nbytes = BLOCK_FORMATS[check_kind(kind)]
  if n_values % per_block:
    raise ValueError(f"{kind} needs a multiple of {per_block} values, got {n_values}")
  return n_values // per_block * nbytes


def align_up(n: int, a: int) -> int:
  return (n + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class PageLayout:
  """Byte geometry of one KV page (one layer, all KV heads, page_tokens rows)."""

  num_kv_heads: int
  head_dim: int
  k_type: str = "q8_0"
  v_type: str = "q4_0"
  page_tokens: int = DEFAULT_PAGE_TOKENS

  def __post_init__(self):
    check_kind(self.k_type)
    check_kind(self.v_type)
    if self.head_dim % QK:
      raise ValueError(f"head_dim {self.head_dim} is not a multiple of {QK} (ggml block size)")
    if self.page_tokens < 1 or self.num_kv_heads < 1:
      raise ValueError("page_tokens and num_kv_heads must be >= 1")

  @property
  def k_head_bytes(self) -> int:
    return row_bytes(self.k_type, self.head_dim)

  @property
  def v_head_bytes(self) -> int:
    return row_bytes(self.v_type, self.head_dim)

  @property
  def k_row_bytes(self) -> int:
    """Bytes of one token's K (all KV heads)."""
    return self.num_kv_heads * self.k_head_bytes

  @property
  def v_row_bytes(self) -> int:
    return self.num_kv_heads * self.v_head_bytes

  @property
  def token_bytes(self) -> int:
    return self.k_row_bytes + self.v_row_bytes

  @property
  def k_plane_bytes(self) -> int:
    return self.page_tokens * self.k_row_bytes

  @property
  def v_offset(self) -> int:
    return align_up(self.k_plane_bytes, V_ALIGN)

  @property
  def v_plane_bytes(self) -> int:
    return self.page_tokens * self.v_row_bytes

  @property
  def page_bytes(self) -> int:
    """Bytes of a page: the V plane's end padded up to a whole number of K rows."""
    return align_up(self.v_offset + self.v_plane_bytes, self.k_row_bytes)

  @property
  def k_rows_per_page(self) -> int:
    """K rows a page spans in the pool's K-row view (`page_bytes / k_row_bytes`)."""
    return self.page_bytes // self.k_row_bytes

  def pages_for(self, tokens: int) -> int:
    return -(-tokens // self.page_tokens)

  def describe(self) -> str:
    return (f"{self.k_type.upper()} K / {self.v_type.upper()} V, {self.num_kv_heads}x{self.head_dim}, "
            f"{self.page_tokens}-token pages: K row {self.k_row_bytes} B, V row {self.v_row_bytes} B, "
            f"page {self.page_bytes} B")
