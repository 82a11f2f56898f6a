"""Span attention over paged, quantized KV pages: Pallas kernels (Triton lowering).

Two kernels:

* `_span_kernel` — split-K over fixed LOGICAL partitions of `block_pages`
  pages. Grid (KV head g, row block, partition). A program reads its
  partition's pages through the page table (a plain GMEM ref: no scalar
  prefetch, which is TPU-only), dequantizes K and V tile by tile from the raw
  page bytes (never a full-precision copy of the cache), and runs one online
  softmax over the partition in logical token order. It writes the partition's
  un-normalised `(m, l, acc)`.
* `_combine_kernel` — folds the partitions into the carry strictly left to
  right in logical order, so one call equals any sequence of waves whose
  boundaries are multiples of `block_pages` pages, bit for bit. An empty
  partition (`m=-inf, l=0, acc=0`) is an exact no-op of the fold.

Neither kernel looks at a physical page number except to form an address, so
the result depends only on the logical token order (placement invariance).

Page bytes are read as little-endian uint16 halfwords (every ggml block,
row and plane offset is even). A head row is decoded into "planes" whose
columns are a fixed permutation of the head dimension:

* Q8_0 (17 halfwords a block: scale, then 16 pairs of int8): 2 planes,
  plane e holds dims `blk*32 + 2i + e` (one halfword gives both planes).
* Q4_0 (9 halfwords a block: scale, then 8 halfwords of 4 nibbles): 4 planes,
  halfword i of a block holds dims 2i (bits 0-3), 2i+16 (4-7), 2i+1 (8-11),
  2i+17 (12-15).
* F16 / BF16: 1 plane, identity.

The query is permuted into K's plane order in the wrapper (a gather of a few
KB), and the output is permuted back from V's plane order.

Paths (all one kernel body, different tiles; see `select_path`):
  "vector"  1-2 query tokens  (decode)           row block 16-32, wide key tiles
  "matrix"  3-8 query tokens  (speculative verify) one row block of <= 64 rows
  "prefill" 9-256 query tokens (chunk vs history) 64-row blocks, causal skip
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # jax 0.10 / 0.11: the Triton compiler params live here
  from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover
  _pltriton = None

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import reference as _ref

SUPPORTED_PAIRS = (("q8_0", "q4_0"), ("q8_0", "q8_0"), ("f16", "f16"), ("bf16", "bf16"))
MAX_QUERY_ROWS = 256  # query tokens per call (prefill chunk)
PATHS = ("vector", "matrix", "prefill")
PRECISIONS = ("tf32", "tf32x3", "ieee", "f16", "bf16")
# "f16" / "bf16": dot operands rounded to that type (f32 accumulation). Dequantized
# Q8_0 / Q4_0 values carry <= 11 significant bits, so f16 loses about what tf32 does.
_OPERAND_DTYPES = {"f16": jnp.float16, "bf16": jnp.bfloat16}
_COMBINE_UNROLL = 8  # partitions loaded at once by the combine kernel

# kind -> (planes, halfwords per 32-value block or None for plain scalars)
_FORMATS = {"q8_0": (2, 17), "q4_0": (4, 9), "f16": (1, None), "bf16": (1, None)}


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class PlaneMap:
  """How one KV kind's head row becomes planes [tokens, width] in the kernel."""

  kind: str
  head_dim: int

  @property
  def planes(self) -> int:
    return _FORMATS[self.kind][0]

  @property
  def width(self) -> int:  # real columns per plane
    return self.head_dim // self.planes

  @property
  def width_pad(self) -> int:  # power of two, >= 16 (Triton dot / tensor shapes)
    return max(16, _next_pow2(self.width))

  def dims(self) -> np.ndarray:
    """[planes, width] int: head-dim index of each plane column."""
    d = self.head_dim
    if self.kind == "q8_0":
      j = np.arange(d // 2)
      blk, i = j // 16, j % 16
      return np.stack([blk * 32 + 2 * i + e for e in range(2)])
    if self.kind == "q4_0":
      j = np.arange(d // 4)
      blk, i = j // 8, j % 8
      return np.stack([blk * 32 + 2 * i, blk * 32 + 16 + 2 * i,
                       blk * 32 + 2 * i + 1, blk * 32 + 17 + 2 * i])
    return np.arange(d)[None]

  def halfword_cols(self):
    """In-kernel: ([1, Wp] data, [1, Wp] scale or None) halfword offsets in a head row."""
    j = jnp.minimum(lax.broadcasted_iota(jnp.int32, (1, self.width_pad), 1), self.width - 1)
    if self.kind == "q8_0":
      blk, i = j // 16, j % 16
      return blk * 17 + 1 + i, blk * 17
    if self.kind == "q4_0":
      blk, i = j // 8, j % 8
      return blk * 9 + 1 + i, blk * 9
    return j, None


@dataclasses.dataclass(frozen=True)
class TileConfig:
  path: str
  block_rows: int     # BM: folded query rows per program
  block_tokens: int   # BT: keys per inner step (divides page_tokens)
  num_warps: int
  num_stages: int


def select_path(num_tokens: int) -> str:
  if num_tokens < 1:
    raise ValueError("span attention needs at least 1 query row")
  if num_tokens <= 2:
    return "vector"
  if num_tokens <= 8:
    return "matrix"
  if num_tokens <= MAX_QUERY_ROWS:
    return "prefill"
  raise ValueError(f"too many query rows: {num_tokens} > {MAX_QUERY_ROWS} "
                   f"(split the prefill chunk into pieces of at most {MAX_QUERY_ROWS} tokens)")


def tile_config(num_tokens: int, group: int, page_tokens: int, path: Optional[str] = None,
                block_tokens: Optional[int] = None, num_warps: Optional[int] = None,
                num_stages: Optional[int] = None) -> TileConfig:
  """Tile sizes of a path. `group` = query heads per KV head (rows per token)."""
  auto = select_path(num_tokens)
  path = path or auto
  if path not in PATHS:
    raise ValueError(f"unknown path {path!r}; choose one of {PATHS}")
  limit = {"vector": 2, "matrix": 8, "prefill": MAX_QUERY_ROWS}[path]
  if num_tokens > limit:
    raise ValueError(f"too many query rows for the {path} path: {num_tokens} tokens > {limit}")
  rows = num_tokens * group
  if path == "prefill":
    bm, bt, nw, ns = min(64, max(16, _next_pow2(rows))), 64, 4, 2
  elif path == "matrix":
    bm, bt, nw, ns = max(16, _next_pow2(rows)), 64, 4, 2
    if bm > 64:
      bm = 64
  else:
    bm, bt, nw, ns = max(16, _next_pow2(rows)), 64, 4, 3
    if bm > 32:
      bm = 32
  bt = block_tokens or bt
  bt = min(bt, _largest_pow2_divisor(page_tokens))
  if bt < 16:
    raise ValueError(f"page_tokens {page_tokens} needs a power-of-two divisor >= 16 for key tiles")
  return TileConfig(path, bm, bt, num_warps or nw, num_stages or ns)


def _largest_pow2_divisor(n: int) -> int:
  return n & -n


def check_layout(layout: PageLayout, head_dim: int):
  pair = (layout.k_type, layout.v_type)
  if pair not in SUPPORTED_PAIRS:
    raise ValueError(f"unsupported K/V pair {layout.k_type.upper()}/{layout.v_type.upper()}; "
                     f"the kernels support {', '.join(k.upper() + '/' + v.upper() for k, v in SUPPORTED_PAIRS)}")
  if head_dim % 32:
    raise ValueError(f"head_dim {head_dim} is not a multiple of 32")
  if head_dim != layout.head_dim:
    raise ValueError(f"query head_dim {head_dim} != layout head_dim {layout.head_dim}")
  if layout.page_bytes % 2 or layout.v_offset % 2:
    raise ValueError("page layout offsets must be even (halfword addressing)")


def _dot_precision(precision: str, interpret: bool):
  if interpret:
    return lax.Precision.HIGHEST  # the CPU interpreter computes float32 exactly
  if precision == "tf32":
    return lax.Precision.DEFAULT
  if precision == "tf32x3":
    return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  if precision == "ieee":
    return lax.Precision.HIGHEST
  if precision in _OPERAND_DTYPES:
    return lax.Precision.DEFAULT
  raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")


def _dot_nt(a, b, precision, dtype=None):  # a [M, K] . b [N, K]^T -> [M, N] f32
  if dtype is not None:
    a, b = a.astype(dtype), b.astype(dtype)
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _dot_nn(a, b, precision, dtype=None):  # a [M, K] . b [K, N] -> [M, N] f32
  if dtype is not None:
    a, b = a.astype(dtype), b.astype(dtype)
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _masked_load(ref, idx, mask, other):
  """Masked gather `ref[idx]` (Triton load; the CPU interpreter runs it too)."""
  if _pltriton is not None and hasattr(_pltriton, "load"):
    return _pltriton.load(ref.at[idx], mask=mask, other=other)
  return pl.load(ref, idx, mask=mask, other=other)  # pragma: no cover (older jax)


def _f16_to_f32(w_u16):
  return lax.bitcast_convert_type(w_u16, jnp.float16).astype(jnp.float32)


def _bf16_to_f32(w_u16):
  return lax.bitcast_convert_type(w_u16.astype(jnp.int32) << 16, jnp.float32)


def _decode_planes(pool_ref, phys, row_hw, kind, cols, scale_cols, valid):
  """Gather one tile of head rows and decode it into planes of float32.

  row_hw   [BT, 1] int32 halfword offset of each token's head row in the page
  cols     [1, Wp] int32 halfword offset of each plane column in a head row
  valid    [BT, 1] bool  rows that may be read (others load 0)
  -> list of [BT, Wp] float32 planes (padded columns hold junk of column W-1;
     the matching query / output columns are zero / dropped).
  """
  bt, wp = row_hw.shape[0], cols.shape[1]
  mask = jnp.broadcast_to(valid, (bt, wp))
  w = _masked_load(pool_ref, (phys, row_hw + cols), mask, 0)
  if kind == "bf16":
    return [_bf16_to_f32(w)]
  if kind == "f16":
    return [_f16_to_f32(w)]
  s = _f16_to_f32(_masked_load(pool_ref, (phys, row_hw + scale_cols), mask, 0))
  x = w.astype(jnp.int32)
  if kind == "q8_0":
    lo = ((x & 0xFF) ^ 0x80) - 0x80
    hi = (((x >> 8) & 0xFF) ^ 0x80) - 0x80
    return [lo.astype(jnp.float32) * s, hi.astype(jnp.float32) * s]
  # q4_0: dims 2i, 2i+16, 2i+1, 2i+17 of the block
  return [(((x >> sh) & 0xF) - 8).astype(jnp.float32) * s for sh in (0, 4, 8, 12)]


def _span_kernel(meta_ref, tab_ref, qpos_ref, q_ref, pool_ref, m_out, l_out, acc_out, *,
                 layout: PageLayout, kmap: PlaneMap, vmap: PlaneMap, cfg: TileConfig,
                 block_pages: int, num_phys: int, precision, operand_dtype):
  g = pl.program_id(0)
  mb = pl.program_id(1)
  pp = pl.program_id(2)
  bm, bt = cfg.block_rows, cfg.block_tokens
  pt = layout.page_tokens
  kv_len = meta_ref[0]
  tile_begin = meta_ref[1]
  tile_end = meta_ref[2]       # already clipped to the active pages
  n_table = meta_ref[3]

  rows = pl.ds(mb * bm, bm)
  qpos = qpos_ref[rows]                                   # [BM] int32 (-1: padding row)
  q_planes = [q_ref[g, rows, p, :] for p in range(kmap.planes)]  # [BM, Wk] f32, pre-scaled

  page_lo = jnp.maximum(pp * block_pages, tile_begin)
  page_hi = jnp.minimum(pp * block_pages + block_pages, tile_end)
  tok_lo = page_lo * pt
  tok_end = jnp.minimum(page_hi * pt, kv_len)             # keys at or past this are masked
  tok_hi = jnp.minimum(tok_end, jnp.max(qpos) + 1)        # causal skip for the whole row block
  n_tiles = jnp.maximum(tok_hi - tok_lo + bt - 1, 0) // bt

  k_cols, k_scols = kmap.halfword_cols()
  v_cols, v_scols = vmap.halfword_cols()
  k_head_hw = layout.k_head_bytes // 2
  v_head_hw = layout.v_head_bytes // 2
  k_row_hw = layout.k_row_bytes // 2
  v_row_hw = layout.v_row_bytes // 2
  v_base_hw = layout.v_offset // 2
  t_iota = lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
  tk_iota = lax.broadcasted_iota(jnp.int32, (1, bt), 1)

  def body(i, carry):
    m_i, l_i, accs = carry
    t0 = tok_lo + i * bt
    lp = jnp.minimum(t0 // pt, n_table - 1)
    phys = jnp.clip(tab_ref[lp], 0, num_phys - 1)
    off = t0 - (t0 // pt) * pt + t_iota                   # [BT, 1] token row within the page
    valid = (t0 + t_iota) < tok_end                        # [BT, 1]
    k_rows = off * k_row_hw + g * k_head_hw
    v_rows = v_base_hw + off * v_row_hw + g * v_head_hw
    k_planes = _decode_planes(pool_ref, phys, k_rows, kmap.kind, k_cols, k_scols, valid)
    s = _dot_nt(q_planes[0], k_planes[0], precision, operand_dtype)
    for p in range(1, kmap.planes):
      s = s + _dot_nt(q_planes[p], k_planes[p], precision, operand_dtype)  # [BM, BT]
    key = t0 + tk_iota                                     # [1, BT]
    ok = (key < tok_end) & (key <= qpos[:, None])
    s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    m_use = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    p_mt = jnp.exp(s - m_use[:, None])
    alpha = jnp.exp(m_i - m_use)
    l_new = l_i * alpha + jnp.sum(p_mt, axis=1)
    v_planes = _decode_planes(pool_ref, phys, v_rows, vmap.kind, v_cols, v_scols, valid)
    accs = tuple(a * alpha[:, None] + _dot_nn(p_mt, vp, precision, operand_dtype) for a, vp in zip(accs, v_planes))
    return m_new, l_new, accs

  init = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32),
          tuple(jnp.zeros((bm, vmap.width_pad), jnp.float32) for _ in range(vmap.planes)))
  m_f, l_f, accs = lax.fori_loop(0, n_tiles, body, init)
  m_out[g, pp, rows] = m_f
  l_out[g, pp, rows] = l_f
  for p in range(vmap.planes):
    acc_out[g, pp, rows, p, :] = accs[p]


def _combine_kernel(m_parts, l_parts, acc_parts, m_in, l_in, acc_in, m_out, l_out, acc_out, *,
                    block_rows: int, num_parts: int, unroll: int):
  """Left fold of the partitions (logical order) into the carry; grid (g, row block, plane)."""
  g = pl.program_id(0)
  mb = pl.program_id(1)
  p = pl.program_id(2)
  rows = pl.ds(mb * block_rows, block_rows)
  m_c = m_in[g, rows]
  l_c = l_in[g, rows]
  a_c = acc_in[g, rows, p, :]

  def fold(c, part):
    m_c, l_c, a_c = c
    m_p, l_p, a_p = part
    m_new = jnp.maximum(m_c, m_p)
    m_use = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    al_c = jnp.exp(m_c - m_use)
    al_p = jnp.exp(m_p - m_use)
    return (m_new, l_c * al_c + l_p * al_p, a_c * al_c[:, None] + a_p * al_p[:, None])

  def body(j, c):
    parts = []
    for u in range(unroll):  # issue all loads of the group, then fold in order
      q = j * unroll + u
      parts.append((m_parts[g, q, rows], l_parts[g, q, rows], acc_parts[g, q, rows, p, :]))
    for part in parts:
      c = fold(c, part)
    return c

  m_c, l_c, a_c = lax.fori_loop(0, num_parts // unroll, body, (m_c, l_c, a_c))
  m_out[g, rows, p] = m_c
  l_out[g, rows, p] = l_c
  acc_out[g, rows, p, :] = a_c


def _compiler_params(cfg_warps: int, cfg_stages: int, interpret: bool):
  if interpret or _pltriton is None:
    return None
  return _pltriton.CompilerParams(num_warps=cfg_warps, num_stages=cfg_stages)


def _permutations(kmap: PlaneMap, vmap: PlaneMap):
  """Gather indices: q [.., D] -> [.., NK, WKp] and acc [.., NV*WVp] -> [.., D]."""
  kd = kmap.dims()                                   # [NK, WK]
  k_idx = np.full((kmap.planes, kmap.width_pad), -1, np.int64)
  k_idx[:, :kmap.width] = kd
  vd = vmap.dims()
  v_src = np.zeros(vmap.head_dim, np.int64)          # dim -> flat padded plane column
  for p in range(vmap.planes):
    v_src[vd[p]] = p * vmap.width_pad + np.arange(vmap.width)
  v_to_plane = np.zeros((vmap.planes, vmap.width_pad), np.int64)  # padded plane col -> dim
  v_to_plane[:, :vmap.width] = vd
  return k_idx, v_src, v_to_plane


@functools.partial(jax.jit, static_argnames=(
    "layout", "num_q_heads", "block_pages", "sm_scale", "interpret", "precision", "path",
    "block_tokens", "num_warps", "num_stages"))
def span_attention_partial_triton(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry: _ref.Carry,
                                  tile_begin, tile_end, *, layout: PageLayout, num_q_heads: int,
                                  block_pages: int = 1, sm_scale: Optional[float] = None,
                                  interpret: bool = False, precision: str = "tf32",
                                  path: Optional[str] = None, block_tokens: Optional[int] = None,
                                  num_warps: Optional[int] = None,
                                  num_stages: Optional[int] = None) -> _ref.Carry:
  """Kernel version of `reference.span_attention_partial_reference` (same contract)."""
  s_tok, h, d = q_shd.shape
  g = layout.num_kv_heads
  check_layout(layout, d)
  if h % g:
    raise ValueError(f"{h} query heads are not a multiple of {g} KV heads")
  if h != num_q_heads:
    raise ValueError(f"q has {h} heads but num_q_heads={num_q_heads}")
  if block_pages < 1:
    raise ValueError(f"block_pages must be >= 1, got {block_pages}")
  if pool_pn.ndim != 2 or pool_pn.shape[1] != layout.page_bytes:
    raise ValueError(f"pool must be [pages, {layout.page_bytes}] bytes, got {pool_pn.shape}")
  r = h // g
  cfg = tile_config(s_tok, r, layout.page_tokens, path, block_tokens, num_warps, num_stages)
  kmap, vmap = PlaneMap(layout.k_type, d), PlaneMap(layout.v_type, d)
  prec = _dot_precision(precision, interpret)
  scale = (1.0 / d ** 0.5) if sm_scale is None else sm_scale
  bm = cfg.block_rows
  rows = s_tok * r
  rows_pad = -(-rows // bm) * bm
  n_mb = rows_pad // bm
  n_table = page_table_t.shape[0]
  unroll = _COMBINE_UNROLL
  n_parts = -(-max(n_table, 1) // block_pages)
  n_parts = -(-n_parts // unroll) * unroll
  num_phys = pool_pn.shape[0]

  k_idx, v_src, _ = _permutations(kmap, vmap)
  qf_gmd = _ref.fold_query(q_shd.astype(jnp.float32), g) * jnp.float32(scale)
  qf_gmd = jnp.pad(qf_gmd, ((0, 0), (0, rows_pad - rows), (0, 0)))
  q_planes = jnp.where(jnp.asarray(k_idx >= 0), qf_gmd[:, :, np.maximum(k_idx, 0)], 0.0)  # [G,Mp,NK,WKp]
  qpos_m = jnp.repeat(q_pos_s.astype(jnp.int32), r)
  qpos_m = jnp.pad(qpos_m, (0, rows_pad - rows), constant_values=-1)
  kv_len = jnp.asarray(kv_len, jnp.int32)
  n_active = (kv_len + layout.page_tokens - 1) // layout.page_tokens
  tile_end_c = jnp.minimum(jnp.minimum(jnp.asarray(tile_end, jnp.int32), n_active), n_table)
  meta = jnp.stack([kv_len, jnp.asarray(tile_begin, jnp.int32), tile_end_c,
                    jnp.int32(n_table)]).astype(jnp.int32)
  pool_u16 = lax.bitcast_convert_type(
      pool_pn.reshape(num_phys, layout.page_bytes // 2, 2), jnp.uint16)

  nv, wvp = vmap.planes, vmap.width_pad
  kern = functools.partial(_span_kernel, layout=layout, kmap=kmap, vmap=vmap, cfg=cfg,
                           block_pages=block_pages, num_phys=num_phys, precision=prec,
                           operand_dtype=_OPERAND_DTYPES.get(precision))
  m_p, l_p, acc_p = pl.pallas_call(
      kern,
      grid=(g, n_mb, n_parts),
      out_shape=(jax.ShapeDtypeStruct((g, n_parts, rows_pad), jnp.float32),
                 jax.ShapeDtypeStruct((g, n_parts, rows_pad), jnp.float32),
                 jax.ShapeDtypeStruct((g, n_parts, rows_pad, nv, wvp), jnp.float32)),
      compiler_params=_compiler_params(cfg.num_warps, cfg.num_stages, interpret),
      interpret=interpret,
      name="kvjax_span_attention",
  )(meta, page_table_t.astype(jnp.int32), qpos_m, q_planes, pool_u16)

  # carry -> padded plane order
  v_dims = np.zeros((nv, wvp), np.int64)
  v_dims[:, :vmap.width] = vmap.dims()
  pad_m = ((0, 0), (0, rows_pad - rows))
  m_in = jnp.pad(carry.m_gm, pad_m, constant_values=-jnp.inf)
  l_in = jnp.pad(carry.l_gm, pad_m)
  acc_in = jnp.pad(carry.acc_gmd, pad_m + ((0, 0),))[:, :, v_dims]      # [G, Mp, NV, WVp]
  # the combine grid also runs over planes; m/l come back once per plane
  m_c, l_c, acc_c = pl.pallas_call(
      functools.partial(_combine_kernel, block_rows=bm, num_parts=n_parts, unroll=unroll),
      grid=(g, n_mb, nv),
      out_shape=(jax.ShapeDtypeStruct((g, rows_pad, nv), jnp.float32),
                 jax.ShapeDtypeStruct((g, rows_pad, nv), jnp.float32),
                 jax.ShapeDtypeStruct((g, rows_pad, nv, wvp), jnp.float32)),
      compiler_params=_compiler_params(4, 2, interpret),
      interpret=interpret,
      name="kvjax_span_combine",
  )(m_p, l_p, acc_p, m_in, l_in, acc_in)
  acc_flat = acc_c.reshape(g, rows_pad, nv * wvp)[:, :rows, v_src]
  return _ref.Carry(m_c[:, :rows, 0], l_c[:, :rows, 0], acc_flat)


def span_attention_triton(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, *, layout: PageLayout,
                          block_pages: int = 1, sm_scale: Optional[float] = None,
                          interpret: bool = False, **kw):
  """o_shd [S, H, D] float32 over all active pages (kernel version of the reference)."""
  s, h, d = q_shd.shape
  carry = _ref.init_carry(layout.num_kv_heads, s * (h // layout.num_kv_heads), d)
  carry = span_attention_partial_triton(
      q_shd, pool_pn, page_table_t, jnp.asarray(kv_len, jnp.int32), q_pos_s, carry, jnp.int32(0),
      jnp.int32(page_table_t.shape[0]), layout=layout, num_q_heads=h, block_pages=block_pages,
      sm_scale=sm_scale, interpret=interpret, **kw)
  return _ref.finalize(carry, h)
