"""kvjax.quant: byte-exact with ggml's C reference and `gguf.quants`.

References used here:
* `gguf.quants.quantize / dequantize` (numpy, the gguf package);
* `_c_q4_0 / _c_q8_0` below: a scalar, step-by-step float32 transcription of
  the C semantics of `quantize_row_q{4,8}_0_ref` (each operation rounded to
  float32 on its own, as ISO C without FP contraction evaluates it), written
  from the formulas in the brief, not from ggml's source.
"""

import math
import warnings

import gguf
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from hypothesis import given, settings, strategies as st

from kvjax import quant

F32 = np.float32
QTYPE = {"q8_0": GT.Q8_0, "q4_0": GT.Q4_0, "bf16": GT.BF16, "f16": GT.F16, "f32": GT.F32}


def ref_encode(x, kind):
  x = np.asarray(x, np.float32)
  with warnings.catch_warnings(), np.errstate(all="ignore"):
    warnings.simplefilter("ignore")
    if kind == "f32":
      return x.view(np.uint8).reshape(*x.shape[:-1], -1)
    if kind == "f16":
      return x.astype(np.float16).view(np.uint8).reshape(*x.shape[:-1], -1)
    return gguf.quants.quantize(x, QTYPE[kind])


def ref_decode(b, kind):
  if kind == "f16":
    return b.view(np.float16).astype(np.float32)
  return gguf.quants.dequantize(np.asarray(b), QTYPE[kind])


def ours(x, kind):
  return np.asarray(quant.encode_jit(jnp.asarray(np.asarray(x, np.float32)), kind=kind))


def assert_same_bytes(x, kind):
  want, got = ref_encode(x, kind), ours(x, kind)
  assert got.dtype == np.uint8 and got.shape == want.shape
  bad = np.nonzero((got != want).reshape(-1, want.shape[-1]).any(-1))[0]
  assert bad.size == 0, f"{kind}: {bad.size} rows differ, first row {bad[0]}"
  dec = np.asarray(quant.decode_jit(jnp.asarray(got), kind=kind))
  np.testing.assert_array_equal(dec, ref_decode(want, kind))  # NaN == NaN here


# ---- scalar transcription of the C reference -------------------------------

def _c_int8(v):
  """(int8_t)(float) as x86 does it: cvttss2si to int32 (0x80000000 for
  NaN / out of range), keep the low byte."""
  if not math.isfinite(v) or abs(v) >= 2**31:
    i = -(2**31)
  else:
    i = math.trunc(v)
  return ((i + 128) % 256) - 128


def _c_q4_0(block):
  amax, mx = F32(0), F32(0)
  for v in block:
    if amax < abs(v):
      amax, mx = abs(v), v
  d = F32(mx / F32(-8))
  iv = F32(1) / d if d != 0 else F32(0)
  q = []
  for v in block:
    y = F32(F32(v * iv) + F32(8.5))
    q.append(min(15, _c_int8(float(y))) & 0xFF)
  q = np.array(q, np.uint8)
  return np.concatenate([np.array([d], np.float16).view(np.uint8), q[:16] | (q[16:] << 4)])


def _c_roundf(v):
  """roundf: half away from zero (float64 holds |v| + 0.5 exactly here)."""
  if not math.isfinite(v):
    return v
  return math.copysign(math.floor(abs(v) + 0.5), v)


def _c_q8_0(block):
  amax = F32(0)
  for v in block:
    amax = max(amax, abs(v))
  d = F32(amax / F32(127))
  iv = F32(1) / d if d != 0 else F32(0)
  q = np.array([_c_int8(_c_roundf(float(F32(v * iv)))) for v in block], np.int8)
  return np.concatenate([np.array([d], np.float16).view(np.uint8), q.view(np.uint8)])


def c_encode(x, kind):
  fn = _c_q4_0 if kind == "q4_0" else _c_q8_0
  with np.errstate(all="ignore"):
    rows = [fn(b) for b in np.asarray(x, np.float32).reshape(-1, 32)]
  return np.stack(rows)


# ---- inputs ------------------------------------------------------------------

SCALES = [1e-45, 1e-42, 1e-40, 1e-38, 3e-38, 1e-37, 5e-37, 1e-36, 3e-36, 1e-30,
          1e-8, 1e-6, 6e-5, 1e-3, 1.0, 300.0, 6e4, 65504.0, 5e5, 1e7, 1e30, 1e37, 3e38]
KINDS = ["q8_0", "q4_0", "bf16", "f16", "f32"]


@pytest.mark.parametrize("kind", KINDS)
def test_random_many_scales(kind):
  rng = np.random.default_rng(0)
  rows = []
  for s in SCALES:
    g = rng.standard_normal((64, 64)).astype(np.float64) * s
    rows.append(np.clip(g, -3.4e38, 3.4e38).astype(np.float32))
  # Each row mixes scales too (one 32-block per scale pair).
  mix = np.stack([rows[i][0] for i in range(len(SCALES))])
  x = np.concatenate(rows + [mix[:, ::-1].copy(), mix], axis=0)
  x = x.reshape(-1, 64)
  assert_same_bytes(x, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_and_constant(kind):
  x = np.stack([np.zeros(64), -np.zeros(64), np.full(64, 1.0), np.full(64, -1.0),
                np.full(64, 0.1), np.full(64, -3.7e-39), np.full(64, 65504.0)]).astype(np.float32)
  assert_same_bytes(x, kind)
  if kind == "q8_0":
    b = ours(x, kind).reshape(-1, 2, 34)
    assert (b[0, :, 2:] == 0).all() and (b[2, :, 2:] == 127).all()
  if kind == "q4_0":
    b = ours(x, kind).reshape(-1, 2, 18)
    assert (b[0, :, 2:] == 0x88).all()  # all-zero block: q = 8
    assert tuple(b[0, 0, :2]) == (0, 0x80)  # d = 0 / -8 = -0 -> fp16 0x8000
    assert (b[2, :, 2:] == 0x00).all()  # constant +1: d = -1/8, q = 0


def test_q8_0_exact_half_rounds_away_from_zero():
  # amax = 127 -> d = 1, id = 1: x * id is exactly k + 0.5.
  vals = [127.0, -127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 0.49999997, -0.49999997,
          126.5, -126.5, 3.5, 100.5] + [0.0] * 18
  x = np.array(vals, np.float32)[None]
  got = ours(x, "q8_0")[0, 2:].view(np.int8)
  assert list(got[:14]) == [127, -127, 3, -3, 1, -1, 2, -2, 0, 0, 127, -127, 4, 101]
  np.testing.assert_array_equal(ours(x, "q8_0"), c_encode(x, "q8_0"))
  assert_same_bytes(x, "q8_0")


def _q4_tie_blocks():
  """Blocks whose values sit on Q4_0 decision boundaries x*id + 8.5 = k."""
  blocks = []
  for m in [-8.0, 8.0, -24.0, -20.0, -28.0, -24.5, -7.3, 3.0, 1e-3, 1e20]:
    mf = F32(m)
    d = F32(mf / F32(-8))
    iv = F32(1) / d
    xs = [mf]
    for k in range(0, 17):
      x0 = F32((k - 8.5) / float(iv))
      for off in (-2, -1, 0, 1, 2):
        xi = (np.array([x0]).view(np.int32) + off).view(np.float32)[0]
        if abs(xi) <= abs(mf):
          xs.append(xi)
      xs.append(F32((k - 8.5) * float(d)))
    xs = np.array(xs, np.float32)
    for i in range(0, len(xs), 31):
      blk = np.concatenate([[mf], xs[i:i + 31]])
      blocks.append(np.pad(blk, (0, 32 - blk.size)))
  return np.array(blocks, np.float32)


def test_q4_0_ties_follow_c():
  x = _q4_tie_blocks()
  got = ours(x, "q4_0")
  np.testing.assert_array_equal(got, c_encode(x, "q4_0"))
  np.testing.assert_array_equal(got, ref_encode(x, "q4_0"))
  # max = -8 -> d = 1, id = 1: x = 0.5 gives exactly 9.0 -> 9; x = -0.5 gives 8.
  blk = np.zeros(32, np.float32)
  blk[:5] = [-8.0, 0.5, -0.5, 0.49999997, 7.5]
  q = ours(blk[None], "q4_0")[0, 2:]
  nib = np.concatenate([q & 15, q >> 4])
  # 0.49999997 + 8.5 rounds (float32) to 9.0 before truncation: C gives 9.
  assert list(nib[:5]) == [0, 9, 8, 9, 15]


def test_q4_0_two_roundings_not_fma():
  """The one place where "the C reference" is build dependent.

  numpy and ISO C evaluate fl(fl(x*id) + 8.5). A build that contracts the
  multiply-add into an FMA (gcc -ffp-contract=fast on FMA hardware, or the
  NVPTX backend) evaluates fl(x*id + 8.5) once. With m = -24: d = 3,
  id = fl(1/3) = 0.33333334 > 1/3, and x = -22.5 = -7.5 * d gives
  x*id = -7.5000001 exactly, so one rounding yields 0.99999976 -> q = 0,
  while two roundings yield fl(-7.5) + 8.5 = 1.0 -> q = 1. We follow the
  unfused C semantics (and numpy): q = 1.
  """
  blk = np.zeros(32, np.float32)
  blk[0], blk[1] = -24.0, -22.5
  iv = F32(1) / F32(F32(-24.0) / F32(-8))
  exact = float(blk[1]) * float(iv) + 8.5  # float64 holds x*id + 8.5 exactly here
  assert math.trunc(float(np.float32(exact))) == 0  # FMA result
  q = ours(blk[None], "q4_0")[0, 2:]
  assert (q[1] & 15) == 1
  np.testing.assert_array_equal(ours(blk[None], "q4_0"), ref_encode(blk[None], "q4_0"))


def test_numpy_q4_0_equals_c_exhaustively_on_scale():
  """Why gguf's numpy Q4_0 never differs from C for finite 1/d.

  Both compute the same float32 operations in the same order; they differ only
  in `astype(uint8).clip(0, 15)` vs `MIN(15, (int8_t)y)`, which agree for
  y in [0, 17). y = fl(fl(x*id) + 8.5) with |x| <= |m| lies in that range iff
  |fl(m*id)| < 8.5. Check it for every float32 mantissa of m (scale by 2^k is
  exact while d and 1/d stay normal, i.e. |m| in (2^-123, 2^125)).
  """
  m = (np.arange(2**23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)  # [1, 2)
  d = m / F32(-8)
  iv = F32(1) / d
  p = m * iv
  assert p.dtype == np.float32
  assert np.all(np.abs(p + F32(8)) <= F32(2e-6))
  # Values of opposite sign reach -p: y stays below 17 too.
  assert float(np.max(np.float32(-p + F32(8.5)))) < 17.0


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_extreme_inputs_match_c_and_numpy(kind):
  rng = np.random.default_rng(1)
  den = (rng.integers(1, 2**23, (4, 32), dtype=np.int64).astype(np.uint32)).view(np.float32)
  den = den * np.where(rng.random((4, 32)) < 0.5, F32(-1), F32(1))
  blocks = [
      den,                                                         # all denormal
      np.concatenate([den[:, :31], np.full((4, 1), 2**-123, np.float32)], 1),
      np.concatenate([den[:, :31], np.full((4, 1), 2**-119, np.float32)], 1),
      np.where(np.arange(32) % 2 == 0, F32(65504), F32(-65504))[None],  # |min| == |max|, + first
      np.where(np.arange(32) % 2 == 0, F32(-65504), F32(65504))[None],  # - first
      np.where(np.arange(32) % 3 == 0, F32(-1.5), F32(1.5))[None],
      np.full((1, 32), 3.4028235e38, np.float32),
      np.linspace(-3e38, 3e38, 32, dtype=np.float32)[None],
      np.array([[F32(65504 * 127)] + [F32(65504 * 127 * 1.01)] + [1.0] * 30], np.float32),
      np.array([[F32(65504 * 8 * 1.01)] + [1e-40] * 31], np.float32),
      np.array([[1.4e-45] + [0.0] * 31, [-1.4e-45] + [0.0] * 31, [5.6e-45] + [0.0] * 31,
                [7e-45] * 32, [1.2e-38] * 32], np.float32),
  ]
  x = np.concatenate([b.astype(np.float32).reshape(-1, 32) for b in blocks])
  got = ours(x, kind)
  np.testing.assert_array_equal(got, c_encode(x, kind))
  assert_same_bytes(x, kind)
  if kind == "q4_0":  # the sign of the first largest |x| fixes the sign of d
    d = got[[4 * 3, 4 * 3 + 1], :2].copy().view(np.float16)[:, 0].astype(np.float32)
    assert d[0] < 0 < d[1]


def test_codec_is_jittable_and_shape_generic():
  x = jax.random.normal(jax.random.key(0), (3, 5, 64))
  for kind in KINDS:
    f = jax.jit(lambda v, k=kind: quant.decode(quant.encode(v, k), k))
    y = f(x)
    assert y.shape == x.shape and y.dtype == jnp.float32
    enc = quant.encode_jit(x, kind=kind)
    assert enc.shape == (3, 5, quant.nbytes(kind, 64))
    np.testing.assert_array_equal(np.asarray(enc), ref_encode(np.asarray(x), kind))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(quant.decode_jit(enc, kind=kind)))
  # Error bound: Q8_0 within d/2 (+ the fp16 rounding of d).
  err8 = np.abs(np.asarray(quant.decode_jit(quant.encode_jit(x, kind="q8_0"), kind="q8_0")) - np.asarray(x))
  assert err8.max() <= np.abs(np.asarray(x)).max() / 127 * 0.51 + 1e-6
  with pytest.raises(ValueError, match="multiple of 32"):
    quant.encode(jnp.zeros((4, 48)), "q8_0")
  with pytest.raises(ValueError, match="unsupported"):
    quant.encode(jnp.zeros((4, 32)), "q5_0")


FINITE = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, (4, 64), elements=FINITE),
       scale_exp=st.integers(-140, 120))
def test_property_bit_exact(x, scale_exp):
  with np.errstate(all="ignore"):
    xs = np.clip(x.astype(np.float64) * 2.0 ** scale_exp, -3.4e38, 3.4e38).astype(np.float32)
  for kind in ("q8_0", "q4_0", "bf16"):
    assert_same_bytes(xs, kind)
