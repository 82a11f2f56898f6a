"""Span attention entry points: `implementation=` picks the jnp reference or a Pallas kernel.

implementations:
  "reference"  plain jnp (`reference.py`), the default
  "triton"     Pallas kernels, Triton lowering (`kernel_triton.py`): split-K
               over logical partitions of `block_pages` pages + an in-order
               combine; runs on NVIDIA GPUs, or anywhere with `interpret=True`.
  "mosaic"     EXPERIMENTAL Pallas kernel, Mosaic GPU lowering (`kernel_mosaic.py`,
               Hopper: TMA + wgmma): Q8_0/Q4_0 and Q8_0/Q8_0 pages, head_dim 256,
               page_tokens a multiple of 64, <= 64 folded query rows, precision
               "f16" only. Correct on the H200 (3.7e-4 vs the float32 reference)
               but 4.9x slower than "triton" at 128K (docs/PERFORMANCE.md), so
               "auto" never picks it. `interpret=True` runs the Mosaic GPU interpreter.
  "mosaic2"    Pallas kernels, Mosaic GPU: calls of up to 40 folded query rows (decode, verify) on
               v2 below; longer ones (prefill chunks of up to 256 tokens) on the prefill kernel
               (`kernel_mosaic_prefill.py`: query rows as the wgmma M, K and V converted to f16
               tiles in SMEM; same contract, same combine). v2 (`kernel_mosaic_v2.py`): TMA copies of the
               tiles (K head-major from the pool's K-row view), the magic-number conversion of
               the ggml quants straight into wgmma registers, one warpgroup a KV head.
               Q8_0/Q4_0 pages, head_dim 256, 1-4 KV heads, <= 40 folded query rows,
               precision "f16". `block_pages="auto"` gives it its own one-wave size. On the
               H200 at 160K decode 1.73x faster than XLA bf16 (S13-3) and 1.76x faster than
               "triton" (S12-4); docs/PERFORMANCE.md.
  "auto"       on an NVIDIA GPU "mosaic2" where it takes the call (`mosaic2_takes`: decode and
               verify of the 27B geometry; prefill chunks only with `AUTO_MOSAIC_PREFILL`) and
               "triton" elsewhere (other K/V pairs, precisions or paths); "reference" without a
               GPU.

Kernel-only keyword arguments (ignored by "reference"):
  precision  how the kernel's dots meet the tensor cores (`kernel_triton.PRECISIONS`):
             "f16" (default, ~3e-4 relative), "f16x3" (16-bit head + tail
             terms, float32-class ~1e-6), "tf32", "ieee". Interpret mode
             computes every dot in float32, so only the operand rounding of
             "f16" shows there.
  path       None (pick by query tokens: 1-2 "vector", 3-8 "matrix",
             9-256 "prefill") or one of those names.

block_pages: an int (pages per logical partition: waves whose boundaries are multiples of it
give the same bits as one call) or "auto": `kernel_triton.choose_block_pages` of the static
shapes (the page table's length, query rows, heads) and the GPU's SM count (132, the H200's,
where no GPU is present), so the same call resolves to the same size for every implementation.

Eager checks (when the arguments are concrete, i.e. outside jit): every page
table entry that will be read names a page of the pool.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import jax

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import reference as _ref
from kvjax_pallas.span_attention import kernel_triton as _triton
from kvjax_pallas.span_attention import kernel_mosaic as _mosaic
from kvjax_pallas.span_attention import kernel_mosaic_v2 as _mosaic2
from kvjax_pallas.span_attention import kernel_mosaic_prefill as _prefill

IMPLEMENTATIONS = ("reference", "triton", "mosaic", "mosaic2")
# "auto" sends prefill chunks (more than v2's MAX_ROWS folded rows) to the Mosaic GPU prefill
# kernel only where it was measured faster than the Triton one (docs/PERFORMANCE.md)
AUTO_MOSAIC_PREFILL = True
# the implementations that take every K/V pair, path and precision of the contract
FULL_IMPLEMENTATIONS = ("reference", "triton")


def uses_prefill_kernel(layout: PageLayout, rows: int) -> bool:
  """Whether "mosaic2" runs a call with the prefill kernel (`kernel_mosaic_prefill`): more than
  the v2 kernel's `MAX_ROWS` folded query rows."""
  del layout
  return rows > _mosaic2.MAX_ROWS


def mosaic2_takes(layout: PageLayout, head_dim: int, rows: int, precision: str = "f16",
                  path: Optional[str] = None, num_tokens: Optional[int] = None,
                  prefill: Optional[bool] = None) -> bool:
  """Whether "auto" gives a call to the Mosaic GPU kernels: their K/V pair, head_dim, KV heads
  and page geometry (`kernel_mosaic_v2.check_layout`), precision "f16", no forced path, and
  either at most v2's `MAX_ROWS` folded query rows or (prefill, default `AUTO_MOSAIC_PREFILL`) a
  chunk the prefill kernel takes (`kernel_mosaic_prefill.check_call`: num_tokens query tokens)."""
  prefill = AUTO_MOSAIC_PREFILL if prefill is None else prefill
  if precision != "f16" or path is not None or rows < 1:
    return False
  try:
    _mosaic2.check_layout(layout, head_dim)
    if rows > _mosaic2.MAX_ROWS:
      if not prefill or num_tokens is None:
        return False
      _prefill.check_call(layout, head_dim, num_tokens)
  except ValueError:
    return False
  return True


def resolve_implementation(implementation: str, *, layout: Optional[PageLayout] = None,
                           q_shape=None, precision: str = _triton.DEFAULT_PRECISION,
                           path: Optional[str] = None, backend: Optional[str] = None) -> str:
  """"auto" -> on an NVIDIA GPU backend "mosaic2" where `mosaic2_takes` the call (layout and
  q_shape [S, H, D] given), else "triton"; "reference" on other backends. Other names are
  checked and returned. backend: the one to decide for (default: jax's default backend)."""
  if implementation == "auto":
    if (backend or jax.default_backend()) != "gpu":
      return "reference"
    if layout is not None and q_shape is not None:
      s, h, d = q_shape
      if mosaic2_takes(layout, d, s * (h // layout.num_kv_heads), precision, path, s):
        return "mosaic2"
    return "triton"
  _check(implementation)
  return implementation


def _check(implementation: str):
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown span-attention implementation {implementation!r}; "
                     f"choose one of {IMPLEMENTATIONS} or 'auto'")


def _check_mosaic_options(precision: str):
  if precision != "f16":
    raise ValueError(f"the Mosaic GPU kernels compute with f16 operands only (precision='f16'), "
                     f"got precision={precision!r}; use implementation='triton' for it")


def num_sms() -> int:
  """Streaming multiprocessors of the default GPU (the H200's 132 where there is none)."""
  dev = jax.devices()[0]
  if dev.platform == "gpu":
    return int(getattr(dev, "core_count", 0) or _triton.DEFAULT_NUM_SMS)
  return _triton.DEFAULT_NUM_SMS


def resolve_block_pages(block_pages: Union[int, str], num_table_pages: int, num_tokens: int,
                        num_q_heads: int, layout: PageLayout, path: Optional[str] = None,
                        implementation: str = "triton") -> int:
  """block_pages as given (an int >= 1), or the "auto" choice for these static shapes (v2,
  `implementation="mosaic2"`, has its own: one CTA a partition for all heads)."""
  if isinstance(block_pages, str):
    if block_pages != "auto":
      raise ValueError(f"block_pages must be an int >= 1 or 'auto', got {block_pages!r}")
    if implementation == "mosaic2":
      rows = num_tokens * max(1, num_q_heads // layout.num_kv_heads)
      if uses_prefill_kernel(layout, rows):
        return _prefill.choose_block_pages(num_table_pages, rows, layout.num_kv_heads, num_sms())
      return _mosaic2.choose_block_pages(num_table_pages, num_sms())
    return _triton.choose_block_pages(num_table_pages, layout.num_kv_heads, num_tokens,
                                      max(1, num_q_heads // layout.num_kv_heads), num_sms(), path)
  if int(block_pages) != block_pages or block_pages < 1:
    raise ValueError(f"block_pages must be an int >= 1 or 'auto', got {block_pages!r}")
  return int(block_pages)


def _concrete(x) -> Optional[np.ndarray]:
  if isinstance(x, jax.core.Tracer):
    return None
  try:
    return np.asarray(x)
  except Exception:  # pragma: no cover (abstract values)
    return None


def check_page_table(page_table_t, num_pages: int, layout: PageLayout, kv_len=None,
                     tile_begin=None, tile_end=None):
  """Raise if a table entry that will be read is outside [0, num_pages).

  Runs only when the table is concrete. With a concrete `kv_len` only the
  active logical pages (and, for waves, [tile_begin, tile_end)) are checked;
  otherwise every entry is.
  """
  table = _concrete(page_table_t)
  if table is None:
    return
  if table.ndim != 1:
    raise ValueError(f"page table must be 1-D [logical pages], got shape {table.shape}")
  lo, hi = 0, table.shape[0]
  kv = None if kv_len is None else _concrete(kv_len)
  if kv is not None:
    hi = min(hi, layout.pages_for(int(kv)))
  tb = None if tile_begin is None else _concrete(tile_begin)
  te = None if tile_end is None else _concrete(tile_end)
  if tb is not None:
    lo = max(lo, int(tb))
  if te is not None:
    hi = min(hi, int(te))
  used = table[lo:hi]
  bad = np.nonzero((used < 0) | (used >= num_pages))[0]
  if bad.size:
    i = int(bad[0]) + lo
    raise ValueError(f"page table entry {i} = {int(table[i])} is out of range: the pool has "
                     f"{num_pages} pages (valid 0..{num_pages - 1}); {bad.size} bad entries")


def span_attention(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, *, layout: PageLayout,
                   block_pages: Union[int, str] = 1, sm_scale: Optional[float] = None,
                   implementation: str = "reference", interpret: bool = False,
                   precision: str = _triton.DEFAULT_PRECISION, path: Optional[str] = None):
  """o_shd [S, H, D] float32: attention of query rows over the active logical pages."""
  implementation = resolve_implementation(implementation, layout=layout, q_shape=q_shd.shape,
                                          precision=precision, path=path)
  block_pages = resolve_block_pages(block_pages, page_table_t.shape[0], q_shd.shape[0],
                                    q_shd.shape[1], layout, path, implementation)
  check_page_table(page_table_t, pool_pn.shape[0], layout, kv_len)
  if implementation == "mosaic2":
    _check_mosaic_options(precision)
    s, h = q_shd.shape[:2]
    if uses_prefill_kernel(layout, s * (h // layout.num_kv_heads)):
      return _prefill.span_attention_mosaic_prefill(q_shd, pool_pn, page_table_t, kv_len, q_pos_s,
                                                    layout=layout, block_pages=block_pages,
                                                    sm_scale=sm_scale, interpret=interpret)
    return _mosaic2.span_attention_mosaic2(q_shd, pool_pn, page_table_t, kv_len, q_pos_s,
                                           layout=layout, block_pages=block_pages,
                                           sm_scale=sm_scale, interpret=interpret)
  if implementation == "mosaic":
    _check_mosaic_options(precision)
    return _mosaic.span_attention_mosaic(q_shd, pool_pn, page_table_t, kv_len, q_pos_s,
                                         layout=layout, block_pages=block_pages,
                                         sm_scale=sm_scale, interpret=interpret)
  if implementation == "triton":
    return _triton.span_attention_triton(q_shd, pool_pn, page_table_t, kv_len, q_pos_s,
                                         layout=layout, block_pages=block_pages,
                                         sm_scale=sm_scale, interpret=interpret,
                                         precision=precision, path=path)
  return _ref.span_attention_reference(q_shd, pool_pn, page_table_t, kv_len, q_pos_s,
                                       layout=layout, block_pages=block_pages, sm_scale=sm_scale)


def span_attention_partial(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end,
                           *, layout: PageLayout, num_q_heads: int,
                           block_pages: Union[int, str] = 1, sm_scale: Optional[float] = None,
                           implementation: str = "reference", interpret: bool = False,
                           precision: str = _triton.DEFAULT_PRECISION, path: Optional[str] = None):
  """Fold logical pages [tile_begin, tile_end) into `carry` (see reference.py).

  For every implementation, waves whose boundaries are multiples of
  `block_pages` pages give the same bits as one call ("auto" resolves from the table's length,
  so waves over one table share the size).
  """
  implementation = resolve_implementation(implementation, layout=layout, q_shape=q_shd.shape,
                                          precision=precision, path=path)
  block_pages = resolve_block_pages(block_pages, page_table_t.shape[0], q_shd.shape[0],
                                    num_q_heads, layout, path, implementation)
  check_page_table(page_table_t, pool_pn.shape[0], layout, kv_len, tile_begin, tile_end)
  if implementation == "mosaic2":
    _check_mosaic_options(precision)
    if uses_prefill_kernel(layout, q_shd.shape[0] * (num_q_heads // layout.num_kv_heads)):
      return _prefill.span_attention_partial_mosaic_prefill(
          q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end,
          layout=layout, num_q_heads=num_q_heads, block_pages=block_pages, sm_scale=sm_scale,
          interpret=interpret)
    return _mosaic2.span_attention_partial_mosaic2(
        q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end, layout=layout,
        num_q_heads=num_q_heads, block_pages=block_pages, sm_scale=sm_scale, interpret=interpret)
  if implementation == "mosaic":
    _check_mosaic_options(precision)
    return _mosaic.span_attention_partial_mosaic(
        q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end, layout=layout,
        num_q_heads=num_q_heads, block_pages=block_pages, sm_scale=sm_scale, interpret=interpret)
  if implementation == "triton":
    return _triton.span_attention_partial_triton(
        q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end, layout=layout,
        num_q_heads=num_q_heads, block_pages=block_pages, sm_scale=sm_scale, interpret=interpret,
        precision=precision, path=path)
  return _ref.span_attention_partial_reference(
      q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end, layout=layout,
      num_q_heads=num_q_heads, block_pages=block_pages, sm_scale=sm_scale)


init_carry = _ref.init_carry
finalize = _ref.finalize
