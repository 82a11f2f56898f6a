"""Span attention for decode and verify, Pallas Mosaic GPU (Hopper): the magic-number conversion
of the ggml quants straight into wgmma registers.

`implementation="mosaic"` runs calls of up to `MAX_ROWS` folded query rows a KV head (query
tokens x query heads per KV head) here, and longer ones (prefill chunks) on `mosaic_prefill.py`.
Q8_0 K / Q4_0 V pages, head_dim 256, 1-4 KV heads, page_tokens a multiple of 64, pages of whole
K rows (`mosaic_common.check_layout`), precision "f16". Same contract as `reference.py`: split-K
over fixed LOGICAL partitions of `block_pages` pages, then the in-order fold of the partitions
into the carry (`combine.combine_call`), so the bits do not depend on where the pages lie.

One CTA a logical partition, one warpgroup a KV head. Per key tile of 64 tokens:

1. TMA copies the tile's K into SMEM head-major (one box a head, [64 rows, head bytes] from the
   pool's K-row view, `mosaic_common.pool_views`) and its all-heads V span in lines of
   `line_bytes`: a ring of 2 K slots (1 where 2 do not fit: `choose_k_slots`) and 1 V slot.
   Warpgroup 0 issues the copies; every warpgroup arrives on a slot's "consumed" barrier.
2. K: `ggml_k_lhs` turns each lane's 4-byte words of the ggml blocks into f16 registers of a
   WGMMA-layout lhs (scaled: one mul.rn.f16x2, the "f16" decode), head dims in
   `magic_ptx.ggml_dims` order; S^T [64, N] = K Q^T by wgmma with Q^T's rows in the same order.
   N is the folded query rows padded to one of `N_CHOICES` (Q and P sit in SMEM N-major and
   reach wgmma through transposed views, so N needs no power of two). Every SMEM access of the
   inline code is a per-thread pointer plus a constant (`mosaic_common.thread_ptr`); Q^T and P^T
   are indexed through a zero read from SMEM at each tile (info word `ZERO`), so ptxas builds
   their wgmma descriptors inside the tile loop instead of keeping them (and spilling them)
   across it.
3. Online softmax of S^T along the tokens (`_softmax_tile`, inline Mosaic GPU code): the scores
   scaled into the log2 domain, masked (keys at or past a column's limit: the partition end, the
   causal bound of its query token; padding columns everything), the max across the warpgroup by
   butterfly shuffles and one SMEM slot per warp behind the warpgroup's named barrier (Pallas's
   own axis-0 reduction shares one scratch between warpgroups), p = 2^(x - m) in f16 to the
   warpgroup's P^T tile. l is kept as per-thread partial sums and reduced once at the end
   (`_column_sums`).
4. V: `ggml_vt_lhs` builds V^T [256, 64] as 4 M-blocks straight from the ggml bytes, scaled,
   with the scales of tokens past the partition end zeroed (junk bytes never make NaN);
   O^T += V^T P^T, 4 wgmmas, the accumulators rescaled by alpha first.
5. m (natural log domain), l and O^T (rows in `magic_ptx.vt_dims` order) per partition to GMEM,
   [G, parts, ...]; the combine reads them as written and folds the partitions in logical order
   (`mosaic_common.combine_tiles`), then unpermutes its small result.

Token order: tile row / column i holds token `mosaic_common.token_perm(i)` (tokens 2 and 3 of
every 4 swapped) in the K lhs rows, the softmax masks, P^T and the V^T columns alike, so V's
quads read rows of alternating parity (2-way instead of 4-way bank conflicts).

Interpret mode (`interpret=True`) runs the same kernel body (page walk, TMA ring, barriers,
masks, outputs) in the Mosaic GPU interpreter, which runs neither inline Mosaic GPU code nor a
register lhs: there the tile math is jnp (`_InterpretTile`): the same scaled f16 values in the
same permuted orders (from `ggml_codec`), the same log2-domain softmax, dots in float32; and one
Pallas thread serves every head in turn (no "consumed" barriers): several interpreter threads
blocking in barrier callbacks at once can starve each other on a small CPU.

Speed on the H200: docs/PERFORMANCE.md, 'Span attention kernels'. Other schedules and layouts
were measured slower or no faster and are not kept (the page table in SMEM, K issued late or by
each warpgroup, V rings of half or several tiles, a producer warpgroup, two heads a warpgroup,
split conversions, accumulators in refs, tokens in order, token-major K, other wgmma N and
combine tiles): docs/DESIGN.md.
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
from kvjax_pallas.span_attention import partitions as _partitions
from kvjax_pallas.span_attention import reference as _ref
from kvjax_pallas.span_attention.mosaic_common import (
    BLOCK_TOKENS, BOX, HEAD_DIM, LN2, LOG2E, SMEM_LIMIT, SMEM_RESERVE, check_layout, combine_tiles,
    copy_lines, f32_ops, fold_query_ggml, ggml_k_lhs, ggml_vt_lhs, interpret_params,
    k_in_ggml_order, lane_ids, mlir_modules, perm_i32, pool_views, thread_ptr, tile_page,
    token_perm, vt_in_magic_order)

MAX_ROWS = 40              # folded query rows a KV head (a wider N is register-bound)
N_CHOICES = (8, 16, 32, 40)  # the wgmma N of a call (Q and P N-major: any multiple of 8 works;
                           # these measured fastest: docs/PERFORMANCE.md)
K_SLOTS = (2, 1)           # K ring slots, most first: the most that fit
INFO = 8                   # per-warpgroup SMEM i32 words before the column limits
ZERO = 2                   # the info word that holds 0 (the loop-variant zero of the Q^T / P^T
                           # indices)

_COMPILER_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def rows_padded(rows: int) -> int:
  """Folded query rows -> the wgmma N: the smallest of `N_CHOICES` that holds them (decode 6 rows
  -> 8, verify S=4 / 5 24 / 30 rows -> 32, S=6 36 rows -> 40). Q and P sit in SMEM N-major ([N, K]
  tiles of (8, 64), swizzle 128) and reach wgmma transposed, so N needs no power of two."""
  if rows < 1:
    raise ValueError("span attention needs at least 1 query row")
  if rows > MAX_ROWS:
    raise ValueError(f"too many folded query rows for the Mosaic GPU decode kernel: {rows} > "
                     f"{MAX_ROWS} (query tokens x query heads per KV head; longer calls go to "
                     f"the prefill kernel, or use implementation='triton')")
  return next(n for n in N_CHOICES if n >= rows)


def smem_bytes(layout: PageLayout, n: int, k_slots: int) -> int:
  """Shared memory of one CTA: the K ring, the V slot (a whole tile), Q^T and P^T per head, the
  reduction slots, the info words and the (m, l) staging, plus SMEM_RESERVE."""
  g, bt = layout.num_kv_heads, BLOCK_TOKENS
  return SMEM_RESERVE + (k_slots * bt * layout.k_row_bytes + bt * layout.v_row_bytes
          + g * (HEAD_DIM + bt) * n * 2 + g * 2 * 4 * n * 4 + g * (INFO + n) * 4 + g * 2 * n * 4)


def choose_k_slots(layout: PageLayout, n: int) -> int:
  """K ring slots of the call: 2 where they fit in SMEM beside the V slot (decode, N = 8 / 16 at
  the 27B shape), else 1 (N = 32 there); raises where not even 1 fits, naming the shortfall."""
  for k_slots in K_SLOTS:
    if smem_bytes(layout, n, k_slots) <= SMEM_LIMIT:
      return k_slots
  need = smem_bytes(layout, n, K_SLOTS[-1])
  raise ValueError(f"the Mosaic GPU decode kernel needs {need:,} B of shared memory at N={n} with "
                   f"{layout.num_kv_heads} KV heads, {need - SMEM_LIMIT:,} B more than the "
                   f"{SMEM_LIMIT:,} B of a CTA")


def choose_block_pages(num_pages: int, num_sms: int = _partitions.DEFAULT_NUM_SMS) -> int:
  """Pages a logical partition: one CTA a partition (all heads), all in one wave
  (`partitions.one_wave`). A pure function of the static shapes."""
  return _partitions.one_wave(num_pages, num_sms)


# ----------------------------------------------------------------------------- inline pieces


def _softmax_tile(n: int, scale_log2: float):
  """The online-softmax step of one tile, inline Mosaic GPU code (GPU only):
  (s [64, N] f32 raw scores S^T, m [N] running max (log2 domain), l [N] per-thread partial sums,
  info ref (i32: [0] the tile's first token, [INFO + c] column c's key limit), red ref (f32 [4, N]:
  one row a warp)) -> (p [64, N] f16, m_new [N], l_new [N], alpha [64, N] f32 broadcast over the
  rows). x = s * scale_log2, -inf at keys >= the column's limit; the tile max of each column is
  reduced over the thread's two rows, the 8 lanes of its column (butterfly shuffles over lane bits
  2-4) and the 4 warps (one SMEM row each, then the warpgroup's named barrier; the caller
  alternates two red slots so a fast warp's next write cannot meet a slow warp's read);
  m_use = m_new or 0 where it is -inf; p = 2^(x - m_use); alpha = 2^(m - m_use);
  l_new = l alpha + this thread's p. Row i of the tile is its token `token_perm(i)`."""
  col = plgpu.Layout.WGMMA.reduce(0)
  ret = (plgpu.ShapeDtypeStruct((BLOCK_TOKENS, n), jnp.float16, plgpu.Layout.WGMMA),
         plgpu.ShapeDtypeStruct((n,), jnp.float32, col),
         plgpu.ShapeDtypeStruct((n,), jnp.float32, col),
         plgpu.ShapeDtypeStruct((BLOCK_TOKENS, n), jnp.float32, plgpu.Layout.WGMMA))

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, col, col, plgpu.RefType(), plgpu.RefType()),
                     return_type=ret)
  def step(ctx, s, m, l, info, red):
    del ctx
    ir, arith, llvm, vector, fa, mu, mgpu = mlir_modules()
    f32, f16, i32 = ir.F32Type.get(), ir.F16Type.get(), ir.IntegerType.get_signless(32)
    fmax, ex2, shfl, neg_inf = f32_ops()
    c, lane, warp, _ = lane_ids(1)
    quad, r = arith.andi(lane, c(3)), arith.shrui(lane, c(2))
    quad2 = arith.muli(quad, c(2))
    t_lim = thread_ptr(info, quad2, i32)                               # + INFO + 8 k + e
    t_red_w = thread_ptr(red, arith.addi(arith.muli(warp, c(n)), quad2), f32)  # + 8 k + e
    t_red = thread_ptr(red, quad2, f32)                                # + w n + 8 k + e
    first = llvm.load(i32, mu.memref_ptr(info))
    row_in = arith.addi(arith.muli(warp, c(16)), r)
    row0 = arith.addi(first, perm_i32(row_in))                 # token of row half 0
    k_scale = arith.constant(f32, ir.FloatAttr.get(f32, scale_log2))
    zero = arith.constant(f32, ir.FloatAttr.get(f32, 0.0))
    groups = n // 8
    x = {}                                             # (group, e, half) -> masked scaled score
    for k in range(groups):
      reg = [s.registers[0, k, 0, 0, h, 0, 0, 0, 0] for h in range(2)]
      for e in range(2):
        lim = llvm.load(i32, mu.getelementptr(t_lim, [INFO + 8 * k + e], i32))
        for h in range(2):
          v = arith.mulf(vector.extract(reg[h], [], [e]), k_scale)
          tok = arith.addi(row0, c(8 * h))
          ok = arith.cmpi(arith.CmpIPredicate.slt, tok, lim)
          x[k, e, h] = arith.select(ok, v, neg_inf)
        mx = fmax(x[k, e, 0], x[k, e, 1])
        for off in (4, 8, 16):
          mx = fmax(mx, shfl(mx, off))
        llvm.store(mx, mu.getelementptr(t_red_w, [8 * k + e], f32))
    mu.warpgroup_barrier()
    m_regs = np.empty(m.registers.shape, dtype=object)
    l_regs = np.empty(l.registers.shape, dtype=object)
    p_regs = np.empty(s.registers.shape, dtype=object)
    a_regs = np.empty(s.registers.shape, dtype=object)
    v2f32 = ir.VectorType.get((2,), f32)
    for k in range(groups):
      m_new, alpha, l_new, p = [], [], [], {}
      for e in range(2):
        tm = llvm.load(f32, mu.getelementptr(t_red, [8 * k + e], f32))
        for w in range(1, 4):
          tm = fmax(tm, llvm.load(f32, mu.getelementptr(t_red, [w * n + 8 * k + e], f32)))
        m_old = vector.extract(m.registers[k, 0, 0], [], [e])
        mn = fmax(m_old, tm)
        m_use = arith.select(arith.cmpf(arith.CmpFPredicate.OEQ, mn, neg_inf), zero, mn)
        a = ex2(arith.subf(m_old, m_use))
        for h in range(2):
          p[e, h] = ex2(arith.subf(x[k, e, h], m_use))
        l_old = vector.extract(l.registers[k, 0, 0], [], [e])
        l_new.append(arith.addf(arith.mulf(l_old, a), arith.addf(p[e, 0], p[e, 1])))
        m_new.append(mn)
        alpha.append(a)
      m_regs[k, 0, 0] = vector.from_elements(v2f32, m_new)
      l_regs[k, 0, 0] = vector.from_elements(v2f32, l_new)
      for h in range(2):
        pair = vector.from_elements(v2f32, [p[0, h], p[1, h]])
        p_regs[0, k, 0, 0, h, 0, 0, 0, 0] = arith.truncf(ir.VectorType.get((2,), f16), pair)
        a_regs[0, k, 0, 0, h, 0, 0, 0, 0] = vector.from_elements(v2f32, alpha)
    mk = lambda regs, layout: mgpu.FragmentedArray(_registers=regs, _layout=layout,
                                                   _is_signed=None)
    return (mk(p_regs, fa.WGMMA_LAYOUT), mk(m_regs, m.layout), mk(l_regs, l.layout),
            mk(a_regs, fa.WGMMA_LAYOUT))

  return step


def _column_sums(n: int):
  """(l [N] per-thread partial sums, red ref f32 [4, N]) -> l [N] summed over the warpgroup:
  butterfly shuffles over the 8 lanes of a column, one SMEM row a warp, the warpgroup's named
  barrier, the 4 rows added (inline Mosaic GPU code)."""
  col = plgpu.Layout.WGMMA.reduce(0)

  @plgpu.inline_mgpu(arg_types=(col, plgpu.RefType()),
                     return_type=plgpu.ShapeDtypeStruct((n,), jnp.float32, col))
  def total(ctx, l, red):
    del ctx
    ir, arith, llvm, vector, _, mu, mgpu = mlir_modules()
    f32 = ir.F32Type.get()
    _, _, shfl, _ = f32_ops()
    c, lane, warp, _ = lane_ids(1)
    quad2 = arith.muli(arith.andi(lane, c(3)), c(2))
    t_red_w = thread_ptr(red, arith.addi(arith.muli(warp, c(n)), quad2), f32)  # + 8 k + e
    t_red = thread_ptr(red, quad2, f32)                                # + w n + 8 k + e
    for k in range(n // 8):
      for e in range(2):
        v = vector.extract(l.registers[k, 0, 0], [], [e])
        for off in (4, 8, 16):
          v = arith.addf(v, shfl(v, off))
        llvm.store(v, mu.getelementptr(t_red_w, [8 * k + e], f32))
    mu.warpgroup_barrier()
    regs = np.empty(l.registers.shape, dtype=object)
    v2f32 = ir.VectorType.get((2,), f32)
    for k in range(n // 8):
      out = []
      for e in range(2):
        acc = llvm.load(f32, mu.getelementptr(t_red, [8 * k + e], f32))
        for w in range(1, 4):
          acc = arith.addf(acc, llvm.load(f32, mu.getelementptr(t_red, [w * n + 8 * k + e], f32)))
        out.append(acc)
      regs[k, 0, 0] = vector.from_elements(v2f32, out)
    return mgpu.FragmentedArray(_registers=regs, _layout=l.layout, _is_signed=None)

  return total


# ----------------------------------------------------------------------------- tile math
# One KV head's work on one tile: `scores` (S^T = K Q^T), `softmax`, `store_p`, `pv`
# (O^T = O^T alpha + V^T P^T, the rescale done by the caller); `head` is the KV head (the
# compiled conversions take it from the warpgroup index instead).


class _CompiledTile:
  """The tile math of the compiled kernel: magic conversions in registers, inline softmax."""

  def __init__(self, layout: PageLayout, n: int, scale_log2: float):
    g = layout.num_kv_heads        # warpgroups: one a KV head
    self.n = n
    self.k_lhs = ggml_k_lhs(layout.k_type, layout, 0, g, scaled=True, perm=True, heads_major=True)
    self.vt_lhs = ggml_vt_lhs(layout, 0, g, masked=True, perm=True)
    self.softmax = _softmax_tile(n, scale_log2)
    self.col_sums = _column_sums(n)

  def scores(self, kbuf, qt, head):
    """S^T [64, N] f32 of kbuf (the K slot [G, 64, head words] i32) and qt (Q [N, 256] f16)."""
    del head

    def qk(acc):
      plgpu.wgmma(acc, self.k_lhs(kbuf), qt.transpose((1, 0)))                 # Q^T [256, N]
      plgpu.wgmma_wait(0)
      return acc[...]
    return pl.run_scoped(qk, plgpu.ACC((BLOCK_TOKENS, self.n), jnp.float32))

  def pv(self, o, vbuf, pt, info, head):
    """o (4 O^T M-blocks [64, N] f32) + V^T P^T of vbuf (the V slot [lines, L] u8) and pt (P
    [N, 64] f16)."""
    del head

    def pv(accs):
      for acc, vt in zip(accs, self.vt_lhs(vbuf, info)):
        plgpu.wgmma(acc, vt, pt.transpose((1, 0)))                             # P^T [64, N]
      plgpu.wgmma_wait(0)
    return pl.run_state(pv)(tuple(plgpu.ACC.init(x) for x in o))

  def store_p(self, p_ref, p16):
    """p [64, N] f16 (WGMMA layout) -> the N-major P ref [N, 64]: one register shuffle into the
    transposed layout, then Mosaic's tiled store through the transposed view."""
    p_ref.transpose((1, 0))[...] = plgpu.layout_cast(p16, plgpu.Layout.WGMMA_TRANSPOSED)

  def zeros(self):
    col = plgpu.Layout.WGMMA.reduce(0)
    n = self.n
    return (plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), col),
            plgpu.layout_cast(jnp.zeros((n,), jnp.float32), col),
            tuple(plgpu.layout_cast(jnp.zeros((BLOCK_TOKENS, n), jnp.float32),
                                    plgpu.Layout.WGMMA) for _ in range(4)))


class _InterpretTile:
  """The tile math in jnp for the Mosaic GPU interpreter: the same scaled f16 values in the same
  column / row orders as the compiled conversions (ggml_codec decodes; one rounding to f16 of
  the exact product, as mul.rn.f16x2), the same log2-domain softmax, dots in float32."""

  def __init__(self, layout: PageLayout, n: int, scale_log2: float):
    self.layout, self.n, self.scale_log2 = layout, n, scale_log2

  def _rows(self, x):
    """The tile's rows in its token order: row i = token `token_perm(i)` (tokens 2 and 3 of
    every 4 swapped, by slices: kernels take no constant index arrays)."""
    q = x.reshape(BLOCK_TOKENS // 4, 4, *x.shape[1:])
    return jnp.concatenate([q[:, :2], q[:, 3:4], q[:, 2:3]], axis=1).reshape(x.shape)

  def _tokens(self, first, shape):
    return first + token_perm(lax.broadcasted_iota(jnp.int32, shape, 0))

  def _decode(self, head, kind: str):
    return self._rows(ggml_codec.decode_rows(head, kind, 1).reshape(BLOCK_TOKENS, HEAD_DIM)
                      .astype(jnp.float16))

  def scores(self, kbuf, qt, head):
    lay = self.layout
    words = kbuf.at[head][...]                 # [64, head words] i32: head's K rows
    k_bytes = lax.bitcast_convert_type(words, jnp.uint8).reshape(BLOCK_TOKENS, lay.k_head_bytes)
    k = k_in_ggml_order(self._decode(k_bytes, lay.k_type))
    return jnp.dot(k.astype(jnp.float32), qt[...].T.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)

  def softmax(self, s, m, l, info, red):
    del red
    bt = BLOCK_TOKENS
    tok = self._tokens(info[0], (bt, self.n))
    lim = info[pl.ds(INFO, self.n)]
    x = jnp.where(tok < lim[None, :], s * jnp.float32(self.scale_log2), -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(x, axis=0))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(x - m_use[None, :])
    alpha = jnp.exp2(m - m_use)
    l_new = l * alpha + jnp.sum(p, axis=0)
    return p.astype(jnp.float16), m_new, l_new, jnp.broadcast_to(alpha[None, :], (bt, self.n))

  def pv(self, o, vbuf, pt, info, head):
    lay = self.layout
    rows = vbuf[...].reshape(BLOCK_TOKENS, lay.v_row_bytes)          # the tile's all-heads V
    v = self._decode(lax.dynamic_slice_in_dim(rows, head * lay.v_head_bytes, lay.v_head_bytes,
                                              axis=1), lay.v_type)
    ok = self._tokens(info[0], (BLOCK_TOKENS, 1)) < info[1]
    vt = vt_in_magic_order(jnp.where(ok, v, jnp.float16(0)).T)      # [256, 64], vt_dims rows
    upd = jnp.dot(vt.astype(jnp.float32), pt[...].T.astype(jnp.float32),
                  precision=lax.Precision.HIGHEST)
    return tuple(x + upd[64 * mb:64 * (mb + 1)] for mb, x in enumerate(o))

  def col_sums(self, l, red):
    del red
    return l

  def store_p(self, p_ref, p16):
    p_ref[...] = p16.T

  def zeros(self):
    n = self.n
    return (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32),
            tuple(jnp.zeros((BLOCK_TOKENS, n), jnp.float32) for _ in range(4)))


# ----------------------------------------------------------------------------- kernel


def _decode_kernel(kv_ref, tb_ref, te_ref, tab_ref, qpos_ref, qt_ref, lines_ref, krows_ref,  # in
                   ml_out, o_out,                                                        # out
                   kbufs, vbuf, kbars, vbar, kfree, vfree, qt_s, pt_s, red_s, info_s, ml_s,
                   in_bar,                                                               # scratch
                   *, layout: PageLayout, block_pages: int, num_phys: int, num_table: int,
                   num_tokens: int, group: int, n: int, scale_log2: float, interpret: bool):
  # kv_len, tile_begin, tile_end [1] i32 (as the caller gave them: no XLA op stacks them);
  # tab [T] i32; qpos [S] i32; qt [G, N, 256] f16 (Q, head dims in ggml_dims order)
  # lines [P, page_bytes / L, L] u8 (L = line_bytes: 256 at the 27B shape)
  # krows [P * page_bytes / k_row_bytes, G, k_head_bytes / 4] i32 (the same pool as K rows)
  # -> ml_out [G, parts, 2, N] f32 (m natural-log domain, l), o_out [G, parts, 256, N] f32
  #    (O^T, rows in vt_dims order)
  # scratch: kbufs [K slots, G, 64, k_head_bytes / 4] i32 (the K ring, head-major), vbuf [1, V
  # lines, L] u8 (the V ring: one whole-tile slot), kbars / kfree (K slots), vbar / vfree (1;
  # "free" barriers: one arrival a warpgroup), qt_s [G, N, 256] f16, pt_s [G, N, 64] f16 (Q and
  # P N-major: wgmma reads them through transposed views as Q^T and P^T), red_s [G, 2, 4, N] f32,
  # info_s [G, INFO + N] i32, ml_s [G, 2, N] f32, in_bar
  g_heads = layout.num_kv_heads
  # compiled: one warpgroup a KV head (Pallas threads); interpreted: one thread serves every head
  # in turn (the interpreter runs each Pallas thread's code as an XLA computation whose barrier
  # waits are host callbacks; several blocking at once could starve each other on a small CPU)
  multi = g_heads > 1 and not interpret
  heads = [lax.axis_index("wg")] if multi else list(range(g_heads))
  pp = lax.axis_index("p")
  bt, pt = BLOCK_TOKENS, layout.page_tokens
  tiles = (_InterpretTile(layout, n, scale_log2) if interpret
           else _CompiledTile(layout, n, scale_log2))
  k_slots = kbufs.shape[0]
  line = lines_ref.shape[-1]
  v_lines = bt * layout.v_row_bytes // line
  v_first = layout.v_offset // line

  kv_len, tile_begin = kv_ref[0], tb_ref[0]
  n_active = (kv_len + pt - 1) // pt                    # pages holding keys
  tile_end = jnp.minimum(jnp.minimum(te_ref[0], n_active), num_table)
  causal_end = functools.reduce(jnp.maximum, [qpos_ref[s] for s in range(num_tokens)]) + 1
  page_lo = jnp.maximum(pp * block_pages, tile_begin)
  page_hi = jnp.minimum(pp * block_pages + block_pages, tile_end)
  tok_lo = page_lo * pt
  tok_end = jnp.minimum(page_hi * pt, kv_len)          # keys at or past this are masked
  tok_hi = jnp.minimum(tok_end, causal_end)             # no tile past the last query's position
  n_tiles = jnp.maximum(tok_hi - tok_lo + bt - 1, 0) // bt

  def by_issuer(fn):
    """fn by warpgroup 0 (compiled) or now (the interpreter's one thread)."""
    if multi:
      pl.when(heads[0] == 0)(fn)
    else:
      fn()

  page_of = functools.partial(tile_page, tab_ref, tok_lo, page_tokens=pt, num_table=num_table,
                              num_phys=num_phys)

  def copy_k(i, slot):
    """TMA copies of key tile i's K into K slot `slot`: one box a head ([64 rows, head words] of
    the K-row view), all arriving on the slot's barrier."""
    phys, r = page_of(i)
    row0 = phys * layout.k_rows_per_page + r * bt
    dst = kbufs.at[slot]
    for h in range(g_heads):
      plgpu.copy_gmem_to_smem(krows_ref.at[pl.ds(row0, bt), h], dst.at[h], kbars.at[slot])

  def copy_v(i):
    """TMA copies of key tile i's all-heads V span into the V slot."""
    phys, r = page_of(i)
    copy_lines(lines_ref, phys, v_first + r * v_lines, v_lines, vbuf.at[0], vbar.at[0])

  def first_copies():
    """The Q copy and the rings' first tiles."""
    plgpu.copy_gmem_to_smem(qt_ref, qt_s, in_bar)

    @pl.when(n_tiles > 0)
    def _():
      copy_k(0, 0)
      copy_v(0)

    if k_slots > 1:
      pl.when(n_tiles > 1)(lambda: copy_k(1, 1))

  def refill_k(i, ks):
    """K slot ks, once every warpgroup has freed it, takes K(i + k_slots)."""
    if multi:
      plgpu.barrier_wait(kfree.at[ks])
    pl.when(i + k_slots < n_tiles)(lambda: copy_k(i + k_slots, ks))

  def refill_v(i):
    """The V slot, once every warpgroup has freed it, takes V(i + 1)."""
    if multi:
      plgpu.barrier_wait(vfree.at[0])
    pl.when(i + 1 < n_tiles)(lambda: copy_v(i + 1))

  by_issuer(first_copies)

  # a head's info words: [0] the tile's first token, [1] the token end, [ZERO] 0, [INFO + c] the
  # key limit of column c: min(token end, q_pos of its query token + 1); padding columns none
  for h in heads:
    info = info_s.at[h]
    info[1] = tok_end
    info[ZERO] = jnp.int32(0)
    for col in range(n):
      info[INFO + col] = (jnp.minimum(tok_end, qpos_ref[col // group] + 1)
                          if col < num_tokens * group else jnp.int32(-1))
  plgpu.barrier_wait(in_bar)

  def body(i, carry):
    """Tile i for every head this thread serves; carry: per head (m, l, O^T)."""
    ks = i % k_slots
    for h in heads:
      info_s.at[h][0] = tok_lo + i * bt
    # the rows of qt_s / pt_s this tile's wgmmas read: head + a zero loaded in the loop
    z = info_s[heads[0], ZERO]
    rh = [h + z for h in heads]
    plgpu.barrier_wait(kbars.at[ks])
    scores = [tiles.scores(kbufs.at[ks], qt_s.at[r], h) for h, r in zip(heads, rh)]
    if multi:
      plgpu.barrier_arrive(kfree.at[ks])
    by_issuer(lambda: refill_k(i, ks))

    stepped = []
    for h, r, s, (m, l, o) in zip(heads, rh, scores, carry):
      p16, m, l, alpha = tiles.softmax(s, m, l, info_s.at[h], red_s.at[h, i % 2])
      tiles.store_p(pt_s.at[r], p16)
      stepped.append((m, l, tuple(x * alpha for x in o)))
    plgpu.commit_smem()
    plgpu.barrier_wait(vbar.at[0])
    carry = [(m, l, tiles.pv(o, vbuf.at[0], pt_s.at[r], info_s.at[h], h))
             for h, r, (m, l, o) in zip(heads, rh, stepped)]
    if multi:
      plgpu.barrier_arrive(vfree.at[0])
    by_issuer(lambda: refill_v(i))
    return tuple(carry)

  final = lax.fori_loop(0, n_tiles, body, tuple(tiles.zeros() for _ in heads))
  for h, (m, l, o) in zip(heads, final):
    l = tiles.col_sums(l, red_s.at[h, 0])
    ml = ml_s.at[h]
    ml[0, :] = jnp.where(m == -jnp.inf, m, m * jnp.float32(LN2))
    ml[1, :] = l
  plgpu.commit_smem()
  for h, (_, _, o) in zip(heads, final):
    plgpu.copy_smem_to_gmem(ml_s.at[h], ml_out.at[h, pp])
    for mb in range(4):
      o_out[h, pp, pl.ds(64 * mb, 64)] = o[mb]
  plgpu.wait_smem_to_gmem(0)


# ----------------------------------------------------------------------------- wrapper


def decode_partials(q_shd, pool_u8, page_table_t, kv_len, tile_begin, tile_end, q_pos_s, *,
                 layout: PageLayout, block_pages: int, n_parts: int, sm_scale: float,
                 interpret: bool):
  """The kernel alone: its per-partition partials before the combine (kv_len, tile_begin,
  tile_end: i32 scalars; tile_end is clipped to the active pages and the table in the kernel;
  n_parts: the grid's partitions, at least the table's) -> (ml [G, parts, 2, N], O^T [G, parts,
  256, N] in vt_dims rows) f32."""
  s_tok, h, d = q_shd.shape
  g = layout.num_kv_heads
  r = h // g
  n = rows_padded(s_tok * r)
  bt = BLOCK_TOKENS
  num_phys = pool_u8.shape[0]
  qt = fold_query_ggml(q_shd, g, n)                                  # [G, N, D]
  lines, krows = pool_views(pool_u8, layout)
  line = lines.shape[-1]
  v_lines = bt * layout.v_row_bytes // line
  k_slots = choose_k_slots(layout, n)
  # Q and P N-major in (8, 64) tiles, 128-byte swizzle: the transposed wgmma rhs of any N % 8 == 0
  rhs = lambda shape: plgpu.SMEM(shape, jnp.float16, transforms=(
      plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
  scratch = [
      plgpu.SMEM((k_slots, g, bt, layout.k_head_bytes // 4), jnp.int32),   # kbufs
      plgpu.SMEM((1, v_lines, line), jnp.uint8),                         # vbuf
      plgpu.Barrier(num_arrivals=g, num_barriers=k_slots),               # kbars (a box a head)
      plgpu.Barrier(num_arrivals=-(-v_lines // BOX), num_barriers=1),    # vbar
      plgpu.Barrier(num_arrivals=g, num_barriers=k_slots),               # kfree (a warpgroup
      plgpu.Barrier(num_arrivals=g, num_barriers=1),                     # vfree  each)
      rhs((g, n, d)),                                                    # qt_s
      rhs((g, n, bt)),                                                   # pt_s
      plgpu.SMEM((g, 2, 4, n), jnp.float32),                             # red_s
      plgpu.SMEM((g, INFO + n), jnp.int32),                              # info_s
      plgpu.SMEM((g, 2, n), jnp.float32),                                # ml_s
      plgpu.Barrier(num_arrivals=1),                                     # in_bar
  ]
  body = functools.partial(_decode_kernel, layout=layout, block_pages=block_pages,
                           num_phys=num_phys, num_table=page_table_t.shape[0],
                           num_tokens=s_tok, group=r, n=n,
                           scale_log2=float(sm_scale) * LOG2E, interpret=interpret)
  kw = dict(num_threads=g, thread_name="wg") if g > 1 and not interpret else {}
  kern = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((g, n_parts, 2, n), jnp.float32),
                jax.ShapeDtypeStruct((g, n_parts, d, n), jnp.float32)),
      scratch_types=scratch, grid=(n_parts,), grid_names=("p",),
      compiler_params=_COMPILER_PARAMS,
      interpret=interpret_params() if interpret else None, **kw)
  scalar = lambda x: jnp.reshape(jnp.asarray(x, jnp.int32), (1,))
  return kern(scalar(kv_len), scalar(tile_begin), scalar(tile_end),
              page_table_t.astype(jnp.int32), q_pos_s.astype(jnp.int32), qt, lines, krows)


@functools.partial(jax.jit, static_argnames=("layout", "num_q_heads", "block_pages", "sm_scale",
                                             "interpret"))
def span_attention_partial_mosaic_decode(q_shd, pool_pn, page_table_t, kv_len, q_pos_s,
                                         carry: Optional[_ref.Carry], tile_begin, tile_end, *,
                                         layout: PageLayout, num_q_heads: int,
                                         block_pages: int = 1, sm_scale: Optional[float] = None,
                                         interpret: bool = False) -> _ref.Carry:
  """Mosaic GPU decode version of `reference.span_attention_partial_reference` (same contract;
  carry=None: the empty carry). The partitions are folded in logical order by the shared combine
  (`combine.combine_call`), O^T's rows taken as its columns in `magic_ptx.vt_dims` order; the
  partition count is padded to the combine's load group with empty CTAs."""
  _common.check_call(q_shd, pool_pn, layout, num_q_heads, block_pages, check_layout)
  s_tok, h, d = q_shd.shape
  rows = s_tok * (h // layout.num_kv_heads)
  n = rows_padded(rows)
  scale = (1.0 / d ** 0.5) if sm_scale is None else sm_scale
  num_parts = -(-max(page_table_t.shape[0], 1) // block_pages)
  tiles = combine_tiles(n, num_parts)
  q_pos_s = jnp.asarray(q_pos_s, jnp.int32)
  ml_p, ot_p = decode_partials(q_shd, _common.byte_view(pool_pn), page_table_t, kv_len,
                               tile_begin, tile_end, q_pos_s, layout=layout,
                               block_pages=block_pages, n_parts=tiles.padded_parts(num_parts),
                               sm_scale=scale, interpret=interpret)
  # ml_p [G, parts, 2, N] and O^T [G, parts, vt rows, N] go to the combine as the kernel wrote them
  return _combine.combine_call(ml_p, None, ot_p, carry, rows=rows, tiles=tiles,
                               acc_transposed=True, v_cols=magic_ptx.vt_dims(d), head_dim=d,
                               interpret=interpret)


def span_attention_mosaic_decode(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, *,
                                 layout: PageLayout, block_pages: int = 1,
                                 sm_scale: Optional[float] = None, interpret: bool = False):
  """o_shd [S, H, D] float32 over all active pages (Mosaic GPU decode version of the
  reference)."""
  return _common.whole_span(span_attention_partial_mosaic_decode, q_shd, pool_pn, page_table_t,
                            kv_len, q_pos_s, layout=layout, block_pages=block_pages,
                            sm_scale=sm_scale, interpret=interpret)
