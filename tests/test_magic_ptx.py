"""kvjax_pallas/span_attention/magic_ptx.py: the PTX of the magic-number conversions, run by the
numpy model of the PTX opcodes (`ptx_model`: mov, xor, shr, prmt, lop3, sub / mul .f16x2), and the lane
addressing of the probes (`mosaic_common.ggml_k_lhs` / `ggml_vt_lhs`, the packed
WGMMA_LAYOUT_8BIT load) replayed in numpy: the lhs columns they build hold exactly the head dims
that `ggml_dims` / `vt_dims` / `packed_dims` say, with ggml_codec's values. The GPU runs check the
same against numpy sums (docs/PERFORMANCE.md); this keeps the CPU side honest."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax_pallas import ggml_codec
import ptx_model

from kvjax_pallas.span_attention import magic_ptx


def _f16x2(x):
  return np.array([x & 0xFFFF, x >> 16], np.uint16).view(np.float16)


def _pack(h):
  b = np.asarray(h, np.float16).view(np.uint16).astype(np.uint64)
  return int(b[0] | (b[1] << 16))


def run_ptx(ptx: str, n_out: int, inputs):
  """`ptx_model.run_ptx` on 32-bit ints: outputs $0..$(n_out-1), inputs after them."""
  ops = {f"${n_out + i}": np.array([int(v) & 0xFFFFFFFF], np.uint32) for i, v in enumerate(inputs)}
  out = ptx_model.run_ptx(ptx, ops)
  return [int(out[f"${i}"][0]) for i in range(n_out)]


def convert_word(kind, word, scale=None):
  regs = run_ptx(magic_ptx.PTX[kind], magic_ptx.REGS_PER_WORD[kind], [word])
  if scale is not None:
    regs = [run_ptx(magic_ptx.MUL_PTX, 1, [r, scale])[0] for r in regs]
  return [_f16x2(r) for r in regs]


def prmt(a, b, sel):
  return run_ptx(f"prmt.b32 $0, $1, $2, {hex(sel)};", 1, [a, b])[0]


def _word(row_bytes, off):
  return int(np.frombuffer(row_bytes[off:off + 4].tobytes(), np.uint32)[0])


def test_convert_word_values_and_order():
  """Each documented register order, on every byte value: Q8_0 (B0, B1), (B2, B3) as int8;
  Q4_0 (n0, n2), (n1, n3), (m0, m2), (m1, m3) minus 8; the scaled form rounds d * q once."""
  for b in range(0, 256, 4):
    w = b | ((b + 1) << 8) | ((b + 2) << 16) | ((b + 3) << 24)
    q = np.array([b, b + 1, b + 2, b + 3], np.uint8).view(np.int8).astype(np.float32)
    got = np.concatenate(convert_word("q8_0", w)).astype(np.float32)
    np.testing.assert_array_equal(got, q)
    n, m = np.array([b, b + 1, b + 2, b + 3]) & 15, np.array([b, b + 1, b + 2, b + 3]) >> 4
    got = np.stack(convert_word("q4_0", w)).astype(np.float32)
    want = np.array([[n[0], n[2]], [n[1], n[3]], [m[0], m[2]], [m[1], m[3]]], np.float32) - 8
    np.testing.assert_array_equal(got, want)
  d = np.float16(0.0371)
  w = 0x80FF7F01                                         # int8 1, 127, -1, -128
  got = np.concatenate(convert_word("q8_0", w, _pack([d, d])))
  np.testing.assert_array_equal(got, (np.float32(d) * np.array([1, 127, -1, -128], np.float32)
                                      ).astype(np.float16))


def test_token_pair_values():
  """`token_pair_ptx(k)`: byte k of two tokens' words -> (low nibbles of a, b) and (high nibbles),
  minus 8, times each token's scale."""
  rng = np.random.default_rng(0)
  a, b = (int(x) for x in rng.integers(0, 2 ** 32, 2))
  sa, sb = np.float16(0.5), np.float16(-0.0625)
  for k in range(4):
    lo, hi = run_ptx(magic_ptx.token_pair_ptx(k), 2, [a, b, _pack([sa, sb])])
    ba, bb = (a >> (8 * k)) & 0xFF, (b >> (8 * k)) & 0xFF
    np.testing.assert_array_equal(_f16x2(lo), np.array([((ba & 15) - 8) * sa, ((bb & 15) - 8) * sb],
                                                       np.float16))
    np.testing.assert_array_equal(_f16x2(hi), np.array([((ba >> 4) - 8) * sa, ((bb >> 4) - 8) * sb],
                                                       np.float16))


def _ggml_rows(kind, tokens, heads, seed):
  x = np.random.default_rng(seed).normal(size=(tokens, heads, 256)).astype(np.float32)
  rows = np.asarray(ggml_codec.encode_rows(jnp.asarray(x), kind))      # [tokens, heads * bytes]
  vals = np.asarray(ggml_codec.decode_rows(jnp.asarray(rows), kind, heads), np.float32)
  return rows, vals


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_ggml_lane_addressing(kind):
  """`mosaic_common.ggml_k_lhs`'s lanes replayed: lane c of a row reads the 4-byte-aligned
  words of blocks 2c and 2c + 1, realigns block 2c's quants with prmt 0x5432, converts each word (scaled), and
  its m-th register fills columns 8 m + 2 c + {0, 1}. The row's columns then hold ggml_codec's
  values (to one f16 rounding) of head dims `ggml_dims(kind)`, on a head that is not the first."""
  per = {"q8_0": 34, "q4_0": 18}[kind]
  rows, vals = _ggml_rows(kind, 2, 3, 1)
  head = 2
  q_words = (per - 2) // 4
  for t in range(2):
    lhs = np.zeros(256, np.float16)
    for c in range(4):
      off = head * 8 * per + c * 2 * per
      words = [_word(rows[t], off + 4 * w) for w in range(2 * per // 4)]
      quants = [prmt(words[w], words[w + 1], 0x5432) for w in range(q_words)] + words[q_words + 1:]
      scales = [prmt(words[0], words[0], 0x1010), prmt(words[q_words], words[q_words], 0x3232)]
      m = 0
      for i, word in enumerate(quants):
        for reg in convert_word(kind, word, scales[i // q_words]):
          lhs[8 * m + 2 * c:8 * m + 2 * c + 2] = reg
          m += 1
    want = vals[t, head, magic_ptx.ggml_dims(kind)]
    np.testing.assert_allclose(lhs.astype(np.float32), want, rtol=1e-3, atol=1e-6)
    np.testing.assert_array_equal(lhs, want.astype(np.float16))   # d * q rounded once


def test_vt_lane_addressing():
  """`mosaic_common.ggml_vt_lhs`'s lanes replayed: lane (warp w, row r, quad c) reads quant
  bytes 4 (8 w + r) .. +3 of the head (two words and prmt with the computed selector) and the block scale for its
  tokens 8 g + 2 c + {0, 1}; byte mb's registers fill M-block mb, rows 16 w + r (+ 8 high
  nibbles), columns 8 g + 2 c + {0, 1}. The stacked M-blocks hold ggml_codec's V values of head
  dims `vt_dims()` for every token."""
  tokens, head = 64, 1
  rows, vals = _ggml_rows("q4_0", tokens, 2, 2)
  rows = np.pad(rows, ((0, 0), (0, 4)))   # an aligned block's unused second word may lie past
  vt = np.zeros((256, tokens), np.float16)
  for w in range(4):
    for r in range(8):
      for c in range(4):
        beta = 4 * (8 * w + r)
        scale_col = head * 144 + 18 * (beta >> 4)
        q_col = scale_col + 2 + (beta & 15)
        sel = 0x3210 + (q_col & 2) * 0x1111
        q_col &= ~3
        for g in range(tokens // 8):
          t0 = 8 * g + 2 * c
          words = [prmt(_word(rows[t], q_col), _word(rows[t], q_col + 4), sel)
                   for t in (t0, t0 + 1)]
          sc = [int(np.frombuffer(rows[t][scale_col:scale_col + 2].tobytes(), np.uint16)[0])
                for t in (t0, t0 + 1)]
          pair = prmt(sc[0], sc[1], 0x5410)
          for mb in range(4):
            lo, hi = run_ptx(magic_ptx.token_pair_ptx(mb), 2, [words[0], words[1], pair])
            vt[64 * mb + 16 * w + r, t0:t0 + 2] = _f16x2(lo)
            vt[64 * mb + 16 * w + r + 8, t0:t0 + 2] = _f16x2(hi)
  want = vals[:, head, :].T[magic_ptx.vt_dims()]
  np.testing.assert_array_equal(vt, want.astype(np.float16))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_packed_lane_order(kind):
  """The packed probe's order: in WGMMA_LAYOUT_8BIT lane c holds bytes 16 G + 4 c .. +3 of a row;
  its word's registers go to 8-column groups per * G + r (per: 2 or 4). The columns then hold
  the packed row's values of head dims `packed_dims`."""
  rng = np.random.default_rng(4)
  cols = 256 if kind == "q8_0" else 128
  row = rng.integers(0, 256, cols, dtype=np.uint8)
  if kind == "q8_0":
    dims_vals = row.view(np.int8).astype(np.float32)
  else:
    blocks = row.reshape(8, 16)
    dims_vals = (np.concatenate([blocks & 15, blocks >> 4], axis=1).reshape(256)
                 .astype(np.float32) - 8)
  per = magic_ptx.REGS_PER_WORD[kind]
  lhs = np.zeros(256, np.float32)
  for g in range(cols // 16):
    for c in range(4):
      for r, reg in enumerate(convert_word(kind, _word(row, 16 * g + 4 * c))):
        col = 8 * (per * g + r) + 2 * c
        lhs[col:col + 2] = reg
  np.testing.assert_array_equal(lhs, dims_vals[magic_ptx.packed_dims(kind, 256)])


def test_dims_are_permutations():
  for f in (magic_ptx.packed_dims("q8_0", 256), magic_ptx.packed_dims("q4_0", 256),
            magic_ptx.ggml_dims("q8_0"), magic_ptx.ggml_dims("q4_0"), magic_ptx.vt_dims()):
    assert sorted(f.tolist()) == list(range(256))
  with pytest.raises(ValueError, match="head_dim 256"):
    magic_ptx.ggml_dims("q8_0", 128)
