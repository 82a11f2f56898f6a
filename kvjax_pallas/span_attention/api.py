"""Span attention entry points: `implementation=` picks the jnp reference or a Pallas kernel.

The implementations are a registry (`IMPLEMENTATIONS`, in `_REGISTRY`): each says which calls
"auto" may give it (`Implementation.supports`, a predicate of the call's static description
`SpanCall`), how it folds logical pages [tile_begin, tile_end) into the carry
(`Implementation.partial`, the contract of `span_attention_partial`) and its own
`block_pages="auto"` size.

implementations:
  "reference"  plain jnp (`reference.py`), the default
  "triton"     Pallas kernel, Triton lowering (`triton.py`): every K/V pair, path and precision of
               the contract; runs on NVIDIA GPUs, or anywhere with `interpret=True`.
  "mosaic"     Pallas kernels, Mosaic GPU lowering (Hopper): calls of up to
               `mosaic_decode.MAX_ROWS` folded query rows (decode, verify) on the decode kernel
               (`mosaic_decode.py`), longer ones (prefill chunks of up to 256 tokens) on the
               prefill kernel (`mosaic_prefill.py`). Q8_0/Q4_0 pages, head_dim 256, 1-4 KV
               heads, precision "f16" (`mosaic_common.check_layout`).
  "auto"       on an NVIDIA GPU the first of `AUTO_ORDER` that supports the call ("mosaic" where
               `mosaic_takes` it, else "triton"); "reference" without a GPU.

Kernel-only keyword arguments (ignored by "reference"):
  precision  how the kernel's dots meet the tensor cores (`triton.PRECISIONS`):
             "f16" (default, ~3e-4 relative), "f16x3" (16-bit head + tail
             terms, float32-class ~1e-6), "tf32", "ieee". Interpret mode
             computes every dot in float32, so only the operand rounding of
             "f16" shows there. The Mosaic GPU kernels take "f16" only.
  path       None (pick by query tokens: 1-2 "vector", 3-8 "matrix",
             9-256 "prefill") or one of those names (the Triton kernel's tiles).

block_pages: an int (pages per logical partition: waves whose boundaries are multiples of it
give the same bits as one call) or "auto": the implementation's own choice from the static
shapes (the page table's length, query rows, heads) and the GPU's SM count
(`partitions.DEFAULT_NUM_SMS` where no GPU is present); "reference" takes the Triton kernel's.

Eager checks (when the arguments are concrete, i.e. outside jit): every page
table entry that will be read names a page of the pool.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Union

import numpy as np
import jax
import jax.numpy as jnp

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import common as _common
from kvjax_pallas.span_attention import mosaic_common as _mc
from kvjax_pallas.span_attention import mosaic_decode as _decode
from kvjax_pallas.span_attention import mosaic_prefill as _prefill
from kvjax_pallas.span_attention import partitions as _partitions
from kvjax_pallas.span_attention import reference as _ref
from kvjax_pallas.span_attention import triton as _triton

# "auto" sends prefill chunks (more than the decode kernel's MAX_ROWS folded rows) to the Mosaic
# GPU prefill kernel (measured faster than the Triton one: docs/PERFORMANCE.md)
AUTO_MOSAIC_PREFILL = True
num_sms = _partitions.num_sms


@dataclasses.dataclass(frozen=True)
class SpanCall:
  """The static description of a call that an implementation is chosen for."""
  layout: PageLayout
  num_tokens: int                 # S: query tokens
  num_q_heads: int                # H
  head_dim: int
  precision: str = _triton.DEFAULT_PRECISION
  path: Optional[str] = None

  @property
  def rows(self) -> int:
    """Folded query rows a KV head: query tokens x query heads per KV head."""
    return self.num_tokens * (self.num_q_heads // self.layout.num_kv_heads)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """An entry of the registry.

  supports(call): whether "auto" may give it the call.
  partial(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end, *, layout,
    num_q_heads, block_pages, sm_scale, interpret, precision, path) -> Carry: the contract of
    `span_attention_partial` (carry None: the empty carry).
  auto_block_pages(call, num_table_pages, num_sms) -> int: its block_pages="auto".
  full: it takes every K/V pair, path and precision of the contract.
  """
  name: str
  supports: Callable[[SpanCall], bool]
  partial: Callable[..., _ref.Carry]
  auto_block_pages: Callable[[SpanCall, int, int], int]
  full: bool


def uses_mosaic_prefill(layout: PageLayout, rows: int) -> bool:
  """Whether "mosaic" runs a call with the prefill kernel (`mosaic_prefill`): more than the
  decode kernel's `MAX_ROWS` folded query rows."""
  del layout
  return rows > _decode.MAX_ROWS


def mosaic_takes(layout: PageLayout, head_dim: int, rows: int, precision: str = "f16",
                 path: Optional[str] = None, num_tokens: Optional[int] = None,
                 prefill: Optional[bool] = None) -> bool:
  """Whether "auto" gives a call to the Mosaic GPU kernels: their K/V pair, head_dim, KV heads
  and page geometry (`mosaic_common.check_layout`), precision "f16", no forced path, and either
  at most the decode kernel's `MAX_ROWS` folded query rows or (prefill, default
  `AUTO_MOSAIC_PREFILL`) a chunk the prefill kernel takes (`mosaic_prefill.check_call`:
  num_tokens query tokens)."""
  prefill = AUTO_MOSAIC_PREFILL if prefill is None else prefill
  if precision != "f16" or path is not None or rows < 1:
    return False
  try:
    _mc.check_layout(layout, head_dim)
    if rows > _decode.MAX_ROWS:
      if not prefill or num_tokens is None:
        return False
      _prefill.check_call(layout, head_dim, num_tokens)
  except ValueError:
    return False
  return True


# ----------------------------------------------------------------------------- the registry


def _reference_partial(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin,
                       tile_end, *, layout, num_q_heads, block_pages, sm_scale, interpret,
                       precision, path):
  del interpret, precision, path
  if carry is None:
    carry = _ref.init_carry(layout.num_kv_heads, q_shd.shape[0] * (num_q_heads //
                                                                  layout.num_kv_heads),
                            q_shd.shape[-1])
  return _ref.span_attention_partial_reference(
      q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end, layout=layout,
      num_q_heads=num_q_heads, block_pages=block_pages, sm_scale=sm_scale)


def _triton_partial(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end,
                    *, layout, num_q_heads, block_pages, sm_scale, interpret, precision, path):
  return _triton.span_attention_partial_triton(
      q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end, layout=layout,
      num_q_heads=num_q_heads, block_pages=block_pages, sm_scale=sm_scale, interpret=interpret,
      precision=precision, path=path)


def _triton_block_pages(call: SpanCall, num_table_pages: int, sms: int) -> int:
  return _triton.choose_block_pages(num_table_pages, call.layout.num_kv_heads, call.num_tokens,
                                    max(1, call.num_q_heads // call.layout.num_kv_heads), sms,
                                    call.path)


def _check_f16(precision: str):
  if precision != "f16":
    raise ValueError(f"the Mosaic GPU kernels compute with f16 operands only (precision='f16'), "
                     f"got precision={precision!r}; use implementation='triton' for it")


def _mosaic_partial(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end,
                    *, layout, num_q_heads, block_pages, sm_scale, interpret, precision, path):
  del path
  _check_f16(precision)
  rows = q_shd.shape[0] * (num_q_heads // layout.num_kv_heads)
  kernel = (_prefill.span_attention_partial_mosaic_prefill if uses_mosaic_prefill(layout, rows)
            else _decode.span_attention_partial_mosaic_decode)
  return kernel(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end,
                layout=layout, num_q_heads=num_q_heads, block_pages=block_pages,
                sm_scale=sm_scale, interpret=interpret)


def _mosaic_block_pages(call: SpanCall, num_table_pages: int, sms: int) -> int:
  rows = call.num_tokens * max(1, call.num_q_heads // call.layout.num_kv_heads)
  if uses_mosaic_prefill(call.layout, rows):
    return _prefill.choose_block_pages(num_table_pages, rows, call.layout.num_kv_heads, sms)
  return _decode.choose_block_pages(num_table_pages, sms)


def mosaic_device_ok(device=None) -> bool:
  """Whether the Mosaic GPU kernels can run on `device` (default: jax's first): they are built on
  Hopper's wgmma and TMA (compute capability 9.x), so on another NVIDIA GPU "auto" gives their
  calls to Triton. True for a device that is not a GPU (routing decided for a GPU elsewhere)."""
  try:
    dev = jax.devices()[0] if device is None else device
  except RuntimeError:
    return True
  cc = getattr(dev, "compute_capability", None)
  if dev.platform != "gpu" or not cc:
    return True
  return str(cc).split(".")[0] == "9"


def _mosaic_supports(call: SpanCall) -> bool:
  return mosaic_device_ok() and mosaic_takes(call.layout, call.head_dim, call.rows, call.precision, call.path,
                                             call.num_tokens)


_REGISTRY = {impl.name: impl for impl in (
    Implementation("reference", lambda call: True, _reference_partial, _triton_block_pages, True),
    Implementation("triton", lambda call: True, _triton_partial, _triton_block_pages, True),
    Implementation("mosaic", _mosaic_supports, _mosaic_partial, _mosaic_block_pages, False),
)}
IMPLEMENTATIONS = tuple(_REGISTRY)
# the implementations that take every K/V pair, path and precision of the contract
FULL_IMPLEMENTATIONS = tuple(name for name, impl in _REGISTRY.items() if impl.full)
AUTO_ORDER = ("mosaic", "triton")     # "auto" on a GPU: the first that supports the call


def get_implementation(name: str) -> Implementation:
  """The registry's entry `name` (one of IMPLEMENTATIONS)."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown span-attention implementation {name!r}; "
                     f"choose one of {IMPLEMENTATIONS} or 'auto'")
  return _REGISTRY[name]


# the page sizes each implementation takes: "reference" any; "triton" key tiles of a power of two
# >= 16 that divide the page (`triton.tile_config`); "mosaic" whole 64-token tiles
# (`mosaic_common.check_layout`). None needs a power of two.
PAGE_TOKENS_MULTIPLE = {"reference": 1, "triton": 16, "mosaic": _mc.BLOCK_TOKENS}


def check_page_tokens(page_tokens: int, implementation: str) -> None:
  """ValueError unless `implementation` ("reference", "triton", "mosaic") takes pages of
  `page_tokens` tokens (`PAGE_TOKENS_MULTIPLE`)."""
  m = PAGE_TOKENS_MULTIPLE[get_implementation(implementation).name]
  if page_tokens < 1 or page_tokens % m:
    raise ValueError(f"the {implementation} attention takes pages of a multiple of {m} tokens >= {m}"
                     + (" (key tiles of a power of two >= 16 that divide the page)" if implementation == "triton"
                        else " (64-token tiles)" if implementation == "mosaic" else ""))


def resolve_implementation(implementation: str, *, layout: Optional[PageLayout] = None,
                           q_shape=None, precision: str = _triton.DEFAULT_PRECISION,
                           path: Optional[str] = None, backend: Optional[str] = None) -> str:
  """"auto" -> on an NVIDIA GPU backend the first of `AUTO_ORDER` that supports the call
  (layout and q_shape [S, H, D] given; "triton" where they are not), "reference" on other
  backends. Other names are checked and returned. backend: the one to decide for (default:
  jax's default backend)."""
  if implementation != "auto":
    return get_implementation(implementation).name
  if (backend or jax.default_backend()) != "gpu":
    return "reference"
  if layout is None or q_shape is None:
    return "triton"
  s, h, d = q_shape
  call = SpanCall(layout, min(s, ROWS_PER_CALL), h, d, precision, path)   # more rows: calls of that many
  return next(name for name in AUTO_ORDER if _REGISTRY[name].supports(call))


def resolve_block_pages(block_pages: Union[int, str], num_table_pages: int, num_tokens: int,
                        num_q_heads: int, layout: PageLayout, path: Optional[str] = None,
                        implementation: str = "triton") -> int:
  """block_pages as given (an int >= 1), or the "auto" choice of `implementation` for these
  static shapes."""
  if isinstance(block_pages, str):
    if block_pages != "auto":
      raise ValueError(f"block_pages must be an int >= 1 or 'auto', got {block_pages!r}")
    call = SpanCall(layout, min(num_tokens, ROWS_PER_CALL), num_q_heads, layout.head_dim, path=path)
    return get_implementation(implementation).auto_block_pages(call, num_table_pages, num_sms())
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
  _common.check_operands(q_shd, pool_pn, layout, None, page_table_t, q_pos_s)
  name = resolve_implementation(implementation, layout=layout, q_shape=q_shd.shape,
                                precision=precision, path=path)
  block_pages = resolve_block_pages(block_pages, page_table_t.shape[0], q_shd.shape[0],
                                    q_shd.shape[1], layout, path, name)
  check_page_table(page_table_t, pool_pn.shape[0], layout, kv_len)
  partial = functools.partial(_in_row_pieces, _REGISTRY[name].partial)
  return _common.whole_span(partial, q_shd, pool_pn, page_table_t, kv_len,
                            q_pos_s, layout=layout, block_pages=block_pages, sm_scale=sm_scale,
                            interpret=interpret, precision=precision, path=path)


def span_attention_partial(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin,
                           tile_end, *, layout: PageLayout, num_q_heads: int,
                           block_pages: Union[int, str] = 1, sm_scale: Optional[float] = None,
                           implementation: str = "reference", interpret: bool = False,
                           precision: str = _triton.DEFAULT_PRECISION, path: Optional[str] = None):
  """Fold logical pages [tile_begin, tile_end) into `carry` (see reference.py; carry None: the
  empty carry).

  For every implementation, waves whose boundaries are multiples of
  `block_pages` pages give the same bits as one call ("auto" resolves from the table's length,
  so waves over one table share the size).
  """
  _common.check_operands(q_shd, pool_pn, layout, num_q_heads, page_table_t, q_pos_s)
  name = resolve_implementation(implementation, layout=layout, q_shape=q_shd.shape,
                                precision=precision, path=path)
  block_pages = resolve_block_pages(block_pages, page_table_t.shape[0], q_shd.shape[0],
                                    num_q_heads, layout, path, name)
  check_page_table(page_table_t, pool_pn.shape[0], layout, kv_len, tile_begin, tile_end)
  return _in_row_pieces(_REGISTRY[name].partial, q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry,
                        tile_begin, tile_end, layout=layout, num_q_heads=num_q_heads,
                        block_pages=block_pages, sm_scale=sm_scale, interpret=interpret,
                        precision=precision, path=path)


# query rows a kernel call takes at most (the prefill path's tile); calls over more rows (a
# prefill micro-batch of 512 or 1024 rows, whose projections run as one GEMM) are split into pieces
ROWS_PER_CALL = _triton.MAX_QUERY_ROWS


def _in_row_pieces(partial, q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end, *,
                   layout: PageLayout, num_q_heads: int, **kw):
  """`partial` over the query rows in pieces of at most `ROWS_PER_CALL`, one call a piece, the
  pieces' carries joined. Each row's result depends on its own query and position only (up to
  the rounding of products over another row count)."""
  s = q_shd.shape[0]
  if s <= ROWS_PER_CALL:
    return partial(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry, tile_begin, tile_end,
                   layout=layout, num_q_heads=num_q_heads, **kw)
  r = num_q_heads // layout.num_kv_heads      # carries fold a KV head's query heads into S x r rows
  parts = []
  for i in range(0, s, ROWS_PER_CALL):
    j = min(s, i + ROWS_PER_CALL)
    piece = None if carry is None else _ref.Carry(*(x[:, i * r:j * r] for x in carry))
    parts.append(partial(q_shd[i:j], pool_pn, page_table_t, kv_len, q_pos_s[i:j], piece, tile_begin,
                         tile_end, layout=layout, num_q_heads=num_q_heads, **kw))
  return _ref.Carry(*(jnp.concatenate(xs, axis=1) for xs in zip(*parts)))


init_carry = _ref.init_carry
finalize = _ref.finalize
