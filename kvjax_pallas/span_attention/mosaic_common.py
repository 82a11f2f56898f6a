"""Mosaic GPU (Hopper) pieces shared by the decode kernel (`mosaic_decode.py`) and the prefill
kernel (`mosaic_prefill.py`): the layout contract, the pool's TMA views, the magic-number
conversions of the ggml quants into WGMMA-layout f16 (`ggml_k_lhs`, `ggml_vt_lhs`), the
per-thread SMEM addressing of inline Mosaic GPU code, the head-dim orders the conversions produce
and their jnp equivalents for the interpreter.

Both kernels take Q8_0 K / Q4_0 V pages, head_dim 256, 1-4 KV heads, page_tokens a multiple of
64 and pages of whole K rows (`check_layout`). The pool is read through two views of its bytes
(`pool_views`): lines [P, page_bytes / L, L] u8 (V spans, `line_bytes`) and K rows
[P * K rows a page, G, head bytes / 4] i32 (one TMA box a head's K rows).

Inline code (`plgpu.inline_mgpu`) runs only when compiled for the GPU; the Mosaic GPU
interpreter runs the jnp forms (`k_in_ggml_order`, `vt_in_magic_order` with `ggml_codec`).
The kernels' transposed SMEM operands are the refs' own views (`ref.transpose((1, 0))`, in jax
0.10 and 0.11), not `plgpu.transpose_ref`, which jax 0.11 deprecates.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax_pallas.page_layout import BLOCK_FORMATS, PageLayout
from kvjax_pallas.span_attention import combine as _combine
from kvjax_pallas.span_attention import magic_ptx
from kvjax_pallas.span_attention import mosaic_names
from kvjax_pallas.span_attention import reference as _ref

SUPPORTED_PAIRS = (("q8_0", "q4_0"),)
HEAD_DIM = 256
BLOCK_TOKENS = 64          # keys a tile: the wgmma M dimension of the decode kernel
MAX_KV_HEADS = 4           # one warpgroup a KV head in the decode kernel
LINE = 256                 # bytes a line of the pool's V view at most (a TMA box's inner
                           # dimension: `line_bytes`)
BOX = 256                  # TMA box limit a dimension
SMEM_LIMIT = 232_448       # bytes of shared memory a CTA may use on the H200
SMEM_RESERVE = 2_048       # bytes for barriers and buffer alignment beyond the buffers
COMBINE_ROWS = 8           # the combine's row block (the kernels' padded rows are multiples of 8)
COMBINE_COLS = 8           # the combine's column block: 2 elements a thread
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

mosaic_names.install()     # kernel modules named by content: one persistent-cache key a program


def check_layout(layout: PageLayout, head_dim: int):
  """Raise ValueError for a page layout the Mosaic GPU kernels do not take."""
  pair = (layout.k_type, layout.v_type)
  if pair not in SUPPORTED_PAIRS:
    raise ValueError(f"unsupported K/V pair {layout.k_type.upper()}/{layout.v_type.upper()} for "
                     f"the Mosaic GPU kernels; they support Q8_0/Q4_0 only")
  if head_dim != layout.head_dim:
    raise ValueError(f"query head_dim {head_dim} != layout head_dim {layout.head_dim}")
  if head_dim != HEAD_DIM:
    raise ValueError(f"the Mosaic GPU kernels support head_dim {HEAD_DIM} only, got {head_dim}")
  if not 1 <= layout.num_kv_heads <= MAX_KV_HEADS:
    raise ValueError(f"the Mosaic GPU kernels take 1-{MAX_KV_HEADS} KV heads (one warpgroup "
                     f"each), got {layout.num_kv_heads}")
  if layout.page_tokens % BLOCK_TOKENS:
    raise ValueError(f"page_tokens {layout.page_tokens} is not a multiple of {BLOCK_TOKENS}")
  if layout.page_bytes % layout.k_row_bytes or layout.k_head_bytes % 16:
    raise ValueError(f"the Mosaic GPU kernels view the pool as K rows: page bytes "
                     f"{layout.page_bytes} must be whole K rows of {layout.k_row_bytes} B and a "
                     f"head's K row ({layout.k_head_bytes} B) whole 16-byte units")
  line_bytes(layout)


def line_bytes(layout: PageLayout) -> int:
  """Bytes a line of the pool's V view (the V TMA boxes' inner dimension): the largest power of
  two up to `LINE` dividing the page, the V plane offset and half a tile's V span (256 at the
  27B shape; the TMA engine wants >= 16)."""
  g = math.gcd(layout.page_bytes, layout.v_offset, BLOCK_TOKENS // 2 * layout.v_row_bytes)
  line = min(LINE, g & -g)
  if line < 16:
    raise ValueError(f"the Mosaic GPU kernels' V copies need the page ({layout.page_bytes} B), "
                     f"the V plane offset ({layout.v_offset} B) and half a tile's V span "
                     f"({BLOCK_TOKENS // 2 * layout.v_row_bytes} B) in 16-byte lines")
  return line


def pool_views(pool_u8, layout: PageLayout):
  """uint8 [P, page_bytes] -> (lines [P, page_bytes / L, L] u8 with L = `line_bytes`, K rows
  [P * K rows a page, G, k_head_bytes / 4] i32): the same bytes, reshapes and a bitcast (no
  copy)."""
  num_phys = pool_u8.shape[0]
  line = line_bytes(layout)
  lines = pool_u8.reshape(num_phys, layout.page_bytes // line, line)
  kw_head = layout.k_head_bytes // 4
  krows = lax.bitcast_convert_type(pool_u8.reshape(num_phys * layout.k_rows_per_page,
                                                   layout.num_kv_heads, kw_head, 4), jnp.int32)
  return lines, krows


def fold_query_ggml(q_shd, num_kv_heads: int, rows_pad: int):
  """q [S, H, D] -> [G, rows_pad, D] f16: a KV head's query heads folded into S x R rows (padded
  with zero rows), head dims in `magic_ptx.ggml_dims` order (K's columns), by reshapes and
  transposes only (one XLA fusion)."""
  qf = k_in_ggml_order(_ref.fold_query(q_shd.astype(jnp.float16), num_kv_heads))   # [G, rows, D]
  return jnp.pad(qf, ((0, 0), (0, rows_pad - qf.shape[1]), (0, 0)))


def combine_tiles(rows_pad: int, num_parts: int) -> _combine.CombineTiles:
  """The combine's tiles of a call whose partials have `rows_pad` rows: COMBINE_ROWS rows (a
  power of two dividing rows_pad; the row blocks cover the real rows only) x COMBINE_COLS
  columns."""
  return _combine.default_tiles(min(COMBINE_ROWS, rows_pad & -rows_pad), COMBINE_COLS, num_parts)


def tile_page(tab_ref, tok_lo, i, *, page_tokens: int, num_table: int, num_phys: int):
  """(physical page, 64-row block in the page) of key tile i of a partition starting at token
  tok_lo: the table entry of its logical page (clipped to the table) clipped to the pool."""
  bt, pt = BLOCK_TOKENS, page_tokens
  t0 = tok_lo + i * bt
  lp = jnp.minimum(t0 // pt, num_table - 1)
  return jnp.clip(tab_ref[lp], 0, num_phys - 1), (t0 - lp * pt) // bt


def copy_lines(lines_ref, phys, first, count: int, dst, bar):
  """TMA copies of `count` lines from line `first` of page `phys` into dst [count, L], in boxes
  of at most BOX lines, all arriving on bar."""
  for c0 in range(0, count, BOX):
    cnt = min(BOX, count - c0)
    plgpu.copy_gmem_to_smem(lines_ref.at[phys, pl.ds(first + c0, cnt)], dst.at[pl.ds(c0, cnt)],
                            bar)


def interpret_params():
  """The Mosaic GPU interpreter's parameters (`plgpu.kernel(interpret=...)`)."""
  # pylint: disable=g-import-not-at-top
  from jax._src.pallas.mosaic_gpu.interpret import params as _ip
  return _ip.InterpretGPUParams()


def k_in_ggml_order(k):
  """[..., 256] by head dim -> [..., 256] in `magic_ptx.ggml_dims("q8_0")` order (column
  8 m + 2 c + e holds dim 64 c + 2 m + e) by reshapes (no gather: kernels take no constants)."""
  lead = k.shape[:-1]
  return jnp.swapaxes(k.reshape(*lead, 4, 32, 2), -3, -2).reshape(*lead, HEAD_DIM)


def vt_in_magic_order(vt):
  """[256, ...] by head dim -> [256, ...] in `magic_ptx.vt_dims` order: dim 64 w + 32 r1 + 16 h +
  4 r0 + mb sits at row 64 mb + 16 w + 8 h + 4 r1 + r0."""
  rest = vt.shape[1:]
  x = vt.reshape(4, 2, 2, 4, 4, *rest)                 # (w, r1, h, r0, mb)
  return jnp.transpose(x, (4, 0, 2, 1, 3, *range(5, 5 + len(rest)))).reshape(HEAD_DIM, *rest)


def token_perm(i):
  """The token order of a decode tile: tile row / column i holds token i ^ ((i >> 1) & 1)
  (tokens 2 and 3 of every 4 swapped; its own inverse). Python ints, numpy or jnp arrays. With
  it the V conversion's 4 quads read tokens of alternating parity: the V row stride (576 B) puts
  tokens of one parity on the same banks, so the V loads have 2-way instead of 4-way bank
  conflicts (K, 1088 B a row, stays 4-way: its 8 rows a quad have 2 bank classes whatever the
  order)."""
  return i ^ ((i >> 1) & 1)


# ----------------------------------------------------------------------------- inline pieces
# Lowering-time code (MLIR through `plgpu.inline_mgpu`); GPU only.


def mlir_modules():
  """(ir, arith, llvm, vector, fragmented_array, mosaic gpu utils, mosaic gpu) for inline code."""
  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, vector
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mu
  import jax.experimental.mosaic.gpu as mgpu
  return ir, arith, llvm, vector, fa, mu, mgpu


def lane_ids(consumers: int, j: int = 0):
  """(i32 constant maker, lane, warp in the warpgroup, head) of this thread: head = warpgroup +
  j * consumers."""
  ir, arith, _, _, _, mu, _ = mlir_modules()
  i32 = ir.IntegerType.get_signless(32)
  c = lambda v: mu.c(v, i32)
  t = mu.thread_idx()
  lane, warp = arith.andi(t, c(31)), arith.andi(arith.shrui(t, c(5)), c(3))
  head = arith.addi(arith.shrui(t, c(7)), c(j * consumers)) if consumers > 1 else c(j)
  return c, lane, warp, head


def thread_ptr(ref, offset, elem_type):
  """A pointer `offset` elements into ref's SMEM buffer (offset: this thread's i32 part of the
  address). Every access then adds a compile-time constant (`mu.getelementptr(p, [int], ...)`),
  which the PTX backend folds into the load's immediate offset. (Whole i32 addresses per access,
  thread part + token x row bytes, were hoisted out of the tile loop by LLVM as loop-invariant
  values and spilled.)"""
  _, _, _, _, _, mu, _ = mlir_modules()
  return mu.getelementptr(mu.memref_ptr(ref), [offset], elem_type)


def perm_i32(x):
  """`token_perm` of an i32 MLIR value."""
  _, arith, _, _, _, mu, _ = mlir_modules()
  i32 = x.type
  one = mu.c(1, i32)
  return arith.xori(x, arith.andi(arith.shrui(x, one), one))



def ggml_k_lhs(kind: str, layout: PageLayout, base: int, consumers: int, j: int = 0,
               scaled: bool = False, part: Optional[int] = None, perm: bool = False,
               heads_major: bool = False):
  """The ggml-layout magic conversion: SMEM tile buffer [lines, L] u8 (a 64-token tile's
  all-heads rows of this plane, row t at byte base + t * row bytes; heads_major: head h's row t
  at byte base + (h * 64 + t) * head bytes, as the kernels copy K) -> f16 [64, head_dim] in the
  WGMMA layout: the quants of head wg + j * consumers (wg from the thread index), in
  `magic_ptx.ggml_dims` column order. Lane c of a row loads the 68 (Q8_0) / 36 (Q4_0) bytes of
  ggml blocks 2c and 2c + 1 as 4-byte-aligned words, realigns block 2c's quants (they start 2
  bytes into the span) with one prmt a word, and converts them with `magic_ptx`. scaled: each
  value times its block scale (f16, rounded once: the "f16" decode); the two scales sit in the
  span's first word (low half) and its middle word (high half).
  part: None (the whole [64, head_dim] lhs) or 0 / 1: only columns [0, 128) (each lane's block
  2c) or [128, 256) (block 2c + 1), a [64, 128] lhs: half the registers live at once.
  perm: lhs row i is the tile's token `token_perm(i)`."""
  per = BLOCK_FORMATS[kind][1]                         # bytes a block: 34 / 18
  row_bytes, head_bytes = ((layout.k_row_bytes, layout.k_head_bytes) if kind == layout.k_type
                           else (layout.v_row_bytes, layout.v_head_bytes))
  bt = BLOCK_TOKENS
  head_step = bt * head_bytes if heads_major else head_bytes   # bytes from a head to the next
  if heads_major:
    row_bytes = head_bytes                             # a token's row of one head
  span_words = 2 * per // 4                            # 17 / 9
  q_words = (per - 2) // 4                             # a block's quant words: 8 / 4

  width = layout.head_dim if part is None else layout.head_dim // 2
  if part is not None and (layout.head_dim != 256 or part not in (0, 1)):
    raise ValueError(f"part={part}: halves of a head_dim 256 lhs are 0 and 1")
  words_used = (range(span_words) if part is None
                else range(q_words + 1) if part == 0 else range(q_words, span_words))

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                     return_type=plgpu.ShapeDtypeStruct((bt, width), jnp.float16,
                                                        plgpu.Layout.WGMMA))
  def conv(ctx, ref):
    del ctx
    ir, arith, llvm, _, fa, mu, mgpu = mlir_modules()
    i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
    c, lane, warp, head = lane_ids(consumers, j)
    quad = arith.andi(lane, c(3))
    col = arith.addi(arith.muli(head, c(head_step)), arith.muli(quad, c(2 * per)))
    row0 = arith.addi(arith.muli(warp, c(16)), arith.shrui(lane, c(2)))
    if perm:
      row0 = perm_i32(row0)
    # one per-thread pointer, every load a constant offset from it (see `thread_ptr`)
    tp = thread_ptr(ref, arith.addi(arith.muli(row0, c(row_bytes)), col), i8)
    regs = np.empty(fa.WGMMA_LAYOUT.registers_shape((bt, width)), dtype=object)
    for half in range(2):                              # rows r and r + 8 of the warp's 16
      off = base + 8 * half * row_bytes
      words = {w: llvm.load(i32, mu.getelementptr(tp, [off + 4 * w], i8), alignment=4)
               for w in words_used}
      blocks = []                                      # (quant words, scale) of block 2c, 2c + 1
      if part in (None, 0):
        blocks.append(([magic_ptx.prmt(words[w], words[w + 1], 0x5432) for w in range(q_words)],
                       magic_ptx.prmt(words[0], words[0], 0x1010) if scaled else None))
      if part in (None, 1):
        blocks.append(([words[w] for w in range(q_words + 1, span_words)],
                       magic_ptx.prmt(words[q_words], words[q_words], 0x3232) if scaled
                       else None))
      m = 0
      for quants, scale in blocks:
        for word in quants:
          for out in magic_ptx.convert_word(kind, word, scale):
            regs[0, m, 0, 0, half, 0, 0, 0, 0] = out
            m += 1
    return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return conv


def ggml_vt_lhs(layout: PageLayout, base: int, consumers: int, j: int = 0, masked: bool = False,
                blocks=(0, 1, 2, 3), perm: bool = False, head_word: Optional[int] = None):
  """Q4_0 V of a 64-token tile as the lhs of O^T = V^T P^T: SMEM tile buffer [lines, L] u8 (V row
  t at byte base + t * v row bytes) -> 4 f16 [64, 64] WGMMA-layout arrays (M-blocks of 64 head
  dims in `magic_ptx.vt_dims` order, tokens as columns), scaled, of head wg + j * consumers.
  A lane (warp w, row r, quad c) takes the 4 quant bytes 4 (8 w + r) .. +3 of the head (one
  block; a 2-byte-misaligned start for even blocks: two words and a prmt with a computed
  selector) and the block scale, for its 16 tokens 8 g + 2 c + {0, 1}; each token pair becomes
  8 registers (`magic_ptx.convert_token_pair`). The second word of an aligned (odd) block is
  read and not used; for the last head of the tile's last token it lies 4 bytes past the V span
  (inside the CTA's SMEM: the kernel's V slot is followed by other scratch).
  masked: the function takes a second ref, the warpgroup's info words (i32: [0] the tile's first
  token, [1] the partition's token end); tokens at or past the end get a zero scale, so junk
  bytes there give exact zeros. blocks: the M-blocks built (fewer: fewer registers live at once;
  each call loads the quant words again). perm: lhs column i is the tile's token
  `token_perm(i)` (odd quads read their token pairs swapped: 2-way instead of 4-way bank
  conflicts).
  head_word (needs masked): the head is info word head_word (a run-time value: the prefill
  kernel's KV head, one a CTA), not the warpgroup's."""
  if head_word is not None and not masked:
    raise ValueError("head_word reads the head from the info ref: it needs masked=True")
  row_bytes, head_bytes = layout.v_row_bytes, layout.v_head_bytes
  bt = BLOCK_TOKENS
  ret = plgpu.ShapeDtypeStruct((bt, bt), jnp.float16, plgpu.Layout.WGMMA)
  args = (plgpu.RefType(),) * (1 + int(masked))

  @plgpu.inline_mgpu(arg_types=args, return_type=(ret,) * len(blocks))
  def conv(ctx, buf, *info):
    del ctx
    ir, arith, llvm, _, fa, mu, mgpu = mlir_modules()
    i32, i16, i8 = (ir.IntegerType.get_signless(b) for b in (32, 16, 8))
    c, lane, warp, head = lane_ids(consumers, j)
    if head_word is not None:
      head = llvm.load(i32, mu.getelementptr(mu.memref_ptr(info[0]), [head_word], i32))
    quad, r = arith.andi(lane, c(3)), arith.shrui(lane, c(2))
    beta = arith.muli(arith.addi(arith.muli(warp, c(8)), r), c(4))   # first quant byte
    blk = arith.shrui(beta, c(4))
    scale_col = arith.addi(arith.muli(head, c(head_bytes)), arith.muli(blk, c(18)))
    q_col = arith.addi(scale_col, arith.addi(c(2), arith.andi(beta, c(15))))
    # quant words start 2 bytes late in even blocks: prmt 0x5432 there, 0x3210 in odd ones
    sel = arith.addi(c(0x3210), arith.muli(arith.andi(q_col, c(2)), c(0x1111)))
    q_col = arith.andi(q_col, c(~3))
    # a quant pointer and a scale pointer for each of the thread's first two columns 2c + e:
    # SMEM row 2c + e, or with perm row 2c + (e ^ odd) (odd: quad & 1; `token_perm`); every
    # load below is a constant offset from one of them (column 8 g + 2c + e: 8 g rows further)
    swap = arith.andi(quad, c(1)) if perm else c(0)
    pair_rows = [arith.addi(arith.muli(quad, c(2)), arith.xori(swap, c(e))) for e in range(2)]
    tq = [thread_ptr(buf, arith.addi(arith.muli(pr, c(row_bytes)), q_col), i8) for pr in pair_rows]
    ts = [thread_ptr(buf, arith.addi(arith.muli(pr, c(row_bytes)), scale_col), i8)
          for pr in pair_rows]
    n_valid = None
    if masked:   # valid tokens of the tile past the row of pair e: end - first - row
      iptr = mu.memref_ptr(info[0])
      first, end = (llvm.load(i32, mu.getelementptr(iptr, [k], i32)) for k in range(2))
      n_valid = [arith.subi(arith.subi(end, first), pr) for pr in pair_rows]

    def load(p, off, ty, align):
      return llvm.load(ty, mu.getelementptr(p, [off], i8), alignment=align)

    regs = [np.empty(fa.WGMMA_LAYOUT.registers_shape((bt, bt)), dtype=object) for _ in blocks]
    for g in range(bt // 8):                           # 8-token column groups
      words, scales = [], []
      for e in range(2):
        row = base + 8 * g * row_bytes
        w0, w1 = (load(tq[e], row + 4 * k, i32, 4) for k in range(2))
        words.append(llvm.inline_asm(i32, [w0, w1, sel], magic_ptx.PRMT_PTX, "=r,r,r,r"))
        sc = arith.extui(i32, load(ts[e], row, i16, 2))
        if masked:
          sc = arith.select(arith.cmpi(arith.CmpIPredicate.slt, c(8 * g), n_valid[e]), sc, c(0))
        scales.append(sc)
      pair = magic_ptx.prmt(scales[0], scales[1], 0x5410)
      for k, mb in enumerate(blocks):
        lo, hi = magic_ptx.convert_token_pair(words[0], words[1], pair, mb)
        regs[k][0, g, 0, 0, 0, 0, 0, 0, 0] = lo
        regs[k][0, g, 0, 0, 1, 0, 0, 0, 0] = hi
    return tuple(mgpu.FragmentedArray(_registers=x, _layout=fa.WGMMA_LAYOUT, _is_signed=None)
                 for x in regs)

  return conv


def f32_ops():
  """MLIR helpers on f32 scalars: (max, ex2, shuffle-xor, -inf constant)."""
  ir, arith, llvm, _, _, _, _ = mlir_modules()
  f32 = ir.F32Type.get()

  def fmax(a, b):
    return arith.maximumf(a, b)

  def ex2(x):
    return llvm.inline_asm(f32, [x], "ex2.approx.ftz.f32 $0, $1;", "=f,f")

  def shfl(x, off):
    return llvm.inline_asm(f32, [x], f"shfl.sync.bfly.b32 $0, $1, {off}, 0x1f, 0xffffffff;",
                           "=f,f")

  neg_inf = arith.constant(f32, ir.FloatAttr.get(f32, float("-inf")))
  return fmax, ex2, shfl, neg_inf


