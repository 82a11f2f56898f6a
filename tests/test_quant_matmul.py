"""Quantized-weight matmul: dequantize bit for bit against gguf's numpy dequantizers, every
implementation against a float64 oracle and the Pallas kernel against the jnp reference, the
kernel's in-register decode bit for bit, tiles, and error cases.

CPU (default): small shapes (more than one tile of S and N, more than one K chunk), the Pallas
kernel in interpret mode. GPU: `KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda pytest
tests/test_quant_matmul.py` runs the same class at larger shapes with the compiled kernel
(interpret=False); the gguf comparisons skip where gguf is not installed.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from kvjax_pallas.quant_matmul import api
from kvjax_pallas.quant_matmul import formats
from kvjax_pallas.quant_matmul import kernel
from kvjax_pallas.quant_matmul import reference as ref

ON_GPU = os.environ.get("KVJAX_TEST_GPU", "0") == "1"
INTERPRET = not ON_GPU
FMTS = formats.FORMAT_NAMES
SHAPE = dict(n=1024, k=5120) if ON_GPU else dict(n=64, k=512)
# several row tiles of S=64, several column tiles of N, several K chunks (Q8_0 / Q4_0: 4 of 128)
SMALL_TILES = kernel.QuantMatmulConfig(block_s=32, block_n=16, block_k=128)
TOL = 1e-5   # of sum |x| |w| (the float32 sums' rounding bound scale)


def _gguf_type(fmt: str):
  gguf = pytest.importorskip("gguf")
  return getattr(gguf.GGMLQuantizationType, fmt.upper())


# the byte offsets of each format's f16 scales (d, dmin) in a block
_F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def random_weights(fmt: str, n: int, k: int, seed: int, denormal_scales: bool = False):
  """uint8 [n, row_bytes]: random bytes (every pattern is a valid block) with sane f16 scales
  (|N(0, 1)| * 0.05 with random signs; `denormal_scales`: a third of them f16 denormals)."""
  rng = np.random.default_rng(seed)
  f = formats.FORMATS[fmt]
  nb = k // f.block_values
  w = rng.integers(0, 256, (n, nb, f.block_bytes), dtype=np.uint8)
  for off in _F16_FIELDS[fmt]:
    d = (rng.standard_normal((n, nb)) * 0.05).astype(np.float16).view(np.uint16)
    if denormal_scales:
      tiny = rng.integers(1, 0x400, (n, nb)).astype(np.uint16) | (d & 0x8000)
      d = np.where(rng.random((n, nb)) < 1 / 3, tiny, d)
    w[..., off:off + 2] = d.astype(np.uint16).view(np.uint8).reshape(n, nb, 2)
  return w.reshape(n, nb * f.block_bytes)


def _x(s: int, k: int, seed: int, dtype=np.float32):
  return np.random.default_rng(seed + 100).standard_normal((s, k)).astype(dtype)


def _bits_equal(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _check_close(out, want, x, w_nk, tol=TOL):
  """|out - want| <= tol * (|x| @ |w|^T), elementwise."""
  out = np.asarray(out, np.float64)
  bound = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w_nk, np.float64)).T
  assert out.shape == bound.shape, (out.shape, bound.shape)
  err = np.abs(out - want)
  worst = float(np.max(err / np.maximum(bound, 1e-30)))
  assert np.all(err <= tol * bound), worst


# ----------------------------------------------------------------------------- formats


def test_format_sizes_match_ggml():
  gguf = pytest.importorskip("gguf")
  for fmt, f in formats.FORMATS.items():
    assert gguf.GGML_QUANT_SIZES[_gguf_type(fmt)] == (f.block_values, f.block_bytes), fmt
  assert formats.row_bytes("q8_0", 5120) == 5440
  assert formats.row_bytes("q4_0", 5120) == 2880
  assert formats.row_bytes("q4_k", 17408) == 68 * 144
  assert formats.row_bytes("q5_k", 256) == 176
  assert formats.row_bytes("q6_k", 5120) == 20 * 210


# ----------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_bit_exact_vs_gguf(fmt):
  """Random blocks over several rows (a third of the scales f16 denormals): the jnp dequantizer
  gives gguf's bits, from the uint8 matrix and from its uint16 view; bf16 is the f32 rounded."""
  f = formats.FORMATS[fmt]
  k = 3 * f.block_values
  w = random_weights(fmt, 7, k, seed=1, denormal_scales=True)
  want = _gguf_dequantize(w, fmt)
  assert _bits_equal(ref.dequantize_jit(jnp.asarray(w), fmt=fmt, k=k), want)
  w16 = jnp.asarray(w.view(np.uint16))
  assert _bits_equal(ref.dequantize_jit(w16, fmt=fmt, k=k), want)
  bf = np.asarray(ref.dequantize_jit(jnp.asarray(w), fmt=fmt, k=k, dtype=jnp.bfloat16))
  assert bf.dtype == jnp.bfloat16
  np.testing.assert_array_equal(bf, want.astype(jnp.bfloat16))


def _gguf_dequantize(w, fmt):
  qtype = _gguf_type(fmt)          # skips where gguf is missing
  from gguf import quants as gq
  return gq.dequantize(w, qtype).astype(np.float32)


@pytest.mark.parametrize("fmt", ("q8_0", "q4_0"))
def test_dequantize_gguf_quantized_rows(fmt):
  """Rows quantized by gguf's own Q8_0 / Q4_0 quantizers decode to gguf's values."""
  _gguf_type(fmt)
  from gguf import quants as gq
  vals = np.random.default_rng(3).standard_normal((5, 256)).astype(np.float32)
  w = np.asarray(gq.quantize(vals, _gguf_type(fmt)), np.uint8)
  assert w.shape == (5, formats.row_bytes(fmt, 256))
  assert _bits_equal(ref.dequantize_jit(jnp.asarray(w), fmt=fmt, k=256), _gguf_dequantize(w, fmt))


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_decode_bit_exact(fmt):
  """The kernel's plane decode (`decode_tile`, the code the kernel runs on its tiles) gives the
  reference's bits in kernel column order, a permutation of each block's positions."""
  f = formats.FORMATS[fmt]
  k = 2 * f.block_values
  order = kernel.column_order(fmt, k)
  assert sorted(order.tolist()) == list(range(k))
  assert (fmt == "q8_0") == np.array_equal(order, np.arange(k))   # only q8_0 is in order
  w = jnp.asarray(random_weights(fmt, 5, k, seed=2, denormal_scales=True))
  want = np.asarray(ref.dequantize_jit(w, fmt=fmt, k=k))
  decode = jax.jit(kernel.decode_tile, static_argnames=("fmt", "k"))
  assert _bits_equal(decode(w, fmt=fmt, k=k), want[:, order])


# ----------------------------------------------------------------------------- matmul


@pytest.fixture(params=[i for i in api.IMPLEMENTATIONS if i != "pallas_gemv"])
def impl(request):
  """The matmul implementations ("pallas_gemv" is its own test below: its rows are the GEMV's)."""
  return request.param


class TestQuantMatmul:
  """Runs for every implementation in `api.IMPLEMENTATIONS` ("pallas" interpreted on CPU)."""

  def _run(self, impl, x, w, fmt, k, **kw):
    return np.asarray(api.quant_matmul(jnp.asarray(x), jnp.asarray(w), fmt, k,
                                       implementation=impl, interpret=INTERPRET, **kw))

  @pytest.mark.parametrize("fmt", FMTS)
  @pytest.mark.parametrize("s", [1, 3, 8, 64])
  def test_matches_f64_oracle_and_reference(self, impl, fmt, s):
    """f32 x: within float32 summation rounding of the float64 product of the dequantized
    weights; the kernel also against the jnp reference (S <= 8: the default GEMV tiles, two
    column tiles, two K chunks; S=64: `SMALL_TILES`, two row tiles)."""
    n, k = SHAPE["n"], SHAPE["k"]
    w = random_weights(fmt, n, k, seed=10 + s)
    x = _x(s, k, seed=s)
    w_nk = np.asarray(ref.dequantize_jit(jnp.asarray(w), fmt=fmt, k=k), np.float64)
    config = SMALL_TILES if s > 8 else None
    out = self._run(impl, x, w, fmt, k, config=config)
    assert out.dtype == np.float32 and out.shape == (s, n)
    _check_close(out, x.astype(np.float64) @ w_nk.T, x, w_nk)
    if impl != "xla":
      want = np.asarray(ref.quant_matmul_reference(jnp.asarray(x), jnp.asarray(w), fmt, k))
      _check_close(out, want, x, w_nk)

  @pytest.mark.parametrize("fmt", FMTS)
  def test_bf16_x(self, impl, fmt):
    """bf16 x meets the weights rounded to bf16 (exact products, float32 sums)."""
    n, k = SHAPE["n"], SHAPE["k"]
    w = random_weights(fmt, n, k, seed=21)
    x = _x(5, k, seed=21).astype(jnp.bfloat16)
    w_nk = np.asarray(ref.dequantize_jit(jnp.asarray(w), fmt=fmt, k=k, dtype=jnp.bfloat16),
                      np.float64)
    out = self._run(impl, x, w, fmt, k)
    _check_close(out, x.astype(np.float64) @ w_nk.T, x.astype(np.float32), w_nk)

  @pytest.mark.parametrize("fmt", ("q4_0", "q6_k"))
  def test_ragged_tiles(self, impl, fmt):
    """N without the requested column tile (48 = 16 x 3) and K of an odd block count (one block
    a chunk), from the uint16 view: still the reference."""
    f = formats.FORMATS[fmt]
    k = 3 * f.block_values
    w = random_weights(fmt, 48, k, seed=33)
    x = _x(20, k, seed=33)
    cfg = kernel.QuantMatmulConfig(block_s=16, block_n=32, block_k=1024)
    t = kernel.resolve_tiles(cfg, fmt, 20, 48, k)
    assert (t.bn, t.kb, t.n_chunks, t.s_pad) == (16, 1, 3, 32)
    w_nk = np.asarray(ref.dequantize_jit(jnp.asarray(w), fmt=fmt, k=k), np.float64)
    out = self._run(impl, x, w.view(np.uint16), fmt, k, config=cfg)
    _check_close(out, x.astype(np.float64) @ w_nk.T, x, w_nk)


@pytest.mark.parametrize("fmt", FMTS)
def test_gemv_matches_the_f64_oracle_and_reference(fmt):
  """The GEMV (interpreted on CPU): f32 x of 1 and 3 rows (padded to 4), bf16 x of 2 rows, within
  float32 summation rounding of the float64 product and of the jnp reference; a matrix of 48
  columns (3 column tiles) and an odd block count (one block a chunk, no K split). "pallas_gemv"
  runs it for one row, or for up to 16 given a GemvConfig; other calls are the matmul kernel's."""
  from kvjax_pallas.quant_matmul import gemv
  n, k = SHAPE["n"], SHAPE["k"]
  w = random_weights(fmt, n, k, seed=40)
  w_nk = np.asarray(ref.dequantize_jit(jnp.asarray(w), fmt=fmt, k=k), np.float64)
  run = lambda x, w, k, **kw: np.asarray(api.quant_matmul(jnp.asarray(x), jnp.asarray(w), fmt, k,  # noqa: E731
                                                          implementation="pallas_gemv", interpret=INTERPRET, **kw))
  for s in (1, 3):
    x = _x(s, k, seed=40 + s)
    out = run(x, w, k, config=gemv.DEFAULT_CONFIG)
    assert out.shape == (s, n)
    if s == 1:     # one row: the GEMV without a config too
      assert np.array_equal(out, run(x, w, k))
    else:          # more rows without a GemvConfig: the matmul kernel's bits
      assert np.array_equal(run(x, w, k), np.asarray(api.quant_matmul(
          jnp.asarray(x), jnp.asarray(w), fmt, k, implementation="pallas", interpret=INTERPRET)))
    _check_close(out, x.astype(np.float64) @ w_nk.T, x, w_nk)
    _check_close(out, np.asarray(ref.quant_matmul_reference(jnp.asarray(x), jnp.asarray(w), fmt, k)), x, w_nk)
  xb = _x(2, k, seed=49).astype(jnp.bfloat16)
  wb = np.asarray(ref.dequantize_jit(jnp.asarray(w), fmt=fmt, k=k, dtype=jnp.bfloat16), np.float64)
  _check_close(run(xb, w, k, config=gemv.DEFAULT_CONFIG), xb.astype(np.float64) @ wb.T, xb.astype(np.float32), wb)
  f = formats.FORMATS[fmt]
  k3 = 3 * f.block_values
  w3 = random_weights(fmt, 48, k3, seed=41)
  t = gemv.resolve_tiles(gemv.GemvConfig(block_n=32), fmt, 3, 48, k3)
  assert (t.bn, t.split, t.kb * t.chunks * t.split) == (16, 1, 3)
  w3_nk = np.asarray(ref.dequantize_jit(jnp.asarray(w3), fmt=fmt, k=k3), np.float64)
  x3 = _x(3, k3, seed=41)
  _check_close(run(x3, w3.view(np.uint16), k3, config=gemv.GemvConfig(block_n=32)), x3.astype(np.float64) @ w3_nk.T,
               x3, w3_nk)


def test_gemv_tiles_and_bad_configs():
  """The GEMV's tiles: rows padded to a power of two, a K chunk within `block_k` and within the
  product's register budget (fewer blocks for more rows), K split into at most `split_k` ranges;
  bad configs and row counts refused."""
  from kvjax_pallas.quant_matmul import gemv
  t1 = gemv.resolve_tiles(gemv.DEFAULT_CONFIG, "q8_0", 1, 17408, 5120)
  t8 = gemv.resolve_tiles(gemv.DEFAULT_CONFIG, "q8_0", 7, 17408, 5120)
  assert (t1.s_pad, t1.bn, t1.kb, t1.split, t1.chunks) == (1, 16, 8, 4, 5)     # 160 blocks
  assert t8.s_pad == 8 and t8.kb == 4 and t8.kb * t8.chunks * t8.split == 5120 // 32
  assert 8 * 16 * t8.kb * 16 <= gemv.PRODUCT_FLOATS
  with pytest.raises(ValueError, match="split_k"):
    gemv.resolve_tiles(gemv.GemvConfig(split_k=3), "q4_0", 1, 64, 512)
  with pytest.raises(ValueError, match="17"):
    gemv.resolve_tiles(gemv.DEFAULT_CONFIG, "q4_0", 17, 64, 512)
  assert sorted(gemv.plane_order("q4_k").tolist()) == list(range(256))


def test_gpu_kernel_at_27b_shapes():
  """Compiled kernel (GPU only) at the 27B model's projection shapes, decode and prefill rows,
  against the jnp reference."""
  for fmt in FMTS:
    for n, k in ((1024, 5120), (5120, 17408)):
      w = jnp.asarray(random_weights(fmt, n, k, seed=5))
      w_nk = np.asarray(ref.dequantize_jit(w, fmt=fmt, k=k), np.float64)
      for s in (1, 4, 256):
        x = _x(s, k, seed=s)
        out = api.quant_matmul(jnp.asarray(x), w, fmt, k, implementation="pallas")
        want = np.asarray(ref.quant_matmul_reference(jnp.asarray(x), w, fmt, k))
        _check_close(np.asarray(out), want, x, w_nk)


@pytest.mark.parametrize("fmt", FMTS)
def test_lowers_for_the_triton_backend(fmt):
  """The kernel passes Pallas' Triton lowering (power-of-two loads, supported primitives) for a
  CUDA target, here on a CPU-only jaxlib: `jax.export` for platform "cuda" stops before
  Triton's own compile (that needs the GPU). bf16 decode tiles and f32 prefill tiles."""
  if kernel._pltriton is None:
    pytest.skip("this jax has no Pallas Triton backend")
  from jax import export
  f = formats.FORMATS[fmt]
  n, k = 256, 512
  w = jax.ShapeDtypeStruct((n, k // f.block_values, f.block_halfwords), jnp.uint16)
  for s, dtype in ((1, jnp.bfloat16), (100, jnp.float32)):
    cfg = kernel.default_config(fmt, s)
    tiles = kernel.resolve_tiles(cfg, fmt, s, n, k)
    fn = functools.partial(kernel._call, fmt=fmt, k=k, cfg=cfg, tiles=tiles, interpret=False)
    exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            jax.ShapeDtypeStruct((tiles.s_pad, k), dtype), w)
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()
  from kvjax_pallas.quant_matmul import gemv     # the GEMV: 1 and 5 rows (padded to 8)
  for s, dtype in ((1, jnp.bfloat16), (5, jnp.float32)):
    tiles = gemv.resolve_tiles(gemv.DEFAULT_CONFIG, fmt, s, n, k)
    fn = functools.partial(gemv._call, fmt=fmt, cfg=gemv.DEFAULT_CONFIG, tiles=tiles, interpret=False)
    exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            jax.ShapeDtypeStruct((tiles.s_pad, k // f.block_values, f.block_values), dtype), w)
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()


def test_bench_small_runs(tmp_path):
  """experiments/bench_gemv.py --small (the kernel interpreted) writes a row a case, no errors,
  the kernel within float32 rounding of "xla"."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "bench.json"
  p = subprocess.run([sys.executable, "-m", "experiments.bench_gemv", "--small", "--formats=q4_k",
                      "--shapes=ffn_down.weight", f"--out={out}"], cwd=root, capture_output=True,
                     text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stderr[-3000:]
  rows = json.loads(out.read_text())["rows"]
  assert [(r["impl"], r["s"]) for r in rows] == [(i, s) for s in (1, 4)
                                                 for i in ("xla", "fused", "pallas", "pallas_gemv", "bf16")]
  assert all("error" not in r and r["gbps"] > 0 for r in rows)
  assert all(r["check"] < 1e-5 for r in rows if r["impl"].startswith("pallas"))


def test_bench_planar_rows_and_bad_tiles_in_one_line(tmp_path):
  """bench_gemv --small: the planar products' rows (the GEMV with tiles given, XLA's reduction)
  within float32 rounding of the float32-weights or bf16 products; a bad tile entry is one line."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "bench.json"
  run = lambda *a: subprocess.run([sys.executable, "-m", "experiments.bench_gemv", "--small", "--formats=q6_k,q5_k",
                                   "--shapes=ffn_down.weight", *a], cwd=root, capture_output=True, text=True,
                                  timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  p = run("--implementations=planar_pallas,planar_xla", "--planar_tiles=8:4:0:8:1:1:4:3", f"--out={out}")
  assert p.returncode == 0, p.stderr[-3000:]
  assert "note: q5_k not repacked into planes" in p.stdout
  rows = json.loads(out.read_text())["rows"]
  assert [(r["impl"], r["s"], r["fmt"]) for r in rows] == [(i, s, "q6_k") for s in (1, 4) for i in ("planar_pallas", "planar_xla")]
  assert all("error" not in r and r["check"] < 1e-2 for r in rows)
  bad = run("--implementations=planar_pallas", "--planar_tiles=12:4:0:8:1:1:4:3")
  assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
      "bench_gemv: error: --planar_tiles entry '12:4:0:8:1:1:4:3': block_n must be a power of two >= 1, got 12"]


# ----------------------------------------------------------------------------- tiles, errors


def test_resolve_tiles():
  t = kernel.resolve_tiles(kernel.default_config("q4_k", 1), "q4_k", 1, 17408, 5120)
  assert (t.bs, t.bn, t.kb, t.kc, t.s_pad, t.n_chunks) == (16, 32, 1, 256, 16, 20)
  t = kernel.resolve_tiles(kernel.default_config("q8_0", 256), "q8_0", 256, 5120, 17408)
  assert (t.bs, t.bn, t.kb, t.s_pad, t.n_chunks) == (64, 64, 8, 256, 68)
  # 160 blocks a row: 8 a chunk divide it; a cap of 12 blocks takes the power of two 8
  t = kernel.resolve_tiles(kernel.QuantMatmulConfig(block_k=12 * 32), "q8_0", 3, 1024, 5120)
  assert (t.kb, t.n_chunks) == (8, 20)
  assert kernel.default_config("q4_0", 16) == kernel.GEMV_CONFIG
  assert kernel.default_config("q4_0", 17) == kernel.GEMM_CONFIG


def test_bad_inputs():
  w = jnp.asarray(random_weights("q4_0", 8, 64, seed=0))
  x = jnp.zeros((2, 64), jnp.float32)
  with pytest.raises(ValueError, match="unknown quant format 'q3_k'; supported: q8_0, q4_0"):
    api.quant_matmul(x, w, "q3_k", 64)
  with pytest.raises(ValueError, match="q4_k: k=300 is not a positive multiple of the block "
                                       "size 256"):
    formats.row_bytes("q4_k", 300)
  with pytest.raises(ValueError, match="q4_0: k=48 is not a positive multiple of the block size 32"):
    api.quant_matmul(jnp.zeros((2, 48)), w, "q4_0", 48)
  with pytest.raises(ValueError, match=r"q4_0 weights of k=64 must be uint8 \[N, 36\] \(or uint16 "
                                       r"\[N, 18\]\), got uint8 \[8, 34\]"):
    api.quant_matmul(x, w[:, :34], "q4_0", 64)
  with pytest.raises(ValueError, match="must be uint8"):
    api.dequantize(w.astype(jnp.int32), "q4_0", 64)
  with pytest.raises(ValueError, match=r"x must be \[S, 64\] \(k=64\), got shape \[2, 32\]"):
    api.quant_matmul(jnp.zeros((2, 32)), w, "q4_0", 64, implementation="pallas", interpret=True)
  with pytest.raises(ValueError, match="x must be floating point"):
    api.quant_matmul(jnp.zeros((2, 64), jnp.int32), w, "q4_0", 64)
  with pytest.raises(ValueError, match="unknown quant-matmul implementation 'cuda'"):
    api.quant_matmul(x, w, "q4_0", 64, implementation="cuda")
  with pytest.raises(ValueError, match="block_s must be a power of two >= 1, got 24"):
    api.quant_matmul(x, w, "q4_0", 64, implementation="pallas",
                     config=kernel.QuantMatmulConfig(block_s=24), interpret=True)
  with pytest.raises(ValueError, match="block_k must be an int >= 1, got 0"):
    kernel.check_config(kernel.QuantMatmulConfig(block_k=0))
