"""Span attention over paged, quantized KV pages: Pallas kernel, Mosaic GPU (Hopper) lowering.

First version (v1: correct before fast). Same contract as `reference.py` and
`kernel_triton.py`: split-K over fixed LOGICAL partitions of `block_pages`
pages, then an in-order left fold of the partitions into the carry.

Kernel `_span_kernel_mosaic`, grid (KV head g, partition pp), one warpgroup a
program. Tokens are the wgmma M dimension (M must be a multiple of 64), the
folded query rows (S query tokens x R query heads of the KV head, padded to
N = 16 / 32 / 64) are the N dimension. Per key tile of BT = 64 tokens of one
page:

1. copy the raw page bytes of the tile into SMEM (TMA), page number read as a
   scalar from the GMEM page table;
2. decode K (Q8_0) and V (Q4_0 or Q8_0) of head g into f16 SMEM tiles
   [64, 256] (32-byte swizzle; wgmma wants the lhs and rhs swizzles equal and
   Q^T has N = 16 columns): `(0x6400 | bits)` as f16 minus 1152 (int8) or 1032
   (Q4_0 nibble) is exact, times the per-token-per-block f16 scale (scales of
   rows past the partition's end are zeroed, so junk bytes never make NaN/inf
   values). The raw SMEM rows are uint8 and the quants are loaded as
   [64, 16]-byte windows in the WGMMA layout (2-byte loads: every ggml block
   starts at an even byte; a 16-bit WGMMA-layout load goes through ldmatrix,
   which needs 16-byte-aligned rows, and failed with
   CUDA_ERROR_MISALIGNED_ADDRESS on the H200). Each window decodes to a
   [64, 16] f16 slice stored straight into the swizzled tile, columns in
   head-dim order;
3. `S^T[64, N] = K_f16[64, 256] @ Q^T[256, N]` (wgmma, Q^T resident in SMEM),
   times sm_scale, mask (key < kv_len, key < partition end, key <= q_pos of the
   column's query token), online softmax along axis 0 with running m, l [N];
4. `O^T[256, N] = O^T * alpha + V_f16^T @ P^T` (wgmma, V through `transpose_ref`).

The program writes m, l [N] and acc^T [256, N]; the wrapper folds the
partitions (after the carry) left to right in jnp and returns a
`reference.Carry`.

Copy scheme. TMA boxes are <= 256 elements a dimension, a copy must move a
multiple of 128 bytes (Pallas arrives on the barrier from every thread of the
warpgroup), and Pallas has no GMEM reshape, so a head's [64 tokens, 272
bytes] K rows (token stride 1088 bytes) cannot be one strided copy of the
[P, page_bytes] pool. The wrapper views the pool (free reshape) as
[P, page_bytes / 16, 16] uint8 (16-byte rows; every row, head, plane and tile
offset of the supported layouts is a multiple of 16 bytes); the kernel copies
the CONTIGUOUS span of 64 token rows that starts at head g's first byte
(`64 * k_row_bytes` bytes, in boxes of [256, 16]) and reshapes the SMEM buffer
to [64, k_row_bytes]: head g's K row of token t is then columns [0, 272) of row
t (static offsets). The same for V. Spans that run past the page end are
zero-filled by TMA and never used.

Interpret mode (`interpret=True`, the Mosaic GPU CPU interpreter) cannot run
SMEM reshapes, `plgpu.load` with a layout, `layout_cast`, `transpose_ref`, or
dynamic SMEM slices, so it uses: a pre-gathered GMEM view [P, T, G, head_bytes]
built in the wrapper (a copy of the pool: test sizes only) and one [64, head_bytes]
copy per tile; plain `ref[...]` loads; and `V^T @ P^T` as a register
`dot_general` instead of the transposed-A wgmma. Everything else (page-table
reads, the decode, the QK^T wgmma, masks, softmax, outputs) is the same code.

Measured on the H200 (jax 0.11.2, docs/PERFORMANCE.md S3-5): correct (3.7e-4
against the float32 reference, like the Triton kernel's "f16"), 1402 us at
128K S=1 against 288 us for the Triton kernel.

Not done in v1 (TODO):
* little pipelining: by default copy, wait, decode, dots per tile, one
  warpgroup; `overlap=True` issues tile i+1's K / V copy once tile i's K / V
  is decoded; measured SLOWER on the H200 (S4-1: 1566 against 1478 us at 128K
  S=1) and refused above 32 folded rows (over the SMEM limit by 24 B at 64),
  so the copies are not what v1 waits on; no producer/consumer warpgroups;
* each head's program copies the whole all-heads span of the tile (4x the
  bytes of its head through L2; whether the G programs of a partition run
  together and hit L2 is not checked), in 16-byte-wide TMA boxes (17 for K,
  9 for V a tile). Alternatives: one program per partition serving all heads
  (contiguous 128-byte-wide boxes), or a strided TMA descriptor through
  `plgpu.inline_mgpu`. Measured with `experiments/probe_tma_reads.py` (session 8,
  docs/PERFORMANCE.md S8-1/2): 16-byte boxes read at most 2.0-2.15 TB/s, 128- or
  256-byte boxes 4.0-4.3 TB/s; and this window decode (`decode_windows`) alone
  stops at 2.1-2.2 TB/s with 4 warpgroups (S8-5);
* every SMEM store gets Pallas's automatic warpgroup barriers (before and
  after); P^T goes through SMEM for the PV wgmma;
* K/V decoded through SMEM, not straight into wgmma register operands;
* the combine is a jnp left fold (not the pipelined Triton combine kernel);
* only Q8_0/Q4_0 and Q8_0/Q8_0 pages, head_dim 256, page_tokens a multiple
  of 64, at most 64 folded query rows (S * R <= 64);
* precision: f16 wgmma operands (the "f16" precision of the Triton kernel)
  with float32 accumulation; P is rounded to f16 before the PV dot;
* GPU tests: `KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu pytest tests/test_span_attention_mosaic.py`.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as _mgpu

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import reference as _ref
from kvjax_pallas.span_attention import kernel_triton as _triton

SUPPORTED_PAIRS = (("q8_0", "q4_0"), ("q8_0", "q8_0"))
HEAD_DIM = 256
BLOCK_TOKENS = 64          # keys per tile (the wgmma M dimension)
MAX_ROWS = 64              # folded query rows (S * R) per program
BLOCK = 32                 # values per ggml quant block
_ROW_BYTES = 16            # bytes per row of the GMEM pool view (the TMA copy granule)
_TMA_ROWS = 256            # TMA box limit per dimension
_KV_SWIZZLE = 32          # decoded K/V tiles: 16-column swizzle tiles (Q8_0 stores 16 columns)

# kind -> bytes per 32-value block (f16 scale first)
_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}

_ROW = _mgpu.WGMMA_ROW_LAYOUT
# a [64] vector along the token axis (one value per row of a WGMMA tile)
_ROW_LAYOUT = plgpu.Layout.TILED(_ROW.tiling, warp_dims=_ROW.warp_dims,
                                 lane_dims=_ROW.lane_dims, vector_dim=_ROW.vector_dim)


# Lane semantics (the kernel manages register layouts itself: plgpu.load(layout=...), layout_cast).
# jax 0.10 defaults to Lane; jax 0.11 defaults to Warpgroup, whose layout inference crashes on
# this kernel's reshaped SMEM views (IndexError in _conjure_transforms_for_smem_ref, seen on the
# H200 with jax 0.11.2), so it is pinned here.
_COMPILER_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def _interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret import params as _ip
  return _ip.InterpretGPUParams()


def _tiles(sw: int):
  return (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))


def rows_padded(rows: int) -> int:
  if rows < 1:
    raise ValueError("span attention needs at least 1 query row")
  if rows > MAX_ROWS:
    raise ValueError(f"too many folded query rows for the Mosaic GPU kernel: {rows} > {MAX_ROWS} "
                     f"(query tokens x query heads per KV head; split the call)")
  for n in (16, 32, 64):
    if rows <= n:
      return n
  raise AssertionError


def check_layout(layout: PageLayout, head_dim: int):
  pair = (layout.k_type, layout.v_type)
  if pair not in SUPPORTED_PAIRS:
    raise ValueError(f"unsupported K/V pair {layout.k_type.upper()}/{layout.v_type.upper()} for the "
                     f"Mosaic GPU kernel; it supports "
                     f"{', '.join(k.upper() + '/' + v.upper() for k, v in SUPPORTED_PAIRS)}")
  if head_dim != layout.head_dim:
    raise ValueError(f"query head_dim {head_dim} != layout head_dim {layout.head_dim}")
  if head_dim != HEAD_DIM:
    raise ValueError(f"the Mosaic GPU kernel supports head_dim {HEAD_DIM} only, got {head_dim}")
  if layout.page_tokens % BLOCK_TOKENS:
    raise ValueError(f"page_tokens {layout.page_tokens} is not a multiple of {BLOCK_TOKENS}")
  unit = _ROW_BYTES
  for name, val in (("k head bytes", layout.k_head_bytes), ("v head bytes", layout.v_head_bytes),
                    ("k row bytes", layout.k_row_bytes), ("v row bytes", layout.v_row_bytes),
                    ("v offset", layout.v_offset), ("page bytes", layout.page_bytes)):
    if val % unit:
      raise ValueError(f"{name} {val} is not a multiple of {unit} (TMA copy granule)")


def byte_view(pool):
  """uint8 [P, page_bytes] (as is) or uint16 [P, page_bytes // 2] -> uint8 [P, page_bytes]."""
  if pool.dtype == jnp.uint8:
    return pool
  p, nhw = pool.shape
  return lax.bitcast_convert_type(pool, jnp.uint8).reshape(p, 2 * nhw)


# ----------------------------------------------------------------------------- kernel pieces


class _Ops:
  """Operations that differ between the compiled lowering and the interpreter."""

  def __init__(self, interpret: bool):
    self.interpret = interpret

  def load(self, ref, idx, layout):
    if self.interpret:
      return ref[idx]
    return plgpu.load(ref, idx, layout=layout, optimized=False)

  def cast(self, x, layout):
    return x if self.interpret else plgpu.layout_cast(x, layout)

  def iota(self, shape, dim):
    if self.interpret:
      return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

  def row_iota(self, n):
    if self.interpret:
      return lax.broadcasted_iota(jnp.int32, (n,), 0)
    return plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=_ROW_LAYOUT)


def ops_for(interpret: bool) -> _Ops:
  """The kernel pieces' operations (`decode_windows`) for the compiled lowering or the
  interpreter."""
  return _Ops(interpret)


def _magic(bits, offset: float):
  """Small non-negative ints (uint16) -> f16 `value - offset` exactly (0x6400 | v is 1024 + v)."""
  return lax.bitcast_convert_type(bits | jnp.uint16(0x6400), jnp.float16) - jnp.float16(offset)


def decode_windows(ops: _Ops, raw, kind: str, valid_rows=None, head_col=0,
                   num_blocks: int = HEAD_DIM // BLOCK):
  """Yield (first head dim, f16 [BT, 16] values) of one head's rows, 16 dims at a time.

  raw SMEM [BT, >= head_col + head_bytes] uint8: the head's row of token t is bytes
  [head_col, head_col + head_bytes) of row t; head_col may be traced (a dynamic column).
  num_blocks: the ggml blocks to decode from head_col on (all of a head by default; a rolled loop
  decodes a few a step). valid_rows: [BT] bool (row layout) or None (all valid); invalid rows get
  a zero scale (exact zeros). The windows come in head-dim order.
  The quants are read as [BT, 16]-byte windows in the WGMMA layout (two consecutive bytes a
  thread: 2-byte loads, and every ggml block starts at an even byte). A 16-bit WGMMA-layout load
  would go through ldmatrix, which needs 16-byte-aligned rows: the blocks of a head row (34 / 18
  bytes) do not start there (CUDA_ERROR_MISALIGNED_ADDRESS on the H200 with the first, uint16
  version).
  """
  bt = raw.shape[0]
  per = _BLOCK_BYTES[kind]
  wgmma = plgpu.Layout.WGMMA
  for b in range(num_blocks):
    base = head_col + b * per
    lo = ops.load(raw, (slice(None), base), _ROW_LAYOUT).astype(jnp.uint16)
    hi = ops.load(raw, (slice(None), base + 1), _ROW_LAYOUT).astype(jnp.uint16)
    sc = lax.bitcast_convert_type(lo | (hi << jnp.uint16(8)), jnp.float16)
    if valid_rows is not None:
      sc = jnp.where(valid_rows, sc, jnp.float16(0))
    scb = lax.broadcast_in_dim(sc, (bt, 16), (0,))
    if kind == "q8_0":        # values 0-15 and 16-31: int8 = (byte ^ 0x80) - 128
      for half in range(2):
        x = ops.load(raw, (slice(None), pl.ds(base + 2 + 16 * half, 16)), wgmma)
        x = (x ^ jnp.uint8(0x80)).astype(jnp.uint16)
        yield b * BLOCK + 16 * half, _magic(x, 1152.0) * scb
    else:                     # q4_0: value j = (qs[j] & 15) - 8, value 16 + j = (qs[j] >> 4) - 8
      x = ops.load(raw, (slice(None), pl.ds(base + 2, 16)), wgmma).astype(jnp.uint16)
      yield b * BLOCK, _magic(x & jnp.uint16(0xF), 1032.0) * scb
      yield b * BLOCK + 16, _magic(x >> jnp.uint16(4), 1032.0) * scb


def _decode_head(ops: _Ops, raw, dst, kind: str, valid_rows):
  """raw SMEM [BT, >= head_bytes] uint8 (one head's rows at column 0) -> dst SMEM [BT, 256] f16,
  columns in head-dim order (`decode_windows`)."""
  for c0, vals in decode_windows(ops, raw, kind, valid_rows):
    dst[:, pl.ds(c0, 16)] = vals


def _tile_scores(ops: _Ops, k_f16, qt_s, t0, tok_end, qcol, sm_scale: float, n: int):
  """Masked, scaled S^T [BT, N] f32 of one decoded key tile (tokens t0 .. t0+BT)."""
  bt = k_f16.shape[0]

  def qk(acc_ref):
    plgpu.wgmma(acc_ref, k_f16, qt_s)
    plgpu.wgmma_wait(0)
    return acc_ref[...]

  s = pl.run_scoped(qk, plgpu.ACC((bt, n), jnp.float32))
  key = t0 + ops.iota((bt, n), 0)
  ok = (key < tok_end) & (key <= qcol)
  return jnp.where(ok, s * jnp.float32(sm_scale), -jnp.inf)


def _column_qpos(ops: _Ops, qpos_ref, num_tokens: int, group: int, shape):
  """[BT, N] int32: q_pos of each column's query token (-1 for padding columns)."""
  col = ops.iota(shape, 1)
  qcol = jnp.full(shape, -1, jnp.int32) if ops.interpret else ops.cast(
      jnp.full(shape, -1, jnp.int32), plgpu.Layout.WGMMA)
  for s in range(num_tokens):
    inside = (col >= s * group) & (col < (s + 1) * group)
    qcol = jnp.where(inside, qpos_ref[s], qcol)
  return qcol


def _init_state(ops: _Ops, n: int):
  """(m [N], l [N], acc^T [256, N]) of an empty online softmax."""
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  return (ops.cast(jnp.full((n,), -jnp.inf, jnp.float32), col_layout),
          ops.cast(jnp.zeros((n,), jnp.float32), col_layout),
          ops.cast(jnp.zeros((HEAD_DIM, n), jnp.float32), plgpu.Layout.WGMMA))


def _tile_update(ops: _Ops, get_k, get_v, k_f16, v_f16, p_s, qt_s, t0, tok_end, qcol,
                 state, *, k_type: str, v_type: str, sm_scale: float, n: int,
                 after=lambda plane: None):
  """One key tile (tokens t0 .. t0+BT) folded into the online softmax state.

  get_k / get_v: callables returning SMEM [BT, >= head_bytes] raw K / V rows of the head (they
  wait for the copy); after(plane) runs once a plane is decoded (its raw buffer is free).
  Returns (new state, masked scaled scores S^T [BT, N]).
  """
  bt = BLOCK_TOKENS
  m_i, l_i, acc = state
  valid = (t0 + ops.row_iota(bt)) < tok_end                    # [BT] row layout
  _decode_head(ops, get_k(), k_f16, k_type, valid)
  after("k")
  _decode_head(ops, get_v(), v_f16, v_type, valid)
  after("v")
  plgpu.commit_smem()                                           # decoded tiles -> wgmma
  s = _tile_scores(ops, k_f16, qt_s, t0, tok_end, qcol, sm_scale, n)
  m_new = jnp.maximum(m_i, jnp.max(s, axis=0))
  m_use = jnp.where(m_new > -jnp.inf, m_new, 0.0)
  p = jnp.exp(s - lax.broadcast_in_dim(m_use, (bt, n), (1,)))
  alpha = jnp.exp(m_i - m_use)
  l_new = l_i * alpha + jnp.sum(p, axis=0)
  p16 = p.astype(jnp.float16)
  if ops.interpret:  # the interpreter cannot run a transposed wgmma operand
    upd = lax.dot_general(v_f16[...], p16, (((0,), (0,)), ((), ())),
                          preferred_element_type=jnp.float32)
  else:
    p_s[...] = p16
    plgpu.commit_smem()

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, plgpu.transpose_ref(v_f16, (1, 0)), p_s)
      plgpu.wgmma_wait(0)
      return acc_ref[...]

    upd = pl.run_scoped(pv, plgpu.ACC((HEAD_DIM, n), jnp.float32))
  acc = acc * lax.broadcast_in_dim(alpha, (HEAD_DIM, n), (1,)) + upd
  return (m_new, l_new, acc), s


def _span_kernel_mosaic(meta_ref, tab_ref, qpos_ref, qt_ref, kmem, vmem,     # inputs
                        ml_out, acc_out,                                    # outputs
                        qt_s, raw_bufs, k_f16, v_f16, p_s, ml_s, acc_s, bar, k_bar, v_bar,  # scratch
                        *, layout: PageLayout, block_pages: int, num_phys: int, num_tokens: int,
                        group: int, n: int, sm_scale: float, interpret: bool,
                        overlap: bool):
  # meta [8] i32: kv_len, tile_begin, tile_end (clipped), n_table, causal end (max q_pos + 1)
  # tab [T] i32, qpos [S] i32, qt [G, 256, N] f16
  # compiled: kmem = vmem = pool [P, page_bytes // 16, 16] u8; interpret: [P, T, G, head_bytes] u8
  # -> ml_out [G, parts, 2, N] f32 (m, l), acc_out [G, parts, 256, N] f32 (acc^T, V columns)
  ops = _Ops(interpret)
  g = lax.axis_index("g")
  pp = lax.axis_index("p")
  bt = BLOCK_TOKENS
  pt = layout.page_tokens
  kk, vk = layout.k_type, layout.v_type

  kv_len = meta_ref[0]
  tile_begin = meta_ref[1]
  tile_end = meta_ref[2]
  n_table = meta_ref[3]
  causal_end = meta_ref[4]

  page_lo = jnp.maximum(pp * block_pages, tile_begin)
  page_hi = jnp.minimum(pp * block_pages + block_pages, tile_end)
  tok_lo = page_lo * pt
  tok_end = jnp.minimum(page_hi * pt, kv_len)          # keys at or past this are masked
  tok_hi = jnp.minimum(tok_end, causal_end)             # no tile past the last query's position
  n_tiles = jnp.maximum(tok_hi - tok_lo + bt - 1, 0) // bt

  # Q^T of this KV head, resident for the whole partition
  plgpu.copy_gmem_to_smem(qt_ref.at[g], qt_s, bar)
  plgpu.barrier_wait(bar)

  def tile_page(i):
    """(physical page, first row in the page) of key tile i."""
    t0 = tok_lo + i * bt
    lp = jnp.minimum(t0 // pt, n_table - 1)
    return jnp.clip(tab_ref[lp], 0, num_phys - 1), t0 - (t0 // pt) * pt

  def issue(plane: str, i):
    """Start the copy of key tile i's raw K or V rows of head g into its SMEM buffer.

    Compiled: the contiguous span of BT token rows starting at head g's first byte, in
    [<=256, 16] uint8 TMA boxes, all arriving on the plane's barrier; head g's row of token t
    is then columns [0, head_bytes) of row t of the [BT, row_bytes] view (`view`).
    """
    phys, r0 = tile_page(i)
    if interpret:
      mem, dst, b = (kmem, raw_bufs[0], k_bar) if plane == "k" else (vmem, raw_bufs[1], v_bar)
      plgpu.copy_gmem_to_smem(mem.at[phys, pl.ds(r0, bt), g], dst, b)
      return
    if plane == "k":
      raw, b, row_b = raw_bufs[0], k_bar, layout.k_row_bytes
      start_b = r0 * row_b + g * layout.k_head_bytes
    else:
      raw, b, row_b = raw_bufs[-1], v_bar, layout.v_row_bytes
      start_b = layout.v_offset + r0 * row_b + g * layout.v_head_bytes
    rows = bt * row_b // _ROW_BYTES
    start = start_b // _ROW_BYTES
    for c0 in range(0, rows, _TMA_ROWS):
      c = min(_TMA_ROWS, rows - c0)
      plgpu.copy_gmem_to_smem(kmem.at[phys, pl.ds(start + c0, c)], raw.at[pl.ds(c0, c)], b)

  def wait(plane: str):
    """Wait for the plane's copy -> SMEM [BT, >= head_bytes] view of head g's raw rows."""
    b = k_bar if plane == "k" else v_bar
    plgpu.barrier_wait(b)                          # every box of the span arrived
    if interpret:
      return raw_bufs[0] if plane == "k" else raw_bufs[1]
    raw = raw_bufs[0] if plane == "k" else raw_bufs[-1]
    row_b = layout.k_row_bytes if plane == "k" else layout.v_row_bytes
    return raw.at[pl.ds(0, bt * row_b // _ROW_BYTES)].reshape(bt, row_b)

  qcol = _column_qpos(ops, qpos_ref, num_tokens, group, (bt, n))

  if overlap:
    # tile i+1's K copy starts once tile i's K is decoded, its V copy once V is decoded: the
    # copies run under the other plane's decode and the two wgmma of tile i
    @pl.when(n_tiles > 0)
    def _():
      issue("k", 0)
      issue("v", 0)

  def body(i, carry):
    t0 = tok_lo + i * bt
    more = i + 1 < n_tiles

    def get_k():
      if not overlap:
        issue("k", i)
      return wait("k")

    def get_v():
      if not overlap:
        issue("v", i)
      return wait("v")

    def after(plane):
      if overlap:
        pl.when(more)(lambda: issue(plane, i + 1))

    carry, _ = _tile_update(ops, get_k, get_v, k_f16, v_f16, p_s, qt_s, t0, tok_end, qcol, carry,
                            k_type=kk, v_type=vk, sm_scale=sm_scale, n=n, after=after)
    return carry

  m_f, l_f, acc_f = lax.fori_loop(0, n_tiles, body, _init_state(ops, n))

  ml_s[0, :] = m_f
  ml_s[1, :] = l_f
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(ml_s, ml_out.at[g, pp])
  rows = acc_s.shape[0]
  for c in range(HEAD_DIM // rows):              # acc^T out in [64, N] row chunks
    if c:
      plgpu.wait_smem_to_gmem(0)                  # acc_s is free again
    acc_s[...] = acc_f[c * rows:(c + 1) * rows]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(acc_s, acc_out.at[g, pp, pl.ds(c * rows, rows)])
  plgpu.wait_smem_to_gmem(0)


def tile_step_mosaic(k_rows, v_rows, qt, tile_meta, q_pos_s, *, k_type: str, v_type: str,
                     group: int, sm_scale: float, interpret: bool = False):
  """One key tile through the kernel's tile code (decode, S^T, mask, softmax, PV): for tests.

  k_rows [64, k_head_bytes] / v_rows [64, v_head_bytes] uint8: one head's raw K / V rows;
  qt [256, N] f16 (Q^T, rows in head-dim order); tile_meta [2] int32
  (t0: position of row 0, tok_end: keys at or past it are masked); q_pos_s [S] int32 (column
  c belongs to query token c // group). Returns (k_f16 [64, 256], v_f16 [64, 256] f16 decoded
  tiles, s [64, N] masked scaled scores, ml [2, N] (m, l), acc^T [256, N] f32).
  """
  bt = BLOCK_TOKENS
  n = qt.shape[1]
  num_tokens = q_pos_s.shape[0]

  def body(meta_ref, qpos_ref, k_ref, v_ref, qt_ref, kf_out, vf_out, s_out, ml_out, acc_out,
           kraw, vraw, qt_s, k_f16, v_f16, p_s, s_s, ml_s, acc_s, bar):
    ops = _Ops(interpret)
    raws = []
    for src, dst, nbytes in ((k_ref, kraw, k_rows.shape[1]), (v_ref, vraw, v_rows.shape[1])):
      # compiled: [BT * nbytes / 16, 16] rows in <= 256-row TMA boxes (as `fetch` does)
      step = src.shape[0] if interpret else _TMA_ROWS
      for r0 in range(0, src.shape[0], step):
        rows = pl.ds(r0, min(step, src.shape[0] - r0))
        plgpu.copy_gmem_to_smem(src.at[rows], dst.at[rows], bar)
        plgpu.barrier_wait(bar)
      raws.append(dst if interpret else dst.reshape(bt, nbytes))
    plgpu.copy_gmem_to_smem(qt_ref, qt_s, bar)
    plgpu.barrier_wait(bar)
    t0, tok_end = meta_ref[0], meta_ref[1]
    qcol = _column_qpos(ops, qpos_ref, num_tokens, group, (bt, n))
    (m, l, acc), s = _tile_update(ops, lambda: raws[0], lambda: raws[1], k_f16, v_f16, p_s, qt_s, t0,
                                  tok_end, qcol, _init_state(ops, n), k_type=k_type,
                                  v_type=v_type, sm_scale=sm_scale, n=n)
    s_s[...] = s
    ml_s[0, :] = m
    ml_s[1, :] = l
    acc_s[...] = acc
    plgpu.commit_smem()
    for src, dst in ((k_f16, kf_out), (v_f16, vf_out), (s_s, s_out), (ml_s, ml_out),
                     (acc_s, acc_out)):
      plgpu.copy_smem_to_gmem(src, dst)
    plgpu.wait_smem_to_gmem(0)

  sw = _tiles(_KV_SWIZZLE)
  if interpret:
    k_in, v_in = k_rows, v_rows
  else:
    k_in, v_in = (x.reshape(-1, _ROW_BYTES) for x in (k_rows, v_rows))
  kern = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((bt, HEAD_DIM), jnp.float16),
                jax.ShapeDtypeStruct((bt, HEAD_DIM), jnp.float16),
                jax.ShapeDtypeStruct((bt, n), jnp.float32),
                jax.ShapeDtypeStruct((2, n), jnp.float32),
                jax.ShapeDtypeStruct((HEAD_DIM, n), jnp.float32)),
      scratch_types=[plgpu.SMEM(k_in.shape, jnp.uint8), plgpu.SMEM(v_in.shape, jnp.uint8),
                     plgpu.SMEM((HEAD_DIM, n), jnp.float16, transforms=sw),
                     plgpu.SMEM((bt, HEAD_DIM), jnp.float16, transforms=sw),
                     plgpu.SMEM((bt, HEAD_DIM), jnp.float16, transforms=sw),
                     plgpu.SMEM((bt, n), jnp.float16, transforms=sw),
                     plgpu.SMEM((bt, n), jnp.float32), plgpu.SMEM((2, n), jnp.float32),
                     plgpu.SMEM((HEAD_DIM, n), jnp.float32), plgpu.Barrier(num_arrivals=1)],
      compiler_params=_COMPILER_PARAMS,
      interpret=_interpret_params() if interpret else None,
  )
  return kern(tile_meta.astype(jnp.int32), q_pos_s.astype(jnp.int32), k_in, v_in, qt)


# ----------------------------------------------------------------------------- wrapper


def fold_partitions(carry: _ref.Carry, m_p, l_p, acc_p) -> _ref.Carry:
  """Left fold of the partitions [G, parts, ...] (logical order) into the carry."""

  def step(c, part):
    return _ref.merge_partials(c, part), None

  parts = (jnp.moveaxis(m_p, 1, 0), jnp.moveaxis(l_p, 1, 0), jnp.moveaxis(acc_p, 1, 0))
  (m, l, a), _ = lax.scan(step, tuple(carry), parts)
  return _ref.Carry(m, l, a)


def _check_args(q_shd, pool_pn, layout, num_q_heads, block_pages):
  _triton.check_call(q_shd, pool_pn, layout, num_q_heads, block_pages, check_layout)
  s_tok, h, _ = q_shd.shape
  rows_padded(s_tok * (h // layout.num_kv_heads))


def _copies_per_fetch(row_bytes: int, interpret: bool) -> int:
  """TMA boxes of one K or V span (each arrives once on the span's barrier)."""
  if interpret:
    return 1
  return -(-(BLOCK_TOKENS * row_bytes // _ROW_BYTES) // _TMA_ROWS)


def query_t(q_shd, num_kv_heads: int, n: int):
  """q [S, H, D] -> Q^T [G, D, N] f16: the query heads of a KV head folded into S x R rows,
  padded with zero rows to the wgmma N (shared by the Mosaic GPU kernels)."""
  qf = _ref.fold_query(q_shd.astype(jnp.float32), num_kv_heads)     # [G, rows, D]
  qf = jnp.pad(qf, ((0, 0), (0, n - qf.shape[1]), (0, 0)))
  return jnp.swapaxes(qf, 1, 2).astype(jnp.float16)


def _span_call(q_shd, pool_u8, page_table_t, meta, q_pos_s, *, layout: PageLayout,
               block_pages: int, n_parts: int, sm_scale: float, interpret: bool,
               overlap: bool):
  """The kernel call: -> (ml [G, parts, 2, N], acc^T [G, parts, 256, N]) float32."""
  s_tok, h, d = q_shd.shape
  g = layout.num_kv_heads
  r = h // g
  rows = s_tok * r
  n = rows_padded(rows)
  bt = BLOCK_TOKENS
  num_phys = pool_u8.shape[0]
  qt = query_t(q_shd, g, n)                                            # [G, D, N]

  kb, vb = layout.k_head_bytes, layout.v_head_bytes
  if overlap and not interpret and n > 32:
    raise ValueError(
        f"overlap=True keeps one raw SMEM buffer per plane and does not fit at {n} padded query "
        f"rows ({rows} folded rows): on the H200 it needs 232,472 B of shared memory for Q8_0/Q4_0 "
        f"pages, 24 B more than the 232,448 B there (docs/PERFORMANCE.md, S4-1); use "
        f"overlap=False or at most 32 folded query rows")
  if interpret:
    pt = layout.page_tokens
    kmem = pool_u8[:, :layout.k_plane_bytes].reshape(num_phys, pt, g, kb)
    v0 = layout.v_offset
    vmem = pool_u8[:, v0:v0 + layout.v_plane_bytes].reshape(num_phys, pt, g, vb)
    raw_t = (plgpu.SMEM((bt, kb), jnp.uint8), plgpu.SMEM((bt, vb), jnp.uint8))
  else:
    kmem = vmem = pool_u8.reshape(num_phys, pool_u8.shape[1] // _ROW_BYTES, _ROW_BYTES)
    if overlap:   # one raw buffer a plane (K span 69,632 B + V span 36,864 B at the 27B shape)
      raw_t = tuple(plgpu.SMEM((bt * rb // _ROW_BYTES, _ROW_BYTES), jnp.uint8)
                    for rb in (layout.k_row_bytes, layout.v_row_bytes))
    else:         # K and V take turns in one buffer
      raw_rows = bt * max(layout.k_row_bytes, layout.v_row_bytes) // _ROW_BYTES
      raw_t = (plgpu.SMEM((raw_rows, _ROW_BYTES), jnp.uint8),)

  sw_n = _KV_SWIZZLE                # wgmma needs the lhs and rhs swizzles to match
  scratch = [
      plgpu.SMEM((d, n), jnp.float16, transforms=_tiles(sw_n)),        # qt_s
      raw_t,
      plgpu.SMEM((bt, d), jnp.float16, transforms=_tiles(_KV_SWIZZLE)),  # k_f16
      plgpu.SMEM((bt, d), jnp.float16, transforms=_tiles(_KV_SWIZZLE)),  # v_f16
      plgpu.SMEM((bt, n), jnp.float16, transforms=_tiles(sw_n)),       # p_s (P^T)
      plgpu.SMEM((2, n), jnp.float32),                                 # ml_s
      plgpu.SMEM((bt, n), jnp.float32),                                # acc_s (a row chunk)
      plgpu.Barrier(num_arrivals=1),                                   # Q^T copy
      plgpu.Barrier(num_arrivals=_copies_per_fetch(layout.k_row_bytes, interpret)),  # K span
      plgpu.Barrier(num_arrivals=_copies_per_fetch(layout.v_row_bytes, interpret)),  # V span
  ]
  body = functools.partial(_span_kernel_mosaic, layout=layout, block_pages=block_pages,
                           num_phys=num_phys, num_tokens=s_tok, group=r, n=n,
                           sm_scale=float(sm_scale), interpret=interpret, overlap=overlap)
  kern = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((g, n_parts, 2, n), jnp.float32),
                jax.ShapeDtypeStruct((g, n_parts, d, n), jnp.float32)),
      scratch_types=scratch,
      grid=(g, n_parts), grid_names=("g", "p"),
      compiler_params=_COMPILER_PARAMS,
      interpret=_interpret_params() if interpret else None,
  )
  return kern(meta, page_table_t.astype(jnp.int32), q_pos_s.astype(jnp.int32), qt, kmem, vmem)


@functools.partial(jax.jit, static_argnames=(
    "layout", "num_q_heads", "block_pages", "sm_scale", "interpret", "overlap"))
def span_attention_partial_mosaic(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry: _ref.Carry,
                                  tile_begin, tile_end, *, layout: PageLayout, num_q_heads: int,
                                  block_pages: int = 1, sm_scale: Optional[float] = None,
                                  interpret: bool = False, overlap: bool = False) -> _ref.Carry:
  """Mosaic GPU version of `reference.span_attention_partial_reference` (same contract).

  overlap=True: one SMEM raw buffer per plane; tile i+1's K (V) copy is issued as soon as tile
  i's K (V) is decoded, so it runs under the rest of tile i. Same bits as overlap=False; slower
  on the H200 (S4-1) and refused (compiled) above 32 folded query rows (SMEM).
  """
  _check_args(q_shd, pool_pn, layout, num_q_heads, block_pages)
  s_tok, h, d = q_shd.shape
  g = layout.num_kv_heads
  rows = s_tok * (h // g)
  scale = (1.0 / d ** 0.5) if sm_scale is None else sm_scale
  n_table = page_table_t.shape[0]
  n_parts = -(-max(n_table, 1) // block_pages)
  kv_len = jnp.asarray(kv_len, jnp.int32)
  q_pos_s = jnp.asarray(q_pos_s, jnp.int32)
  n_active = (kv_len + layout.page_tokens - 1) // layout.page_tokens
  tile_end_c = jnp.minimum(jnp.minimum(jnp.asarray(tile_end, jnp.int32), n_active), n_table)
  causal_end = jnp.max(q_pos_s) + 1
  z = jnp.int32(0)
  meta = jnp.stack([kv_len, jnp.asarray(tile_begin, jnp.int32), tile_end_c, jnp.int32(n_table),
                    causal_end, z, z, z]).astype(jnp.int32)
  ml_p, acct_p = _span_call(q_shd, byte_view(pool_pn), page_table_t, meta, q_pos_s, layout=layout,
                            block_pages=block_pages, n_parts=n_parts, sm_scale=scale,
                            interpret=interpret, overlap=overlap)
  m_p = ml_p[:, :, 0, :rows]                                     # [G, parts, rows]
  l_p = ml_p[:, :, 1, :rows]
  acc_p = jnp.swapaxes(acct_p, 2, 3)[:, :, :rows, :]             # [G, parts, rows, D]
  return fold_partitions(carry, m_p, l_p, acc_p)


def span_attention_mosaic(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, *, layout: PageLayout,
                          block_pages: int = 1, sm_scale: Optional[float] = None,
                          interpret: bool = False, overlap: bool = False):
  """o_shd [S, H, D] float32 over all active pages (Mosaic GPU version of the reference)."""
  s, h, d = q_shd.shape
  carry = _ref.init_carry(layout.num_kv_heads, s * (h // layout.num_kv_heads), d)
  carry = span_attention_partial_mosaic(
      q_shd, pool_pn, page_table_t, jnp.asarray(kv_len, jnp.int32), q_pos_s, carry, jnp.int32(0),
      jnp.int32(page_table_t.shape[0]), layout=layout, num_q_heads=h, block_pages=block_pages,
      sm_scale=sm_scale, interpret=interpret, overlap=overlap)
  return _ref.finalize(carry, h)
