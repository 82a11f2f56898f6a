"""Span attention over paged, quantized KV pages: Pallas kernels (Triton lowering).

Two kernels:

* `_span_kernel` — split-K over fixed LOGICAL partitions of `block_pages`
  pages. Grid (KV head g, row block, partition). A program reads its
  partition's pages through the page table (a plain GMEM ref: no scalar
  prefetch, which is TPU-only), decodes K and V tile by tile from the raw
  page bytes (never a full-precision copy of the cache), and runs one online
  softmax over the partition in logical token order. It writes the
  partition's un-normalised `(m, l, acc)`.
* `_combine_kernel` — folds the partitions into the carry strictly left to
  right in logical order, so one call equals any sequence of waves whose
  boundaries are multiples of `block_pages` pages, bit for bit. An empty
  partition (`m=-inf, l=0, acc=0`) is an exact no-op of the fold.

Neither kernel looks at a physical page number except to form an address, so
the result depends only on the logical token order (placement invariance).

Decoding: page bytes are read as little-endian uint16 halfwords (every ggml
block, row and plane offset is even), in pieces (`row_pieces`, `reads=`):

* "gather" (default): [tokens, blocks, halfwords] gathers of each block's data
  halfwords (one ggml block = 32 values of the head dimension) and
  [tokens, blocks, 1] gathers of the scales: 2-byte loads.
* "windows": contiguous power-of-two windows of the head row (for Q8_0 at
  D=256: [0, 128) and [120, 136)) loaded 16 bytes at a time; the scale of
  each group of 8 halfwords is a select between two gathered scales; scale
  halfwords and overlaps decode to junk columns that meet zero query columns
  and are dropped. One dot per piece (two per tile).
* "words" (quant rows): 32-bit words a pair of blocks (`_load_words`): the main piece is words
  1.. of each pair, the head piece word 0 (block 2p's scale and first two quants); the scale
  bytes are junk columns. Measured slower than "gather" (docs/PERFORMANCE.md S6-2).

Each halfword decodes to its planes, kept next to each other: Q8_0 its low
and high byte (dims 2i, 2i+1 of the block's data halfword i), Q4_0 the
nibbles at bits 0, 4, 8, 12 (dims 2i, 2i+16, 2i+1, 2i+17), F16 / BF16 the
halfword itself. `column_dims` maps the kernel's columns to head dims: the
wrapper puts the query into K's columns and takes V's columns back to dims.

A quant becomes an f16 integer without an int->float conversion: `0x6400 | b`
is the f16 number 1024 + b, so `(0x6400 | byte) - 1152` is the signed int8 and
`(0x6400 | nibble) - 1032` the Q4_0 value, exactly. The block scale
multiplies the values, and one dot per piece takes the piece's columns:
scores `[rows, columns] . [tokens, columns]^T`, output `[rows, tokens] .
[tokens, columns]`. On the GPU the "f16" decode of quant pages runs as packed PTX
(`decode="asm"`, `_asm_plane`: two halfwords a 32-bit register, f16x2 sub / mul), with the same
bits as this jnp form; the interpreter runs the jnp form. `precision` says how the float32 side
meets the tensor cores:

  "f16"    16-bit operands (bf16 for BF16 pages): ~3e-4 relative error, fastest
  "f16x3"  each float32 operand split into a 16-bit head and tail (the exact
           integers / F16 / BF16 values need no tail); three dots (two when one
           side is exact) give float32-class results (~1e-6)
  "tf32"   float32 operands on TF32 tensor cores (~3e-4)
  "ieee"   float32 FMAs (exact float32, slow)

The softmax scale is applied to the scores, not to the query.

Paths (all one kernel body, different tiles; see `select_path`):
  "vector"  1-2 query tokens  (decode)             row block 16, key tile 32
  "matrix"  3-8 query tokens  (speculative verify) one row block of <= 64 rows, key tile 32
  "prefill" 9-256 query tokens (chunk vs history)  64-row blocks, causal skip

Partition size: `choose_block_pages` (the api's block_pages="auto"), a rounds model of CTAs per SM.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

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
PRECISIONS = ("f16", "f16x3", "tf32", "ieee")  # see the module docstring
DEFAULT_PRECISION = "f16"
READS = ("gather", "windows", "words")  # how head rows are read, see `row_pieces`
DEFAULT_READS = "gather"       # measured faster (docs/PERFORMANCE.md, S3-6)
BLOCK = 32                 # head-dim values per decoded block (the ggml quant block)
# combine_unroll="auto": the most partitions (16 or 8) the combine loads at once whose tiles
# hold at most this many floats (unroll x row block x column block). Measured on the H200 (session
# 6, S6-1): 32 x 8 x 32 = 8,192 at S=1 took the combine from 19.9 to 15.7 us; 32 x 64 x 32 at S=6
# spilled (871 vs 393 us a call); 8 x 64 x 32 = 16,384 was the old default everywhere. Session 14
# (S14-1, the v2 call at 128K, 128 partitions): 16 a group against 32 compiled in 6.5 s instead of
# 38.7 (S=1) and 7.0 instead of 34.8 (S=4), and ran faster (call 96.7 vs 98.8 us, 128.0 vs 133.1);
# 8: 2.4 s but 107.7 / 139.7 us. So 16 at most.
COMBINE_TILE_FLOATS = 16384
COMBINE_UNROLL_MAX = 16

# kind -> (halfwords per 32-value block, has an f16 scale in front)
_BLOCK_HW = {"q8_0": (17, True), "q4_0": (9, True), "f16": (32, False), "bf16": (32, False)}
# kind -> the planes decoded from one raw halfword: (operation, shift)
_PLANES = {"q8_0": (("byte", 0), ("byte", 8)),
           "q4_0": (("nibble", 0), ("nibble", 4), ("nibble", 8), ("nibble", 12)),
           "f16": (("raw", 0),), "bf16": (("raw", 0),)}
_GROUP = 8                 # halfwords a thread loads at once (16 bytes) and that share <= 2 scales
# reads="words" (quant kinds): a head row is read as 32-bit words, block pair by block pair. kind ->
# (words a pair of blocks spans, data words read as the pair's main piece from word 1 on)
_WORD_PAIR = {"q8_0": (17, 16), "q4_0": (9, 8)}
# kind -> the planes decoded from one word: (operation, bit shift): every byte of a Q8_0 word;
# both nibbles of every byte of a Q4_0 word (low first)
_WORD_PLANES = {"q8_0": tuple(("byte", 8 * k) for k in range(4)),
                "q4_0": tuple(("nibble", 8 * k + 4 * hi) for k in range(4) for hi in (0, 1))}
DECODES = ("asm", "jnp")   # how quant halfwords become f16 values, see `_decode_piece`
DEFAULT_DECODE = "asm"

# Packed decode (PTX, one instance per 32-bit register = 2 raw halfwords, "f16" operands only).
# Same bits as the jnp decode: each value is an exact f16 integer (0x6400 | quant is 1024 +
# quant, minus 1152 (Q8_0, 0x6480) or 1032 (Q4_0, 0x6408)), then ONE rounded f16 product with the
# block scale. One asm per plane (Pallas lowers only single-result inline asm): $0 the plane's
# f16x2 values, $1 the raw halfwords, $2 the scales (f16x2). The output is written last, from
# temporaries (it may share a register with an input). tests/test_span_decode_asm.py runs these
# strings in a numpy model of their opcodes.
def _asm_plane(kind: str, plane: int) -> str:
  op, shift = _PLANES[kind][plane]
  if op == "byte":     # Q8_0: (byte ^ 0x80) of each halfword's low / high byte, in an f16 1024 + b
    sel = (0x5240, 0x5341)[shift // 8]
    body = ["xor.b32 kvt, $1, 0x80808080",
            "mov.b32 kvk, 0x64646464",
            f"prmt.b32 kvt, kvt, kvk, 0x{sel:04x}",
            "mov.b32 kvc, 0x64806480"]                    # 1152, 1152
  else:                # Q4_0: the nibble at bits shift..shift+3 of each halfword, in 1024 + n
    body = [f"shr.u32 kvt, $1, {shift}" if shift else "mov.b32 kvt, $1",
            "mov.b32 kvk, 0x000F000F",
            "and.b32 kvt, kvt, kvk",
            "mov.b32 kvk, 0x64006400",
            "or.b32 kvt, kvt, kvk",
            "mov.b32 kvc, 0x64086408"]                    # 1032, 1032
  body += ["sub.rn.f16x2 kvt, kvt, kvc",                 # exact: the quant as an f16 integer
           "mul.rn.f16x2 kvt, kvt, $2",                  # one rounding: value x scale
           "mov.b32 $0, kvt"]
  return "{\n.reg .b32 kvt, kvk, kvc;\n" + "".join(line + ";\n" for line in body) + "}"


_ASM_CONSTRAINTS = "=r,r,r"


# Packed decode of 32-bit words (reads="words"): pack=2 over 32-bit data gives one asm instance two
# words ($1, $2) and their two scales as one f16x2 register ($3); $0 is the plane's byte / nibble of
# each word as f16x2 (the first word's value in the low half). Same arithmetic as `_asm_plane`:
# `prmt` brings the plane's byte of each word to bytes 0 and 2, `lop3` masks it and sets the 0x64
# exponent bytes (Q8_0: (t & 0x00FF00FF) ^ 0x64806480 also flips the sign bit, LUT 0x6A;
# Q4_0: (t & 0x000F000F) | 0x64006400, LUT 0xEA).
def _asm_word_plane(kind: str, plane: int) -> str:
  op, shift = _WORD_PLANES[kind][plane]
  k = shift // 8
  sel = k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12)
  body = [f"prmt.b32 kvt, $1, $2, 0x{sel:04x}"]
  if op == "byte":
    body += ["mov.b32 kvk, 0x00FF00FF", "mov.b32 kvc, 0x64806480",
             "lop3.b32 kvt, kvt, kvk, kvc, 0x6a"]
    off = 0x64806480                                       # 1152, 1152
  else:
    if shift % 8:
      body.append("shr.u32 kvt, kvt, 4")
    body += ["mov.b32 kvk, 0x000F000F", "mov.b32 kvc, 0x64006400",
             "lop3.b32 kvt, kvt, kvk, kvc, 0xea"]
    off = 0x64086408                                       # 1032, 1032
  body += [f"mov.b32 kvc, 0x{off:08X}",
           "sub.rn.f16x2 kvt, kvt, kvc",
           "mul.rn.f16x2 kvt, kvt, $3",
           "mov.b32 $0, kvt"]
  return "{\n.reg .b32 kvt, kvk, kvc;\n" + "".join(line + ";\n" for line in body) + "}"


_ASM_WORD_CONSTRAINTS = "=r,r,r,r"


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def _prev_pow2(n: int) -> int:
  return 1 << (int(n).bit_length() - 1)


def row_pieces(kind: str, head_dim: int, reads: str = "gather"):
  """The pieces a tile of head rows is read in, each decoded to its own block of columns.

  reads="gather": one piece ("gather", blocks): the data halfwords of every block gathered as
    [tokens, blocks, halfwords] and the scales as [tokens, blocks, 1] (2-byte loads: ggml blocks
    of 17 / 9 halfwords start at any halfword).
  reads="windows": ("window", first halfword, width) pieces, power-of-two widths >= 16: a head
    row of a quant kind (136 halfwords for Q8_0, 72 for Q4_0 at D=256) is one main window
    [0, P) (P the largest power of two that fits) and one tail window that ends at the row's end
    and may overlap the main one ([120, 136), [56, 72)): contiguous 16-byte loads; the scale of
    each group of 8 halfwords is a select between two gathered scales.
  """
  per, _ = _BLOCK_HW[kind]
  nb = head_dim // BLOCK
  if reads == "words" and kind in _WORD_PAIR:
    if head_dim % (2 * BLOCK):
      raise ValueError(f"reads='words' reads pairs of blocks: head_dim {head_dim} is not a "
                       f"multiple of {2 * BLOCK}")
    return [("words", 1, _WORD_PAIR[kind][1]), ("words", 0, 1)]
  if reads in ("gather", "words"):    # F16 / BF16 rows: their gathers are whole aligned blocks
    return [("gather", nb)]
  if reads != "windows":
    raise ValueError(f"unknown reads {reads!r}; choose one of {READS}")
  head_hw = per * nb
  if head_hw <= 16:
    return [("window", 0, 16)]                     # halfwords past the row are masked off
  main = _prev_pow2(head_hw)
  rem = head_hw - main
  if not rem:
    return [("window", 0, main)]
  tail = max(16, _next_pow2(rem))
  return [("window", 0, main), ("window", head_hw - tail, tail)]


def _piece_positions(kind: str, piece) -> np.ndarray:
  """[halfwords] int: the row halfword behind each raw halfword of a piece, in load order."""
  per, scaled = _BLOCK_HW[kind]
  if piece[0] == "gather":
    blk = np.arange(piece[1])[:, None]
    return (blk * per + int(scaled) + np.arange(per - int(scaled))[None, :]).reshape(-1)
  return np.arange(piece[1], piece[1] + piece[2])


def column_dims(kind: str, head_dim: int, reads: str = "gather") -> np.ndarray:
  """[columns] int: the head dim of each kernel column of a decoded K or V tile (-1: junk).

  Columns run piece by piece, raw halfword by halfword, and within a halfword plane by plane
  (`_PLANES`: Q8_0 low then high byte, Q4_0 the nibbles at bits 0, 4, 8, 12). Junk columns
  (windows only: a block's scale halfword, a tail window's overlap with the main window,
  halfwords past the row) meet zero query columns in the scores and are dropped from the output.
  """
  per, scaled = _BLOCK_HW[kind]
  head_hw = per * (head_dim // BLOCK)
  cols = []
  covered = 0
  for piece in row_pieces(kind, head_dim, reads):
    if piece[0] == "words":
      cols.append(_word_piece_dims(kind, head_dim, piece))
      continue
    pos = _piece_positions(kind, piece)
    blk, off = pos // per, pos % per
    junk = (pos < covered) | (pos >= head_hw)
    if scaled:
      junk |= off == 0
      i = off - 1                                    # data halfword within the block
    else:
      i = off
    planes = []
    for op, shift in _PLANES[kind]:
      if op == "byte":                               # Q8_0: bytes 2i, 2i+1 are dims 2i, 2i+1
        dim = 2 * i + shift // 8
      elif op == "nibble":                           # Q4_0: qs[j] & 15 -> j, qs[j] >> 4 -> j + 16
        dim = 2 * i + (shift // 8) + 16 * ((shift // 4) % 2)
      else:                                          # F16 / BF16: halfword = dim
        dim = i
      planes.append(np.where(junk, -1, blk * BLOCK + dim))
    cols.append(np.stack(planes, axis=-1).reshape(-1))   # halfword-major, plane-minor
    covered = max(covered, int(pos.max()) + 1)
  return np.concatenate(cols).astype(np.int64)


def _word_piece_dims(kind: str, head_dim: int, piece) -> np.ndarray:
  """[columns] head dim of each column of a "words" piece (-1: junk, a scale's byte / nibble).

  The piece is [tokens, pairs, width] words, word `first + j` of each block pair; columns run
  pair, word, plane (`_WORD_PLANES`)."""
  _, first, width = piece
  pair_words, _ = _WORD_PAIR[kind]
  block_bytes = 2 * _BLOCK_HW[kind][0]
  pairs = np.arange(head_dim // (2 * BLOCK))[:, None, None]
  word = pairs * pair_words + first + np.arange(width)[None, :, None]          # [P, W, 1]
  shift = np.array([sh for _, sh in _WORD_PLANES[kind]])[None, None, :]        # [1, 1, planes]
  byte = 4 * word + shift // 8
  blk, r = byte // block_bytes, byte % block_bytes
  dim = blk * BLOCK + (r - 2)
  if kind == "q4_0":                     # qs[i] & 15 -> dim i, qs[i] >> 4 -> dim i + 16
    dim = blk * BLOCK + (r - 2) + 16 * ((shift % 8) // 4)
  return np.where(r < 2, -1, dim).reshape(-1)


def _piece_slices(kind: str, head_dim: int, reads: str):
  """[(first column, columns)] of each piece of `row_pieces`, in column order."""
  out, col = [], 0
  for piece in row_pieces(kind, head_dim, reads):
    if piece[0] == "words":
      n = (head_dim // (2 * BLOCK)) * piece[2] * len(_WORD_PLANES[kind])
      out.append((col, n))
      col += n
      continue
    n = _piece_positions(kind, piece).shape[0] * len(_PLANES[kind])
    out.append((col, n))
    col += n
  return out


@dataclasses.dataclass(frozen=True)
class TileConfig:
  path: str
  block_rows: int     # BM: folded query rows per program
  block_tokens: int   # BT: keys per inner step (divides page_tokens)
  num_warps: int
  num_stages: int
  prefetch: bool      # load tile i+1 while computing tile i
  reads: str = DEFAULT_READS  # `row_pieces`
  decode: str = DEFAULT_DECODE  # `DECODES`: "asm" (packed PTX) or "jnp"; interpret runs "jnp"
  # clamp_rows: load the rows of a partial key tile from the last key it may read instead of
  # masking every load (no per-element predicate; masked keys still get -inf scores). Default:
  # measured faster on the H200 (session 7, S7-1: span kernel 171.1 -> 165.4 us at 128K S=1)
  clamp_rows: bool = True


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
                num_stages: Optional[int] = None, prefetch: Optional[bool] = None,
                reads: Optional[str] = None, block_rows: Optional[int] = None,
                decode: Optional[str] = None, clamp_rows: Optional[bool] = None) -> TileConfig:
  """Tile sizes of a path. `group` = query heads per KV head (rows per token).

  block_rows: folded query rows per program (a power of two >= 16); rows past it go to more
  row blocks, which read the same pages (grid order puts them next to each other).
  """
  auto = select_path(num_tokens)
  path = path or auto
  if path not in PATHS:
    raise ValueError(f"unknown path {path!r}; choose one of {PATHS}")
  limit = {"vector": 2, "matrix": 8, "prefill": MAX_QUERY_ROWS}[path]
  if num_tokens > limit:
    raise ValueError(f"too many query rows for the {path} path: {num_tokens} tokens > {limit}")
  rows = num_tokens * group
  if path == "prefill":
    bm, bt, nw, ns, pf = min(64, max(16, _next_pow2(rows))), 64, 4, 1, False
  elif path == "matrix":
    bm, bt, nw, ns, pf = min(64, max(16, _next_pow2(rows))), 32, 4, 1, False
  else:
    bm, bt, nw, ns, pf = min(32, max(16, _next_pow2(rows))), 32, 4, 1, False
  if block_rows is not None:
    if block_rows < 16 or block_rows & (block_rows - 1):
      raise ValueError(f"block_rows must be a power of two >= 16, got {block_rows}")
    bm = min(block_rows, max(16, _next_pow2(rows)))
  bt = block_tokens or bt
  bt = min(bt, _largest_pow2_divisor(page_tokens))
  if bt < 16:
    raise ValueError(f"page_tokens {page_tokens} needs a power-of-two divisor >= 16 for key tiles")
  reads = reads or DEFAULT_READS
  if reads not in READS:
    raise ValueError(f"unknown reads {reads!r}; choose one of {READS}")
  decode = decode or DEFAULT_DECODE
  if decode not in DECODES:
    raise ValueError(f"unknown decode {decode!r}; choose one of {DECODES}")
  return TileConfig(path, bm, bt, num_warps or nw, num_stages or ns,
                    pf if prefetch is None else bool(prefetch), reads, decode,
                    True if clamp_rows is None else bool(clamp_rows))


# Partition size ("auto" block_pages). CTAs an SM holds, by ncu on the H200 (132 SMs): the
# 16-row tile uses 128 registers, so 4 CTAs (S5-2, jax 0.11.2); the 64-row tile 226, so 2 (S4-4);
# the 32-row tile is taken as 3 (its measured best size, 160K S=4 bp7, fits that; not profiled).
DEFAULT_NUM_SMS = 132
CTA_OVERHEAD_PAGES = 1     # per-CTA fixed cost (query load, partial write), in page-reads


def ctas_per_sm(block_rows: int) -> int:
  """CTAs one SM holds at the row tile's register count (see above)."""
  return {16: 4, 32: 3}.get(block_rows, 2)


def choose_block_pages(num_pages: int, num_kv_heads: int, num_tokens: int, group: int,
                       num_sms: int = DEFAULT_NUM_SMS, path: Optional[str] = None,
                       block_rows: Optional[int] = None) -> int:
  """Logical partition size (pages) for a call over `num_pages` pages: a pure function.

  CTAs run in rounds of `ctas_per_sm x num_sms`; the choice has the fewest page-reads per CTA
  slot, rounds x (pages a CTA + CTA_OVERHEAD_PAGES), and on a tie the larger size (fewer
  partitions to combine). Measured best on the H200 at 4 KV heads x 6 rows (docs/PERFORMANCE.md,
  S5-1 / S5-2): decode 128K bp4, 160K bp5, 256K bp8 (512 CTAs: one round of 4 an SM); 160K
  verify S=4 bp7, S=6 bp10 (256 CTAs: one round of 2 an SM).
  """
  num_pages = max(1, int(num_pages))
  # only the row tile matters here; any page size with a power-of-two divisor >= 16 will do
  cfg = tile_config(num_tokens, group, 16, path, block_rows=block_rows)
  n_mb = -(-num_tokens * group // cfg.block_rows)
  ctas_per_part = n_mb * num_kv_heads
  slots = ctas_per_sm(cfg.block_rows) * num_sms
  best, best_cost = 1, None
  for bp in range(1, num_pages + 1):
    rounds = -(-ctas_per_part * -(-num_pages // bp) // slots)
    cost = rounds * (bp + CTA_OVERHEAD_PAGES)
    if best_cost is None or cost <= best_cost:
      best, best_cost = bp, cost
  return best


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


@dataclasses.dataclass(frozen=True)
class OperandPlan:
  dtype: object         # dot operand dtype
  q_terms: int          # terms of the query / softmax weights
  kv_terms: int         # terms of the decoded K / V values
  precision: object     # lax precision of each dot

  def pairs(self):
    """(i, j) term pairs that are kept: i + j < max terms (drops the tail x tail products)."""
    n = max(self.q_terms, self.kv_terms)
    return [(i, j) for i in range(self.q_terms) for j in range(self.kv_terms) if i + j < n]


def check_call(q_shd, pool_pn, layout: PageLayout, num_q_heads: int, block_pages: int,
               layout_check=check_layout):
  """Argument checks shared by the kernels' wrappers (`layout_check`: the kernel's own)."""
  _, h, d = q_shd.shape
  g = layout.num_kv_heads
  layout_check(layout, d)
  if h % g:
    raise ValueError(f"{h} query heads are not a multiple of {g} KV heads")
  if h != num_q_heads:
    raise ValueError(f"q has {h} heads but num_q_heads={num_q_heads}")
  if block_pages < 1:
    raise ValueError(f"block_pages must be >= 1, got {block_pages}")
  if pool_pn.dtype == jnp.uint16:  # a halfword view of the pool (no bitcast in the call)
    if pool_pn.ndim != 2 or pool_pn.shape[1] * 2 != layout.page_bytes:
      raise ValueError(f"uint16 pool must be [pages, {layout.page_bytes // 2}], got {pool_pn.shape}")
  elif pool_pn.dtype != jnp.uint8 or pool_pn.ndim != 2 or pool_pn.shape[1] != layout.page_bytes:
    raise ValueError(f"pool must be uint8 [pages, {layout.page_bytes}] (or its uint16 view), "
                     f"got {pool_pn.dtype} {pool_pn.shape}")


def _operand_plan(precision: str, layout: PageLayout, interpret: bool) -> OperandPlan:
  if precision not in PRECISIONS:
    raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
  exact = lax.Precision.HIGHEST  # the CPU interpreter computes float32 exactly
  if precision == "tf32":
    return OperandPlan(jnp.float32, 1, 1, exact if interpret else lax.Precision.DEFAULT)
  if precision == "ieee":
    return OperandPlan(jnp.float32, 1, 1, lax.Precision.HIGHEST)
  kinds = (layout.k_type, layout.v_type)
  dtype = jnp.bfloat16 if "bf16" in kinds else jnp.float16
  prec = exact if interpret else lax.Precision.DEFAULT
  if precision == "f16":
    return OperandPlan(dtype, 1, 1, prec)
  if kinds == ("bf16", "bf16"):
    return OperandPlan(dtype, 3, 1, prec)   # values exact in bf16: 3 x 8 bits of q / p
  if kinds == ("f16", "f16"):
    return OperandPlan(dtype, 2, 1, prec)   # values exact in f16: 2 x 11 bits
  return OperandPlan(dtype, 2, 2, prec)     # scaled quants: head + tail on both sides


_KEEP_BITS = {jnp.dtype(jnp.float16): 0xFFFFE000, jnp.dtype(jnp.bfloat16): 0xFFFF0000}


def _split(x, n: int, dtype):
  """x (f32) -> n terms of `dtype` whose float32 sum approximates x (head first).

  Heads are cut with a bit mask, not a round trip through `dtype` (XLA may
  remove f32 -> 16 bit -> f32 round trips under its excess-precision rule).
  """
  if n == 1 or dtype == jnp.float32:
    return [x.astype(dtype)]
  keep = jnp.uint32(_KEEP_BITS[jnp.dtype(dtype)])
  terms = []
  for _ in range(n - 1):
    head = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & keep, jnp.float32)
    terms.append(head.astype(dtype))
    x = x - head
  terms.append(x.astype(dtype))
  return terms


def _dot_nt(a, b, precision):  # a [M, K] . b [N, K]^T -> [M, N] f32
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _dot_nn(a, b, precision):  # a [M, K] . b [K, N] -> [M, N] f32
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _masked_load(ref, idx, mask, other):
  """Masked gather `ref[idx]` (Triton load; the CPU interpreter runs it too); mask None: plain."""
  if mask is None:
    if _pltriton is not None and hasattr(_pltriton, "load"):
      return _pltriton.load(ref.at[idx])
    return pl.load(ref, idx)  # pragma: no cover (older jax)
  if _pltriton is not None and hasattr(_pltriton, "load"):
    return _pltriton.load(ref.at[idx], mask=mask, other=other)
  return pl.load(ref, idx, mask=mask, other=other)  # pragma: no cover (older jax)


def _mask(ok, shape):
  """A load mask broadcast to `shape`, or None (clamp_rows: every row in range, no mask)."""
  return None if ok is None else jnp.broadcast_to(ok, shape)


def _load_piece(pool_ref, phys, row_hw, valid, kind: str, head_dim: int, piece):
  """Raw halfwords of one piece (`row_pieces`) of a tile of head rows, and their scales.

  row_hw [BT, 1] int32 halfword offset of each token's head row; valid [BT, 1] (None: no mask)
  -> (data [BT, n, w] uint16, scale [BT, n, w or 1] uint16 (f16 bits) or None)
  gather: n = blocks, w = data halfwords a block, one scale a block.
  window: n = width / 8, w = 8: each group of 8 halfwords (one 16-byte load) holds at most two
  blocks, whose scales are two [BT, n, 1] gathers and a select (not a gather per halfword).
  """
  per, scaled = _BLOCK_HW[kind]
  nb = head_dim // BLOCK
  bt = row_hw.shape[0]
  rows3 = row_hw[:, :, None]                       # [BT, 1, 1]
  ok = None if valid is None else valid[:, :, None]
  if piece[0] == "gather":
    w = per - int(scaled)                          # 16 (q8_0), 8 (q4_0), 32 (f16/bf16)
    blk = lax.broadcasted_iota(jnp.int32, (1, nb, 1), 1) * per
    col = lax.broadcasted_iota(jnp.int32, (1, 1, w), 2) + int(scaled)
    data = _masked_load(pool_ref, (phys, rows3 + blk + col), _mask(ok, (bt, nb, w)), 0)
    scale = None
    if scaled:
      scale = _masked_load(pool_ref, (phys, rows3 + blk), _mask(ok, (bt, nb, 1)), 0)
    return data, scale
  _, start, width = piece
  head_hw = per * nb
  n8 = width // _GROUP
  grp = lax.broadcasted_iota(jnp.int32, (1, n8, 1), 1)
  c8 = lax.broadcasted_iota(jnp.int32, (1, 1, _GROUP), 2)
  pos = start + grp * _GROUP + c8                  # [1, n8, 8] halfword within the row
  if start + width > head_hw:                      # rows shorter than 16 halfwords
    ok = (pos < head_hw) if ok is None else ok & (pos < head_hw)
  data = _masked_load(pool_ref, (phys, rows3 + pos), _mask(ok, (bt, n8, _GROUP)), 0)
  if not scaled:
    return data, None
  pos0 = start + grp * _GROUP                      # [1, n8, 1]
  lo_blk = pos0 // per
  hi_blk = jnp.minimum((pos0 + _GROUP - 1) // per, nb - 1)
  split = (lo_blk + 1) * per - pos0                # halfwords of the group in lo_blk
  ok1 = None if valid is None else _mask(valid[:, :, None], (bt, n8, 1))
  s_lo = _masked_load(pool_ref, (phys, rows3 + lo_blk * per), ok1, 0)
  s_hi = _masked_load(pool_ref, (phys, rows3 + hi_blk * per), ok1, 0)
  return data, jnp.where(c8 < split, s_lo, s_hi)


def _load_words(pool_ref, phys, row_w, valid, kind: str, head_dim: int):
  """The two "words" pieces of a tile of head rows (`row_pieces`), read from the uint32 pool.

  row_w [BT, 1] int32 word offset of each token's head row; valid [BT, 1] (None: no mask)
  -> [(main [BT, P, W] u32, scale [BT, P, W] u16), (head [BT, P, 1] u32, scale [BT, P, 1] u16)]
  P = block pairs, W = `_WORD_PAIR` data words. A pair's word 0 holds block 2p's scale (low half)
  and its first two quant bytes; block 2p+1's scale is the high half of word (pair_words - 1) / 2,
  the word where block 2p ends; main words before (pair_words + 1) / 2 take block 2p's scale.
  """
  pair_words, width = _WORD_PAIR[kind]
  n_pairs = head_dim // (2 * BLOCK)
  bt = row_w.shape[0]
  base = row_w[:, :, None] + lax.broadcasted_iota(jnp.int32, (1, n_pairs, 1), 1) * pair_words
  ok = None if valid is None else valid[:, :, None]
  ok1 = _mask(ok, (bt, n_pairs, 1))
  j = lax.broadcasted_iota(jnp.int32, (1, 1, width), 2)
  main = _masked_load(pool_ref, (phys, base + 1 + j), _mask(ok, (bt, n_pairs, width)), 0)
  head = _masked_load(pool_ref, (phys, base), ok1, 0)
  hi_word = _masked_load(pool_ref, (phys, base + (pair_words - 1) // 2), ok1, 0)
  s_lo = (head & 0xFFFF).astype(jnp.uint16)
  s_hi = (hi_word >> 16).astype(jnp.uint16)
  s_main = jnp.where(1 + j < (pair_words + 1) // 2, s_lo, s_hi)
  return [(main, s_main), (head, s_lo)]


def _interleave(vals):
  """[x_0 .. x_{n-1}] (n a power of two, same shapes) -> [..., 2, .., 2] whose flattened last
  axes run x_0 .. x_{n-1} element by element: built from pairwise stacks only (Triton joins)."""
  if len(vals) == 1:
    return vals[0][..., None]
  if len(vals) == 2:
    return jnp.stack(vals, axis=-1)
  return jnp.stack([_interleave(vals[0::2]), _interleave(vals[1::2])], axis=-1)


def _magic(bits_i32, offset: float):
  """Small non-negative ints -> f16 `value - offset` exactly (0x6400 | v is 1024 + v)."""
  h = lax.bitcast_convert_type((bits_i32 | 0x6400).astype(jnp.int16), jnp.float16)
  return h - jnp.float16(offset)


def _decode_piece(data, scale, kind: str, f32: bool, asm: bool = False):
  """Raw halfwords [BT, n, w] u16 (or words, u32: reads="words") + scales -> values
  [BT, n * w * planes] (kernel columns: element by element, plane by plane within an element,
  `_PLANES` / `_WORD_PLANES`).

  f32=False: f16 (bf16 for BF16 pages), each value rounded once (the "f16" operand);
  f32=True: float32, exact (the source of "f16x3" heads / tails and "tf32" / "ieee").
  asm=True (f16 values of quant pages only): the same bits from the packed PTX of `_asm_plane`
  (`_asm_word_plane` for words). Junk columns hold finite values (a scale's bytes as a quant,
  times a real scale).
  """
  bt, n, w = data.shape
  words = data.dtype == jnp.uint32
  planes = (_WORD_PLANES if words else _PLANES)[kind]
  if planes[0][0] == "raw":
    src = jnp.float16 if kind == "f16" else jnp.bfloat16
    v = lax.bitcast_convert_type(data, src).reshape(bt, n * w)
    return v.astype(jnp.float32) if f32 else v
  sc = lax.bitcast_convert_type(scale, jnp.float16)
  if asm and not f32:   # GPU only: one single-result asm a plane (see `_asm_plane`)
    asm_plane, constraints = ((_asm_word_plane, _ASM_WORD_CONSTRAINTS) if words
                              else (_asm_plane, _ASM_CONSTRAINTS))
    sc = jnp.broadcast_to(sc, data.shape)
    out = jax.ShapeDtypeStruct(data.shape, jnp.float16)
    vals = [_pltriton.elementwise_inline_asm(asm_plane(kind, p), args=[data, sc],
                                             constraints=constraints, pack=2,
                                             result_shape_dtypes=[out])[0]
            for p in range(len(planes))]
  else:
    x = data if words else data.astype(jnp.int32)
    if f32:
      sc = sc.astype(jnp.float32)
    vals = []
    for op, shift in planes:
      if op == "byte":                                              # int8 = (byte ^ 0x80) - 128
        v = _magic((((x >> shift) & 0xFF) ^ 0x80).astype(jnp.int32), 1152.0)
      else:                                                         # Q4_0: nibble - 8
        v = _magic(((x >> shift) & 0xF).astype(jnp.int32), 1032.0)
      vals.append(v.astype(jnp.float32) * sc if f32 else v * sc)   # f16: rounded once
  return _interleave(vals).reshape(bt, n * w * len(planes))


def _value_terms(data, scale, kind: str, plan: OperandPlan, asm: bool = False):
  if plan.dtype == jnp.float32:
    return [_decode_piece(data, scale, kind, True)]
  if plan.kv_terms == 1:
    return [_decode_piece(data, scale, kind, False, asm)]
  return _split(_decode_piece(data, scale, kind, True), plan.kv_terms, plan.dtype)


def _span_kernel(*refs, layout: PageLayout, cfg: TileConfig, block_pages: int, num_phys: int,
                 plan: OperandPlan, sm_scale: float, interpret: bool = False,
                 fused_prep: bool = False, group: int = 1, num_rows: int = 0, num_table: int = 0):
  # wrapper prep: meta_ref [4] i32, tab_ref [T] i32, qpos_ref [Mp] i32,
  #   q_ref [terms, G, Mp, Kc] plan.dtype (K kernel columns), pool_ref [P, page_hw] u16 (reads
  #   "words": [P, page_hw / 2] u32)
  # fused_prep: kv_ref [1], begin_ref [1], end_ref [1] i32, tab_ref [T] i32, qpos_ref [S] i32,
  #   q_ref [S, H, D] f32 (the caller's query: folded, padded and split here), pool_ref
  # -> m_out, l_out [G, parts, Mp], acc_out [G, parts, Mp, Vc] f32 (V kernel columns)
  # grid (row block, KV head, partition): the first axis varies fastest in launch order, so the
  # row blocks and heads of one partition (the same pages) run next to each other
  mb = pl.program_id(0)
  g = pl.program_id(1)
  pp = pl.program_id(2)
  bm, bt = cfg.block_rows, cfg.block_tokens
  pt = layout.page_tokens
  d = layout.head_dim
  kk, vk = layout.k_type, layout.v_type
  prec = plan.precision
  k_pieces, v_pieces = row_pieces(kk, d, cfg.reads), row_pieces(vk, d, cfg.reads)
  words = k_pieces[0][0] == "words"          # then V's are too (check_words_layout)
  asm = cfg.decode == "asm" and not interpret    # the interpreter cannot run PTX
  k_slices, v_slices = _piece_slices(kk, d, cfg.reads), _piece_slices(vk, d, cfg.reads)
  rows = pl.ds(mb * bm, bm)
  if fused_prep:
    kv_ref, begin_ref, end_ref, tab_ref, qpos_ref, q_ref, pool_ref, m_out, l_out, acc_out = refs
    kv_len = kv_ref[0]
    tile_begin = begin_ref[0]
    n_active = (kv_len + pt - 1) // pt
    tile_end = jnp.minimum(jnp.minimum(end_ref[0], n_active), num_table)
    n_table = num_table
    m_idx = mb * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)      # folded row
    real = m_idx < num_rows
    tok = jnp.where(real, m_idx // group, 0)                          # its query token
    head = g * group + m_idx % group                                  # its query head
    qpos = jnp.where(real, _masked_load(qpos_ref, (tok,), real, 0), -1)   # [BM] (-1: padding)
    dims = lax.broadcasted_iota(jnp.int32, (1, d), 1)
    q_bd = _masked_load(q_ref, (tok[:, None], head[:, None], dims),
                        jnp.broadcast_to(real[:, None], (bm, d)), 0.0)     # [BM, D] f32
    q_pieces = [_split(q_bd, plan.q_terms, plan.dtype)]   # gather reads: K columns = head dims
  else:
    meta_ref, tab_ref, qpos_ref, q_ref, pool_ref, m_out, l_out, acc_out = refs
    kv_len = meta_ref[0]
    tile_begin = meta_ref[1]
    tile_end = meta_ref[2]       # already clipped to the active pages
    n_table = meta_ref[3]
    qpos = qpos_ref[rows]                                   # [BM] int32 (-1: padding row)
    # per K piece: the query terms of its columns, [BM, columns] each (unscaled)
    q_pieces = [[q_ref[i, g, rows, pl.ds(c0, n)] for i in range(plan.q_terms)]
                for c0, n in k_slices]

  page_lo = jnp.maximum(pp * block_pages, tile_begin)
  page_hi = jnp.minimum(pp * block_pages + block_pages, tile_end)
  tok_lo = page_lo * pt
  tok_end = jnp.minimum(page_hi * pt, kv_len)             # keys at or past this are masked
  tok_hi = jnp.minimum(tok_end, jnp.max(qpos) + 1)        # causal skip for the whole row block
  n_tiles = jnp.maximum(tok_hi - tok_lo + bt - 1, 0) // bt

  k_head_hw = layout.k_head_bytes // 2
  v_head_hw = layout.v_head_bytes // 2
  k_row_hw = layout.k_row_bytes // 2
  v_row_hw = layout.v_row_bytes // 2
  v_base_hw = layout.v_offset // 2
  t_iota = lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
  tk_iota = lax.broadcasted_iota(jnp.int32, (1, bt), 1)

  def load_tile(i):
    """Raw pieces of key tile i (masked off past the causal end)."""
    t0 = tok_lo + i * bt
    lp = jnp.minimum(t0 // pt, n_table - 1)
    phys = jnp.clip(tab_ref[lp], 0, num_phys - 1)
    in_page = t0 - (t0 // pt) * pt + t_iota               # [BT, 1] token row within the page
    valid = (t0 + t_iota) < tok_hi
    if cfg.clamp_rows:   # rows past tok_hi re-read the last row it may read (in-page, finite)
      last = jnp.clip(tok_hi - 1 - (t0 // pt) * pt, 0, pt - 1)
      in_page = jnp.minimum(in_page, last)
      valid = None
    k_row = in_page * k_row_hw + g * k_head_hw
    v_row = v_base_hw + in_page * v_row_hw + g * v_head_hw
    if words:    # the pool is uint32 words: offsets in words (check_words_layout: all even)
      return (tuple(_load_words(pool_ref, phys, k_row // 2, valid, kk, d)),
              tuple(_load_words(pool_ref, phys, v_row // 2, valid, vk, d)))
    k = tuple(_load_piece(pool_ref, phys, k_row, valid, kk, d, pc) for pc in k_pieces)
    v = tuple(_load_piece(pool_ref, phys, v_row, valid, vk, d, pc) for pc in v_pieces)
    return k, v

  def compute(i, raw, m_i, l_i, accs):
    k_raw, v_raw = raw
    t0 = tok_lo + i * bt
    s = None
    for w, q_terms in enumerate(q_pieces):
      k_terms = _value_terms(*k_raw[w], kk, plan, asm)    # [BT, columns] each
      for a, b in plan.pairs():
        part = _dot_nt(q_terms[a], k_terms[b], prec)      # [BM, BT]
        s = part if s is None else s + part
    s = s * sm_scale
    key = t0 + tk_iota                                     # [1, BT]
    ok = (key < tok_end) & (key <= qpos[:, None])
    s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    m_use = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    p_bt = jnp.exp(s - m_use[:, None])                     # [BM, BT]
    alpha = jnp.exp(m_i - m_use)
    l_new = l_i * alpha + jnp.sum(p_bt, axis=1)
    p_terms = _split(p_bt, plan.q_terms, plan.dtype)
    upds = []
    for w in range(len(accs)):
      v_terms = _value_terms(*v_raw[w], vk, plan, asm)
      upd = None
      for a, b in plan.pairs():
        part = _dot_nn(p_terms[a], v_terms[b], prec)      # [BM, columns]
        upd = part if upd is None else upd + part
      upds.append(upd)
    # (skipping acc * alpha when no row max moved was measured slower: docs/PERFORMANCE.md S5-3)
    return m_new, l_new, tuple(acc * alpha[:, None] + upd for acc, upd in zip(accs, upds))

  init = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32),
          tuple(jnp.zeros((bm, n), jnp.float32) for _, n in v_slices))
  if cfg.prefetch:
    def body(i, carry):
      m_i, l_i, accs, raw = carry
      nxt = load_tile(i + 1)            # in flight while tile i is computed
      m_i, l_i, accs = compute(i, raw, m_i, l_i, accs)
      return m_i, l_i, accs, nxt
    m_f, l_f, accs, _ = lax.fori_loop(0, n_tiles, body, init + (load_tile(0),))
  else:
    def body(i, carry):
      return compute(i, load_tile(i), *carry)
    m_f, l_f, accs = lax.fori_loop(0, n_tiles, body, init)
  m_out[g, pp, rows] = m_f
  l_out[g, pp, rows] = l_f
  for (c0, n), acc in zip(v_slices, accs):
    acc_out[g, pp, rows, pl.ds(c0, n)] = acc


def _combine_kernel(*refs, block_rows: int, block_cols: int, num_parts: int, unroll: int,
                    has_carry: bool = True, ml_packed: bool = False,
                    acc_transposed: bool = False):
  """Left fold of the partitions (logical order) into the carry; grid (g, row block, column block).

  Partials: m_parts, l_parts [G, parts, rows] and acc_parts [G, parts, rows, columns]; or
  (ml_packed) m and l in one ref [G, parts, 2, rows] (l_parts unused: the same ref); or
  (acc_transposed) acc_parts [G, parts, columns, rows], and then acc_in / acc_out [G, columns,
  rows] too: the fold runs on [columns, rows] blocks as loaded (`merge_partials(...,
  acc_transposed=True)`: the same operations; the bits can differ from the other layout's where
  the compiler contracts into FMAs differently), no transpose in the kernel.

  Software-pipelined: the loads of group j+1 are issued before group j is
  folded (a plain loop let the compiler sink each load next to its fold: one
  memory round trip per partition, 65 us for 64 partitions at 128K).
  """
  if has_carry:
    m_parts, l_parts, acc_parts, m_in, l_in, acc_in, m_out, l_out, acc_out = refs
  else:   # a fresh call: the carry starts empty (-inf, 0, 0), the same bits as one passed in
    m_parts, l_parts, acc_parts, m_out, l_out, acc_out = refs
  g = pl.program_id(0)
  mb = pl.program_id(1)
  c = pl.program_id(2)
  rows = pl.ds(mb * block_rows, block_rows)
  cols = pl.ds(c * block_cols, block_cols)

  def load_group(j):
    j = jnp.minimum(j, num_parts // unroll - 1)   # the prefetch past the end re-reads the last
    parts = []
    for u in range(unroll):
      q = j * unroll + u
      if ml_packed:
        m, l = m_parts[g, q, 0, rows], m_parts[g, q, 1, rows]
      else:
        m, l = m_parts[g, q, rows], l_parts[g, q, rows]
      acc = acc_parts[g, q, cols, rows] if acc_transposed else acc_parts[g, q, rows, cols]
      parts.append((m, l, acc))
    return tuple(parts)

  def body(j, carry):
    state, parts = carry
    nxt = load_group(j + 1)
    for part in parts:
      state = _ref.merge_partials(state, part, acc_transposed)
    return state, nxt

  acc_block = (cols, rows) if acc_transposed else (rows, cols)
  if has_carry:
    state = (m_in[g, rows], l_in[g, rows], acc_in[(g,) + acc_block])
  else:
    state = (jnp.full((block_rows,), -jnp.inf, jnp.float32), jnp.zeros((block_rows,), jnp.float32),
             jnp.zeros((block_cols, block_rows) if acc_transposed else (block_rows, block_cols),
                       jnp.float32))
  (m_c, l_c, a_c), _ = lax.fori_loop(0, num_parts // unroll, body, (state, load_group(0)))
  m_out[g, rows, c] = m_c
  l_out[g, rows, c] = l_c
  acc_out[(g,) + acc_block] = a_c


def combine_unroll_for(block_rows: int, block_cols: int, num_parts: int) -> int:
  """combine_unroll="auto": the largest of 16 (COMBINE_UNROLL_MAX) and 8 whose group of partition
  tiles holds at most COMBINE_TILE_FLOATS floats (8 at least), and no larger than `num_parts`
  rounded up to a multiple of 8 (the partitions are padded to a whole number of groups with empty
  ones)."""
  need = max(8, -(-int(num_parts) // 8) * 8)
  for unroll in (32, 16):
    if unroll > COMBINE_UNROLL_MAX:
      continue
    if unroll * block_rows * block_cols <= COMBINE_TILE_FLOATS:
      return min(unroll, need)
  return 8


def _compiler_params(cfg_warps: int, cfg_stages: int, interpret: bool):
  if interpret or _pltriton is None:
    return None
  return _pltriton.CompilerParams(num_warps=cfg_warps, num_stages=cfg_stages)


def _to_columns(x_gmd, col_dims: np.ndarray):
  """[..., D] -> [..., columns]: each kernel column takes its dim; junk columns are zero."""
  if np.array_equal(col_dims, np.arange(x_gmd.shape[-1])):
    return x_gmd
  take = x_gmd[..., np.maximum(col_dims, 0)]
  return jnp.where(jnp.asarray(col_dims >= 0), take, jnp.zeros((), x_gmd.dtype))


def _from_columns(x_gmc, col_dims: np.ndarray, head_dim: int):
  """[..., columns] -> [..., D]: dim d from the one non-junk column that holds it."""
  if np.array_equal(col_dims, np.arange(head_dim)):
    return x_gmc
  first = np.full(head_dim, -1)
  for c in range(col_dims.shape[0] - 1, -1, -1):
    if col_dims[c] >= 0:
      first[col_dims[c]] = c
  assert (first >= 0).all()
  return x_gmc[..., first]


def check_words_layout(layout: PageLayout):
  """reads="words": both planes' row and head offsets must be whole 32-bit words."""
  kinds = {layout.k_type, layout.v_type}
  if not kinds <= set(_WORD_PAIR):
    raise ValueError(f"reads='words' reads quant rows (Q8_0 / Q4_0) only; K/V pair "
                     f"{layout.k_type.upper()}/{layout.v_type.upper()} has other kinds: use "
                     f"reads='gather'")
  offsets = dict(page_bytes=layout.page_bytes, v_offset=layout.v_offset,
                 k_row_bytes=layout.k_row_bytes, v_row_bytes=layout.v_row_bytes,
                 k_head_bytes=layout.k_head_bytes, v_head_bytes=layout.v_head_bytes)
  bad = {k: v for k, v in offsets.items() if v % 4}
  if bad:
    raise ValueError(f"reads='words' needs 4-byte aligned page offsets; not multiples of 4: {bad}")


def word_view(pool_u16):
  """uint16 [P, page_hw] -> uint32 [P, page_hw // 2] (little-endian words)."""
  p, hw = pool_u16.shape
  return lax.bitcast_convert_type(pool_u16.reshape(p, hw // 2, 2), jnp.uint32)


def halfword_view(pool_pn):
  """uint8 [P, page_bytes] -> uint16 [P, page_bytes // 2] (little-endian halfwords).

  XLA may materialise this as a copy of the pool; callers that keep a pool for
  many calls can convert it once and pass the uint16 view instead.
  """
  p, nbytes = pool_pn.shape
  return lax.bitcast_convert_type(pool_pn.reshape(p, nbytes // 2, 2), jnp.uint16)


@functools.partial(jax.jit, static_argnames=(
    "layout", "num_q_heads", "block_pages", "sm_scale", "interpret", "precision", "path",
    "block_tokens", "num_warps", "num_stages", "prefetch", "reads", "block_rows", "decode",
    "clamp_rows",
    "combine_cols", "combine_rows", "combine_warps", "combine_unroll", "fused_prep"))
def span_attention_partial_triton(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, carry: _ref.Carry,
                                  tile_begin, tile_end, *, layout: PageLayout, num_q_heads: int,
                                  block_pages: int = 1, sm_scale: Optional[float] = None,
                                  interpret: bool = False, precision: str = DEFAULT_PRECISION,
                                  path: Optional[str] = None, block_tokens: Optional[int] = None,
                                  num_warps: Optional[int] = None,
                                  num_stages: Optional[int] = None,
                                  prefetch: Optional[bool] = None,
                                  reads: Optional[str] = None,
                                  block_rows: Optional[int] = None,
                                  decode: Optional[str] = None,
                                  combine_cols: Optional[int] = None,
                                  combine_rows: Optional[int] = None,
                                  combine_warps: Optional[int] = None,
                                  combine_unroll: Union[int, str] = "auto",
                                  fused_prep: Optional[bool] = None,
                                  clamp_rows: Optional[bool] = None) -> _ref.Carry:
  """Kernel version of `reference.span_attention_partial_reference` (same contract).

  carry=None: a fresh call (the empty carry, not read from memory: the same bits).
  combine_rows / combine_cols / combine_warps: the combine's tile (rows x V columns a program) and
  warps. combine_rows None: the real rows rounded up to a power of two, at most the span tile's
  row block; combine_warps None: one warp a 64 elements of the tile, 1 to 4. The tiling changes no
  bit (the fold is elementwise per row, in logical order).
  combine_unroll: partitions the combine loads at once, one group ahead of the fold: a multiple of
  8, or "auto" (`combine_unroll_for`: 16 for decode, fewer where the row block is larger). Larger
  groups hide more of the load latency of its serial chain (S6-1: 19.9 -> 15.7 us at 128
  partitions) but compile superlinearly longer (S14-1: 32 took ~35 s more than 16 and ran no
  faster). The fold order is the same; the interpreter gives the same bits for 8, 16 and 32
  but not for 1 (its compiler contracts the merge's multiply-adds differently in that loop body).
  fused_prep: the span kernel folds, pads and splits the query and repeats its positions itself,
  and clips the page range, instead of 6 small XLA fusions before it (S6-1: together with the
  combine above, 233.3 -> 216.7 us of kernels a 128K call). Same bits. None (default): on where
  the K columns are the head dims in order (gather reads, F16 / BF16 K); True there only.
  clamp_rows (None: on, the default since session 7; False: masked loads): the key rows of a
  partial tile are read from the last key the row block may see (`min(token, tok_hi - 1)`, real
  finite data) instead of masked loads, so no load carries a per-element predicate. Masked keys
  still get -inf scores and zero weights: the same bits (test_clamp_rows_same_bits). Measured
  (S7-1, 128K S=1): span kernel 171.1 -> 165.4 us; the 3.75 M ISETP became 3.56 M VIMNMX.
  (A `peel_tail` option, full tiles with plain loads and only the partial tail clamped, was
  measured 1.5x slower in session 8 and removed: docs/DESIGN.md, "peel_tail".)
  """
  s_tok, h, d = q_shd.shape
  g = layout.num_kv_heads
  check_call(q_shd, pool_pn, layout, num_q_heads, block_pages, check_layout)
  r = h // g
  cfg = tile_config(s_tok, r, layout.page_tokens, path, block_tokens, num_warps, num_stages,
                    prefetch, reads, block_rows, decode, clamp_rows)
  plan = _operand_plan(precision, layout, interpret)
  scale = (1.0 / d ** 0.5) if sm_scale is None else sm_scale
  bm = cfg.block_rows
  rows = s_tok * r
  rows_pad = -(-rows // bm) * bm
  n_mb = rows_pad // bm
  n_table = page_table_t.shape[0]
  k_cols = column_dims(layout.k_type, d, cfg.reads)
  v_cols = column_dims(layout.v_type, d, cfg.reads)
  vc = v_cols.shape[0]
  if combine_cols is None:       # 32, or the largest power of two dividing the V columns
    combine_cols = min(BLOCK, _largest_pow2_divisor(vc))
  if combine_cols < 1 or combine_cols & (combine_cols - 1) or vc % combine_cols:
    raise ValueError(f"combine_cols must be a power of two dividing {vc}, got {combine_cols}")
  c_rows = min(bm, _next_pow2(rows))             # the combine's row block (real rows only)
  if combine_rows is not None:
    if combine_rows < 1 or combine_rows & (combine_rows - 1) or combine_rows > c_rows:
      raise ValueError(f"combine_rows must be a power of two <= {c_rows} (the rows rounded up to "
                       f"a power of two, at most the row block {bm}), got {combine_rows}")
    c_rows = combine_rows
  if combine_warps is None:
    combine_warps = int(min(4, max(1, c_rows * combine_cols // 64)))
  n_parts = -(-max(n_table, 1) // block_pages)
  if combine_unroll == "auto":
    unroll = combine_unroll_for(c_rows, combine_cols, n_parts)
  elif isinstance(combine_unroll, str) or int(combine_unroll) < 8 or int(combine_unroll) % 8:
    raise ValueError(f"combine_unroll must be a multiple of 8 or 'auto', got {combine_unroll!r}")
  else:
    unroll = int(combine_unroll)
  n_parts = -(-n_parts // unroll) * unroll      # empty partitions pad the last group
  num_phys = pool_pn.shape[0]
  pool_u16 = pool_pn if pool_pn.dtype == jnp.uint16 else halfword_view(pool_pn)
  if row_pieces(layout.k_type, d, cfg.reads)[0][0] == "words":
    check_words_layout(layout)
    pool_u16 = word_view(pool_u16)                                   # the kernel reads words
    narrow = [n for kind in (layout.k_type, layout.v_type)
              for _, n in _piece_slices(kind, d, cfg.reads) if n < 16]
    if narrow and not interpret:
      raise ValueError(f"reads='words' at head_dim {d} gives a piece of {min(narrow)} columns; "
                       f"compiled dots need >= 16 (head_dim >= 256 for Q8_0 K, 128 for Q4_0 V)")
  kv_len = jnp.asarray(kv_len, jnp.int32)
  if fused_prep is None:
    fused_prep = bool(np.array_equal(k_cols, np.arange(d)))
  if fused_prep:
    if not np.array_equal(k_cols, np.arange(d)):
      raise ValueError(f"fused_prep needs K columns in head-dim order (reads='gather'), "
                       f"got reads={cfg.reads!r}")
    scalars = [jnp.reshape(jnp.asarray(x, jnp.int32), (1,)) for x in (kv_len, tile_begin, tile_end)]
    span_inputs = (*scalars, page_table_t.astype(jnp.int32), q_pos_s.astype(jnp.int32),
                   q_shd.astype(jnp.float32), pool_u16)
  else:
    qf_gmd = _ref.fold_query(q_shd.astype(jnp.float32), g)
    qf_gmd = jnp.pad(qf_gmd, ((0, 0), (0, rows_pad - rows), (0, 0)))
    q_gmk = _to_columns(qf_gmd, k_cols)                              # [G, Mp, Kc] K kernel columns
    q_terms = jnp.stack(_split(q_gmk, plan.q_terms, plan.dtype))     # [terms, G, Mp, Kc]
    qpos_m = jnp.repeat(q_pos_s.astype(jnp.int32), r)
    qpos_m = jnp.pad(qpos_m, (0, rows_pad - rows), constant_values=-1)
    n_active = (kv_len + layout.page_tokens - 1) // layout.page_tokens
    tile_end_c = jnp.minimum(jnp.minimum(jnp.asarray(tile_end, jnp.int32), n_active), n_table)
    meta = jnp.stack([kv_len, jnp.asarray(tile_begin, jnp.int32), tile_end_c,
                      jnp.int32(n_table)]).astype(jnp.int32)
    span_inputs = (meta, page_table_t.astype(jnp.int32), qpos_m, q_terms, pool_u16)

  kern = functools.partial(_span_kernel, layout=layout, cfg=cfg, block_pages=block_pages,
                           num_phys=num_phys, plan=plan, sm_scale=float(scale),
                           interpret=interpret, fused_prep=fused_prep, group=r, num_rows=rows,
                           num_table=n_table)
  m_p, l_p, acc_p = pl.pallas_call(
      kern,
      grid=(n_mb, g, n_parts),
      out_shape=(jax.ShapeDtypeStruct((g, n_parts, rows_pad), jnp.float32),
                 jax.ShapeDtypeStruct((g, n_parts, rows_pad), jnp.float32),
                 jax.ShapeDtypeStruct((g, n_parts, rows_pad, v_cols.shape[0]), jnp.float32)),
      compiler_params=_compiler_params(cfg.num_warps, cfg.num_stages, interpret),
      interpret=interpret,
      name="kvjax_span_attention",
  )(*span_inputs)

  return combine_call(m_p, l_p, acc_p, carry, rows=rows, c_rows=c_rows,
                      combine_cols=combine_cols, combine_warps=combine_warps, unroll=unroll,
                      v_cols=v_cols, head_dim=d, interpret=interpret)


def combine_call(m_p, l_p, acc_p, carry, *, rows: int, c_rows: int, combine_cols: int,
                 combine_warps: int, unroll: int, v_cols: np.ndarray, head_dim: int,
                 interpret: bool, acc_transposed: bool = False) -> _ref.Carry:
  """The pipelined in-order combine (`_combine_kernel`) of a span kernel's partitions, shared by
  the Triton and the Mosaic GPU v2 kernels: m_p, l_p [G, parts, rows_pad], acc_p [G, parts,
  rows_pad, V columns] (column c holds head dim v_cols[c]; parts a multiple of `unroll`), the
  carry (or None: the empty one) -> the folded carry, rows [:rows], dims in order. The grid:
  KV heads x row blocks of c_rows (covering the real rows) x column blocks of combine_cols.
  l_p None: m_p is m and l packed [G, parts, 2, rows_pad]; acc_transposed: acc_p is [G, parts,
  V columns, rows_pad] (the kernel's O^T as it wrote it: no transpose in XLA between)."""
  ml_packed = l_p is None
  g, n_parts, rows_pad = (m_p.shape[0], m_p.shape[1], m_p.shape[-1])
  vc = v_cols.shape[0]
  d = head_dim
  carry_inputs = ()
  if carry is not None:
    pad_m = ((0, 0), (0, rows_pad - rows))
    m_in = jnp.pad(carry.m_gm, pad_m, constant_values=-jnp.inf)
    l_in = jnp.pad(carry.l_gm, pad_m)
    acc_in = _to_columns(jnp.pad(carry.acc_gmd, pad_m + ((0, 0),)), v_cols)  # [G, Mp, Vc]
    if acc_transposed:
      acc_in = jnp.swapaxes(acc_in, 1, 2)                                    # [G, Vc, Mp]
    carry_inputs = (m_in, l_in, acc_in)
  # the combine grid runs over row blocks of the real rows (not the span tile's padding) and
  # column blocks; m/l come back once per column block. Its tiling changes no bit (elementwise).
  n_cb = vc // combine_cols
  n_cm = -(-rows // c_rows)
  m_c, l_c, acc_c = pl.pallas_call(
      functools.partial(_combine_kernel, block_rows=c_rows, block_cols=combine_cols,
                        num_parts=n_parts, unroll=unroll, has_carry=carry is not None,
                        ml_packed=ml_packed, acc_transposed=acc_transposed),
      grid=(g, n_cm, n_cb),
      out_shape=(jax.ShapeDtypeStruct((g, rows_pad, n_cb), jnp.float32),
                 jax.ShapeDtypeStruct((g, rows_pad, n_cb), jnp.float32),
                 jax.ShapeDtypeStruct((g, vc, rows_pad) if acc_transposed else (g, rows_pad, vc),
                                      jnp.float32)),
      compiler_params=_compiler_params(combine_warps, 1, interpret),
      interpret=interpret,
      name="kvjax_span_combine",
  )(m_p, m_p if ml_packed else l_p, acc_p, *carry_inputs)
  if acc_transposed:
    acc_c = jnp.swapaxes(acc_c, 1, 2)                      # (fused into the columns' gather)
  acc = _from_columns(acc_c[:, :rows], v_cols, d)          # kernel columns -> dims
  return _ref.Carry(m_c[:, :rows, 0], l_c[:, :rows, 0], acc)


def span_attention_triton(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, *, layout: PageLayout,
                          block_pages: int = 1, sm_scale: Optional[float] = None,
                          interpret: bool = False, **kw):
  """o_shd [S, H, D] float32 over all active pages (kernel version of the reference)."""
  h = q_shd.shape[1]
  carry = None                   # a fresh call: the combine starts from the empty carry itself
  carry = span_attention_partial_triton(
      q_shd, pool_pn, page_table_t, jnp.asarray(kv_len, jnp.int32), q_pos_s, carry, jnp.int32(0),
      jnp.int32(page_table_t.shape[0]), layout=layout, num_q_heads=h, block_pages=block_pages,
      sm_scale=sm_scale, interpret=interpret, **kw)
  return _ref.finalize(carry, h)
