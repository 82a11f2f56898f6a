"""kvjax_pallas.quant_matmul.planar_q8: x's int8 blocks are ggml-style (d = max|x| / 127, q =
round(x / d)); the dp4a GEMV (interpreted) is its plain-jnp reference within float32 rounding, is the
float32-weights product within x's rounding, and a row's sums never depend on the call's other rows."""

import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from kvjax import qweights
from kvjax_pallas.quant_matmul import api as qmm, planar, planar_gemv as pg, planar_q8 as pq


def _planes(fmt, n, k, seed=0):
  w = qweights.random_quantized(fmt, n, k, seed=seed)
  values, scales = qmm.to_planes(np.asarray(w.data), fmt, k)
  return jnp.asarray(values), jnp.asarray(scales)


def test_x_blocks_are_int8_with_one_scale_a_block():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 128)).astype(np.float32)
  x[1, 32:64] = 0.0                                               # an all-zero block
  words, d, sums, qsums = (np.asarray(a) for a in pq.quantize_x(jnp.asarray(x)))
  q = words.view(np.int8).reshape(3, 4, 32).astype(np.int64)     # little-endian bytes: value order
  xb = x.reshape(3, 4, 32)
  amax = np.abs(xb).max(-1)
  np.testing.assert_allclose(d, amax / np.float32(127), rtol=3e-7, atol=0)   # XLA may divide by a reciprocal
  assert d[1, 1] == 0 and not q[1, 1].any()
  assert np.abs(q).max() == 127 and np.all(np.abs(q) <= 127)
  nz = d > 0
  assert np.all(np.abs(q - xb / np.where(nz, d, 1)[..., None])[nz] <= 0.5 + 1e-4)   # round(x / d)
  np.testing.assert_allclose(sums, xb.sum(-1), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(qsums, q.reshape(3, 8, 16).sum(-1))


def test_dp4a_as_interpreted_is_the_bytes_dot():
  rng = np.random.default_rng(1)
  a = rng.integers(-2**31, 2**31, (64,), dtype=np.int64).astype(np.int32)
  b = rng.integers(-2**31, 2**31, (64,), dtype=np.int64).astype(np.int32)
  bs = b.view(np.int8).reshape(64, 4).astype(np.int64)
  for signed in (False, True):
    av = (a.view(np.int8) if signed else a.view(np.uint8)).reshape(64, 4).astype(np.int64)
    got = np.asarray(pq._dp4a(jnp.asarray(a), jnp.asarray(b), signed, True))   # pylint: disable=protected-access
    np.testing.assert_array_equal(got, (av * bs).sum(-1))


@pytest.mark.parametrize("fmt", qmm.PLANAR_FORMATS)
def test_q8_gemv_is_its_reference_and_the_float_product_within_xs_rounding(fmt):
  """Rows 1 to 8, float32 and bfloat16 x, a K split and several column tiles: within float32 rounding
  of the plain-jnp reference; within x's rounding (half a block's d a value) of a float64 oracle of
  the planes' float32 weights."""
  n, k = 48, 1024
  values, scales = _planes(fmt, n, k, 6)
  w = np.asarray(qmm.dequantize_planes(values, scales, fmt, k), np.float64)
  cfg = pg.PlanarGemvConfig(block_n=16, block_groups=2, min_programs=8)
  assert pg.resolve_tiles(cfg, fmt, n, k).split > 1
  rng = np.random.default_rng(7)
  for s, dtype in ((1, jnp.float32), (3, jnp.bfloat16), (8, jnp.float32)):
    x = jnp.asarray(rng.standard_normal((s, k)), dtype)
    got = np.asarray(pq.planar_q8_gemv(x, values, scales, fmt, k, config=cfg, interpret=True))
    want = np.asarray(pq.planar_q8_reference(x, values, scales, fmt, k), np.float64)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    scale = np.abs(x64) @ np.abs(w).T
    assert got.shape == (s, n) and np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30), s
    half_d = np.repeat(np.abs(x64).reshape(s, k // 32, 32).max(-1) / 254.0, 32, axis=1)   # x's rounding a value
    bound = half_d @ np.abs(w).T
    err = np.abs(got - x64 @ w.T)
    assert np.all(err <= bound * 1.001 + 1e-5 * scale) and err.max() > 1e-3 * bound.max(), s


@pytest.mark.parametrize("fmt", qmm.PLANAR_FORMATS)
def test_q8_rows_sums_do_not_depend_on_the_other_rows(fmt):
  """A GEMV call of 8 rows and each row alone (x's blocks made first, the default, and by each
  program); `planar_matmul("pallas_q8")` over 20 rows (calls of 8)."""
  n, k = 32, 512
  values, scales = _planes(fmt, n, k, 8)
  x = jnp.asarray(np.random.default_rng(9).standard_normal((20, k)), jnp.bfloat16)
  for cfg in (pq.DEFAULT_CONFIG, pq.NARROW_CONFIG, pq.IN_KERNEL_CONFIG):
    eight = np.asarray(pq.planar_q8_gemv(x[:8], values, scales, fmt, k, config=cfg, interpret=True))
    for r in (0, 5):
      assert np.array_equal(eight[r:r + 1], np.asarray(pq.planar_q8_gemv(x[r:r + 1], values, scales, fmt, k, config=cfg,
                                                                         interpret=True))), cfg
  many = np.asarray(qmm.planar_matmul(x, values, scales, fmt, k, implementation="pallas_q8"))
  alone = np.concatenate([np.asarray(qmm.planar_matmul(x[r:r + 1], values, scales, fmt, k, implementation="pallas_q8"))
                          for r in range(20)])
  assert np.array_equal(many, alone)
  assert np.array_equal(many[:8], np.asarray(pq.planar_q8_gemv(x[:8], values, scales, fmt, k, interpret=True)))


def test_x_blocks_kernel_is_quantize_x():
  """The Pallas quantizer (interpreted): the words, d and sums of q of `quantize_x`, each unit's sum
  of x within float32 rounding of numpy's; several programs a row (K of 17 * 1024 values)."""
  rng = np.random.default_rng(15)
  for s, k, dtype in ((3, 17 * 1024, jnp.bfloat16), (1, 256, jnp.float32)):
    x = rng.standard_normal((s, k)).astype(np.float32)
    x[0, :32] = 0.0                                            # an all-zero block: d 0, q 0
    xj = jnp.asarray(x, dtype)
    words, d, xs, xq = (np.asarray(a) for a in pq.quantize_x_blocks(xj, interpret=True))
    w_ref, d_ref, _, q_ref = (np.asarray(a) for a in pq.quantize_x(xj))
    np.testing.assert_array_equal(words, w_ref)
    np.testing.assert_array_equal(d, d_ref)
    np.testing.assert_array_equal(xq, q_ref)
    x64 = np.asarray(xj.astype(jnp.float32), np.float64).reshape(s, k // 16, 16)
    assert xs.shape == (s, k // 16) and np.all(np.abs(xs - x64.sum(-1)) <= 1e-6 * np.abs(x64).sum(-1) + 1e-30)
    assert d[0, 0] == 0 and words[0, 0] == 0


@pytest.mark.parametrize("fmt", qmm.PLANAR_FORMATS)
def test_q8_blocks_made_first_and_prefetch_give_the_same_sums(fmt):
  """x's blocks made by their own kernel before the GEMV (`x_blocks=1`) and each step's loads issued a
  step ahead (`prefetch=1`), interpreted: the bits of each program quantizing x without prefetch
  (several loop steps, a K split)."""
  n, k = 32, 2048
  values, scales = _planes(fmt, n, k, 16)
  base = pg.PlanarGemvConfig(block_n=16, block_groups=2, min_programs=4)
  t = pg.resolve_tiles(base, fmt, n, k)
  assert t.steps > 1 and t.split > 1, t
  x = jnp.asarray(np.random.default_rng(17).standard_normal((4, k)), jnp.bfloat16)
  a = np.asarray(pq.planar_q8_gemv(x, values, scales, fmt, k, config=base, interpret=True))
  assert np.abs(a).max() > 0
  for xb, ahead in ((1, 0), (0, 1), (1, 1)):
    cfg = dataclasses.replace(base, x_blocks=xb, prefetch=ahead)
    assert np.array_equal(a, np.asarray(pq.planar_q8_gemv(x, values, scales, fmt, k, config=cfg, interpret=True))), cfg


def test_q8_gemv_lowers_for_the_triton_backend():
  """Every planar format's dp4a GEMV passes Pallas' Triton lowering for a CUDA target, one and four
  rows, with the dp4a as inline PTX."""
  from jax import export
  from kvjax_pallas.quant_matmul import kernel
  if kernel._pltriton is None:   # pylint: disable=protected-access
    pytest.skip("this jax has no Pallas Triton backend")
  n, k = 1024, 5120
  for fmt in qmm.PLANAR_FORMATS:
    (vs, vd), (ss, sd) = planar.plane_shapes(fmt, n, k)
    for s, cfg in ((1, pq.DEFAULT_CONFIG), (4, pq.DEFAULT_CONFIG), (1, pq.IN_KERNEL_CONFIG),
                   (4, dataclasses.replace(pq.IN_KERNEL_CONFIG, prefetch=1))):
      fn = functools.partial(pq._call, fmt=fmt, k=k, cfg=cfg,   # pylint: disable=protected-access
                             tiles=pq._gemv.resolve_tiles(cfg, fmt, n, k), interpret=False)   # pylint: disable=protected-access
      exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
          export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
              jax.ShapeDtypeStruct((s, k), jnp.bfloat16), jax.ShapeDtypeStruct(vs, vd), jax.ShapeDtypeStruct(ss, sd))
      assert "__gpu$xla.gpu.triton" in exp.mlir_module()


@pytest.mark.parametrize("fmt", qmm.PLANAR_FORMATS)
def test_gpu_q8_compiled_is_its_interpretation(fmt):
  """Compiled for the GPU (KVJAX_TEST_GPU=1): the default (x's blocks made first, 32 columns with
  prefetch), 16 columns without, and the in-kernel form with those tiles each equal their
  interpretation bit for bit, the last two each other, and 8 rows equal each row alone; at a
  27B-like K (5120)."""
  n, k = 512, 5120
  values, scales = _planes(fmt, n, k, 18)
  x = jnp.asarray(np.random.default_rng(19).standard_normal((8, k)) * 3, jnp.bfloat16)
  outs = {}
  for name, cfg in (("default", pq.DEFAULT_CONFIG), ("narrow", pq.NARROW_CONFIG), ("in_kernel", pq.IN_KERNEL_CONFIG)):
    got = np.asarray(pq.planar_q8_gemv(x, values, scales, fmt, k, config=cfg))
    assert np.array_equal(got, np.asarray(pq.planar_q8_gemv(x, values, scales, fmt, k, config=cfg, interpret=True))), name
    for r in (0, 7):
      assert np.array_equal(got[r:r + 1], np.asarray(pq.planar_q8_gemv(x[r:r + 1], values, scales, fmt, k, config=cfg))), name
    outs[name] = got
  assert np.array_equal(outs["narrow"], outs["in_kernel"])
  blocks = pq.quantize_x_blocks(x)
  for got, want in zip((blocks[0], blocks[1], blocks[3]), (lambda q: (q[0], q[1], q[3]))(pq.quantize_x(x))):
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_q8_gemv_refuses_what_it_cannot_take():
  values, scales = _planes("q4_k", 16, 256, 1)
  with pytest.raises(ValueError, match="^planar q8 GEMV: takes 1 to 8 rows of x here, got 9$"):
    pq.planar_q8_gemv(jnp.ones((9, 256)), values, scales, "q4_k", 256, interpret=True)
  with pytest.raises(ValueError, match="^planar q8 GEMV: config.dot must be 0"):
    pq.planar_q8_gemv(jnp.ones((1, 256)), values, scales, "q4_k", 256, interpret=True, config=pg.DOT_CONFIG)
  with pytest.raises(ValueError, match="block_n must be a power of two"):
    pq.planar_q8_gemv(jnp.ones((1, 256)), values, scales, "q4_k", 256, interpret=True, config=pg.PlanarGemvConfig(block_n=12))
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="^planar q8 GEMV: the kernel compiles for a GPU; on cpu pass interpret=True$"):
      pq.planar_q8_gemv(jnp.ones((1, 256)), values, scales, "q4_k", 256)
  with pytest.raises(ValueError, match=r"^planar weights: q4_k values for rows of 256 values must be uint8 \[16, 4, 32\]"):
    pq.planar_q8_gemv(jnp.ones((1, 256)), values[:, :, :16], scales, "q4_k", 256, interpret=True)
