"""Weights kept in their GGUF block format (kvjax.qweights): a model loaded with its matrices
quantized computes the logits of the same file dequantized at load, and takes the file's bytes.

Q8_0 / Q4_0 on the packaged code-tiny and a tiny-geometry file; the K-quants on a geometry whose
every matrix has rows of a multiple of 256 values (their block)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import api, config as config_lib, engine, gguf_io, qweights, tiny, tokenizer
from kvjax import weights as weights_lib

# every matrix's rows (its input features) a multiple of 256: hidden 256, attention 4 x 64,
# Gated DeltaNet values 8 x 32, FFN 512
WIDE = dict(hidden_size=256, intermediate_size=512, num_layers=4, num_attention_heads=4, num_kv_heads=2,
            head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_head_dim=32)


def _write(path, cfg, fmt: str, seed: int = 0) -> str:
  """A GGUF of `cfg` with random weights: every matrix that stays quantized in `fmt`, the rest F32."""
  tensors = weights_lib.random_tensors(cfg, seed)
  for i, name in enumerate(sorted(tensors)):
    if qweights.keeps_quantized(name):
      n, k = tensors[name].shape
      tensors[name] = qweights.random_quantized(fmt, n, k, seed=1000 * seed + i)
  return gguf_io.write_gguf(path, cfg, tensors, weight_type="f32")


def _models(path, impl="xla"):
  g = gguf_io.read_gguf(path)
  quant = engine.build_model(g.config, qweights.quantized_tensors(g, impl=impl), names=g.tensor_names())
  plain = engine.build_model(g.config, g.iter_tensors(np.float32), names=g.tensor_names())
  return g, quant, plain


@nnx.jit
def _both_logits(model, toks):
  logits, hn = model.causal(toks)
  return logits, model.mtp_causal(hn[:-1], toks[1:])


def _logits(model, n=24, seed=0):
  """The target's logits of n random tokens [n, V] and the MTP head's [n - 1, V] (numpy)."""
  toks = jnp.asarray(np.random.default_rng(seed).integers(0, model.cfg.vocab_size, n), jnp.int32)
  return tuple(np.asarray(x) for x in _both_logits(model, toks))


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q4_0"])
def test_quantized_logits_equal_dequantized(tmp_path, fmt):
  """Every kept matrix quantized ("xla": dequantized inside the step, the same product): the target's
  and the MTP head's logits are those of the file dequantized at load, bit for bit."""
  cfg = config_lib.tiny(**WIDE)
  g, quant, plain = _models(_write(tmp_path / f"{fmt}.gguf", cfg, fmt))
  kept = [n for n in g.tensor_names() if qweights.keeps_quantized(n)]
  assert kept and all(g.tensor_info(n).ggml_type.name == fmt.upper() for n in kept)
  leaves = jax.tree_util.tree_leaves(nnx.state(quant), is_leaf=qweights.is_quantized)
  assert sum(qweights.is_quantized(x) for x in leaves) == len(kept)
  (lq, mq), (lp, mp) = _logits(quant), _logits(plain)
  assert np.isfinite(lp).all() and np.abs(lp).max() > 0.1
  assert np.array_equal(lq, lp) and np.array_equal(mq, mp)


@pytest.mark.parametrize("impl", ["pallas", "pallas_gemv", "fused", "planar", "planar:pallas"])
def test_pallas_quantized_logits_within_1e3_of_dequantized(tmp_path, monkeypatch, impl):
  """The products that dequantize as they read (the kernels in interpret mode here), Q4_K layers:
  the target's and the MTP head's logits within 1e-3 of the largest (float32), the same top-1 on
  every row. The matmul kernel runs 8-row forwards; "pallas_gemv" a 2-row forward (the matmul
  kernel: it routes more than one row there) and the MTP head's 1-row forward (the GEMV,
  interpreted a row at a time; its row padding and splits: tests/test_quant_matmul.py); "fused"
  2-row forwards (the multiply-and-sum); "planar" the dequantized planes' dot for the target's 2 rows,
  the planes' multiply-and-sum for the MTP head's row; "planar:pallas" the planes' GEMV (the GPU's default
  product, its grouped sums) for both."""
  impl, _, product = impl.partition(":")
  if product:
    monkeypatch.setenv("KVJAX_PLANAR_PRODUCT", product)
  cfg = config_lib.tiny(**WIDE)
  _, quant, plain = _models(_write(tmp_path / "q4_k.gguf", cfg, "q4_k"), impl=impl)
  n = 8 if impl == "pallas" else 2
  for lq, lp in zip(_logits(quant, n=n), _logits(plain, n=n)):
    assert np.abs(lq - lp).max() <= 1e-3 * np.abs(lp).max()
    assert np.array_equal(lq.argmax(-1), lp.argmax(-1))


def test_code_tiny_quantized_takes_its_file_bytes_and_generates_the_same():
  """The packaged Q8_0 model kept quantized: its device weights take <= 1.15x the file's tensor bytes
  (3.7x dequantized to float32), and greedy generation gives the same tokens."""
  g = gguf_io.read_gguf(tiny.builtin_path("code-tiny"))
  file_bytes = sum(g.tensor_info(n).nbytes for n in g.tensor_names())
  quant = api.load_model("code-tiny", weights="quantized", compile_cache=False)
  plain = api.load_model("code-tiny", weights="dequantized", compile_cache=False)
  qb, pb = api.weight_bytes(quant), api.weight_bytes(plain)
  assert qb <= 1.15 * file_bytes < pb
  assert quant.weights == "quantized" and plain.weights == "dequantized"
  a = api.generate(quant, prompt="def main(", n_predict=12)
  b = api.generate(plain, prompt="def main(", n_predict=12)
  assert a.tokens == b.tokens


def test_code_tiny_planar_takes_its_file_bytes_and_decodes_within_rounding():
  """weights_impl "planar": the Q8_0 matrices as planes (values and f16 scales: the file's bytes),
  joined as the blocks are; greedy decoding gives the dequantized model's tokens, every decode
  step's logits within float32 rounding of its."""
  g = gguf_io.read_gguf(tiny.builtin_path("code-tiny"))
  file_bytes = sum(g.tensor_info(n).nbytes for n in g.tensor_names())
  planar = api.load_model("code-tiny", weights_impl="planar", compile_cache=False)
  plain = api.load_model("code-tiny", weights="dequantized", compile_cache=False)
  dtypes = {jnp.dtype(x.dtype).name for x in jax.tree_util.tree_leaves([x for _, x in planar.runner.groups])}
  assert {"int8", "float16"} <= dtypes and planar.weights_impl == "planar"    # Q8_0 values and scales planes
  assert api.weight_bytes(planar) <= 1.15 * file_bytes
  runs = []
  for model in (planar, plain):
    rows = []
    res = api.generate(model, prompt="def main(", n_predict=12, on_logits=lambda _, lg: rows.append(np.asarray(lg)))
    runs.append((res.tokens, np.stack(rows)))
  assert runs[0][0] == runs[1][0]
  assert np.abs(runs[0][1] - runs[1][1]).max() <= 1e-4 * np.abs(runs[1][1]).max()


def test_q8_0_tiny_file_loads_quantized_by_default(tmp_path):
  path = tiny.write_tiny_gguf(tmp_path / "t.gguf", weight_type="q8_0")
  model = api.load_model(str(path), compile_cache=False)
  assert model.weights == "quantized"
  assert api.load_model(str(path), weights="dequantized", compile_cache=False).weights == "dequantized"
  assert api.load_model("tiny", compile_cache=False).weights == "dequantized"     # random: nothing stored


def test_bad_quantized_input_is_one_line():
  with pytest.raises(ValueError, match="q3_k.*expected one of"):
    qweights.random_quantized("q3_k", 4, 256)
  with pytest.raises(ValueError, match="rows of 100 values"):
    qweights.random_quantized("q4_k", 4, 100)
  with pytest.raises(api.ParameterError, match="weights 'int4'"):
    api.load_model("code-tiny", weights="int4", compile_cache=False)


def test_weight_arguments_that_do_not_go_together_are_refused_naming_them():
  """Nothing asked for is dropped: a weight_type the preset's rows cannot take, weights 'dequantized'
  beside a weight_type, weights 'quantized' where nothing would be kept; a model with nothing
  quantized reports its weights' product as "none"."""
  for kw, param, what in [
      (dict(preset="tiny", weight_type="q4_k"), "weight_type", "weight_type 'q4_k': blk.0.attn_gate.weight has rows of 64 values, not a multiple of its 256-value block"),
      (dict(preset="tiny", weight_type="q8_0", weights="dequantized"), "weights", "weights 'dequantized' with weight_type 'q8_0'"),
      (dict(preset="tiny", weights="quantized"), "weights", "weights 'quantized' with a preset needs weight_type"),
      (dict(weights="quantized"), "weights", "weights 'quantized': tiny has no matrix in a kept block format"),
      (dict(source="code-tiny", weight_type="q4_k"), "weight_type", "weight_type 'q4_k' draws a preset's matrices"),
  ]:
    source = kw.pop("source", "tiny")
    with pytest.raises(api.ParameterError, match="^" + what) as e:
      api.load_model(source, compile_cache=False, **kw)
    assert e.value.params == (param,)
  assert api.load_model("tiny", weights_impl="planar", compile_cache=False).weights_impl == "none"


def test_preset_draws_quantized_random_weights():
  """`weight_type` gives a preset random blocks of a format, kept quantized (what a quantized file
  of its geometry holds): a fraction of the float32 bytes, and it generates."""
  quant = api.load_model(preset="tiny", weight_type="q4_0", compile_cache=False)
  plain = api.load_model(preset="tiny", compile_cache=False)
  assert quant.weights == "quantized" and plain.weights == "dequantized"
  assert api.weight_bytes(quant) < api.weight_bytes(plain) / 4
  assert len(api.generate(quant, prompt_tokens=[1, 2, 3], n_predict=4).tokens) == 4
  with pytest.raises(api.ParameterError, match="weight_type 'q4_k' draws a preset's matrices.*needs preset="):
    api.load_model("tiny", weight_type="q4_k", compile_cache=False)


def test_cli_weights_flags(capsys):
  """`--weights` / `--weight-type` reach the API: the metrics say which weights ran; a format for a
  GGUF (its types are its own) is one line naming the flag."""
  import json
  from kvjax import cli
  argv = ["generate", "--model=code-tiny", "--prompt-tokens=5,6,7", "--n-predict=3", "--json"]
  runs = {}
  for weights in ("quantized", "dequantized"):
    assert cli.main(argv + [f"--weights={weights}"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs[weights] = line
  assert runs["quantized"]["metrics"]["weights"] == "quantized"
  assert runs["dequantized"]["metrics"]["weights"] == "dequantized"
  assert runs["quantized"]["tokens"] == runs["dequantized"]["tokens"]
  assert cli.main(argv + ["--weight-type=q4_k"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--weight-type" in err[0] and "q4_k" in err[0]


@pytest.mark.parametrize("product", ["xla", "pallas", "pallas_dot", "pallas_q8"])
def test_planar_bfloat16_speculative_output_equals_plain_greedy(tmp_path, monkeypatch, product):
  """A bfloat16 model with Q4_K / Q8_0 / Q4_0 / Q6_K planes: speculative decoding (ngram and MTP drafts)
  gives plain greedy's tokens with either planar product. "xla": a decode row's multiply-and-sum
  and the verify rows' dot share their (bfloat16) products (they split at the 8th token while the
  decode row multiplied the exact values in float32); "pallas" (the GPU's GEMV, interpreted) and
  "pallas_dot" (its tensor-core dots): a row's sums are the same bits whatever other rows its call
  has."""
  monkeypatch.setenv("KVJAX_PLANAR_PRODUCT", product)
  cfg = config_lib.tiny(**WIDE)
  tensors = weights_lib.random_tensors(cfg, 0)
  fmts = ("q4_k", "q8_0", "q4_0", "q6_k")
  for i, name in enumerate(sorted(tensors)):
    if qweights.keeps_quantized(name):
      tensors[name] = qweights.random_quantized(fmts[i % 4], *tensors[name].shape, seed=i)
  path = gguf_io.write_gguf(str(tmp_path / "mixed.gguf"), cfg, tensors, tokenizer.tiny_tokenizer_spec(), weight_type="f32")
  model = api.load_model(path, weights_impl="planar", dtype="bfloat16", compile_cache=False)
  assert model.weights == "quantized" and model.weights_impl == "planar"
  groups = [jax.tree_util.tree_unflatten(st.treedef, lv) for st, lv in model.runner.groups]
  kept = [w for w in jax.tree_util.tree_leaves(groups, is_leaf=qweights.is_quantized)
          if qweights.is_quantized(w)]        # the product is the weights' (static: the steps' key), not the trace's
  assert kept and {w.product for w in kept} == {product}
  prompt = list(range(5, 160))
  plain = api.generate(model, prompt_tokens=prompt, n_predict=32, ignore_eos=True).tokens
  for spec in (api.SpecConfig("ngram", n_max=3, ngram_n=2), api.SpecConfig("mtp", n_max=3)):
    assert api.generate(model, prompt_tokens=prompt, n_predict=32, ignore_eos=True, spec=spec).tokens == plain
