"""Span attention for prefill chunks, Pallas Mosaic GPU (Hopper): query chunks of up to 256
tokens.

`implementation="mosaic"` hands calls of more than `mosaic_decode.MAX_ROWS` folded query rows
(prefill chunks against the history) to this kernel. The layouts of `mosaic_common.check_layout`
(Q8_0 K / Q4_0 V pages, head_dim 256, page tokens a multiple of 64), precision "f16". Same
contract as `reference.py`: split-K over fixed LOGICAL partitions of `block_pages` pages, then
the in-order fold of the partitions into the carry (`combine.combine_call`), so the bits do not
depend on where the pages lie.

The decode kernel puts the keys on the wgmma M side (S^T = K Q^T with K converted straight into
registers), which holds O^T as 2 N registers a thread and stops at N = 40 rows. Here the query
rows are M, as in FlashAttention on Hopper:

* grid (KV head, block of 128 folded rows, logical partition); 2 warpgroups a CTA, 64 rows each
  (Q [64, 256] f16 in SMEM, O [64, 256] f32 in 128 registers a thread);
* a key tile of 64 tokens: warpgroup 0 copies it by TMA (this head's K box [64 rows, 272 B] from
  the pool's K-row view, 2 slots; the all-heads V span, 1 slot), then converts K to f16 SMEM
  [64 tokens, 256] with the magic-number conversion (`mosaic_common.ggml_k_lhs`, scaled, head
  dims in `magic_ptx.ggml_dims` order, Q's columns in the same order) while warpgroup 1 converts
  V^T to f16 SMEM [256, 64] (`mosaic_common.ggml_vt_lhs` with the head read from an info word,
  scales of tokens past the partition end zeroed: junk bytes never make NaN); both meet on a
  barrier;
* each warpgroup: S = Q K^T (wgmma, K^T through a transposed view), the mask (keys at or past its
  row's limit min(kv_len, q_pos + 1): `_mask_rows`, inline), online softmax in the log2 domain
  (jnp on the WGMMA layout), O = O alpha + P V (P from registers, V through a transposed view of
  V^T); both meet on a second barrier before the next tile's conversions overwrite K and V^T.
* m (natural log), l and O (columns in `magic_ptx.vt_dims` order) of each partition to GMEM.

Partitions: `choose_block_pages` picks the count whose CTAs fill whole waves (one CTA an SM).
Speed on the H200: docs/PERFORMANCE.md, 'Span attention kernels'. The schedules measured slower
or no faster (the next tile's conversions beside the other warpgroup's work; each warpgroup half
of each plane) are not kept: docs/DESIGN.md.

Interpret mode (`interpret=True`) runs the same kernel body (page walk, TMA copies, barriers,
masks, outputs) in the Mosaic GPU interpreter with the tile math in jnp (`_InterpretPrefill`: the
same f16 values in the same orders from `ggml_codec`, dots in float32); one Pallas thread serves
both warpgroups' rows in turn.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax_pallas import ggml_codec
from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import combine as _combine
from kvjax_pallas.span_attention import common as _common
from kvjax_pallas.span_attention import magic_ptx
from kvjax_pallas.span_attention import mosaic_common as _mc
from kvjax_pallas.span_attention import partitions as _partitions
from kvjax_pallas.span_attention import reference as _ref

HEAD_DIM = _mc.HEAD_DIM
BLOCK_TOKENS = _mc.BLOCK_TOKENS   # keys a tile
BLOCK_Q = 64                      # folded query rows a warpgroup (the wgmma M)
CONSUMERS = 2                     # warpgroups a CTA
CTA_ROWS = BLOCK_Q * CONSUMERS    # folded query rows a CTA
MAX_TOKENS = 256                  # query tokens a call (a prefill micro-batch)
K_SLOTS = 2                       # raw K tile slots (one tile ahead)
INFO = 4                          # info words a warpgroup: [0] tile's first token, [1] the
HEAD_WORD = 2                     # partition's token end, [HEAD_WORD] the KV head
MAX_WAVES = 4                     # waves of CTAs `choose_block_pages` considers
_COMPILER_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                        approx_math=True)


def row_blocks(rows: int) -> int:
  """CTAs a KV head: blocks of CTA_ROWS folded rows."""
  return -(-rows // CTA_ROWS)


def smem_bytes(layout: PageLayout) -> int:
  """Shared memory of one CTA: Q of both warpgroups, the f16 K and V^T tiles, the raw K ring and
  V slot, the row limits, info words and (m, l) staging, plus SMEM_RESERVE."""
  bt = BLOCK_TOKENS
  return (_mc.SMEM_RESERVE + CONSUMERS * BLOCK_Q * HEAD_DIM * 2 + 2 * bt * HEAD_DIM * 2
          + K_SLOTS * bt * layout.k_head_bytes + bt * layout.v_row_bytes
          + CONSUMERS * (BLOCK_Q + INFO + 2 * BLOCK_Q) * 4)


def check_call(layout: PageLayout, head_dim: int, num_tokens: int):
  """The Mosaic GPU layout checks, at most MAX_TOKENS query tokens, and the SMEM plan."""
  _mc.check_layout(layout, head_dim)
  if not 1 <= num_tokens <= MAX_TOKENS:
    raise ValueError(f"the Mosaic GPU prefill kernel takes 1-{MAX_TOKENS} query tokens a call, got "
                     f"{num_tokens} (split the chunk)")
  need = smem_bytes(layout)
  if need > _mc.SMEM_LIMIT:
    raise ValueError(f"the prefill kernel needs {need:,} B of shared memory with "
                     f"{layout.num_kv_heads} KV heads, {need - _mc.SMEM_LIMIT:,} B more than the "
                     f"{_mc.SMEM_LIMIT:,} B of a CTA")


def choose_block_pages(num_pages: int, rows: int, num_kv_heads: int,
                       num_sms: int = _partitions.DEFAULT_NUM_SMS) -> int:
  """Pages a logical partition: the partition count whose KV heads x row blocks x partitions
  CTAs (one an SM: its SMEM) fill their waves of `num_sms` best, up to MAX_WAVES waves, the
  fewest partitions among equals (`partitions.fullest_waves`; at 128K with 256 query tokens, 48
  CTAs a partition: 11 partitions of 47 pages, 4 whole waves). A pure function of the static
  shapes."""
  return _partitions.fullest_waves(num_pages, num_kv_heads * row_blocks(rows), num_sms, MAX_WAVES)


# ----------------------------------------------------------------------------- inline pieces


def _mask_rows(scale_log2: float):
  """(s [64, 64] f32 scores S in the WGMMA layout, info ref (i32: [0] the tile's first token),
  lim ref (i32 [64]: each row's key limit)) -> s * scale_log2 where the key is below its row's
  limit, else -inf (inline Mosaic GPU code, GPU only). A thread holds rows warp * 16 + lane / 4
  (+ 8) and columns 8 k + 2 (lane % 4) + {0, 1}."""
  wgmma = plgpu.Layout.WGMMA
  ret = plgpu.ShapeDtypeStruct((BLOCK_Q, BLOCK_TOKENS), jnp.float32, wgmma)

  @plgpu.inline_mgpu(arg_types=(wgmma, plgpu.RefType(), plgpu.RefType()), return_type=ret)
  def mask(ctx, s, info, lim):
    del ctx
    ir, arith, llvm, vector, fa, mu, mgpu = _mc.mlir_modules()
    f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
    _, _, _, neg_inf = _mc.f32_ops()
    c, lane, warp, _ = _mc.lane_ids(1)
    quad2 = arith.muli(arith.andi(lane, c(3)), c(2))
    row0 = arith.addi(arith.muli(warp, c(16)), arith.shrui(lane, c(2)))
    t_lim = _mc.thread_ptr(lim, row0, i32)
    lims = [llvm.load(i32, mu.getelementptr(t_lim, [8 * h], i32)) for h in range(2)]
    first = llvm.load(i32, mu.memref_ptr(info))
    tok0 = arith.addi(first, quad2)
    k_scale = arith.constant(f32, ir.FloatAttr.get(f32, scale_log2))
    v2f32 = ir.VectorType.get((2,), f32)
    regs = np.empty(s.registers.shape, dtype=object)
    for k in range(BLOCK_TOKENS // 8):
      for h in range(2):
        reg = s.registers[0, k, 0, 0, h, 0, 0, 0, 0]
        out = []
        for e in range(2):
          tok = arith.addi(tok0, c(8 * k + e))
          ok = arith.cmpi(arith.CmpIPredicate.slt, tok, lims[h])
          out.append(arith.select(ok, arith.mulf(vector.extract(reg, [], [e]), k_scale), neg_inf))
        regs[0, k, 0, 0, h, 0, 0, 0, 0] = vector.from_elements(v2f32, out)
    return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return mask


# ----------------------------------------------------------------------------- tile math


class _CompiledPrefill:
  """Tile math of the compiled kernel: magic conversions to f16 SMEM, wgmma, inline mask."""

  def __init__(self, layout: PageLayout, scale_log2: float):
    self.k_parts = [_mc.ggml_k_lhs(layout.k_type, layout, 0, 1, 0, scaled=True, part=p,
                                   heads_major=True) for p in (0, 1)]
    self.v_parts = [(b, _mc.ggml_vt_lhs(layout, 0, 1, 0, masked=True, blocks=b,
                                        head_word=HEAD_WORD)) for b in ((0, 1), (2, 3))]
    self.mask = _mask_rows(scale_log2)

  def convert_k(self, kraw, kf, head):
    """kraw [64, head words] i32 (this head's K rows) -> kf [64, 256] f16, ggml_dims columns, in
    two column halves (half the registers live at once)."""
    del head
    for p, conv in enumerate(self.k_parts):
      kf.at[:, pl.ds(128 * p, 128)][...] = conv(kraw)

  def convert_v(self, vraw, vtf, info, head):
    """vraw [lines, L] u8 (the tile's all-heads V span) -> vtf [256, 64] f16 (V^T, vt_dims rows;
    tokens at or past info[1] zero), in two pairs of 64-row M-blocks."""
    del head
    for blocks, conv in self.v_parts:
      for mb, vt in zip(blocks, conv(vraw, info)):
        vtf.at[pl.ds(64 * mb, 64)][...] = vt

  def scores(self, q, kf):
    def qk(acc):
      plgpu.wgmma(acc, q, kf.transpose((1, 0)))                            # K^T [256, 64]
      plgpu.wgmma_wait(0)
      return acc[...]
    return pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, BLOCK_TOKENS), jnp.float32))

  def pv(self, o, p16, vtf):
    def pv(acc):
      plgpu.wgmma(acc, p16, vtf.transpose((1, 0)))                          # V [64, 256]
      plgpu.wgmma_wait(0)
    return pl.run_state(pv)(plgpu.ACC.init(o))

  def zeros(self):
    row = plgpu.Layout.WGMMA.reduce(1)
    return (plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), row),
            plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), row),
            plgpu.layout_cast(jnp.zeros((BLOCK_Q, HEAD_DIM), jnp.float32), plgpu.Layout.WGMMA))


class _InterpretPrefill:
  """The tile math in jnp for the Mosaic GPU interpreter: the compiled path's f16 values (one
  rounding of the exact product) in its orders, dots in float32."""

  def __init__(self, layout: PageLayout, scale_log2: float):
    self.layout, self.scale_log2 = layout, scale_log2

  def _decode(self, head_bytes, kind):
    return ggml_codec.decode_rows(head_bytes, kind, 1).reshape(BLOCK_TOKENS, HEAD_DIM).astype(
        jnp.float16)

  def convert_k(self, kraw, kf, head):
    del head
    lay = self.layout
    k = lax.bitcast_convert_type(kraw[...], jnp.uint8).reshape(BLOCK_TOKENS, lay.k_head_bytes)
    kf[...] = _mc.k_in_ggml_order(self._decode(k, lay.k_type))

  def convert_v(self, vraw, vtf, info, head):
    lay = self.layout
    rows = vraw[...].reshape(BLOCK_TOKENS, lay.v_row_bytes)
    v = self._decode(lax.dynamic_slice_in_dim(rows, head * lay.v_head_bytes, lay.v_head_bytes,
                                              axis=1), lay.v_type)
    tok = info[0] + lax.broadcasted_iota(jnp.int32, (BLOCK_TOKENS, 1), 0)
    vtf[...] = _mc.vt_in_magic_order(jnp.where(tok < info[1], v, jnp.float16(0)).T)

  def mask(self, s, info, lim):
    tok = info[0] + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return jnp.where(tok < lim[...][:, None], s * jnp.float32(self.scale_log2), -jnp.inf)

  def scores(self, q, kf):
    return jnp.dot(q[...].astype(jnp.float32), kf[...].T.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)

  def pv(self, o, p16, vtf):
    return o + jnp.dot(p16.astype(jnp.float32), vtf[...].T.astype(jnp.float32),
                       precision=lax.Precision.HIGHEST)

  def zeros(self):
    return (jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), jnp.zeros((BLOCK_Q,), jnp.float32),
            jnp.zeros((BLOCK_Q, HEAD_DIM), jnp.float32))


# ----------------------------------------------------------------------------- kernel


def _prefill_kernel(kv_ref, tb_ref, te_ref, cend_ref, tab_ref, lim_ref, q_ref, lines_ref,
                    krows_ref,                                        # inputs
                    ml_out, o_out,                                    # outputs
                    q_s, kf, vtf, kraw, vraw, lim_s, info_s, ml_s, kbar, vbar, qbar, ready,
                    done,                                             # scratch
                    *, layout: PageLayout, block_pages: int, num_phys: int, num_table: int,
                    scale_log2: float, interpret: bool):
  # kv_len, tile_begin, tile_end [1] i32; cend [RB] i32 (a row block's last key + 1: its largest
  # row limit); tab [T] i32; lim [RB * 128] i32 (row r's key limit min(kv_len, q_pos + 1), -1
  # for padding rows); q [G, RB * 128, 256] f16 (folded rows, head dims in ggml_dims order);
  # lines [P, page_bytes / L, L] u8; krows [P * page_bytes / k_row_bytes, G, k_head_bytes / 4] i32
  # -> ml_out [G, parts, 2, RB * 128] f32 (m natural-log domain, l), o_out [G, parts, RB * 128,
  #    256] f32 (vt_dims columns)
  # scratch: q_s [2, 64, 256] f16, kf [64, 256] f16, vtf [256, 64] f16, kraw [K_SLOTS, 64, head
  # words] i32, vraw [v lines, L] u8, lim_s [2, 64] i32, info_s [2, INFO] i32, ml_s [2, 2, 64] f32,
  # kbar (K_SLOTS), vbar, qbar (2: Q and limits of a warpgroup), ready / done (both warpgroups
  # arrive)
  multi = not interpret      # compiled: one Pallas thread a warpgroup; interpreted: one for both
  wgs = [lax.axis_index("wg")] if multi else list(range(CONSUMERS))
  head, rb, pp = lax.axis_index("g"), lax.axis_index("rb"), lax.axis_index("p")
  bt, pt = BLOCK_TOKENS, layout.page_tokens
  tiles = (_InterpretPrefill(layout, scale_log2) if interpret
           else _CompiledPrefill(layout, scale_log2))
  line = lines_ref.shape[-1]
  v_lines = bt * layout.v_row_bytes // line
  v_first = layout.v_offset // line

  kv_len, tile_begin = kv_ref[0], tb_ref[0]
  n_active = (kv_len + pt - 1) // pt
  tile_end = jnp.minimum(jnp.minimum(te_ref[0], n_active), num_table)
  page_lo = jnp.maximum(pp * block_pages, tile_begin)
  page_hi = jnp.minimum(pp * block_pages + block_pages, tile_end)
  tok_lo = page_lo * pt
  tok_end = jnp.minimum(page_hi * pt, kv_len)
  tok_hi = jnp.minimum(tok_end, cend_ref[rb])          # no tile past the block's last query
  n_tiles = jnp.maximum(tok_hi - tok_lo + bt - 1, 0) // bt

  def on(w: int, fn):
    """fn by warpgroup w (compiled) or now (the interpreter's one thread)."""
    if multi:
      @pl.when(wgs[0] == w)
      def _():
        fn()
    else:
      fn()

  page_of = functools.partial(_mc.tile_page, tab_ref, tok_lo, page_tokens=pt,
                              num_table=num_table, num_phys=num_phys)

  def copy_k(i, slot):
    phys, r = page_of(i)
    plgpu.copy_gmem_to_smem(krows_ref.at[pl.ds(phys * layout.k_rows_per_page + r * bt, bt), head],
                            kraw.at[slot], kbar.at[slot])

  def copy_v(i):
    phys, r = page_of(i)
    _mc.copy_lines(lines_ref, phys, v_first + r * v_lines, v_lines, vraw, vbar)

  row0 = [rb * CTA_ROWS + w * BLOCK_Q for w in wgs]
  for w, r0 in zip(wgs, row0):
    plgpu.copy_gmem_to_smem(q_ref.at[head, pl.ds(r0, BLOCK_Q)], q_s.at[w], qbar.at[w])
    plgpu.copy_gmem_to_smem(lim_ref.at[pl.ds(r0, BLOCK_Q)], lim_s.at[w], qbar.at[w])
    info = info_s.at[w]
    info[1] = tok_end
    info[HEAD_WORD] = head

  @functools.partial(on, 0)
  def _():
    @pl.when(n_tiles > 0)
    def _():
      copy_k(0, 0)
      copy_v(0)
    for j in range(1, K_SLOTS):
      pl.when(n_tiles > j)(functools.partial(copy_k, j, j))

  for w in wgs:
    plgpu.barrier_wait(qbar.at[w])

  def sync(bar):
    """Both warpgroups arrive on bar and wait for each other (compiled only)."""
    if multi:
      plgpu.barrier_arrive(bar)
      plgpu.barrier_wait(bar)

  def softmax_pv(carry_w, s, w):
    """Mask, online softmax and O = O alpha + P V of warpgroup w's scores s."""
    m, l, o = carry_w
    x = tiles.mask(s, info_s.at[w], lim_s.at[w])
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, jnp.float32(0), m_new)
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(x - lax.broadcast_in_dim(m_use, x.shape, [0]))
    l = l * alpha + jnp.sum(p, axis=1)
    o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
    return m_new, l, tiles.pv(o, p.astype(jnp.float16), vtf)

  def body(i, carry):
    """Tile i: warpgroup 0 converts K, warpgroup 1 V^T; a barrier; both warpgroups' QK, softmax
    and PV; a barrier."""
    slot = lax.rem(i, K_SLOTS)
    t0 = tok_lo + i * bt
    for w in wgs:
      info_s[w, 0] = t0

    @functools.partial(on, 0)
    def _():
      plgpu.barrier_wait(kbar.at[slot])
      tiles.convert_k(kraw.at[slot], kf, head)

    @functools.partial(on, 1)
    def _():
      plgpu.barrier_wait(vbar)
      tiles.convert_v(vraw, vtf, info_s.at[1], head)

    plgpu.commit_smem()          # the generic-proxy stores, before wgmma reads them
    sync(ready)

    @functools.partial(on, 0)    # the raw slots are free: K two tiles ahead, V one
    def _():
      pl.when(i + K_SLOTS < n_tiles)(lambda: copy_k(i + K_SLOTS, slot))
      pl.when(i + 1 < n_tiles)(lambda: copy_v(i + 1))

    out = [softmax_pv(c, tiles.scores(q_s.at[w], kf), w) for w, c in zip(wgs, carry)]
    sync(done)                   # K and V^T read by both before the next tile overwrites them
    return tuple(out)

  final = lax.fori_loop(0, n_tiles, body, tuple(tiles.zeros() for _ in wgs))
  for w, (m, l, _) in zip(wgs, final):
    ml = ml_s.at[w]
    ml[0, :] = jnp.where(m == -jnp.inf, m, m * jnp.float32(_mc.LN2))
    ml[1, :] = l
  plgpu.commit_smem()
  for w, r0, (_, _, o) in zip(wgs, row0, final):
    plgpu.copy_smem_to_gmem(ml_s.at[w], ml_out.at[head, pp, :, pl.ds(r0, BLOCK_Q)])
    o_out[head, pp, pl.ds(r0, BLOCK_Q)] = o
  plgpu.wait_smem_to_gmem(0)


# ----------------------------------------------------------------------------- wrapper


def row_limits(q_pos_s, kv_len, rows: int, group: int, rows_pad: int):
  """[rows_pad] i32: folded row r (query token r // group) sees keys below min(kv_len,
  q_pos + 1); padding rows -1 (none)."""
  r = jnp.arange(rows_pad, dtype=jnp.int32)
  tok = jnp.minimum(r // group, q_pos_s.shape[0] - 1)
  lim = jnp.minimum(jnp.asarray(kv_len, jnp.int32), q_pos_s[tok] + 1)
  return jnp.where(r < rows, lim, -1)


def prefill_partials(q_shd, pool_u8, page_table_t, kv_len, tile_begin, tile_end, q_pos_s, *,
                  layout: PageLayout, block_pages: int, n_parts: int, sm_scale: float,
                  interpret: bool):
  """The kernel alone: its per-partition partials before the combine -> (ml [G, parts, 2,
  rows_pad], O [G, parts, rows_pad, 256] in vt_dims columns) f32."""
  s_tok, h, d = q_shd.shape
  g = layout.num_kv_heads
  group = h // g
  rows = s_tok * group
  n_rb = row_blocks(rows)
  rows_pad = n_rb * CTA_ROWS
  bt = BLOCK_TOKENS
  num_phys = pool_u8.shape[0]
  qf = _mc.fold_query_ggml(q_shd, g, rows_pad)                       # [G, rows_pad, D]
  lim = row_limits(q_pos_s, kv_len, rows, group, rows_pad)
  cend = jnp.max(lim.reshape(n_rb, CTA_ROWS), axis=1)
  lines, krows = _mc.pool_views(pool_u8, layout)
  line = lines.shape[-1]
  v_lines = bt * layout.v_row_bytes // line
  mma = lambda shape: plgpu.SMEM(shape, jnp.float16, transforms=(
      plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
  scratch = [
      mma((CONSUMERS, BLOCK_Q, d)),                                   # q_s
      mma((bt, d)),                                                   # kf
      mma((d, bt)),                                                   # vtf
      plgpu.SMEM((K_SLOTS, bt, layout.k_head_bytes // 4), jnp.int32),  # kraw
      plgpu.SMEM((v_lines, line), jnp.uint8),                         # vraw (lim_s after it: the
      plgpu.SMEM((CONSUMERS, BLOCK_Q), jnp.int32),                    # lim_s  V conversion reads
      plgpu.SMEM((CONSUMERS, INFO), jnp.int32),                       # info_s  4 B past the span)
      plgpu.SMEM((CONSUMERS, 2, BLOCK_Q), jnp.float32),               # ml_s
      plgpu.Barrier(num_arrivals=1, num_barriers=K_SLOTS),            # kbar
      plgpu.Barrier(num_arrivals=-(-v_lines // _mc.BOX)),             # vbar
      plgpu.Barrier(num_arrivals=2, num_barriers=CONSUMERS),          # qbar
      plgpu.Barrier(num_arrivals=CONSUMERS),                          # ready
      plgpu.Barrier(num_arrivals=CONSUMERS),                          # done
  ]
  body = functools.partial(_prefill_kernel, layout=layout, block_pages=block_pages,
                           num_phys=num_phys, num_table=page_table_t.shape[0],
                           scale_log2=float(sm_scale) * _mc.LOG2E, interpret=interpret)
  kw = dict(num_threads=CONSUMERS, thread_name="wg") if not interpret else {}
  kern = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((g, n_parts, 2, rows_pad), jnp.float32),
                jax.ShapeDtypeStruct((g, n_parts, rows_pad, d), jnp.float32)),
      scratch_types=scratch, grid=(g, n_rb, n_parts), grid_names=("g", "rb", "p"),
      compiler_params=_COMPILER_PARAMS,
      interpret=_mc.interpret_params() if interpret else None, **kw)
  scalar = lambda x: jnp.reshape(jnp.asarray(x, jnp.int32), (1,))
  return kern(scalar(kv_len), scalar(tile_begin), scalar(tile_end), cend,
              page_table_t.astype(jnp.int32), lim, qf, lines, krows)


@functools.partial(jax.jit, static_argnames=("layout", "num_q_heads", "block_pages", "sm_scale",
                                             "interpret"))
def span_attention_partial_mosaic_prefill(q_shd, pool_pn, page_table_t, kv_len, q_pos_s,
                                          carry: Optional[_ref.Carry], tile_begin, tile_end, *,
                                          layout: PageLayout, num_q_heads: int,
                                          block_pages: int = 1, sm_scale: Optional[float] = None,
                                          interpret: bool = False) -> _ref.Carry:
  """Mosaic GPU prefill version of `reference.span_attention_partial_reference` (same contract;
  carry=None: the empty carry): the kernel's partitions folded in logical order by the shared
  combine (`combine.combine_call`, O's columns in `magic_ptx.vt_dims` order)."""
  _common.check_call(q_shd, pool_pn, layout, num_q_heads, block_pages, _mc.check_layout)
  s_tok, h, d = q_shd.shape
  check_call(layout, d, s_tok)
  rows = s_tok * (h // layout.num_kv_heads)
  scale = (1.0 / d ** 0.5) if sm_scale is None else sm_scale
  num_parts = -(-max(page_table_t.shape[0], 1) // block_pages)
  tiles = _mc.combine_tiles(row_blocks(rows) * CTA_ROWS, num_parts)
  ml_p, o_p = prefill_partials(q_shd, _common.byte_view(pool_pn), page_table_t, kv_len,
                               tile_begin, tile_end, jnp.asarray(q_pos_s, jnp.int32),
                               layout=layout, block_pages=block_pages,
                               n_parts=tiles.padded_parts(num_parts), sm_scale=scale,
                               interpret=interpret)
  return _combine.combine_call(ml_p, None, o_p, carry, rows=rows, tiles=tiles,
                               v_cols=magic_ptx.vt_dims(d), head_dim=d, interpret=interpret)


def span_attention_mosaic_prefill(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, *,
                                  layout: PageLayout, block_pages: int = 1,
                                  sm_scale: Optional[float] = None, interpret: bool = False):
  """o_shd [S, H, D] float32 over all active pages (Mosaic GPU prefill version of the
  reference)."""
  return _common.whole_span(span_attention_partial_mosaic_prefill, q_shd, pool_pn, page_table_t,
                            kv_len, q_pos_s, layout=layout, block_pages=block_pages,
                            sm_scale=sm_scale, interpret=interpret)
