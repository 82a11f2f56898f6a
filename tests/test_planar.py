"""kvjax_pallas.quant_matmul.planar: ggml blocks repacked into planes hold the same numbers
(dequantized bit for bit as ggml's rows), and the planar product is the reference's: a decode row
(the multiply-and-sum) within float32 rounding, more rows (dequantize, then the dot) bit for bit."""

import numpy as np
import jax.numpy as jnp
import pytest

from kvjax import qweights
from kvjax_pallas.quant_matmul import api as qmm, reference as ref


def _planes(fmt, n, k, seed=0):
  w = qweights.random_quantized(fmt, n, k, seed=seed)
  values, scales = qmm.to_planes(np.asarray(w.data), fmt, k)
  return jnp.asarray(w.data), jnp.asarray(values), jnp.asarray(scales)


@pytest.mark.parametrize("fmt", qmm.PLANAR_FORMATS)
def test_planes_dequantize_as_ggml_rows_bit_for_bit(fmt):
  for n, k, seed in ((24, 512, 1), (3, 256, 2)):
    rows, values, scales = _planes(fmt, n, k, seed)
    got = np.asarray(qmm.dequantize_planes(values, scales, fmt, k))
    want = np.asarray(ref.dequantize(rows, fmt, k))
    assert np.abs(want).max() > 0 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert values.nbytes + scales.nbytes == qmm.planes_nbytes(fmt, n, k)
  if fmt != "q4_k":   # the same bytes as ggml's rows; q4_k 6 bits a value against 4.5
    assert qmm.planes_nbytes(fmt, 8, 512) == 8 * qmm.row_bytes(fmt, 512)
  else:
    assert qmm.planes_nbytes(fmt, 8, 512) * 3 == 4 * 8 * qmm.row_bytes(fmt, 512)


@pytest.mark.parametrize("fmt", qmm.PLANAR_FORMATS)
def test_planar_product_is_the_references(fmt):
  n, k = 40, 512
  rows, values, scales = _planes(fmt, n, k, 3)
  rng = np.random.default_rng(4)
  for s in (1, 2, 5):
    x = jnp.asarray(rng.standard_normal((s, k)), jnp.float32)
    got = np.asarray(qmm.planar_matmul(x, values, scales, fmt, k))
    want = np.asarray(ref.quant_matmul_reference(x, rows, fmt, k))
    assert got.shape == (s, n)
    if s <= 1:   # one multiply-and-sum: float32 sums in another order
      assert 0 < np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    else:        # dequantize, then the reference's dot
      assert np.array_equal(got, want)
  xb = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)   # the dot's bf16 products, float32 sums
  got = np.asarray(qmm.planar_matmul(xb, values, scales, fmt, k))
  want = np.asarray(ref.quant_matmul_reference(xb, rows, fmt, k))
  exact = np.asarray(ref.quant_matmul_reference(xb.astype(jnp.float32), rows, fmt, k))
  assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max() < np.abs(exact - want).max()


def test_what_planes_cannot_take_is_refused():
  rows = np.asarray(qweights.random_quantized("q6_k", 2, 256).data)
  with pytest.raises(ValueError, match="^planar weights: format 'q6_k' is not repacked"):
    qmm.to_planes(rows, "q6_k", 256)
  with pytest.raises(ValueError, match=r"^planar weights: q8_0 rows of 64 values need uint8 \[N, 68\], got uint8 \(2, 34\)"):
    qmm.to_planes(np.zeros((2, 34), np.uint8), "q8_0", 64)
  with pytest.raises(ValueError, match="^q4_k: k=96"):
    qmm.to_planes(np.zeros((2, 54), np.uint8), "q4_k", 96)
  values, scales = qmm.to_planes(np.asarray(qweights.random_quantized("q4_k", 4, 512).data), "q4_k", 512)
  x = jnp.ones((1, 512), jnp.float32)
  for call, what in [
      (lambda: qmm.planar_matmul(x, values, scales, "q6_k", 512), "format 'q6_k' is not repacked"),
      (lambda: qmm.planar_matmul(x, scales, values, "q4_k", 512), r"q4_k values for rows of 512 values must be uint8 \[4, 8, 32\], got float32"),
      (lambda: qmm.planar_matmul(x, values, scales[:2], "q4_k", 512), r"q4_k scales .* must be float32 \[4, 2, 16\], got float32 \[2, 2, 16\]"),
      (lambda: qmm.planar_matmul([[1.0] * 512], values, scales, "q4_k", 512), "x must be an array"),
      (lambda: qmm.dequantize_planes(values, scales, "q8_0", 512), "q8_0 values .* must be int8"),
      (lambda: qmm.to_planes(np.zeros((2, 1088), np.uint8), "q8_0", 512.0), "k \\(values a row\\) must be an int, got 512.0"),
      (lambda: qmm.planes_nbytes("q4_k", -1, 512), "n \\(rows\\) must be an int >= 0, got -1")]:
    with pytest.raises(ValueError, match="^planar weights: " + what):
      call()


def test_kept_repacks_the_planar_formats_only(tmp_path):
  """`qweights.kept(impl="planar")` repacks Q4_K (its dequantized rows unchanged); a GGUF is not
  written from planes (one-line error naming the tensor); Q6_K keeps its rows and another product."""
  w = qweights.random_quantized("q4_k", 6, 256, seed=5)
  planar = qweights.kept(np.asarray(w.data), "q4_k", 256, impl="planar")
  assert planar.impl == "planar" and planar.scales is not None and planar.shape == (6, 256)
  assert np.array_equal(np.asarray(planar.dequantize()), np.asarray(w.dequantize()))
  assert np.array_equal(np.asarray(planar[jnp.asarray([4, 1])]), np.asarray(w.dequantize())[[4, 1]])
  from kvjax import config as config_lib, gguf_io, weights as weights_lib
  cfg = config_lib.tiny()
  tensors = weights_lib.random_tensors(cfg, 0)
  n, k = tensors["blk.0.ffn_up.weight"].shape
  tensors["blk.0.ffn_up.weight"] = qweights.kept(np.asarray(qweights.random_quantized("q8_0", n, k).data), "q8_0", k,
                                                 impl="planar")
  with pytest.raises(gguf_io.GGUFError, match="blk.0.ffn_up.weight: weights repacked into planes"):
    gguf_io.write_gguf(str(tmp_path / "planar.gguf"), cfg, tensors)
  other = qweights.kept(np.asarray(qweights.random_quantized("q6_k", 6, 256).data), "q6_k", 256, impl="planar")
  assert other.impl == "xla" and other.scales is None
