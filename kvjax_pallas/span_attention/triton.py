"""Span attention over paged, quantized KV pages: a Pallas kernel, Triton lowering.

`implementation="triton"` (and "auto" on a GPU for the calls the Mosaic GPU kernels do not take):
every K/V pair of `SUPPORTED_PAIRS`, head_dim a multiple of 32, 1-256 query tokens, every
precision of `PRECISIONS`; runs on NVIDIA GPUs, or anywhere with `interpret=True`.

`_span_kernel` runs split-K over fixed LOGICAL partitions of `block_pages` pages. Grid (row
block, KV head, partition). A program reads its partition's pages through the page table (a
plain GMEM ref: no scalar prefetch, which is TPU-only), decodes K and V tile by tile from the raw
page bytes (never a full-precision copy of the cache), and runs one online softmax over the
partition in logical token order. It writes the partition's un-normalised `(m, l, acc)`; the
shared combine (`combine.combine_call`) folds the partitions into the carry in logical order, so
one call equals any sequence of waves whose boundaries are multiples of `block_pages` pages, bit
for bit. No physical page number is looked at except to form an address: the result depends
only on the logical token order (placement invariance).

The program folds, pads and splits the query itself from the caller's q [S, H, D] and q_pos [S]
and clips the page range (no XLA ops before it). Key rows of a partial tile are read from the
last key the row block may see (`min(token, tok_hi - 1)`: real finite data), so no load carries a
per-element predicate; masked keys still get -inf scores and zero weights.

Decoding: page bytes are read as little-endian uint16 halfwords (every ggml block, row and plane
offset is even): [tokens, blocks, halfwords] gathers of each block's data halfwords (one ggml
block = 32 values of the head dimension) and [tokens, blocks, 1] gathers of the scales.
Each halfword decodes to its planes, kept next to each other: Q8_0 its low and high byte (dims
2i, 2i+1 of the block's data halfword i), Q4_0 the nibbles at bits 0, 4, 8, 12 (dims 2i, 2i+16,
2i+1, 2i+17), F16 / BF16 the halfword itself. `column_dims` maps the kernel's columns to head
dims: the query's columns are the head dims in order for every K kind; V's columns go back to
dims after the combine.

A quant becomes an f16 integer without an int->float conversion: `0x6400 | b` is the f16 number
1024 + b, so `(0x6400 | byte) - 1152` is the signed int8 and `(0x6400 | nibble) - 1032` the Q4_0
value, exactly. The block scale multiplies the values, and one dot a tile takes all columns:
scores `[rows, columns] . [tokens, columns]^T`, output `[rows, tokens] . [tokens, columns]`. On
the GPU the "f16" decode of quant pages runs as packed PTX (`decode="asm"`, `_asm_plane`: two
halfwords a 32-bit register, f16x2 sub / mul), with the same bits as the jnp form
(`decode="jnp"`); the interpreter runs the jnp form. `precision` says how the float32 side meets
the tensor cores:

  "f16"    16-bit operands (bf16 for BF16 pages): ~3e-4 relative error, fastest
  "f16x3"  each float32 operand split into a 16-bit head and tail (the exact
           integers / F16 / BF16 values need no tail); three dots (two when one
           side is exact) give float32-class results (~1e-6)
  "tf32"   float32 operands on TF32 tensor cores (~3e-4)
  "ieee"   float32 FMAs (exact float32, slow)

The softmax scale is applied to the scores, not to the query.

Paths (one kernel body, different tiles; see `select_path`):
  "vector"  1-2 query tokens  (decode)             row block 16, key tile 32
  "matrix"  3-8 query tokens  (speculative verify) one row block of <= 64 rows, key tile 32
  "prefill" 9-256 query tokens (chunk vs history)  64-row blocks, causal skip

Tuning knobs (`TritonOptions`, None: the path's default, the measured choice): rows a program,
keys a tile, warps, pipeline stages, the decode form. Partition size: `choose_block_pages` (the
api's block_pages="auto"). Speed on the H200: docs/PERFORMANCE.md, 'Span attention kernels'.
Reads measured slower or no faster are not kept (contiguous windows of a head row, 32-bit words
a block pair, masked loads instead of clamped rows, software prefetch of the next tile, the
query prepared by XLA ops): docs/DESIGN.md.
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

try:  # jax 0.10 / 0.11: the Triton load and inline asm (the Triton backend, deprecated in jax 0.11)
  from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover (a jax without the Triton backend: "reference" only)
  _pltriton = None

from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import combine as _combine
from kvjax_pallas.span_attention import common as _common
from kvjax_pallas.span_attention import partitions as _partitions
from kvjax_pallas.span_attention import reference as _ref

SUPPORTED_PAIRS = (("q8_0", "q4_0"), ("q8_0", "q8_0"), ("f16", "f16"), ("bf16", "bf16"))
MAX_QUERY_ROWS = 256  # query tokens per call (prefill chunk)
PATHS = ("vector", "matrix", "prefill")
PRECISIONS = ("f16", "f16x3", "tf32", "ieee")  # see the module docstring
DEFAULT_PRECISION = "f16"
BLOCK = 32                 # head-dim values per decoded block (the ggml quant block)

# kind -> (halfwords per 32-value block, has an f16 scale in front)
_BLOCK_HW = {"q8_0": (17, True), "q4_0": (9, True), "f16": (32, False), "bf16": (32, False)}
# kind -> the planes decoded from one raw halfword: (operation, shift)
_PLANES = {"q8_0": (("byte", 0), ("byte", 8)),
           "q4_0": (("nibble", 0), ("nibble", 4), ("nibble", 8), ("nibble", 12)),
           "f16": (("raw", 0),), "bf16": (("raw", 0),)}
DECODES = ("asm", "jnp")   # how quant halfwords become f16 values, see `decode_blocks`
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


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def column_dims(kind: str, head_dim: int) -> np.ndarray:
  """[columns] int: the head dim of each kernel column of a decoded K or V tile.

  Columns run block by block, data halfword by halfword, and within a halfword plane by plane
  (`_PLANES`: Q8_0 low then high byte, Q4_0 the nibbles at bits 0, 4, 8, 12); every kind gives
  head_dim columns.
  """
  per, scaled = _BLOCK_HW[kind]
  nb = head_dim // BLOCK
  blk = np.repeat(np.arange(nb), per - int(scaled))                # block of each data halfword
  i = np.tile(np.arange(per - int(scaled)), nb)                    # its data halfword
  planes = []
  for op, shift in _PLANES[kind]:
    if op == "byte":                               # Q8_0: bytes 2i, 2i+1 are dims 2i, 2i+1
      dim = 2 * i + shift // 8
    elif op == "nibble":                           # Q4_0: qs[j] & 15 -> j, qs[j] >> 4 -> j + 16
      dim = 2 * i + (shift // 8) + 16 * ((shift // 4) % 2)
    else:                                          # F16 / BF16: halfword = dim
      dim = i
    planes.append(blk * BLOCK + dim)
  return np.stack(planes, axis=-1).reshape(-1).astype(np.int64)   # halfword-major, plane-minor


@dataclasses.dataclass(frozen=True)
class TritonOptions:
  """Tuning knobs of the Triton kernel; None takes the path's default (`tile_config`), the
  measured choice (docs/PERFORMANCE.md, 'Span attention kernels'). No knob changes the contract;
  the decode form changes no bit."""
  block_rows: Optional[int] = None    # folded query rows a program: a power of two >= 16
  block_tokens: Optional[int] = None  # keys a tile (capped at the page's power-of-two divisor)
  num_warps: Optional[int] = None
  num_stages: Optional[int] = None
  decode: Optional[str] = None        # `DECODES`: "asm" (packed PTX) or "jnp"


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """The resolved tiles of a call (`tile_config`)."""
  path: str
  block_rows: int     # BM: folded query rows per program
  block_tokens: int   # BT: keys per inner step (divides page_tokens)
  num_warps: int
  num_stages: int
  decode: str = DEFAULT_DECODE  # `DECODES`; the interpreter runs "jnp"


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
                options: TritonOptions = TritonOptions()) -> TileConfig:
  """Tile sizes of a path. `group` = query heads per KV head (rows per token).

  options.block_rows: folded query rows per program (a power of two >= 16); rows past it go to
  more row blocks, which read the same pages (grid order puts them next to each other).
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
    bm, bt, nw, ns = min(64, max(16, _next_pow2(rows))), 64, 4, 1
  elif path == "matrix":
    bm, bt, nw, ns = min(64, max(16, _next_pow2(rows))), 32, 4, 1
  else:
    bm, bt, nw, ns = min(32, max(16, _next_pow2(rows))), 32, 4, 1
  if options.block_rows is not None:
    if options.block_rows < 16 or options.block_rows & (options.block_rows - 1):
      raise ValueError(f"block_rows must be a power of two >= 16, got {options.block_rows}")
    bm = min(options.block_rows, max(16, _next_pow2(rows)))
  bt = options.block_tokens or bt
  bt = min(bt, _largest_pow2_divisor(page_tokens))
  if bt < 16:
    raise ValueError(f"page_tokens {page_tokens} needs a power-of-two divisor >= 16 for key tiles")
  decode = options.decode or DEFAULT_DECODE
  if decode not in DECODES:
    raise ValueError(f"unknown decode {decode!r}; choose one of {DECODES}")
  return TileConfig(path, bm, bt, options.num_warps or nw, options.num_stages or ns, decode)


def ctas_per_sm(block_rows: int) -> int:
  """CTAs one SM holds at the row tile's register count (by ncu on the H200: the 16-row tile
  uses 128 registers, so 4 CTAs; the 64-row tile 226, so 2; the 32-row tile is taken as 3)."""
  return {16: 4, 32: 3}.get(block_rows, 2)


def choose_block_pages(num_pages: int, num_kv_heads: int, num_tokens: int, group: int,
                       num_sms: int = _partitions.DEFAULT_NUM_SMS, path: Optional[str] = None,
                       options: TritonOptions = TritonOptions()) -> int:
  """Logical partition size (pages) for a call over `num_pages` pages, a pure function: KV heads
  x row blocks CTAs a partition, `ctas_per_sm` of them an SM, `partitions.fewest_rounds`."""
  # only the row tile matters here; any page size with a power-of-two divisor >= 16 will do
  cfg = tile_config(num_tokens, group, 16, path, options)
  n_mb = -(-num_tokens * group // cfg.block_rows)
  return _partitions.fewest_rounds(num_pages, n_mb * num_kv_heads, ctas_per_sm(cfg.block_rows),
                                   num_sms)


def _largest_pow2_divisor(n: int) -> int:
  return n & -n


def check_layout(layout: PageLayout, head_dim: int):
  """Raise ValueError for a page layout the Triton kernel does not take."""
  pair = (layout.k_type, layout.v_type)
  if pair not in SUPPORTED_PAIRS:
    raise ValueError(f"unsupported K/V pair {layout.k_type.upper()}/{layout.v_type.upper()}; "
                     f"the Triton kernel supports "
                     f"{', '.join(k.upper() + '/' + v.upper() for k, v in SUPPORTED_PAIRS)}")
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
  """Masked gather `ref[idx]` (the Triton load, `jax.experimental.pallas.triton.load`: jax 0.10
  and 0.11 have no `pl.load`; the CPU interpreter runs it too); mask None: plain."""
  if mask is None:
    return _pltriton.load(ref.at[idx])
  return _pltriton.load(ref.at[idx], mask=mask, other=other)


def load_blocks(pool_ref, phys, row_hw, kind: str, head_dim: int):
  """The kernel's load (inside a Pallas Triton kernel; `kernel_lab.probe_page_reads` times it
  alone): raw halfwords of a tile of head rows of page `phys`, row_hw [BT, 1] int32 halfword
  offset of each token's head row -> (data [BT, blocks, data halfwords] uint16, scale [BT,
  blocks, 1] uint16 (f16 bits) or None for F16 / BF16): gathers of 2-byte loads (ggml blocks of
  17 / 9 halfwords start at any halfword)."""
  per, scaled = _BLOCK_HW[kind]
  nb = head_dim // BLOCK
  rows3 = row_hw[:, :, None]                       # [BT, 1, 1]
  w = per - int(scaled)                            # 16 (q8_0), 8 (q4_0), 32 (f16/bf16)
  blk = lax.broadcasted_iota(jnp.int32, (1, nb, 1), 1) * per
  col = lax.broadcasted_iota(jnp.int32, (1, 1, w), 2) + int(scaled)
  data = _masked_load(pool_ref, (phys, rows3 + blk + col), None, 0)
  scale = None
  if scaled:
    scale = _masked_load(pool_ref, (phys, rows3 + blk), None, 0)
  return data, scale


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

def decode_blocks(data, scale, kind: str, f32: bool, asm: bool = False):
  """The kernel's decode: raw halfwords [BT, n, w] u16 + scales -> values [BT, n * w * planes]
  (kernel columns: element by element, plane by plane within an element, `_PLANES`).

  f32=False: f16 (bf16 for BF16 pages), each value rounded once (the "f16" operand);
  f32=True: float32, exact (the source of "f16x3" heads / tails and "tf32" / "ieee").
  asm=True (f16 values of quant pages only): the same bits from the packed PTX of `_asm_plane`.
  """
  bt, n, w = data.shape
  planes = _PLANES[kind]
  if planes[0][0] == "raw":
    src = jnp.float16 if kind == "f16" else jnp.bfloat16
    v = lax.bitcast_convert_type(data, src).reshape(bt, n * w)
    return v.astype(jnp.float32) if f32 else v
  sc = lax.bitcast_convert_type(scale, jnp.float16)
  if asm and not f32:   # GPU only: one single-result asm a plane (see `_asm_plane`)
    sc = jnp.broadcast_to(sc, data.shape)
    out = jax.ShapeDtypeStruct(data.shape, jnp.float16)
    vals = [_pltriton.elementwise_inline_asm(_asm_plane(kind, p), args=[data, sc],
                                             constraints=_ASM_CONSTRAINTS, pack=2,
                                             result_shape_dtypes=[out])[0]
            for p in range(len(planes))]
  else:
    x = data.astype(jnp.int32)
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
    return [decode_blocks(data, scale, kind, True)]
  if plan.kv_terms == 1:
    return [decode_blocks(data, scale, kind, False, asm)]
  return _split(decode_blocks(data, scale, kind, True), plan.kv_terms, plan.dtype)


def _span_kernel(kv_ref, begin_ref, end_ref, tab_ref, qpos_ref, q_ref, pool_ref,   # inputs
                 m_out, l_out, acc_out,                                          # outputs
                 *, layout: PageLayout, cfg: TileConfig, block_pages: int, num_phys: int,
                 plan: OperandPlan, sm_scale: float, interpret: bool, group: int, num_rows: int,
                 num_table: int):
  # kv_ref, begin_ref, end_ref [1] i32 (kv_len, tile_begin, tile_end), tab_ref [T] i32,
  # qpos_ref [S] i32, q_ref [S, H, D] f32 (the caller's query: folded, padded and split here),
  # pool_ref [P, page_hw] u16
  # -> m_out, l_out [G, parts, Mp], acc_out [G, parts, Mp, D] f32 (V kernel columns)
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
  asm = cfg.decode == "asm" and not interpret    # the interpreter cannot run PTX
  rows = pl.ds(mb * bm, bm)
  kv_len = kv_ref[0]
  tile_begin = begin_ref[0]
  n_active = (kv_len + pt - 1) // pt
  tile_end = jnp.minimum(jnp.minimum(end_ref[0], n_active), num_table)
  m_idx = mb * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)      # folded row
  real = m_idx < num_rows
  tok = jnp.where(real, m_idx // group, 0)                          # its query token
  head = g * group + m_idx % group                                  # its query head
  qpos = jnp.where(real, _masked_load(qpos_ref, (tok,), real, 0), -1)   # [BM] (-1: padding)
  dims = lax.broadcasted_iota(jnp.int32, (1, d), 1)
  q_bd = _masked_load(q_ref, (tok[:, None], head[:, None], dims),
                      jnp.broadcast_to(real[:, None], (bm, d)), 0.0)     # [BM, D] f32
  q_terms = _split(q_bd, plan.q_terms, plan.dtype)  # K's columns are the head dims in order

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
    """Raw halfwords of key tile i; rows past the causal end re-read the last row it may read
    (in the page, finite)."""
    t0 = tok_lo + i * bt
    lp = jnp.minimum(t0 // pt, num_table - 1)
    phys = jnp.clip(tab_ref[lp], 0, num_phys - 1)
    in_page = t0 - (t0 // pt) * pt + t_iota               # [BT, 1] token row within the page
    last = jnp.clip(tok_hi - 1 - (t0 // pt) * pt, 0, pt - 1)
    in_page = jnp.minimum(in_page, last)
    k_row = in_page * k_row_hw + g * k_head_hw
    v_row = v_base_hw + in_page * v_row_hw + g * v_head_hw
    return (load_blocks(pool_ref, phys, k_row, kk, d), load_blocks(pool_ref, phys, v_row, vk, d))

  def body(i, carry):
    m_i, l_i, acc = carry
    k_raw, v_raw = load_tile(i)
    t0 = tok_lo + i * bt
    s = None
    k_terms = _value_terms(*k_raw, kk, plan, asm)          # [BT, D] each
    for a, b in plan.pairs():
      part = _dot_nt(q_terms[a], k_terms[b], prec)        # [BM, BT]
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
    v_terms = _value_terms(*v_raw, vk, plan, asm)
    upd = None
    for a, b in plan.pairs():
      part = _dot_nn(p_terms[a], v_terms[b], prec)        # [BM, D]
      upd = part if upd is None else upd + part
    # (skipping acc * alpha when no row max moved was measured slower)
    return m_new, l_new, acc * alpha[:, None] + upd

  init = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32),
          jnp.zeros((bm, d), jnp.float32))
  m_f, l_f, acc = lax.fori_loop(0, n_tiles, body, init)
  m_out[g, pp, rows] = m_f
  l_out[g, pp, rows] = l_f
  acc_out[g, pp, rows, pl.ds(0, d)] = acc


@functools.partial(jax.jit, static_argnames=(
    "layout", "num_q_heads", "block_pages", "sm_scale", "interpret", "precision", "path",
    "options"))
def span_attention_partial_triton(q_shd, pool_pn, page_table_t, kv_len, q_pos_s,
                                  carry: Optional[_ref.Carry], tile_begin, tile_end, *,
                                  layout: PageLayout, num_q_heads: int, block_pages: int = 1,
                                  sm_scale: Optional[float] = None, interpret: bool = False,
                                  precision: str = DEFAULT_PRECISION, path: Optional[str] = None,
                                  options: TritonOptions = TritonOptions()) -> _ref.Carry:
  """Kernel version of `reference.span_attention_partial_reference` (same contract; carry=None:
  the empty carry, not read from memory: the same bits). The combine's tiles: the real rows
  rounded up to a power of two (at most the row block) x 32 V columns."""
  s_tok, h, d = q_shd.shape
  g = layout.num_kv_heads
  _common.check_call(q_shd, pool_pn, layout, num_q_heads, block_pages, check_layout)
  r = h // g
  cfg = tile_config(s_tok, r, layout.page_tokens, path, options)
  plan = _operand_plan(precision, layout, interpret)
  scale = (1.0 / d ** 0.5) if sm_scale is None else sm_scale
  bm = cfg.block_rows
  rows = s_tok * r
  rows_pad = -(-rows // bm) * bm
  n_mb = rows_pad // bm
  n_table = page_table_t.shape[0]
  v_cols = column_dims(layout.v_type, d)
  num_parts = -(-max(n_table, 1) // block_pages)
  tiles = _combine.default_tiles(min(bm, _next_pow2(rows)), BLOCK, num_parts)
  n_parts = tiles.padded_parts(num_parts)           # empty partitions pad the last load group
  num_phys = pool_pn.shape[0]
  pool_u16 = pool_pn if pool_pn.dtype == jnp.uint16 else _common.halfword_view(pool_pn)
  kv_len = jnp.asarray(kv_len, jnp.int32)
  scalars = [jnp.reshape(jnp.asarray(x, jnp.int32), (1,)) for x in (kv_len, tile_begin, tile_end)]
  kern = functools.partial(_span_kernel, layout=layout, cfg=cfg, block_pages=block_pages,
                           num_phys=num_phys, plan=plan, sm_scale=float(scale),
                           interpret=interpret, group=r, num_rows=rows, num_table=n_table)
  m_p, l_p, acc_p = pl.pallas_call(
      kern,
      grid=(n_mb, g, n_parts),
      out_shape=(jax.ShapeDtypeStruct((g, n_parts, rows_pad), jnp.float32),
                 jax.ShapeDtypeStruct((g, n_parts, rows_pad), jnp.float32),
                 jax.ShapeDtypeStruct((g, n_parts, rows_pad, d), jnp.float32)),
      compiler_params=_common.triton_params(cfg.num_warps, cfg.num_stages, interpret),
      interpret=interpret,
      name="kvjax_span_attention",
  )(*scalars, page_table_t.astype(jnp.int32), q_pos_s.astype(jnp.int32),
    q_shd.astype(jnp.float32), pool_u16)
  return _combine.combine_call(m_p, l_p, acc_p, carry, rows=rows, tiles=tiles, v_cols=v_cols,
                               head_dim=d, interpret=interpret)


def span_attention_triton(q_shd, pool_pn, page_table_t, kv_len, q_pos_s, *, layout: PageLayout,
                          block_pages: int = 1, sm_scale: Optional[float] = None,
                          interpret: bool = False, precision: str = DEFAULT_PRECISION,
                          path: Optional[str] = None, options: TritonOptions = TritonOptions()):
  """o_shd [S, H, D] float32 over all active pages (kernel version of the reference)."""
  return _common.whole_span(span_attention_partial_triton, q_shd, pool_pn, page_table_t, kv_len,
                            q_pos_s, layout=layout, block_pages=block_pages, sm_scale=sm_scale,
                            interpret=interpret, precision=precision, path=path, options=options)
