"""Span attention v2, Pallas Mosaic GPU (Hopper): the magic-number conversion feeding wgmma.

`implementation="mosaic2"` (and "auto" on a GPU where it takes the call, `api.mosaic2_takes`):
Q8_0 K / Q4_0 V pages, head_dim 256, 1-4 KV heads,
page_tokens a multiple of 64, at most 40 folded query rows a KV head, precision "f16". Same
contract as `reference.py`: split-K over fixed LOGICAL partitions of `block_pages` pages, then
the in-order left fold of the partitions into the carry (`reference.merge_partials`), so the
bits do not depend on where the pages lie.

One CTA a logical partition, one warpgroup a KV head (4 for the 27B). Per key tile of 64 tokens
(docs/DESIGN.md, "Span attention v2 with the magic conversion"; the pieces were measured one by
one in session 9 with `experiments/probe_tma_reads.py`):

1. TMA copies the tile's K into SMEM head-major (`k_heads`, the default since session 13: one box
   a head, [64 rows, 272 B] from the pool's K-row view [pages x rows a page, heads, head bytes],
   which needs pages of whole K rows: `PageLayout.page_bytes`) and its all-heads V span in lines
   of `line_bytes`: a ring of 2 K slots and 1 V slot (2 whole stages do not fit beside Q^T at
   106.5 KB a tile; at N = 32 only 1 K slot fits: `choose_k_slots`); warpgroup 0 issues, every
   warpgroup arrives on a slot's "consumed" barrier. A head-major row is 272 B, so the 8 rows a
   K load reads fall on 8 bank groups (token-major 1088-byte rows: 2, 4-way conflicts).
   Sessions 14 and 15 tried other issue schedules and rings, each an option with the same bits
   and none faster (`table_smem`, `late_k`, `own_k`, `v_halves=3`, `v_tiles`, `heads_per_wg=2`,
   `producer`: see `span_attention_partial_mosaic2`; docs/DESIGN.md, "Span attention v2,
   session 14" and "session 15").
2. K: `ggml_k_lhs` turns each lane's 4-byte words of the ggml blocks into f16 registers of a
   WGMMA-layout lhs with the magic-number PTX (`magic_ptx`), scaled (one mul.rn.f16x2: the "f16"
   decode), head dims in `magic_ptx.ggml_dims` order; S^T [64, N] = K Q^T by wgmma with Q^T's
   rows in the same order (N = folded query rows padded to 8 / 16 / 32 / 40: Q and P sit in SMEM
   N-major and reach wgmma through transposed views, so N needs no power of two). Every SMEM
   access is a per-thread pointer plus a constant (`_thread_ptr`): whole addresses per access
   were hoisted out of the loop by LLVM and spilled. For the same reason Q^T and P^T are indexed
   through a zero read from SMEM at each tile (`rhs_per_tile`, session 15): ptxas had hoisted
   their wgmma descriptors out of the tile loop and spilled them (no spills at N = 8 since).
3. Online softmax of S^T along the tokens (`_softmax_tile`, inline Mosaic GPU code): the scores
   scaled into the log2 domain, masked (keys at or past a column's limit: the partition end, the
   causal bound of its query token; padding columns everything), the max across the warpgroup by
   butterfly shuffles and one SMEM slot per warp behind the warpgroup's named barrier (Pallas's
   own axis-0 reduction shares one scratch between warpgroups and races: S9-8), p = 2^(x - m) in
   f16 to the warpgroup's P^T tile. l is kept as per-thread partial sums and reduced once at the
   end (`_column_sums`).
4. V: `ggml_vt_lhs` builds V^T [256, 64] as 4 M-blocks straight from the ggml bytes (a lane takes
   4 quant bytes of the head for its 16 tokens; token pairs joined by prmt), scaled, with the
   scales of tokens past the partition end zeroed (junk bytes never make NaN); O^T += V^T P^T, 4
   wgmmas (`pl.run_state` on `ACC.init`), the accumulators rescaled by alpha first.
5. m (natural log domain), l and O^T (rows in `magic_ptx.vt_dims` order) per partition to GMEM,
   [G, parts, ...]; the Triton combine reads them as written and folds the partitions in logical
   order (tiles of 8 rows x 8 columns a program: `combine_plan`), then unpermutes its small
   result.

Interpret mode (`interpret=True`) runs the same kernel body (page walk, TMA ring, K / V
barriers, masks, outputs) in the Mosaic GPU interpreter, which runs neither inline Mosaic GPU
code nor a register lhs: there the tile math is jnp (`_InterpretTile`): the same scaled f16
values in the same permuted orders (from `ggml_codec`), the same log2-domain softmax, dots in
float32; and one Pallas thread serves every head in turn (no "consumed" barriers), because
several interpreter threads blocking in barrier callbacks at once hung on a 2-core CPU.

Token order (`perm_tokens`, default on since session 12): tile row / column i holds token
`token_perm(i)` (tokens 2 and 3 of every 4 swapped) in the K lhs rows, the softmax masks, P^T and
the V^T columns alike, so V's 4 quads read rows of alternating parity: V's shared-memory loads
went from 4-way to 2-way bank conflicts (ncu: 3.86 -> 2.79 wavefronts a load) and the kernel
from 92.3 to 81.3 us at 128K S=1, output bits unchanged on the GPU (S12-2). K's loads stay 4-way
conflicted: its rows (1088 B) fall on 2 bank classes whatever the order (docs/DESIGN.md).

Measured on the H200 (docs/PERFORMANCE.md, sessions 13 and 14): correct (4.0e-4 against the
float32 reference, like the Triton "f16"; placement invariance and waves bit for bit; in the
model within 5e-3 of the reference's logits); kernel 77.9 us by ncu at 128K S=1 (S13-4), 154.8
us at 256K (2.82 TB/s, S13-3); in the session-14 bench (S14-4) the call 98.8 us at 128K, 115.3
at 160K (XLA bf16 196.9: 1.71x; Triton 225.2: 1.95x), 165.9 at 256K (2.63 TB/s); verify S=4
1.36x the 1-row call at 160K, S=6 2.45x; still at the 128-register cap of 4 warpgroups (48 B of
spills at N = 8), 0.50 issues a scheduler cycle (S13-4); the issuing warpgroup's per-tile work
is on the critical path (S14-3: one more copy + wait a tile cost 11 %).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax_pallas import ggml_codec
from kvjax_pallas.page_layout import BLOCK_FORMATS, PageLayout
from kvjax_pallas.span_attention import magic_ptx
from kvjax_pallas.span_attention import reference as _ref

SUPPORTED_PAIRS = (("q8_0", "q4_0"),)
HEAD_DIM = 256
BLOCK_TOKENS = 64          # keys a tile: the wgmma M dimension
MAX_KV_HEADS = 4           # one warpgroup a KV head
MAX_ROWS = 40              # folded query rows a KV head (wider N is register-bound: S9-9)
N_CHOICES = (8, 16, 32, 40)  # the wgmma N of a call (Q and P N-major: any multiple of 8 works;
                           # N=24 measured slower than 32 at 128K, S11-1: 197 vs 167 us)
LINE = 256                 # bytes a line of the pool's V view at most (a TMA box's inner
                           # dimension: `line_bytes`)
BOX = 256                  # TMA box limit a dimension
K_SLOTS = (2, 1)           # K ring slots, most first: the most that fit
V_HALVES = (2, 3)          # V ring slots of half a tile (32 tokens); 2 (the default: one whole tile
                           # in static slots) or 3 where it fits (measured slower, S14-2)
V_TILES = (1, 2, 3)        # V ring slots of a whole tile (`v_tiles`; K takes the SMEM left)
INFO = 8                   # per-warpgroup SMEM i32 words before the column limits
ZERO = 2                   # the info word that holds 0 (rhs_per_tile's loop-variant zero)
REGISTERS = 65_536         # 32-bit registers of an SM (the H200's)
PRODUCER_REGS = 40         # registers a thread of the producer warpgroup keeps (`producer`)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
SMEM_LIMIT = 232_448       # bytes of shared memory a CTA may use on the H200
SMEM_RESERVE = 2_048       # bytes for barriers and buffer alignment beyond the buffers (Mosaic's
                           # total at N = 32, 1 K slot, 2 V tiles: 232,504 B, 1,464 over them)
COMBINE_ROWS = 8           # the Triton combine's default row block (N is a multiple of 8)
COMBINE_COLS = 8           # the Triton combine's default column block: 2 elements a thread at
                           # every N (S13-2, 128K calls: S=1 96.1 us against 108.0 with 32
                           # columns, S=4 131.1 against 142.8)

_COMPILER_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def rows_padded(rows: int) -> int:
  """Folded query rows -> the wgmma N: the smallest of `N_CHOICES` that holds them (decode 6 rows
  -> 8, verify S=4 / 5 24 / 30 rows -> 32, S=6 36 rows -> 40). Q and P sit in SMEM N-major ([N, K]
  tiles of (8, 64), swizzle 128) and reach wgmma transposed, so N needs no power of two."""
  if rows < 1:
    raise ValueError("span attention needs at least 1 query row")
  if rows > MAX_ROWS:
    raise ValueError(f"too many folded query rows for the Mosaic GPU v2 kernel: {rows} > "
                     f"{MAX_ROWS} (query tokens x query heads per KV head; split the call or use "
                     f"implementation='triton')")
  return next(n for n in N_CHOICES if n >= rows)


def choose_n(rows: int, wgmma_n: Optional[int] = None) -> int:
  """The wgmma N of a call: `rows_padded(rows)`, or wgmma_n where given (an experiment's choice:
  a multiple of 8 from the rows up to 256)."""
  n = rows_padded(rows)
  if wgmma_n is None:
    return n
  if wgmma_n % 8 or not rows <= wgmma_n <= 256:
    raise ValueError(f"wgmma_n={wgmma_n} must be a multiple of 8 between the folded query rows "
                     f"({rows}) and 256")
  return wgmma_n


def check_layout(layout: PageLayout, head_dim: int):
  pair = (layout.k_type, layout.v_type)
  if pair not in SUPPORTED_PAIRS:
    raise ValueError(f"unsupported K/V pair {layout.k_type.upper()}/{layout.v_type.upper()} for the "
                     f"Mosaic GPU v2 kernel; it supports Q8_0/Q4_0 only")
  if head_dim != layout.head_dim:
    raise ValueError(f"query head_dim {head_dim} != layout head_dim {layout.head_dim}")
  if head_dim != HEAD_DIM:
    raise ValueError(f"the Mosaic GPU v2 kernel supports head_dim {HEAD_DIM} only, got {head_dim}")
  if not 1 <= layout.num_kv_heads <= MAX_KV_HEADS:
    raise ValueError(f"the Mosaic GPU v2 kernel takes 1-{MAX_KV_HEADS} KV heads (one warpgroup "
                     f"each), got {layout.num_kv_heads}")
  if layout.page_tokens % BLOCK_TOKENS:
    raise ValueError(f"page_tokens {layout.page_tokens} is not a multiple of {BLOCK_TOKENS}")
  if layout.page_bytes % layout.k_row_bytes or layout.k_head_bytes % 16:
    raise ValueError(f"the v2 kernel views the pool as K rows: page bytes {layout.page_bytes} "
                     f"must be whole K rows of {layout.k_row_bytes} B and a head's K row "
                     f"({layout.k_head_bytes} B) whole 16-byte units")
  line_bytes(layout)


def line_bytes(layout: PageLayout) -> int:
  """Bytes a line of the pool's V view (the V TMA boxes' inner dimension): the largest power of
  two up to `LINE` dividing the page, the V plane offset and half a tile's V span (V is copied
  in half tiles; 256 at the 27B shape; the TMA engine wants >= 16)."""
  g = math.gcd(layout.page_bytes, layout.v_offset, BLOCK_TOKENS // 2 * layout.v_row_bytes)
  line = min(LINE, g & -g)
  if line < 16:
    raise ValueError(f"the v2 kernel's V copies need the page ({layout.page_bytes} B), the V "
                     f"plane offset ({layout.v_offset} B) and half a tile's V span "
                     f"({BLOCK_TOKENS // 2 * layout.v_row_bytes} B) in 16-byte lines")
  return line


def smem_bytes(layout: PageLayout, n: int, k_slots: int, v_halves: int = 2) -> int:
  """Shared memory of one CTA: the K ring, the V ring (half tiles), Q^T and P^T per head, the
  reduction slots, the info words and the (m, l) staging, plus SMEM_RESERVE."""
  g, bt = layout.num_kv_heads, BLOCK_TOKENS
  return SMEM_RESERVE + (k_slots * bt * layout.k_row_bytes + v_halves * bt // 2 * layout.v_row_bytes
          + g * (HEAD_DIM + bt) * n * 2 + g * 2 * 4 * n * 4 + g * (INFO + n) * 4 + g * 2 * n * 4)


def choose_k_slots(layout: PageLayout, n: int, v_halves: int = 2) -> int:
  """K ring slots of the call beside a V ring of `v_halves` half tiles (2: one whole tile): 2
  where they fit in SMEM (decode, N = 16), else 1 (N = 32 at the 27B shape: 2 slots need
  263,808 B; N = 8 beside 2 whole V tiles); raises where not even 1 fits, naming the shortfall."""
  for k_slots in K_SLOTS:
    if smem_bytes(layout, n, k_slots, v_halves) <= SMEM_LIMIT:
      return k_slots
  need = smem_bytes(layout, n, K_SLOTS[-1], v_halves)
  raise ValueError(f"the v2 kernel needs {need:,} B of shared memory at N={n} with "
                   f"{layout.num_kv_heads} KV heads and {v_halves / 2:g} V tiles, "
                   f"{need - SMEM_LIMIT:,} B more than the {SMEM_LIMIT:,} B of a CTA")


def max_v_halves(layout: PageLayout, n: int, k_slots: int) -> int:
  """The most V half-tile slots that fit beside `k_slots` K slots (3 at N = 8 and N = 24 to 32 at
  the 27B shape, 2 at N = 16 and 40)."""
  return max(v for v in V_HALVES if v == 2 or smem_bytes(layout, n, k_slots, v) <= SMEM_LIMIT)


def choose_v_halves(layout: PageLayout, n: int, k_slots: int,
                    v_halves: Optional[int] = None) -> int:
  """V ring slots of half a tile beside `k_slots` K slots: v_halves where given (2 or 3, checked
  against the SMEM limit), else 2: one whole tile, V(i + 1) copied after tile i's PV. 3 copies
  V(i + 1)'s first half a tile earlier, but its two dynamic half-slot pointers measured slower
  (S14-2, 128K kernel: S=1 107.5 vs 99.8 us, S=4 178.2 vs 132.9)."""
  if v_halves is None:
    return 2
  if v_halves not in V_HALVES:
    raise ValueError(f"v_halves must be one of {V_HALVES}, got {v_halves}")
  need = smem_bytes(layout, n, k_slots, v_halves)
  if need > SMEM_LIMIT:
    raise ValueError(f"v_halves={v_halves} needs {need:,} B of shared memory at N={n}, "
                     f"{need - SMEM_LIMIT:,} B more than the {SMEM_LIMIT:,} B of a CTA")
  return v_halves


def consumer_regs(n_consumers: int) -> int:
  """Registers a consumer thread may take beside a producer warpgroup at PRODUCER_REGS
  (`setmaxnreg`: a multiple of 8 up to 256): 2 consumer warpgroups 232, 4 of them 112."""
  regs = (REGISTERS - 128 * PRODUCER_REGS) // (128 * n_consumers) // 8 * 8
  return min(256, regs)


def choose_block_pages(num_pages: int, num_sms: int = 132) -> int:
  """Pages a logical partition: the fewest that keep the partitions (one CTA each, all heads) in
  one wave of `num_sms` CTAs. A pure function of the static shapes."""
  return max(1, -(-max(1, int(num_pages)) // num_sms))


# ----------------------------------------------------------------------------- inline pieces
# Lowering-time code (MLIR through `plgpu.inline_mgpu`); GPU only.


def _mlir():
  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, vector
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mu
  import jax.experimental.mosaic.gpu as mgpu
  return ir, arith, llvm, vector, fa, mu, mgpu


def _lane_ids(consumers: int, j: int = 0):
  """(i32 constant maker, lane, warp in the warpgroup, head) of this thread: head = warpgroup +
  j * consumers."""
  ir, arith, _, _, _, mu, _ = _mlir()
  i32 = ir.IntegerType.get_signless(32)
  c = lambda v: mu.c(v, i32)
  t = mu.thread_idx()
  lane, warp = arith.andi(t, c(31)), arith.andi(arith.shrui(t, c(5)), c(3))
  head = arith.addi(arith.shrui(t, c(7)), c(j * consumers)) if consumers > 1 else c(j)
  return c, lane, warp, head


def _thread_ptr(ref, offset, elem_type):
  """A pointer `offset` elements into ref's SMEM buffer (offset: this thread's i32 part of the
  address). Every access then adds a compile-time constant (`mu.getelementptr(p, [int], ...)`),
  which the PTX backend folds into the load's immediate offset. Whole i32 addresses per access
  (thread part + token * row bytes) were hoisted out of the tile loop by LLVM as ~60
  loop-invariant values and spilled (S11-2: 248 B of spill stores, the V row addresses)."""
  _, _, _, _, _, mu, _ = _mlir()
  return mu.getelementptr(mu.memref_ptr(ref), [offset], elem_type)


def token_perm(i):
  """The token order of a tile (`perm_tokens`): tile row / column i holds token
  i ^ ((i >> 1) & 1) (tokens 2 and 3 of every 4 swapped; its own inverse). Python ints, numpy or
  jnp arrays. With it the V conversion's 4 quads read tokens of alternating parity: the V row
  stride (576 B) puts tokens of one parity on the same banks, so the V loads go from 4-way to
  2-way bank conflicts (K, 1088 B a row, stays 4-way: its 8 rows a quad have 2 bank classes
  whatever the order)."""
  return i ^ ((i >> 1) & 1)


def _perm_i32(x):
  """`token_perm` of an i32 MLIR value."""
  _, arith, _, _, _, mu, _ = _mlir()
  i32 = x.type
  one = mu.c(1, i32)
  return arith.xori(x, arith.andi(arith.shrui(x, one), one))


def ggml_k_lhs(kind: str, layout: PageLayout, base: int, consumers: int, j: int = 0,
               scaled: bool = False, part: Optional[int] = None, perm: bool = False,
               heads_major: bool = False):
  """The ggml-layout magic conversion: SMEM tile buffer [lines, L] u8 (a 64-token tile's
  all-heads rows of this plane, row t at byte base + t * row bytes; heads_major: head h's row t
  at byte base + (h * 64 + t) * head bytes, as `_span_call` copies K) -> f16 [64, head_dim] in the
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
    ir, arith, llvm, _, fa, mu, mgpu = _mlir()
    i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
    c, lane, warp, head = _lane_ids(consumers, j)
    quad = arith.andi(lane, c(3))
    col = arith.addi(arith.muli(head, c(head_step)), arith.muli(quad, c(2 * per)))
    row0 = arith.addi(arith.muli(warp, c(16)), arith.shrui(lane, c(2)))
    if perm:
      row0 = _perm_i32(row0)
    # one per-thread pointer, every load a constant offset from it (see `_thread_ptr`)
    tp = _thread_ptr(ref, arith.addi(arith.muli(row0, c(row_bytes)), col), i8)
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
                blocks=(0, 1, 2, 3), perm: bool = False, halves: bool = False,
                head_word: Optional[int] = None):
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
  conflicts). halves: the function takes two tile refs before the info ref, tokens 0-31 and
  32-63 (the V ring's half-tile slots); each holds its 32 rows from byte base.
  head_word (needs masked): the head is info word head_word (a run-time value: the prefill
  kernel's KV head, one a CTA), not the warpgroup's."""
  if head_word is not None and not masked:
    raise ValueError("head_word reads the head from the info ref: it needs masked=True")
  row_bytes, head_bytes = layout.v_row_bytes, layout.v_head_bytes
  bt = BLOCK_TOKENS
  ret = plgpu.ShapeDtypeStruct((bt, bt), jnp.float16, plgpu.Layout.WGMMA)
  n_refs = 2 if halves else 1
  args = (plgpu.RefType(),) * (n_refs + int(masked))

  @plgpu.inline_mgpu(arg_types=args, return_type=(ret,) * len(blocks))
  def conv(ctx, *refs):
    del ctx
    bufs, info = refs[:n_refs], refs[n_refs:]
    ir, arith, llvm, _, fa, mu, mgpu = _mlir()
    i32, i16, i8 = (ir.IntegerType.get_signless(b) for b in (32, 16, 8))
    c, lane, warp, head = _lane_ids(consumers, j)
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
    # [buffer][e]: with halves, column groups g < 4 read the first buffer, g >= 4 the second
    tq = [[_thread_ptr(ref, arith.addi(arith.muli(pr, c(row_bytes)), q_col), i8)
           for pr in pair_rows] for ref in bufs]
    ts = [[_thread_ptr(ref, arith.addi(arith.muli(pr, c(row_bytes)), scale_col), i8)
           for pr in pair_rows] for ref in bufs]
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
      b, g_in = divmod(g, bt // 8 // n_refs)           # this group's buffer, its group there
      for e in range(2):
        row = base + 8 * g_in * row_bytes
        w0, w1 = (load(tq[b][e], row + 4 * k, i32, 4) for k in range(2))
        words.append(llvm.inline_asm(i32, [w0, w1, sel], magic_ptx.PRMT_PTX, "=r,r,r,r"))
        sc = arith.extui(i32, load(ts[b][e], row, i16, 2))
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


def _f32_ops():
  """MLIR helpers on f32 scalars: (max, ex2, shuffle-xor, -inf constant)."""
  ir, arith, llvm, _, _, _, _ = _mlir()
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


def _softmax_tile(n: int, scale_log2: float, perm: bool = False):
  """The online-softmax step of one tile, inline Mosaic GPU code (GPU only):
  (s [64, N] f32 raw scores S^T, m [N] running max (log2 domain), l [N] per-thread partial sums,
  info ref (i32: [0] the tile's first token, [INFO + c] column c's key limit), red ref (f32 [4, N]:
  one row a warp)) -> (p [64, N] f16, m_new [N], l_new [N], alpha [64, N] f32 broadcast over the
  rows). x = s * scale_log2, -inf at keys >= the column's limit; the tile max of each column is
  reduced over the thread's two rows, the 8 lanes of its column (butterfly shuffles over lane bits
  2-4) and the 4 warps (one SMEM row each, then the warpgroup's named barrier; the caller
  alternates two red slots so a fast warp's next write cannot meet a slow warp's read);
  m_use = m_new or 0 where it is -inf; p = 2^(x - m_use); alpha = 2^(m - m_use);
  l_new = l alpha + this thread's p. perm: row i of the tile is its token `token_perm(i)`."""
  col = plgpu.Layout.WGMMA.reduce(0)
  ret = (plgpu.ShapeDtypeStruct((BLOCK_TOKENS, n), jnp.float16, plgpu.Layout.WGMMA),
         plgpu.ShapeDtypeStruct((n,), jnp.float32, col),
         plgpu.ShapeDtypeStruct((n,), jnp.float32, col),
         plgpu.ShapeDtypeStruct((BLOCK_TOKENS, n), jnp.float32, plgpu.Layout.WGMMA))

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, col, col, plgpu.RefType(), plgpu.RefType()),
                     return_type=ret)
  def step(ctx, s, m, l, info, red):
    del ctx
    ir, arith, llvm, vector, fa, mu, mgpu = _mlir()
    f32, f16, i32 = ir.F32Type.get(), ir.F16Type.get(), ir.IntegerType.get_signless(32)
    fmax, ex2, shfl, neg_inf = _f32_ops()
    c, lane, warp, _ = _lane_ids(1)
    quad, r = arith.andi(lane, c(3)), arith.shrui(lane, c(2))
    quad2 = arith.muli(quad, c(2))
    t_lim = _thread_ptr(info, quad2, i32)                               # + INFO + 8 k + e
    t_red_w = _thread_ptr(red, arith.addi(arith.muli(warp, c(n)), quad2), f32)  # + 8 k + e
    t_red = _thread_ptr(red, quad2, f32)                                # + w n + 8 k + e
    first = llvm.load(i32, mu.memref_ptr(info))
    row_in = arith.addi(arith.muli(warp, c(16)), r)
    row0 = arith.addi(first, _perm_i32(row_in) if perm else row_in)  # token of row half 0
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
    ir, arith, llvm, vector, _, mu, mgpu = _mlir()
    f32 = ir.F32Type.get()
    _, _, shfl, _ = _f32_ops()
    c, lane, warp, _ = _lane_ids(1)
    quad2 = arith.muli(arith.andi(lane, c(3)), c(2))
    t_red_w = _thread_ptr(red, arith.addi(arith.muli(warp, c(n)), quad2), f32)  # + 8 k + e
    t_red = _thread_ptr(red, quad2, f32)                                # + w n + 8 k + e
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


class _CompiledTile:
  """The tile math of the compiled kernel: magic conversions in registers, inline softmax."""

  def __init__(self, layout: PageLayout, n: int, scale_log2: float, split: bool = False,
               perm: bool = False, k_heads: bool = True, heads_per_wg: int = 1):
    g = layout.num_kv_heads
    n_wg = g // heads_per_wg          # warpgroups: head = warpgroup + j * n_wg, j < heads_per_wg
    self.n = n
    # split: the K lhs in two halves of the head dims and V^T in two pairs of M-blocks, each
    # waited for before the next is built (the whole lhs at once spilled registers: ncu S10-3)
    # [j][part]: the conversions of the warpgroup's j-th head
    k_lhs = functools.partial(ggml_k_lhs, layout.k_type, layout, 0, n_wg, scaled=True,
                              perm=perm, heads_major=k_heads)
    self.k_parts = [[k_lhs(j=j, part=p) for p in (0, 1)] if split else [k_lhs(j=j)]
                    for j in range(heads_per_wg)]
    # V^T from one whole-tile ref (a 2-slot V ring: static slots) or from two half-tile refs;
    # [halves][j][part]
    self.vt_parts = {halves: [([ggml_vt_lhs(layout, 0, n_wg, j, masked=True, blocks=b, perm=perm,
                                            halves=halves) for b in ((0, 1), (2, 3))] if split
                               else [ggml_vt_lhs(layout, 0, n_wg, j, masked=True, perm=perm,
                                                 halves=halves)])
                              for j in range(heads_per_wg)]
                     for halves in (False, True)}
    self.softmax = _softmax_tile(n, scale_log2, perm)
    self.col_sums = _column_sums(n)

  def scores_heads(self, kbuf, qts, heads=None):
    """S^T [64, N] of each of the warpgroup's heads (qts: their Q refs, in j order). With 2
    heads, head 1's K conversion runs while head 0's wgmma does (one wait for both)."""
    del heads    # the conversions take their head from the warpgroup index and j
    n_parts = len(self.k_parts[0])
    rows = HEAD_DIM // n_parts

    def qk(*accs):
      for p in range(n_parts):
        for j, (acc, qt) in enumerate(zip(accs, qts)):
          q_part = qt.at[:, pl.ds(p * rows, rows)] if n_parts > 1 else qt
          plgpu.wgmma(acc, self.k_parts[j][p](kbuf),
                      plgpu.transpose_ref(q_part, (1, 0)))                 # Q^T [256, N]
        plgpu.wgmma_wait(0)
      return tuple(acc[...] for acc in accs)
    return pl.run_scoped(qk, *[plgpu.ACC((BLOCK_TOKENS, self.n), jnp.float32)] * len(qts))

  def pv_heads(self, os, vbufs, pts, infos, heads=None):
    """O^T += V^T P^T for each of the warpgroup's heads (os: their 4 accumulator values each);
    with 2 heads, head 1's V conversion runs while head 0's wgmmas do."""
    del heads
    flat = pl.run_state(lambda accs: self.pv_refs(accs, vbufs, pts, infos))(
        tuple(plgpu.ACC.init(x) for o in os for x in o))
    return [tuple(flat[4 * j:4 * j + 4]) for j in range(len(os))]

  def pv_refs(self, o_refs, vbufs, pts, infos):
    """O^T += V^T P^T into the accumulator refs (4 a head, heads in j order; O held in refs
    for the whole loop with acc_refs); vbufs: (the whole tile's V) or the tile's two half-tile V
    slots; pts / infos: each head's P ref and info words."""
    convs = self.vt_parts[len(vbufs) == 2]
    n_parts = len(convs[0])
    k = [0] * len(pts)
    for p in range(n_parts):
      for j, (pt, info) in enumerate(zip(pts, infos)):
        for vt in convs[j][p](*vbufs, info):
          plgpu.wgmma(o_refs[4 * j + k[j]], vt, plgpu.transpose_ref(pt, (1, 0)))   # P^T [64, N]
          k[j] += 1
      plgpu.wgmma_wait(0)

  def store_p(self, p_ref, p16):
    """p [64, N] f16 (WGMMA layout) -> the N-major P ref [N, 64]: one register shuffle into the
    transposed layout, then Mosaic's tiled store through the transposed view."""
    plgpu.transpose_ref(p_ref, (1, 0))[...] = plgpu.layout_cast(p16, plgpu.Layout.WGMMA_TRANSPOSED)

  def zeros(self):
    col = plgpu.Layout.WGMMA.reduce(0)
    n = self.n
    return (plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), col),
            plgpu.layout_cast(jnp.zeros((n,), jnp.float32), col),
            tuple(plgpu.layout_cast(jnp.zeros((BLOCK_TOKENS, n), jnp.float32),
                                    plgpu.Layout.WGMMA) for _ in range(4)))


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


class _InterpretTile:
  """The tile math in jnp for the Mosaic GPU interpreter: the same scaled f16 values in the same
  column / row orders as the compiled conversions (ggml_codec decodes; one rounding to f16 of
  the exact product, as mul.rn.f16x2), the same log2-domain softmax, dots in float32."""

  def __init__(self, layout: PageLayout, n: int, scale_log2: float, perm: bool = False,
               k_heads: bool = True):
    self.layout, self.n, self.scale_log2, self.perm = layout, n, scale_log2, perm
    self.k_heads = k_heads

  def _rows(self, x):
    """The tile's rows in its token order: row i = token `token_perm(i)` with perm (tokens 2
    and 3 of every 4 swapped, by slices: kernels take no constant index arrays)."""
    if not self.perm:
      return x
    q = x.reshape(BLOCK_TOKENS // 4, 4, *x.shape[1:])
    return jnp.concatenate([q[:, :2], q[:, 3:4], q[:, 2:3]], axis=1).reshape(x.shape)

  def _tokens(self, first, shape):
    i = lax.broadcasted_iota(jnp.int32, shape, 0)
    return first + (token_perm(i) if self.perm else i)

  def _head(self, buf, row_bytes: int, head_bytes: int, kind: str, wg):
    """Head wg's bytes [64, head bytes] of a token-major tile's bytes (all heads' rows), decoded
    to f16 in the tile's row order."""
    rows = buf.reshape(BLOCK_TOKENS, row_bytes)
    return self._decode(lax.dynamic_slice_in_dim(rows, wg * head_bytes, head_bytes, axis=1), kind)

  def _decode(self, head, kind: str):
    return self._rows(ggml_codec.decode_rows(head, kind, 1).reshape(BLOCK_TOKENS, HEAD_DIM)
                      .astype(jnp.float16))

  def scores(self, kbuf, qt, wg):
    lay = self.layout
    if self.k_heads:   # kbuf [G, 64, head words] i32: head wg's rows as 4-byte words
      words = kbuf.at[wg][...]
      head = lax.bitcast_convert_type(words, jnp.uint8).reshape(BLOCK_TOKENS, lay.k_head_bytes)
      k = k_in_ggml_order(self._decode(head, lay.k_type))
    else:
      k = k_in_ggml_order(self._head(kbuf[...], lay.k_row_bytes, lay.k_head_bytes, lay.k_type,
                                     wg))
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

  def scores_heads(self, kbuf, qts, heads):
    return tuple(self.scores(kbuf, qt, h) for qt, h in zip(qts, heads))

  def pv_heads(self, os, vbufs, pts, infos, heads):
    return [self.pv(o, vbufs, pt, info, h) for o, pt, info, h in zip(os, pts, infos, heads)]

  def pv(self, o, vbufs, pt, info, wg):
    lay = self.layout
    tile = jnp.concatenate([b[...].reshape(-1) for b in vbufs])     # the two half-tile slots
    v = self._head(tile, lay.v_row_bytes, lay.v_head_bytes, lay.v_type, wg)
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


def _span_kernel_v2(kv_ref, tb_ref, te_ref, tab_ref, qpos_ref, qt_ref, lines_ref,  # inputs
                    krows_ref,
                    ml_out, o_out,                                    # outputs
                    kbufs, vbuf, kbars, vbar, kfree, vfree, qt_s, pt_s, red_s, info_s, ml_s,
                    in_bar, tab_s,                                    # scratch
                    *, layout: PageLayout, block_pages: int, num_phys: int, num_table: int,
                    num_tokens: int, group: int, n: int, scale_log2: float, interpret: bool,
                    split: bool, acc_refs: bool, perm: bool, k_heads: bool, table_smem: bool,
                    late_k: bool, own_k: bool, heads_per_wg: int, producer: bool,
                    rhs_per_tile: bool):
  # kv_len, tile_begin, tile_end [1] i32 (as the caller gave them: no XLA op stacks them);
  # tab [T] i32; qpos [S] i32; qt [G, N, 256] f16 (Q, head dims in ggml_dims order)
  # lines [P, page_bytes / L, L] u8 (L = line_bytes: 256 at the 27B shape)
  # krows [P * page_bytes / k_row_bytes, G, k_head_bytes / 4] i32 (the same pool as K rows)
  # -> ml_out [G, parts, 2, N] f32 (m natural-log domain, l), o_out [G, parts, 256, N] f32
  #    (O^T, rows in vt_dims order)
  # scratch: kbufs [2, G, 64, k_head_bytes / 4] i32 (k_heads: head-major) or [2, k_lines, L] u8
  # (token-major), vbuf [v_slots, chunk lines, L] u8 (the V ring: 1-3 slots of a whole tile
  # (`v_tiles`), or 3 of half a tile: chunk j, part j % 2 of tile j // 2, in slot j % 3), kbars (2), vbar
  # (v_slots), kfree (2), vfree (v_slots; arrivals: G), qt_s [G, N, 256] f16, pt_s [G, N, 64] f16 (Q and P
  # N-major: wgmma reads them through transposed views as Q^T and P^T), red_s [G, 2, 4, N] f32,
  # info_s [G, INFO + N] i32, ml_s [G, 2, N] f32, in_bar, tab_s [G, block_pages] i32
  # (table_smem: the partition's physical pages, read once from GMEM by each warpgroup into its
  # row; else unused). own_k: kbars are [slots x G] (one a slot and head), kfree unused
  # rhs_per_tile: Q^T and P^T indexed by head + a zero read from info word ZERO each tile, so the
  # wgmma descriptors of their k-steps are built in the tile loop, not hoisted out of it
  g_heads = layout.num_kv_heads
  # compiled: one warpgroup a KV head (Pallas threads); interpreted: one thread serves every head
  # in turn (the interpreter runs each Pallas thread's code as an XLA computation whose barrier
  # waits are host callbacks; several blocking at once could starve each other on a 2-core CPU)
  # heads_per_wg 2: warpgroup w serves heads w and w + G / 2 (`_CompiledTile`'s j)
  n_wg = g_heads // heads_per_wg      # consumer warpgroups (+ 1 producer with `producer`)
  producer = producer and not interpret
  multi = (n_wg > 1 or producer) and not interpret
  if multi:
    heads = [lax.axis_index("wg") + j * n_wg for j in range(heads_per_wg)]
  else:
    heads = list(range(g_heads))
  issuer = heads[0] if multi else None
  pp = lax.axis_index("p")
  bt, pt = BLOCK_TOKENS, layout.page_tokens
  tiles = (_InterpretTile(layout, n, scale_log2, perm, k_heads) if interpret
           else _CompiledTile(layout, n, scale_log2, split, perm, k_heads, heads_per_wg))
  k_slots, k_lines = kbufs.shape[0], kbufs.shape[1]
  v_slots = vbuf.shape[0]
  line = lines_ref.shape[-1]
  chunk_lines = vbuf.shape[1]
  v_lines = bt * layout.v_row_bytes // line
  v_parts = v_lines // chunk_lines     # V chunks a tile: 1 (whole-tile slots) or 2 (half tiles)
  v_first = layout.v_offset // line

  kv_len, tile_begin = kv_ref[0], tb_ref[0]
  n_active = (kv_len + pt - 1) // pt                    # pages holding keys
  tile_end = jnp.minimum(jnp.minimum(te_ref[0], n_active), num_table)
  n_table = num_table
  causal_end = functools.reduce(jnp.maximum, [qpos_ref[s] for s in range(num_tokens)]) + 1
  page_lo = jnp.maximum(pp * block_pages, tile_begin)
  page_hi = jnp.minimum(pp * block_pages + block_pages, tile_end)
  tok_lo = page_lo * pt
  tok_end = jnp.minimum(page_hi * pt, kv_len)          # keys at or past this are masked
  tok_hi = jnp.minimum(tok_end, causal_end)             # no tile past the last query's position
  n_tiles = jnp.maximum(tok_hi - tok_lo + bt - 1, 0) // bt

  def by_issuer(fn):
    if producer:     # the producer warpgroup issues every copy
      return
    if multi:
      pl.when(issuer == 0)(fn)
    else:
      fn()

  def copy(plane: str, i, dst, bar, head=None, part: int = 0):
    """TMA copies of key tile i into dst, all arriving on bar: K with k_heads one box a head
    ([64 rows, head words] of the K-row view into dst [G, 64, head words]; head given: that
    head's box only, into dst [64, head words]); else the all-heads K or V span into dst
    [lines, L], in boxes of <= 256 lines; V in chunks of `chunk_lines` (part p of the tile)."""
    t0 = tok_lo + i * bt
    lp = jnp.minimum(t0 // pt, n_table - 1)
    if table_smem:   # an SMEM load on the issuer's path instead of a GMEM one a copy
      row = heads[0] if head is None else head
      phys = tab_s[row, jnp.clip(lp - pp * block_pages, 0, block_pages - 1)]
    else:
      phys = jnp.clip(tab_ref[lp], 0, num_phys - 1)
    r = (t0 - lp * pt) // bt
    if plane == "k" and k_heads:
      row0 = phys * layout.k_rows_per_page + r * bt
      if head is not None:
        plgpu.copy_gmem_to_smem(krows_ref.at[pl.ds(row0, bt), head], dst, bar)
        return
      for h in range(g_heads):
        plgpu.copy_gmem_to_smem(krows_ref.at[pl.ds(row0, bt), h], dst.at[h], bar)
      return
    first, lines = ((r * k_lines, k_lines) if plane == "k"
                    else (v_first + r * v_lines + part * chunk_lines, chunk_lines))
    for c0 in range(0, lines, BOX):
      cnt = min(BOX, lines - c0)
      plgpu.copy_gmem_to_smem(lines_ref.at[phys, pl.ds(first + c0, cnt)],
                              dst.at[pl.ds(c0, cnt)], bar)

  def copy_v(j: int):   # the ring's first chunks: chunk j into slot j
    return lambda: copy("v", j // v_parts, vbuf.at[j], vbar.at[j], part=j % v_parts)

  def first_copies(k_too: bool = True):
    """The Q copy and the rings' first tiles (K too unless each warpgroup copies its own)."""
    plgpu.copy_gmem_to_smem(qt_ref, qt_s, in_bar)

    @pl.when(n_tiles > 0)
    def _():
      if k_too:
        copy("k", 0, kbufs.at[0], kbars.at[0])

    for j in range(v_slots):     # the V ring's first chunks
      pl.when(j < v_parts * n_tiles)(copy_v(j))

    if k_slots > 1 and k_too:
      pl.when(n_tiles > 1)(lambda: copy("k", 1, kbufs.at[1], kbars.at[1]))

  def refill_k(i, ks):
    """K slot ks, once every consumer has freed it (every completion of a "consumed" barrier is
    waited for: the interpreter checks), takes K(i + k_slots)."""
    if multi:
      plgpu.barrier_wait(kfree.at[ks])
    pl.when(i + k_slots < n_tiles)(lambda: copy("k", i + k_slots, kbufs.at[ks], kbars.at[ks]))

  def v_tile_slots(i):
    """The V slots holding tile i's chunks (chunk c sits in slot c % v_slots): the one
    whole-tile slot (static), slot i % v_tiles, or 2 of the 3 half-tile slots."""
    if v_slots == 1:
      return [0]
    return [(v_parts * i + b) % v_slots for b in range(v_parts)]

  def refill_v(i, tile_slots):
    """Tile i's freed V slots take chunks v_parts i + v_slots + b: tile i + 1 (one whole-tile
    slot); tile i + v_tiles (whole-tile slots); with 3 half slots, tile i + 1's second half and
    tile i + 2's first (a tile ahead)."""
    for b, vs in enumerate(tile_slots):
      if multi:
        plgpu.barrier_wait(vfree.at[vs])
      j = v_slots + b                # chunk v_parts i + j: tile i + j // v_parts
      pl.when(v_parts * i + j < v_parts * n_tiles)(
          lambda j=j, vs=vs: copy("v", i + j // v_parts, vbuf.at[vs], vbar.at[vs],
                                  part=j % v_parts))

  def consumer():
    """A consumer warpgroup (every warpgroup without `producer`): its heads' tiles, and the
    copies where it is the issuer."""
    if table_smem:     # each warpgroup its row (own_k: each issues its head's K copies)
      for h in heads:
        for j in range(block_pages):
          tab_s[h, j] = jnp.clip(tab_ref[jnp.minimum(pp * block_pages + j, n_table - 1)], 0,
                                 num_phys - 1)

    def kbar(slot, h):   # own_k: one barrier a slot and head
      return kbars.at[slot * g_heads + h] if own_k else kbars.at[slot]

    def copy_own_k(i, slot):
      for h in heads:
        copy("k", i, kbufs.at[slot, h], kbar(slot, h), head=h)

    if own_k:
      pl.when(n_tiles > 0)(lambda: copy_own_k(0, 0))
      if k_slots > 1:
        pl.when(n_tiles > 1)(lambda: copy_own_k(1, 1))

    by_issuer(lambda: first_copies(k_too=not own_k))

    # a head's info words: [0] the tile's first token, [1] the token end, [INFO + c] the key limit
    # of column c: min(token end, q_pos of its query token + 1); padding columns none
    for h in heads:
      info = info_s.at[h]
      info[1] = tok_end
      info[ZERO] = jnp.int32(0)
      for col in range(n):
        info[INFO + col] = (jnp.minimum(tok_end, qpos_ref[col // group] + 1)
                            if col < num_tokens * group else jnp.int32(-1))
    plgpu.barrier_wait(in_bar)

    def body(i, carry, o_refs=None):
      """Tile i for every head this thread serves; carry: per head (m, l, O^T values or none)."""
      ks = i % k_slots
      for h in heads:
        info_s.at[h][0] = tok_lo + i * bt
      # the rows of qt_s / pt_s this tile's wgmmas read: a loop-variant index with rhs_per_tile
      z = info_s[heads[0], ZERO] if rhs_per_tile else 0
      rh = [h + z for h in heads]
      for h in (heads if own_k else heads[:1]):
        plgpu.barrier_wait(kbar(ks, h))
      scores = tiles.scores_heads(kbufs.at[ks], [qt_s.at[r] for r in rh], heads)
      if own_k:    # this warpgroup's K slot is consumed (its wgmma waited for): refill it
        pl.when(i + k_slots < n_tiles)(lambda: copy_own_k(i + k_slots, ks))
      elif multi:
        plgpu.barrier_arrive(kfree.at[ks])

      # late_k (2 K slots): K(i + 2) is issued after tile i's PV, beside V(i + 1), so the issuer
      # meets the other warpgroups once a tile instead of twice; with 1 slot it would leave
      # tile i + 1's K wholly exposed, so it is issued here as soon as the slot is consumed
      k_late = late_k and k_slots > 1 and not own_k
      if not (k_late or own_k):
        by_issuer(lambda: refill_k(i, ks))

      stepped = []
      for h, r, s, (m, l, o) in zip(heads, rh, scores, carry):
        p16, m, l, alpha = tiles.softmax(s, m, l, info_s.at[h], red_s.at[h, i % 2])
        tiles.store_p(pt_s.at[r], p16)
        if o_refs is None:
          o = tuple(x * alpha for x in o)
        else:
          for ref in o_refs:
            ref[...] = ref[...] * alpha
        stepped.append((m, l, o))
      plgpu.commit_smem()
      # tile i's V chunks (`v_tile_slots`: static with the default one slot)
      tile_slots = v_tile_slots(i)
      for vs in tile_slots:
        plgpu.barrier_wait(vbar.at[vs])
      vbufs = tuple(vbuf.at[vs] for vs in tile_slots)
      pts, infos = [pt_s.at[r] for r in rh], [info_s.at[h] for h in heads]
      if o_refs is not None:           # acc_refs: one head a warpgroup
        tiles.pv_refs(o_refs, vbufs, pts, infos)
        carry = stepped
      else:
        new_o = tiles.pv_heads([o for _, _, o in stepped], vbufs, pts, infos, heads)
        carry = [(m, l, o) for (m, l, _), o in zip(stepped, new_o)]
      if multi:
        for vs in tile_slots:
          plgpu.barrier_arrive(vfree.at[vs])

      @by_issuer
      def _():
        refill_v(i, tile_slots)
        if k_late:
          refill_k(i, ks)

      return tuple(carry)

    if acc_refs and not interpret:   # O^T in 4 accumulator refs for the whole loop (as the probes)
      def scoped(*o_refs):
        m0, l0, _ = tiles.zeros()
        (m_f, l_f, _), = lax.fori_loop(0, n_tiles, functools.partial(body, o_refs=o_refs),
                                       ((m0, l0, None),))
        return ((m_f, l_f, tuple(r[...] for r in o_refs)),)
      final = pl.run_scoped(scoped, *[plgpu.ACC((bt, n), jnp.float32)] * 4)
    else:                            # O^T as loop-carried values, updated through ACC.init
      final = lax.fori_loop(0, n_tiles, body, tuple(tiles.zeros() for _ in heads))
    for h, (m, l, o) in zip(heads, final):
      l = tiles.col_sums(l, red_s.at[h, 0])
      ml = ml_s.at[h]
      ml[0, :] = jnp.where(m == -jnp.inf, m, m * jnp.float32(_LN2))
      ml[1, :] = l
    plgpu.commit_smem()
    for h, (_, _, o) in zip(heads, final):
      plgpu.copy_smem_to_gmem(ml_s.at[h], ml_out.at[h, pp])
      for mb in range(4):
        o_out[h, pp, pl.ds(64 * mb, 64)] = o[mb]
    plgpu.wait_smem_to_gmem(0)

  if not producer:
    consumer()
    return

  @pl.when(lax.axis_index("wg") == n_wg)
  def _():
    # the producer warpgroup: every TMA copy, each slot refilled once all consumers freed it
    plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
    first_copies()

    def refill(i, c):
      refill_k(i, i % k_slots)
      refill_v(i, v_tile_slots(i))
      return c
    lax.fori_loop(0, n_tiles, refill, 0)

  @pl.when(lax.axis_index("wg") < n_wg)
  def _():
    plgpu.set_max_registers(consumer_regs(n_wg), action="increase")
    consumer()


# ----------------------------------------------------------------------------- wrapper


def _interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret import params as _ip  # pylint: disable=g-import-not-at-top
  return _ip.InterpretGPUParams()


def query_n_major(q_shd, num_kv_heads: int, n: int):
  """q [S, H, D] -> Q [G, N, D] f16: a KV head's query heads folded into S x R rows (padded with
  zero rows to N), head dims in `magic_ptx.ggml_dims` order, by reshapes and transposes only (one
  XLA fusion; a gather of the dims made a second)."""
  qf = k_in_ggml_order(_ref.fold_query(q_shd.astype(jnp.float16), num_kv_heads))   # [G, rows, D]
  return jnp.pad(qf, ((0, 0), (0, n - qf.shape[1]), (0, 0)))


def _span_call(q_shd, pool_u8, page_table_t, kv_len, tile_begin, tile_end, q_pos_s, *,
               layout: PageLayout, block_pages: int, n_parts: int, sm_scale: float,
               interpret: bool, split: bool = False, acc_refs: bool = False,
               wgmma_n: Optional[int] = None, perm_tokens: bool = True, k_heads: bool = True,
               table_smem: bool = False, late_k: bool = False, own_k: bool = False,
               v_halves: Optional[int] = None, heads_per_wg: int = 1,
               producer: bool = False, rhs_per_tile: bool = True,
               v_tiles: Optional[int] = None):
  """The kernel call (kv_len, tile_begin, tile_end: i32 scalars; tile_end is clipped to the
  active pages and the table in the kernel): -> (ml [G, parts, 2, N], O^T [G, parts, 256, N] in
  vt_dims rows) f32."""
  s_tok, h, d = q_shd.shape
  g = layout.num_kv_heads
  r = h // g
  rows = s_tok * r
  n = choose_n(rows, wgmma_n)
  bt = BLOCK_TOKENS
  num_phys = pool_u8.shape[0]
  qt = query_n_major(q_shd, g, n)                                   # [G, N, D]
  line = line_bytes(layout)
  lines = pool_u8.reshape(num_phys, layout.page_bytes // line, line)
  # the same bytes as K rows, 4-byte words: [P * rows a page, G, head words] (bitcast, no copy)
  kw_head = layout.k_head_bytes // 4
  krows = lax.bitcast_convert_type(pool_u8.reshape(num_phys * layout.k_rows_per_page, g, kw_head,
                                                   4), jnp.int32)
  k_lines, v_lines = bt * layout.k_row_bytes // line, bt * layout.v_row_bytes // line
  if v_tiles is not None:           # whole V tiles first, K takes the SMEM left (1 slot at N = 8)
    k_slots = choose_k_slots(layout, n, 2 * v_tiles)
    v_slots, v_parts = v_tiles, 1
  else:
    k_slots = choose_k_slots(layout, n)
    v_halves = choose_v_halves(layout, n, k_slots, v_halves)
    v_slots, v_parts = (1, 1) if v_halves == 2 else (v_halves, 2)   # whole-tile slot, or halves
  # Q and P N-major in (8, 64) tiles, 128-byte swizzle: the transposed wgmma rhs of any N % 8 == 0
  rhs = lambda shape: plgpu.SMEM(shape, jnp.float16, transforms=(
      plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
  boxes = lambda lines_: -(-lines_ // BOX)
  scratch = [
      (plgpu.SMEM((k_slots, g, bt, kw_head), jnp.int32) if k_heads      # kbufs
       else plgpu.SMEM((k_slots, k_lines, line), jnp.uint8)),
      plgpu.SMEM((v_slots, v_lines // v_parts, line), jnp.uint8),      # vbuf
      (plgpu.Barrier(num_arrivals=1, num_barriers=k_slots * g) if own_k      # kbars
       else plgpu.Barrier(num_arrivals=g if k_heads else boxes(k_lines), num_barriers=k_slots)),
      plgpu.Barrier(num_arrivals=boxes(v_lines // v_parts), num_barriers=v_slots),  # vbar
      plgpu.Barrier(num_arrivals=g // heads_per_wg, num_barriers=k_slots),  # kfree (a warpgroup
      plgpu.Barrier(num_arrivals=g // heads_per_wg, num_barriers=v_slots),  # vfree  each)
      rhs((g, n, d)),                                                  # qt_s
      rhs((g, n, bt)),                                                 # pt_s
      plgpu.SMEM((g, 2, 4, n), jnp.float32),                           # red_s
      plgpu.SMEM((g, INFO + n), jnp.int32),                            # info_s
      plgpu.SMEM((g, 2, n), jnp.float32),                              # ml_s
      plgpu.Barrier(num_arrivals=1),                                   # in_bar
      plgpu.SMEM((g, block_pages) if table_smem else (1, 1), jnp.int32),  # tab_s
  ]
  body = functools.partial(_span_kernel_v2, layout=layout, block_pages=block_pages,
                           num_phys=num_phys, num_table=page_table_t.shape[0],
                           num_tokens=s_tok, group=r, n=n,
                           scale_log2=float(sm_scale) * _LOG2E, interpret=interpret,
                           split=split, acc_refs=acc_refs, perm=perm_tokens, k_heads=k_heads,
                           table_smem=table_smem, late_k=late_k, own_k=own_k,
                           heads_per_wg=heads_per_wg, producer=producer,
                           rhs_per_tile=rhs_per_tile)
  n_threads = g // heads_per_wg + int(producer)
  kw = dict(num_threads=n_threads, thread_name="wg") if n_threads > 1 and not interpret else {}
  kern = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((g, n_parts, 2, n), jnp.float32),
                jax.ShapeDtypeStruct((g, n_parts, d, n), jnp.float32)),
      scratch_types=scratch, grid=(n_parts,), grid_names=("p",),
      compiler_params=_COMPILER_PARAMS,
      interpret=_interpret_params() if interpret else None, **kw)
  scalar = lambda x: jnp.reshape(jnp.asarray(x, jnp.int32), (1,))
  return kern(scalar(kv_len), scalar(tile_begin), scalar(tile_end),
              page_table_t.astype(jnp.int32), q_pos_s.astype(jnp.int32), qt, lines, krows)


def _check_args(q_shd, pool_pn, layout, num_q_heads, block_pages):
  # pylint: disable=import-outside-toplevel
  from kvjax_pallas.span_attention import kernel_triton as _triton
  _triton.check_call(q_shd, pool_pn, layout, num_q_heads, block_pages, check_layout)
  s_tok, h, _ = q_shd.shape
  rows_padded(s_tok * (h // layout.num_kv_heads))


def combine_plan(n: int, num_parts: int, head_dim: int = HEAD_DIM,
                 cols: Optional[int] = None, warps: Optional[int] = None,
                 unroll: Optional[int] = None, rows_block: Optional[int] = None) -> dict:
  """The combine of a call: `kernel_triton.combine_call`'s tile arguments and the padded
  partition count `parts` (a whole number of load groups). Given values are checked; None takes
  the default: row block c_rows COMBINE_ROWS (a power of two dividing N; the row blocks cover the
  real rows only, N's padding rows past them are not read); columns COMBINE_COLS; warps one a 64
  elements of the tile (1-4); unroll `combine_unroll_for`."""
  # pylint: disable=import-outside-toplevel
  from kvjax_pallas.span_attention import kernel_triton as _triton
  c_rows = min(COMBINE_ROWS, n & -n) if rows_block is None else rows_block
  if c_rows < 1 or c_rows & (c_rows - 1) or n % c_rows:
    raise ValueError(f"combine_rows must be a power of two dividing N={n}, got {c_rows}")
  cols = COMBINE_COLS if cols is None else cols
  if cols < 1 or cols & (cols - 1) or head_dim % cols:
    raise ValueError(f"combine_cols must be a power of two dividing {head_dim}, got {cols}")
  warps = min(4, max(1, c_rows * cols // 64)) if warps is None else warps
  if warps not in (1, 2, 4, 8):
    raise ValueError(f"combine_warps must be 1, 2, 4 or 8, got {warps}")
  if unroll is None:
    unroll = _triton.combine_unroll_for(c_rows, cols, num_parts)
  elif unroll < 8 or unroll % 8:
    raise ValueError(f"combine_unroll must be a multiple of 8, got {unroll}")
  parts = -(-num_parts // unroll) * unroll
  return dict(c_rows=c_rows, combine_cols=cols, combine_warps=warps, unroll=unroll, parts=parts)


@functools.partial(jax.jit, static_argnames=(
    "layout", "num_q_heads", "block_pages", "sm_scale", "interpret", "split", "acc_refs",
    "wgmma_n", "combine_cols", "combine_warps", "combine_unroll", "combine_rows",
    "perm_tokens", "k_heads", "table_smem", "late_k", "own_k", "v_halves", "heads_per_wg",
    "producer", "rhs_per_tile", "v_tiles"))
def span_attention_partial_mosaic2(q_shd, pool_pn, page_table_t, kv_len, q_pos_s,
                                   carry: Optional[_ref.Carry], tile_begin, tile_end, *,
                                   layout: PageLayout, num_q_heads: int, block_pages: int = 1,
                                   sm_scale: Optional[float] = None, interpret: bool = False,
                                   split: bool = False, acc_refs: bool = False,
                                   wgmma_n: Optional[int] = None,
                                   combine_cols: Optional[int] = None,
                                   combine_warps: Optional[int] = None,
                                   combine_unroll: Optional[int] = None,
                                   combine_rows: Optional[int] = None,
                                   perm_tokens: bool = True, k_heads: bool = True,
                                   table_smem: bool = False, late_k: bool = False,
                                   own_k: bool = False,
                                   v_halves: Optional[int] = None,
                                   heads_per_wg: int = 1,
                                   producer: bool = False,
                                   rhs_per_tile: bool = True,
                                   v_tiles: Optional[int] = None) -> _ref.Carry:
  """Mosaic GPU v2 version of `reference.span_attention_partial_reference` (same contract;
  carry=None: the empty carry). The partitions are folded in logical order by the Triton
  kernel's pipelined combine (`kernel_triton.combine_call`), O^T's rows taken as its columns in
  `magic_ptx.vt_dims` order; the partition count is padded to the combine's group with empty
  CTAs. Compiled-only options (the interpreter ignores them): split builds the K lhs in two
  halves and V^T in two pairs of M-blocks (fewer registers live at once; measured no faster at
  S=1 and 1.35x slower at S=4, S10-4); acc_refs keeps O^T in 4 accumulator refs for the whole
  loop (rescaled in place) instead of loop-carried values. wgmma_n overrides the wgmma N of
  `rows_padded` (any multiple of 8 from the rows up; for experiments). combine_cols /
  combine_warps / combine_unroll / combine_rows: the combine's tiles (`combine_plan`; None: the
  defaults).
  perm_tokens: the tiles' token order `token_perm` (V loads 2-way instead of 4-way bank
  conflicts; False: tokens in order, as before session 12).
  k_heads: K copied head-major (one TMA box a head from the pool's K-row view: a row stride of
  one head's 272 B, no bank conflicts in the K conversion's loads); False: the all-heads span
  token-major as before session 13 (1088-byte rows, 4-way conflicts). Same bits.
  table_smem: the issuer reads the partition's page-table entries from GMEM once, into SMEM,
  instead of one GMEM load a copy (2 a tile, on the issuing warpgroup's path). late_k: with 2 K
  slots, K(i + 2) is issued after tile i's PV beside V(i + 1) (one wait on the other warpgroups
  a tile instead of two). own_k (needs k_heads): each warpgroup issues its own head's K box on
  its own barrier as soon as its wgmma has read the slot (no "consumed" barrier for K: the
  warpgroups meet only on V). v_halves: the V ring in half tiles (None / 2: one whole-tile slot,
  V(i + 1) copied after tile i's PV, as before session 14; 3: three half-tile slots, V(i + 1)'s
  first half copied a tile earlier; `choose_v_halves`). heads_per_wg: KV heads a warpgroup (1;
  2: half the warpgroups, each serving heads w and w + G / 2 with twice the registers, head 1's
  conversions issued while head 0's wgmmas run). producer: one more warpgroup issues every TMA
  copy and waits on the "consumed" barriers (`setmaxnreg`: it keeps PRODUCER_REGS registers,
  the consumers take `consumer_regs`: 232 with heads_per_wg=2, 112 with 1); the consumers never
  wait for each other. Compiled only (the interpreter keeps its one thread). rhs_per_tile (the
  default since session 15): the wgmma right-hand sides (Q^T, P^T) indexed by the head plus a
  zero read from SMEM each tile, so ptxas builds their k-steps' descriptors inside the tile loop
  instead of hoisting them out of it; hoisted (False, as before), they are the 64-bit values
  ptxas spilled and reloaded after each K wait (S15-1: 80 B of spills at N = 8 -> 0; the kernel
  at 128K S=1 73.8 us vs 85.7-104 us). v_tiles: a V ring of that many whole-tile slots (None / 1:
  the default one; 2 or 3: V(i + v_tiles) copied as soon as tile i's PV frees its slot), the K ring
  taking the SMEM left (`choose_k_slots`: 1 slot at N = 8). None of these options changes a
  bit."""
  if own_k and not k_heads:
    raise ValueError("own_k needs k_heads=True (one K box a head)")
  g_heads = layout.num_kv_heads
  if heads_per_wg not in (1, 2) or g_heads % heads_per_wg:
    raise ValueError(f"heads_per_wg must be 1 or 2 and divide the {g_heads} KV heads, got "
                     f"{heads_per_wg}")
  if acc_refs and heads_per_wg > 1:
    raise ValueError("acc_refs keeps one head's O^T in refs: it needs heads_per_wg=1")
  if v_tiles not in (None,) + V_TILES:
    raise ValueError(f"v_tiles must be one of {V_TILES}, got {v_tiles}")
  if v_tiles is not None and v_halves not in (None, 2):
    raise ValueError(f"v_tiles={v_tiles} (whole-tile V slots) and v_halves={v_halves} (half-tile "
                     f"V slots) are two V rings: give one")
  if producer and (table_smem or late_k or own_k or v_halves not in (None, 2)
                   or v_tiles not in (None, 1)):
    raise ValueError("producer issues every copy itself: it takes none of table_smem, late_k, "
                     "own_k, v_halves=3, v_tiles > 1")
  # pylint: disable=import-outside-toplevel
  from kvjax_pallas.span_attention import kernel_mosaic as _v1
  from kvjax_pallas.span_attention import kernel_triton as _triton
  _check_args(q_shd, pool_pn, layout, num_q_heads, block_pages)
  s_tok, h, d = q_shd.shape
  g = layout.num_kv_heads
  rows = s_tok * (h // g)
  n = choose_n(rows, wgmma_n)
  scale = (1.0 / d ** 0.5) if sm_scale is None else sm_scale
  n_table = page_table_t.shape[0]
  plan = combine_plan(n, -(-max(n_table, 1) // block_pages), d, combine_cols,
                      combine_warps, combine_unroll, combine_rows)
  n_parts = plan.pop("parts")
  q_pos_s = jnp.asarray(q_pos_s, jnp.int32)
  ml_p, ot_p = _span_call(q_shd, _v1.byte_view(pool_pn), page_table_t, kv_len, tile_begin,
                          tile_end, q_pos_s,
                          layout=layout, block_pages=block_pages, n_parts=n_parts,
                          sm_scale=scale, interpret=interpret, split=split, acc_refs=acc_refs,
                          wgmma_n=wgmma_n, perm_tokens=perm_tokens, k_heads=k_heads,
                          table_smem=table_smem, late_k=late_k, own_k=own_k,
                          v_halves=v_halves, heads_per_wg=heads_per_wg, producer=producer,
                          rhs_per_tile=rhs_per_tile, v_tiles=v_tiles)
  # ml_p [G, parts, 2, N] and O^T [G, parts, vt rows, N] go to the combine as the kernel wrote them
  return _triton.combine_call(ml_p, None, ot_p, carry, rows=rows, acc_transposed=True,
                              v_cols=magic_ptx.vt_dims(d), head_dim=d, interpret=interpret,
                              **plan)


def span_attention_mosaic2(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, *, layout: PageLayout,
                           block_pages: int = 1, sm_scale: Optional[float] = None,
                           interpret: bool = False, **kw):
  """o_shd [S, H, D] float32 over all active pages (Mosaic GPU v2 version of the reference);
  kw: the options of `span_attention_partial_mosaic2`."""
  h = q_shd.shape[1]
  carry = span_attention_partial_mosaic2(
      q_shd, pool_pn, page_table_t, jnp.asarray(kv_len, jnp.int32), q_pos_s, None, jnp.int32(0),
      jnp.int32(page_table_t.shape[0]), layout=layout, num_q_heads=h, block_pages=block_pages,
      sm_scale=sm_scale, interpret=interpret, **kw)
  return _ref.finalize(carry, h)
