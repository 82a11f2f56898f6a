"""The magic-number int8 / int4 -> f16 conversion as PTX, for Mosaic GPU inline code
(`plgpu.inline_mgpu`: the conversions of `mosaic_common` and the kernel lab's probes): one 32-bit
register of quants becomes f16x2 registers with no int->float conversion.

  Q8_0 int8 b -> f16: u = b ^ 0x80 (0..255); prmt puts 0x64 above each byte (f16 1024 + u);
  minus 1152 gives b exactly. 5 instructions a 4 values (xor, 2 prmt, 2 sub.f16x2).
  Q4_0 nibble n -> f16 n - 8: (x >> k) & 0x000F000F | 0x64006400 is f16 1024 + n for the nibbles
  of two bytes at once; minus 1032. 11 instructions a 8 values (3 shifts, 4 lop3, 4 sub.f16x2).

Output registers of one word (bytes B0..B3 of the word, low first; a Q4_0 byte holds nibble n
low, m high): Q8_0 (B0, B1), (B2, B3); Q4_0 (n0, n2), (n1, n3), (m0, m2), (m1, m3).

A conversion lays these registers into a WGMMA-layout lhs as they come, so its columns hold the
head dims in a permuted order; `packed_dims` / `ggml_dims` give that order, and the wgmma rhs rows
(the query) follow it. The scale multiplies are not part of this conversion.
"""

import numpy as np

REGS_PER_WORD = {"q8_0": 2, "q4_0": 4}

PTX = {
    "q8_0": """{
    .reg .b32 u, k, off;
    mov.b32 k, 0x64646464;
    mov.b32 off, 0x64806480;
    xor.b32 u, $2, 0x80808080;
    prmt.b32 $0, u, k, 0x5150;
    prmt.b32 $1, u, k, 0x5352;
    sub.f16x2 $0, $0, off;
    sub.f16x2 $1, $1, off;
    }""",
    "q4_0": """{
    .reg .b32 t1, t2, t3, off;
    mov.b32 off, 0x64086408;
    shr.b32 t1, $4, 8;
    shr.b32 t2, $4, 4;
    shr.b32 t3, $4, 12;
    lop3.b32 $0, $4, 0x000F000F, 0x64006400, 0xea;
    lop3.b32 $1, t1, 0x000F000F, 0x64006400, 0xea;
    lop3.b32 $2, t2, 0x000F000F, 0x64006400, 0xea;
    lop3.b32 $3, t3, 0x000F000F, 0x64006400, 0xea;
    sub.f16x2 $0, $0, off;
    sub.f16x2 $1, $1, off;
    sub.f16x2 $2, $2, off;
    sub.f16x2 $3, $3, off;
    }""",
}


MUL_PTX = "mul.rn.f16x2 $0, $1, $2;"
PRMT_PTX = "prmt.b32 $0, $1, $2, $3;"     # a dynamic selector


def token_pair_ptx(byte: int) -> str:
  """PTX of `convert_token_pair` for quant byte `byte` (0-3) of the two words: outputs $0 (low
  nibbles) and $1 (high nibbles); inputs $2, $3 (the two tokens' words), $4 (their scales)."""
  sel = ((4 + byte) << 8) | byte
  return f"""{{
    .reg .b32 x, y, off;
    mov.b32 off, 0x64086408;
    prmt.b32 x, $2, $3, {hex(sel)};
    shr.b32 y, x, 4;
    lop3.b32 $0, x, 0x000F000F, 0x64006400, 0xea;
    lop3.b32 $1, y, 0x000F000F, 0x64006400, 0xea;
    sub.rn.f16x2 $0, $0, off;
    sub.rn.f16x2 $1, $1, off;
    mul.rn.f16x2 $0, $0, $4;
    mul.rn.f16x2 $1, $1, $4;
    }}"""


def _asm(ptx: str, n_out: int, operands):
  """Inline PTX with n_out 32-bit results and 32-bit operands (MLIR values) -> the i32 results."""
  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  i32 = ir.IntegerType.get_signless(32)
  ops = [mgpu_utils.bitcast(x, i32) for x in operands]
  if n_out == 1:
    return [llvm.inline_asm(i32, ops, ptx, ",".join(["=r"] + ["r"] * len(ops)))]
  res = llvm.inline_asm(llvm.StructType.get_literal([i32] * n_out), ops, ptx,
                        ",".join(["=r"] * n_out + ["r"] * len(ops)))
  return [llvm.extractvalue(i32, res, [r]) for r in range(n_out)]


def as_f16x2(regs):
  """i32 MLIR values -> vector<2xf16> values (the registers of a WGMMA-layout f16 array)."""
  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
  return [mgpu_utils.bitcast(r, f16x2) for r in regs]


def prmt(a, b, selector: int):
  """PTX prmt of two 32-bit values (a: bytes 0-3, b: bytes 4-7) with a static selector."""
  return _asm(f"prmt.b32 $0, $1, $2, {hex(selector)};", 1, [a, b])[0]


def convert_word(kind: str, word, scale=None):
  """One 32-bit register of quants (an MLIR value: i32 or a 4 x i8 vector) -> its f16x2 registers
  (vector<2xf16> values), in the order of the module docstring; scale (an f16x2 register, the
  block scale in both halves) multiplies each value once (round to nearest), as the "f16"
  decode does. Lowering-time code (MLIR)."""
  per = REGS_PER_WORD[kind]
  regs = _asm(PTX[kind], per, [word])
  if scale is not None:
    regs = [_asm(MUL_PTX, 1, [r, scale])[0] for r in regs]
  return as_f16x2(regs)


def convert_token_pair(a, b, scales, byte: int):
  """Q4_0 for a transposed (V^T) lhs: the words of two tokens' quant bytes (a, b) and their
  scales (f16x2: a's, b's) -> 2 f16x2 registers (low nibbles, high nibbles) of byte `byte` of
  each word, each register holding (token a, token b) of one dim, scaled. 10 instructions a 4
  values (prmt, shift, 2 lop3, 2 sub, 2 mul, and the moves of the constants)."""
  return as_f16x2(_asm(token_pair_ptx(byte), 2, [a, b, scales]))


def check_weights(head_dim: int, n: int) -> np.ndarray:
  """W [2, head_dim, n] int64: small integers (K's weights, V's) by head dim, the probes' wgmma
  rhs before it is put in a conversion's column order; with them every float32 sum of the probes
  is an exact integer (or an exact multiple of the scales), checked bit for bit."""
  d = np.arange(head_dim)[:, None]
  return np.stack([(d * 7 + np.arange(n) * 3) % 5 - 2, (d * 5 + np.arange(n)) % 3 - 1]).astype(
      np.int64)


def check_operands(order: str, head_dim: int, n: int):
  """(W [2, head_dim, n] int64 (`check_weights`), the rhs [2, head_dim, n] f16: W's rows in the
  column order of the lhs that the conversion builds, K's (Q8_0) then V's (Q4_0)); order
  "packed" (`packed_dims`) or "ggml" (`ggml_dims`)."""
  dims = {"packed": lambda kind: packed_dims(kind, head_dim),
          "ggml": lambda kind: ggml_dims(kind, head_dim)}[order]
  w = check_weights(head_dim, n)
  return w, np.stack([w[0][dims("q8_0")], w[1][dims("q4_0")]]).astype(np.float16)


def packed_dims(kind: str, width: int) -> np.ndarray:
  """Head dim held by each lhs column (slot) when a packed int8 tile is loaded in Mosaic's
  WGMMA_LAYOUT_8BIT (a lane: 4 consecutive bytes of a row) and converted word by word.
  Slot 16 g + 8 s + 2 c + e of a Q8_0 tile holds byte column 16 g + 4 c + 2 s + e; a Q4_0 slot
  16 (2 G + h) + 8 s + 2 c + e holds the low (h = 0) or high (h = 1) nibble of byte 16 G + 4 c +
  s + 2 e: dim 32 G + 16 h + 4 c + s + 2 e (byte j of a block: dims j and 16 + j, as ggml)."""
  k = np.arange(width)
  e, c, s, g = k % 2, (k // 2) % 4, (k // 8) % 2, k // 16
  if kind == "q8_0":
    return 16 * g + 4 * c + 2 * s + e
  return 32 * (g // 2) + 16 * (g % 2) + 4 * c + s + 2 * e


def ggml_dims(kind: str, head_dim: int = 256) -> np.ndarray:
  """Head dim held by each lhs column when lane c of a row loads the ggml blocks 2c and 2c + 1 of
  the head's row (dims 64 c .. 64 c + 63: 68 / 36 bytes from a 4-byte-aligned start) and converts
  them word by word, the m-th f16x2 register going to the lhs's 8-column group m. Column
  8 m + 2 c + e: Q8_0 dim 64 c + 2 m + e; Q4_0 (word i = m // 4, register r = m % 4 of the word,
  block b = 2 c + i // 4, first byte j0 = 4 (i % 4)) dim 32 b + 16 (r // 2) + j0 + r % 2 + 2 e."""
  if head_dim != 256:
    raise ValueError(f"the ggml magic layout covers head_dim 256 (4 lanes x 2 blocks), not "
                     f"{head_dim}")
  k = np.arange(head_dim)
  e, c, m = k % 2, (k // 2) % 4, k // 8
  if kind == "q8_0":
    return 64 * c + 2 * m + e
  i, r = m // 4, m % 4
  return 32 * (2 * c + i // 4) + 16 * (r // 2) + 4 * (i % 4) + r % 2 + 2 * e


def vt_dims(head_dim: int = 256) -> np.ndarray:
  """Head dim of each row of a transposed Q4_0 lhs (V^T, M-blocks of 64 rows stacked: [head_dim]
  rows) built by `convert_token_pair`: row 64 mb + 16 w + r + 8 h (warp w, lane row r, register
  half h) of M-block mb holds nibble h (0 low, 1 high) of quant byte 4 (8 w + r) + mb of the
  head's 128 (byte j of block b: dims 32 b + j and 32 b + 16 + j, as ggml)."""
  if head_dim != 256:
    raise ValueError(f"the transposed magic layout covers head_dim 256, not {head_dim}")
  rows = np.arange(head_dim)
  mb, rho = rows // 64, rows % 64
  w, h, r = rho // 16, (rho % 16) // 8, rho % 8
  beta = 4 * (8 * w + r) + mb
  return 32 * (beta // 16) + 16 * h + beta % 16
