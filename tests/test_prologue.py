"""kvjax_pallas.quant_matmul.prologue: the q8 GEMV's quantizing kernel makes x itself (an RMS norm, SwiGLU's
gate, the Gated DeltaNet's gated per-head norm): its blocks are those of the jnp formula's x (interpreted), a
row's blocks never depend on the call's other rows, columns read in place equal the columns cut out, the
kernels lower for Triton, and a model whose q8 products make their x decodes speculatively as plain greedy."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from kvjax import api, config as config_lib, gguf_io, qweights, tokenizer, weights as weights_lib
from kvjax_pallas.quant_matmul import api as qmm, planar_q8 as pq, prologue as pp

K = 512
HEAD = 128


def _cases(dtype, s=3, seed=0):
  """(name, prologue, operands) of each kind at a small K, the column operands inside wider arrays."""
  rng = np.random.default_rng(seed)
  a = jnp.asarray(rng.standard_normal((s, K)) * 3, dtype)
  w = jnp.asarray(rng.standard_normal(K) + 1, jnp.float32)
  wide = jnp.asarray(rng.standard_normal((s, 3 * K + 64)), jnp.float32)   # a joined product's output
  o = jnp.asarray(rng.standard_normal((s, K)), jnp.float32)
  wh = jnp.asarray(rng.standard_normal(HEAD) + 1, jnp.float32)
  name = jnp.dtype(dtype).name
  return [("rms", pp.Prologue("rms", 1e-6, casts=(name,)), (a, w)),
          ("swiglu", pp.Prologue("swiglu", casts=(name,)), (pp.Cols(wide, 64, K), pp.Cols(wide, 64 + K, K))),
          ("gated_rms", pp.Prologue("gated_rms", 1e-6, HEAD, (name,)), (o, pp.Cols(wide, 1024, K), wh))]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prologue_blocks_are_the_formulas_blocks(dtype):
  """Interpreted, each kind's blocks are `quantize_x_blocks` of the jnp formula's x up to x's last bit (the norms'
  sums of squares run in another order): int8 values within 1 (under 1% of them moved), scales and sums of x within
  float32 rounding, the sums of q those of its own values; and x's dequantized blocks are the formula's x within
  half an int8 step."""
  for name, p, ops in _cases(dtype):
    x = pp.prologue_reference(p, ops)
    got = pp.quantize_x_blocks_pre(p, ops, interpret=True)
    want = pq.quantize_x_blocks(x, interpret=True)
    q, q_want = (np.asarray(b[0]).view(np.int8).astype(np.int32) for b in (got, want))
    assert np.abs(q - q_want).max() <= 1 and np.mean(q != q_want) < 1e-2, name
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.array_equal(np.asarray(got[3]), q.reshape(x.shape[0], -1, 16).sum(-1)), name   # sums of q: its own
    words = np.asarray(got[0]).view(np.int8).reshape(x.shape[0], -1, 32).astype(np.float32)
    deq = (words * np.asarray(got[1])[..., None]).reshape(x.shape)
    step = np.repeat(np.asarray(got[1]), 32, axis=1)
    assert np.all(np.abs(deq - np.asarray(x, np.float32)) <= 0.5 * step + 1e-6), name


def test_prologue_rows_do_not_depend_on_the_other_rows():
  """A row's blocks (and the GEMV's sums) are the same bits alone as among 8 rows: a decode row and the same
  row among verify rows agree."""
  w = qweights.random_quantized("q4_k", 64, K, seed=2)
  values, scales = (jnp.asarray(a) for a in qmm.to_planes(np.asarray(w.data), "q4_k", K))
  for name, p, ops in _cases(jnp.bfloat16, s=8, seed=1):
    full = np.asarray(pp.planar_q8_gemv_pre(p, ops, values, scales, "q4_k", K, interpret=True))
    for r in (0, 5):
      one = tuple(pp.Cols(c.array[r:r + 1], c.start, c.width) if isinstance(c, pp.Cols) else
                  (c[r:r + 1] if c.ndim == 2 else c) for c in ops)
      if name == "rms":
        one = (ops[0][r:r + 1], ops[1])
      got = np.asarray(pp.planar_q8_gemv_pre(p, one, values, scales, "q4_k", K, interpret=True))
      assert np.array_equal(got, full[r:r + 1]), (name, r)


def test_prologue_gemv_is_the_q8_gemv_of_the_formula():
  """`planar_q8_gemv_pre` = `planar_q8_gemv` on the formula's x (the same blocks, the same GEMV), and within x's
  int8 rounding of the float32 product."""
  w = qweights.random_quantized("q8_0", 96, K, seed=3)
  values, scales = (jnp.asarray(a) for a in qmm.to_planes(np.asarray(w.data), "q8_0", K))
  w_nk = np.asarray(qmm.dequantize_planes(values, scales, "q8_0", K), np.float32)
  for name, p, ops in _cases(jnp.float32, s=2, seed=4):
    x = pp.prologue_reference(p, ops)
    got = np.asarray(pp.planar_q8_gemv_pre(p, ops, values, scales, "q8_0", K, interpret=True))
    want = np.asarray(pq.planar_q8_gemv(x, values, scales, "q8_0", K, interpret=True))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=name)
    exact = np.asarray(x, np.float32) @ w_nk.T
    assert np.abs(got - exact).max() <= 2e-2 * np.abs(exact).max(), name


def test_columns_read_in_place_equal_the_columns_cut_out():
  """`Cols` of a wider array read in place give the same bits as the columns cut out first; an array whose width is
  not whole blocks of 32 (a joined output with beta / alpha's odd rows) is cut first, with the same result."""
  for name, p, ops in _cases(jnp.float32, seed=5)[1:]:
    cut = tuple(c.value() if isinstance(c, pp.Cols) else c for c in ops)
    a = pp.quantize_x_blocks_pre(p, ops, interpret=True)
    b = pp.quantize_x_blocks_pre(p, cut, interpret=True)
    odd = tuple(pp.Cols(jnp.pad(c.array, ((0, 0), (0, 7))), c.start, c.width) if isinstance(c, pp.Cols) else c
                for c in ops)
    c = pp.quantize_x_blocks_pre(p, odd, interpret=True)
    for u, v, t in zip(a, b, c):
      assert np.array_equal(np.asarray(u), np.asarray(v)) and np.array_equal(np.asarray(u), np.asarray(t)), name


def test_prologue_refuses_what_it_cannot_take(monkeypatch):
  a, w = jnp.ones((2, K)), jnp.ones((K,))
  with pytest.raises(ValueError, match="^prologue: kind must be one of rms, swiglu, gated_rms, got 'norm'$"):
    pp.Prologue("norm")
  with pytest.raises(ValueError, match="^prologue gated_rms: head_dim must be a power of two >= 32, got 48$"):
    pp.Prologue("gated_rms", head_dim=48)
  with pytest.raises(ValueError, match="^prologue rms: takes 2 operands, got 1$"):
    pp.PrologueInput(pp.Prologue("rms"), (a,))
  with pytest.raises(ValueError, match=r"^prologue rms: the norm weight must be \(512,\), got \(256,\)$"):
    pp.quantize_x_blocks_pre(pp.Prologue("rms"), (a, w[:256]), interpret=True)
  with pytest.raises(ValueError, match="^prologue swiglu: operand 1 must be"):
    pp.quantize_x_blocks_pre(pp.Prologue("swiglu"), (a, jnp.ones((3, K))), interpret=True)
  with pytest.raises(ValueError, match="^prologue swiglu: operand 0 must be .* at a multiple of 32"):
    pp.quantize_x_blocks_pre(pp.Prologue("swiglu"), (pp.Cols(jnp.ones((2, 2 * K)), 8, K), a), interpret=True)
  with pytest.raises(ValueError, match="^prologue gated_rms: x's 480 columns must be whole heads of 128$"):
    pp.quantize_x_blocks_pre(pp.Prologue("gated_rms", head_dim=128), (a[:, :480], a[:, :480], jnp.ones(128)),
                             interpret=True)
  values, scales = qmm.to_planes(np.asarray(qweights.random_quantized("q4_k", 16, K, seed=1).data), "q4_k", K)
  with pytest.raises(ValueError, match="^prologue rms: takes 1 to 8 rows, got 9$"):
    pp.planar_q8_gemv_pre(pp.Prologue("rms"), (jnp.ones((9, K)), w), values, scales, "q4_k", K, interpret=True)
  monkeypatch.setenv("KVJAX_Q8_PROLOGUE", "yes")
  with pytest.raises(ValueError, match=r"^\$KVJAX_Q8_PROLOGUE must be 0 or 1 \(or unset: 1\), got 'yes'$"):
    pp.prologue_enabled()
  err = qweights.request_error(None, None, None, 1)
  assert err is not None and err[1] == "KVJAX_Q8_PROLOGUE"


def test_prologue_kernels_lower_for_the_triton_backend():
  """Each kind passes Pallas' Triton lowering for a CUDA target at the 27B's shapes (the norm over 5120 values,
  SwiGLU's halves of the 34816-wide gate / up output, the gated norm's z inside the 16480-wide joined output)."""
  from jax import export
  from kvjax_pallas.quant_matmul import kernel
  if kernel._pltriton is None:   # pylint: disable=protected-access
    pytest.skip("this jax has no Pallas Triton backend")
  f32 = jnp.float32
  cases = {
      "rms": (pp.Prologue("rms", 1e-6, casts=("bfloat16",)), ((4, 5120), jnp.bfloat16), ((5120,), f32), None),
      "swiglu": (pp.Prologue("swiglu", casts=("bfloat16",)), ((4, 34816), f32), ((4, 34816), f32), (0, 17408, 17408)),
      "gated_rms": (pp.Prologue("gated_rms", 1e-6, 128, ("bfloat16",)), ((4, 6144), f32), ((4, 16480), f32),
                    (None, 10240, 6144)),
  }
  for name, (p, sa, sb, cols) in cases.items():
    def fn(a, b, c=None, p=p, cols=cols):
      if p.kind == "rms":
        ops = (a, b)
      elif p.kind == "swiglu":
        ops = (pp.Cols(a, 0, cols[2]), pp.Cols(b, cols[1], cols[2]))
      else:
        ops = (a, pp.Cols(b, cols[1], cols[2]), c)
      return pp.quantize_x_blocks_pre(p, ops, interpret=False)
    args = [jax.ShapeDtypeStruct(*sa), jax.ShapeDtypeStruct(*sb)]
    if name == "gated_rms":
      args.append(jax.ShapeDtypeStruct((128,), f32))
    exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 1, name


def test_kernel_bfloat16_rounding_is_xlas():
  """`_cast` (the kernels' float32 -> bfloat16 by integer operations) gives XLA's conversion's bits: values at
  every scale, exact ties, one bit either side of a tie, subnormals, infinities, NaN; and a wrong rounding (a
  truncation) would be caught by these values."""
  rng = np.random.default_rng(3)
  x = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-40, 38, 20000)).astype(np.float32)
  b = rng.standard_normal(4000).astype(jnp.bfloat16).astype(np.float32).view(np.int32)
  edges = [(b + off).view(np.float32) for off in (0x8000, 0x7FFF, 0x8001, 0x18000)]
  specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4028235e38, -3.4028235e38, 1e-40, -1e-40, 1e-45],
                      np.float32)
  x = np.concatenate([x, *edges, specials])
  want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
  got = np.asarray(jax.jit(lambda v: pp._cast(v, jnp.bfloat16))(x).astype(jnp.float32))  # pylint: disable=protected-access
  nan = np.isnan(want)
  assert np.array_equal(np.isnan(got), nan)
  assert np.array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32))
  truncated = (x.view(np.int32) & -65536).view(np.float32)
  assert not np.array_equal(truncated[~nan].view(np.int32), want[~nan].view(np.int32))
  assert pp._cast(jnp.ones(4, jnp.float32), jnp.float32).dtype == jnp.float32   # pylint: disable=protected-access


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_prologue_compiled_is_its_interpretation(dtype):
  """Compiled for the GPU (KVJAX_TEST_GPU=1), at the 27B's widths: each kind's blocks are the interpreted kernel's
  up to x's last bit (libdevice's rsqrt and exp against XLA's: int8 values within 1, under 1% moved),
  and a row's blocks alone equal the same row's among 4 bit for bit."""
  rng = np.random.default_rng(7)
  s, f32 = 4, jnp.float32
  name = jnp.dtype(dtype).name
  cases = [
      (pp.Prologue("rms", 1e-6, casts=(name,)), (jnp.asarray(rng.standard_normal((s, 5120)) * 3, dtype),
                                                 jnp.asarray(rng.standard_normal(5120), f32))),
      (pp.Prologue("swiglu", casts=(name,)), (lambda gu: (pp.Cols(gu, 0, 17408), pp.Cols(gu, 17408, 17408)))(
          jnp.asarray(rng.standard_normal((s, 34816)), f32))),
      (pp.Prologue("gated_rms", 1e-6, 128, (name,)), (jnp.asarray(rng.standard_normal((s, 6144)), f32),
                                                      pp.Cols(jnp.asarray(rng.standard_normal((s, 16480)), f32),
                                                              10240, 6144),
                                                      jnp.asarray(rng.standard_normal(128), f32))),
  ]
  for p, ops in cases:
    got = pp.quantize_x_blocks_pre(p, ops)
    want = pp.quantize_x_blocks_pre(p, ops, interpret=True)
    q, q_want = (np.asarray(b[0]).view(np.int8).astype(np.int32) for b in (got, want))
    assert np.abs(q - q_want).max() <= 1 and np.mean(q != q_want) < 1e-2, p.kind
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6, err_msg=p.kind)
    one = tuple(pp.Cols(c.array[1:2], c.start, c.width) if isinstance(c, pp.Cols) else
                (c[1:2] if c.ndim == 2 else c) for c in ops)
    for u, v in zip(pp.quantize_x_blocks_pre(p, one), got):
      assert np.array_equal(np.asarray(u), np.asarray(v)[1:2]), p.kind


def _joined_q4k_model(tmp):
  wide = dict(hidden_size=256, intermediate_size=512, num_layers=4, num_attention_heads=4, num_kv_heads=2,
              head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_head_dim=32)
  cfg = config_lib.tiny(**wide)
  tensors = weights_lib.random_tensors(cfg, 0)
  for i, name in enumerate(sorted(tensors)):
    if qweights.keeps_quantized(name):
      tensors[name] = qweights.random_quantized("q4_k", *tensors[name].shape, seed=i)
  return gguf_io.write_gguf(f"{tmp}/q4k.gguf", cfg, tensors, tokenizer.tiny_tokenizer_spec(), weight_type="f32")


def test_model_with_prologues_decodes_as_without_and_speculates_as_plain_greedy(tmp_path, monkeypatch):
  """A bfloat16 model of Q4_K planes (its projections joined) with the q8 product: its products make their x
  (each kind traced, counted); a decode's logits equal those of the same model making x in XLA first
  (`KVJAX_Q8_PROLOGUE=0`) within x's int8 rounding (the prefill's rows, more than a call takes, bit for bit); and
  speculation (MTP and ngram) gives plain greedy's tokens."""
  monkeypatch.setenv("KVJAX_PLANAR_PRODUCT", "pallas_q8")
  path = _joined_q4k_model(str(tmp_path))
  made = []
  real = pp._blocks_pre   # pylint: disable=protected-access
  monkeypatch.setattr(pp, "_blocks_pre", lambda arrays, **kw: made.append(kw["p"].kind) or real(arrays, **kw))
  prompt = list(range(5, 60))
  logits = {}
  for flag in ("1", "0"):
    monkeypatch.setenv("KVJAX_Q8_PROLOGUE", flag)
    model = api.load_model(path, weights_impl="planar", dtype="bfloat16", compile_cache=False)
    rows = []
    api.generate(model, prompt_tokens=prompt, n_predict=2, ignore_eos=True, on_logits=lambda i, lg: rows.append(
        np.asarray(lg, np.float32)))
    np.testing.assert_array_equal(rows[0], logits.get("1", [rows[0]])[0])   # the prefill's row: no prologue
    logits[flag] = rows
    if flag == "1":
      assert {"rms", "swiglu", "gated_rms"} <= set(made)
      plain = api.generate(model, prompt_tokens=prompt, n_predict=24, ignore_eos=True).tokens
      for spec in (api.SpecConfig("ngram", n_max=3, ngram_n=2), api.SpecConfig("mtp", n_max=3)):
        assert api.generate(model, prompt_tokens=prompt, n_predict=24, ignore_eos=True, spec=spec).tokens == plain
      made.clear()
    else:
      assert not made
  scale = np.abs(logits["0"][1]).max()       # the first decode row, after the same token
  assert np.abs(logits["1"][1] - logits["0"][1]).max() <= 3e-2 * scale
