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
  # the same bytes as ggml's rows; q4_k 5 bits a value against 4.5, q6_k 6.75 against 6.5625
  num, den = {"q4_k": (10, 9), "q6_k": (36, 35)}.get(fmt, (1, 1))
  assert qmm.planes_nbytes(fmt, 8, 512) * den == num * 8 * qmm.row_bytes(fmt, 512)


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
  rows = np.asarray(qweights.random_quantized("q5_k", 2, 256).data)
  with pytest.raises(ValueError, match="^planar weights: format 'q5_k' is not repacked"):
    qmm.to_planes(rows, "q5_k", 256)
  with pytest.raises(ValueError, match=r"^planar weights: q8_0 rows of 64 values need uint8 \[N, 68\], got uint8 \(2, 34\)"):
    qmm.to_planes(np.zeros((2, 34), np.uint8), "q8_0", 64)
  with pytest.raises(ValueError, match="^q4_k: k=96"):
    qmm.to_planes(np.zeros((2, 54), np.uint8), "q4_k", 96)
  values, scales = qmm.to_planes(np.asarray(qweights.random_quantized("q4_k", 4, 512).data), "q4_k", 512)
  x = jnp.ones((1, 512), jnp.float32)
  for call, what in [
      (lambda: qmm.planar_matmul(x, values, scales, "q5_k", 512), "format 'q5_k' is not repacked"),
      (lambda: qmm.planar_matmul(x, scales, values, "q4_k", 512), r"q4_k values for rows of 512 values must be uint8 \[4, 8, 32\], got uint32 \[4, 8, 2\]"),
      (lambda: qmm.planar_matmul(x, values, scales[:2], "q4_k", 512), r"q4_k scales .* must be uint32 \[4, 8, 2\], got uint32 \[2, 8, 2\]"),
      (lambda: qmm.planar_matmul([[1.0] * 512], values, scales, "q4_k", 512), "x must be an array"),
      (lambda: qmm.dequantize_planes(values, scales, "q8_0", 512), "q8_0 values .* must be int8"),
      (lambda: qmm.to_planes(np.zeros((2, 1088), np.uint8), "q8_0", 512.0), "k \\(values a row\\) must be an int, got 512.0"),
      (lambda: qmm.planes_nbytes("q4_k", -1, 512), "n \\(rows\\) must be an int >= 0, got -1")]:
    with pytest.raises(ValueError, match="^planar weights: " + what):
      call()


def test_kept_repacks_the_planar_formats_only(tmp_path):
  """`qweights.kept(impl="planar")` repacks Q4_K (its dequantized rows unchanged); a GGUF is not
  written from planes (one-line error naming the tensor); Q5_K keeps its rows and another product."""
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
  other = qweights.kept(np.asarray(qweights.random_quantized("q5_k", 6, 256).data), "q5_k", 256, impl="planar")
  assert other.impl == "xla" and other.scales is None


def _oracle(x, values, scales, fmt, k, round_bf16):
  """float64 x @ W.T of the planes' weights (rounded to bfloat16 first where the product does)."""
  w = qmm.dequantize_planes(values, scales, fmt, k)
  if round_bf16:
    w = w.astype(jnp.bfloat16).astype(jnp.float32)
  return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


@pytest.mark.parametrize("fmt", qmm.PLANAR_FORMATS)
def test_gemv_kernel_is_the_product_of_its_weights(fmt):
  """The Pallas GEMV (interpreted): grouped (float32 weights, the scale a group), ggml-made weights
  (bfloat16 for bfloat16 x), their dot and the grouped dots (bfloat16 x), rows 1 to 8,
  within float32 summation of a float64 oracle; a K split and several column tiles."""
  from kvjax_pallas.quant_matmul import planar_gemv as pg
  n, k = 48, 1024
  _, values, scales = _planes(fmt, n, k, 6)
  rng = np.random.default_rng(7)
  for grouped, dot in ((1, 0), (0, 0), (0, 1), (1, 2)):
    cfg = pg.PlanarGemvConfig(block_n=16, block_groups=4, min_programs=8, grouped=grouped, dot=dot)
    assert pg.resolve_tiles(cfg, fmt, n, k).split > 1
    for s, dtype in ((1, jnp.float32), (3, jnp.bfloat16), (8, jnp.float32), (8, jnp.bfloat16)):
      if s > pg.max_rows(cfg, fmt, n, k, dtype):
        continue
      assert pg.uses_dot(cfg, fmt, n, k, dtype) == (dot > 0 and dtype == jnp.bfloat16)
      x = jnp.asarray(rng.standard_normal((s, k)), dtype)
      got = np.asarray(pg.planar_gemv(x, values, scales, fmt, k, config=cfg, interpret=True))
      want = _oracle(x.astype(jnp.float32), values, scales, fmt, k, round_bf16=(not grouped or dot == 1) and dtype == jnp.bfloat16)
      scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(qmm.dequantize_planes(values, scales, fmt, k), np.float64)).T
      assert got.shape == (s, n) and np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30), (grouped, s)


@pytest.mark.parametrize("fmt", qmm.PLANAR_FORMATS)
def test_a_rows_sums_do_not_depend_on_the_other_rows(fmt):
  """A decode row and the same row among verify rows give the same bits: the GEMV with 1 and with
  5 rows, and `planar_matmul` ("pallas", interpreted) over 20 rows (GEMV calls of 8) against each
  row alone; the dots' calls of 8 rows against each row alone (as GEMV calls: under the suite's
  unoptimised XLA CPU build an interpreted dot inside a larger program may round otherwise, seen
  once for q6_k at 4.8e-7; on a GPU the kernel is the same compiled program wherever it is called);
  more than KERNEL_ROWS rows run the dequantize-then-dot."""
  from kvjax_pallas.quant_matmul import planar, planar_gemv as pg
  n, k = 32, 512
  rows, values, scales = _planes(fmt, n, k, 8)
  x = jnp.asarray(np.random.default_rng(9).standard_normal((20, k)), jnp.bfloat16)
  five = np.asarray(pg.planar_gemv(x[:5], values, scales, fmt, k, interpret=True))
  one = np.asarray(pg.planar_gemv(x[3:4], values, scales, fmt, k, interpret=True))
  assert np.array_equal(five[3:4], one)
  many = np.asarray(qmm.planar_matmul(x, values, scales, fmt, k, implementation="pallas"))
  alone = np.concatenate([np.asarray(qmm.planar_matmul(x[r:r + 1], values, scales, fmt, k, implementation="pallas"))
                          for r in range(20)])
  assert np.array_equal(many, alone)
  for cfg in (pg.DOT_CONFIG, pg.PlanarGemvConfig(block_n=16, block_groups=4, dot=1)):     # the dots: calls of 8
    eights = np.concatenate([np.asarray(pg.planar_gemv(x[r:r + 8], values, scales, fmt, k, config=cfg, interpret=True))
                             for r in range(0, 20, 8)])
    alone = np.concatenate([np.asarray(pg.planar_gemv(x[r:r + 1], values, scales, fmt, k, config=cfg, interpret=True))
                            for r in range(20)])
    assert np.array_equal(eights, alone)
  wide = jnp.asarray(np.random.default_rng(10).standard_normal((planar.KERNEL_ROWS + 1, k)), jnp.bfloat16)
  assert np.array_equal(np.asarray(qmm.planar_matmul(wide, values, scales, fmt, k, implementation="pallas")),
                        np.asarray(ref.quant_matmul_reference(wide, rows, fmt, k)))


@pytest.mark.parametrize("fmt", qmm.PLANAR_FORMATS)
def test_prefetch_gives_the_same_sums(fmt):
  """The grouped sums with each step's loads issued a step ahead (`prefetch=1`) give the same bits
  as without (several loop steps, a K split, rows 1 and 5)."""
  from kvjax_pallas.quant_matmul import planar_gemv as pg
  n, k = 32, 2048
  _, values, scales = _planes(fmt, n, k, 11)
  base = pg.PlanarGemvConfig(block_n=8, block_groups=2, min_programs=8)
  ahead = pg.PlanarGemvConfig(block_n=8, block_groups=2, min_programs=8, prefetch=1)
  t = pg.resolve_tiles(base, fmt, n, k)
  assert t.steps > 1 and t.split > 1, t
  x = jnp.asarray(np.random.default_rng(12).standard_normal((5, k)), jnp.bfloat16)
  for s in (1, 5):
    a = np.asarray(pg.planar_gemv(x[:s], values, scales, fmt, k, config=base, interpret=True))
    b = np.asarray(pg.planar_gemv(x[:s], values, scales, fmt, k, config=ahead, interpret=True))
    assert np.array_equal(a, b) and np.abs(a).max() > 0, s


@pytest.mark.parametrize("fmt", qmm.PLANAR_FORMATS)
def test_gpu_gemv_prefetch_is_the_same_sums(fmt):
  """Compiled for the GPU (KVJAX_TEST_GPU=1): the grouped sums with and without prefetch give the same
  bits, within float32 rounding of their interpretation (the GPU may contract multiply-adds), at a
  27B-like K (5120), rows 1 and 4."""
  from kvjax_pallas.quant_matmul import planar_gemv as pg
  n, k = 512, 5120
  _, values, scales = _planes(fmt, n, k, 20)
  x = jnp.asarray(np.random.default_rng(21).standard_normal((4, k)), jnp.bfloat16)
  for s in (1, 4):
    a = np.asarray(pg.planar_gemv(x[:s], values, scales, fmt, k))
    b = np.asarray(pg.planar_gemv(x[:s], values, scales, fmt, k, config=pg.PlanarGemvConfig(prefetch=1)))
    assert np.array_equal(a, b), s
    want = np.asarray(pg.planar_gemv(x[:s], values, scales, fmt, k, interpret=True))
    assert np.allclose(a, want, rtol=1e-5, atol=1e-5 * np.abs(want).max()), s


def test_gemv_lowers_for_the_triton_backend():
  """Every planar format's GEMV passes Pallas' Triton lowering for a CUDA target (on a CPU-only
  jaxlib `jax.export` stops before Triton's own compile), one and four rows, both products and the dot."""
  import functools
  import jax
  from jax import export
  from kvjax_pallas.quant_matmul import kernel, planar, planar_gemv as pg
  if kernel._pltriton is None:
    pytest.skip("this jax has no Pallas Triton backend")
  n, k = 1024, 5120
  for fmt in qmm.PLANAR_FORMATS:
    (vs, vd), (ss, sd) = planar.plane_shapes(fmt, n, k)
    for s, dtype, grouped, dot, ahead in ((1, jnp.bfloat16, 1, 0, 0), (4, jnp.float32, 0, 0, 0), (4, jnp.bfloat16, 0, 1, 0),
                                          (1, jnp.bfloat16, 1, 2, 0), (4, jnp.bfloat16, 1, 0, 1)):
      cfg = pg.PlanarGemvConfig(block_n=32 if dot else 8, block_groups=8, grouped=grouped, dot=dot, prefetch=ahead)
      fn = functools.partial(pg._call, fmt=fmt, k=k, cfg=cfg, tiles=pg.resolve_tiles(cfg, fmt, n, k), interpret=False,
                             dot=bool(dot))
      exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
          export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
              jax.ShapeDtypeStruct((s, k), dtype), jax.ShapeDtypeStruct(vs, vd), jax.ShapeDtypeStruct(ss, sd))
      assert "__gpu$xla.gpu.triton" in exp.mlir_module()


def test_gemv_refuses_what_it_cannot_take(monkeypatch):
  from kvjax_pallas.quant_matmul import planar, planar_gemv as pg
  _, values, scales = _planes("q8_0", 16, 256, 1)
  for cfg, what in [(pg.PlanarGemvConfig(block_n=12), "block_n must be a power of two"),
                    (pg.PlanarGemvConfig(split_k=3), "split_k must be 0"),
                    (pg.PlanarGemvConfig(grouped=2), "grouped must be 0 or 1"),
                    (pg.PlanarGemvConfig(split_k=16), "split_k=16 must divide the 8 groups"),
                    (pg.PlanarGemvConfig(dot=1), "block_n must be >= 16 with dot=1"),
                    (pg.PlanarGemvConfig(dot=3), "dot must be 0, 1 or 2"),
                    (pg.PlanarGemvConfig(prefetch=2), "prefetch must be 0 or 1, got 2"),
                    (pg.PlanarGemvConfig(x_blocks=1), "^planar GEMV: x_blocks must be 0"),
                    (pg.PlanarGemvConfig(grouped=0, prefetch=1), "prefetch=1 needs grouped=1 and dot=0")]:
    with pytest.raises(ValueError, match=what):
      pg.planar_gemv(jnp.ones((1, 256)), values, scales, "q8_0", 256, config=cfg, interpret=True)
  with pytest.raises(ValueError, match="planar GEMV: takes 1 to 8 rows of x here, got 9"):
    pg.planar_gemv(jnp.ones((9, 256)), values, scales, "q8_0", 256, interpret=True)
  with pytest.raises(ValueError, match="planar GEMV: takes 1 to 8 rows of x here, got 9"):
    pg.planar_gemv(jnp.ones((9, 256), jnp.bfloat16), values, scales, "q8_0", 256, interpret=True,
                   config=pg.PlanarGemvConfig(block_n=16, dot=1))
  with pytest.raises(ValueError, match="^planar weights: implementation must be one of auto, pallas, pallas_dot, pallas_q8, xla, got 'cuda'"):
    qmm.planar_matmul(jnp.ones((1, 256)), values, scales, "q8_0", 256, implementation="cuda")
  monkeypatch.setenv(planar.PRODUCT_ENV, "triton")
  with pytest.raises(ValueError, match=r"^planar weights: \$KVJAX_PLANAR_PRODUCT must be one of auto, pallas, pallas_dot, pallas_q8, xla, got 'triton'"):
    qmm.planar_matmul(jnp.ones((2, 256)), values, scales, "q8_0", 256)
  msg, param = qweights.request_error(None, None, None, 1)     # load_model's check: whatever the weights
  assert param == "KVJAX_PLANAR_PRODUCT" and msg.endswith("got 'triton'") and "\n" not in msg
  monkeypatch.setenv(planar.PRODUCT_ENV, "")             # set but empty: as unset
  assert planar.resolve_product("auto") == "xla" and qweights.request_error(None, None, None, 1) is None
  monkeypatch.setenv(planar.PRODUCT_ENV, "pallas")
  assert planar.resolve_product("auto") == "pallas" and planar.resolve_product("xla") == "xla"
