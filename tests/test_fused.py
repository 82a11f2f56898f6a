"""Joined products (kvjax.fused): a model whose same-input matrices are joined computes the logits
of the model without, within float rounding, generates the same greedy tokens, takes the same
weight bytes, and joins only matrices that can be one (dtype, block format)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import api, config as config_lib, engine, fused, model as model_lib, qweights, tiny
from kvjax import weights as weights_lib


def _tiny_model(seed=0):
  cfg, tensors, _ = tiny.load_model_source("tiny", seed=seed, dtype=np.float32, weights="dequantized")
  return engine.build_model(cfg, tensors)


@nnx.jit
def _logits(model, toks):
  logits, hn = model.causal(toks)
  return logits, model.mtp_causal(hn[:-1], toks[1:])


def test_joined_model_has_the_logits_of_the_parts():
  """Every module joins (FFN gate / up, attention q / k / v, Gated DeltaNet qkv / z / beta / alpha):
  the parts are gone, the target's and the MTP head's logits within 1e-5 of the largest."""
  plain, joined = _tiny_model(), _tiny_model()
  cfg = plain.cfg
  n_modules = (cfg.num_layers + 1) + cfg.num_layers + 1    # FFNs (+ MTP), mixers, the MTP's attention
  assert fused.fuse_projections(joined) == n_modules
  assert fused.fuse_projections(joined) == 0                # joined once
  g0 = joined.groups[0]
  assert not hasattr(g0.recurrent[0].ffn, "ffn_gate") and g0.recurrent[0].ffn.fused_rows_ffn_gate == (
      cfg.intermediate_size, cfg.intermediate_size)
  assert g0.recurrent[0].mixer.fused_groups == (("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),)
  toks = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, 20), jnp.int32)
  for a, b in zip(_logits(plain, toks), _logits(joined, toks)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max() and np.array_equal(a.argmax(-1), b.argmax(-1))


def test_a_device_without_room_joins_through_the_host(monkeypatch):
  """Where the device has no free block for a join (`device_room` below the joined bytes), the parts
  are copied to the host, freed on the device, and the joined matrix placed after: the same matrices
  as a join on the device, the parts deleted, the joins on the device again."""
  on_device, through_host = _tiny_model(), _tiny_model()
  fused.fuse_projections(on_device)
  ffn = through_host.groups[0].recurrent[0].ffn
  gate = ffn.ffn_gate.get_value()
  monkeypatch.setattr(fused, "device_room", lambda arrays: 0)
  fused.fuse_projections(through_host)
  assert gate.is_deleted()
  for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(on_device)), nnx.to_flat_state(nnx.state(through_host))):
    a, b = a.get_value(), b.get_value()
    assert isinstance(b, jax.Array) and not b.is_deleted() and np.array_equal(np.asarray(a), np.asarray(b)), path


def test_a_join_without_room_even_through_the_host_stops_the_joins(monkeypatch):
  """The joined matrix finds no block even in its parts' room: the parts go back, the joins stop
  there with a warning, the modules joined so far stay joined, and the model's logits are those
  of the unjoined model within float rounding."""
  plain, model = _tiny_model(), _tiny_model()
  calls, real = [], fused._joined

  def joined_until_full(ws):
    calls.append(1)
    if len(calls) == 4:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00MiB")
    return real(ws)
  monkeypatch.setattr(fused, "device_room", lambda arrays: 0)
  monkeypatch.setattr(fused, "_joined", joined_until_full)
  with pytest.warns(UserWarning, match="no free block of .* MiB for a join; 3 joined, the rest kept apart"):
    assert fused.fuse_projections(model) == 3
  modules = [m for _, m in nnx.iter_graph(model) if type(m).__name__ in fused.FUSED_PRODUCTS]
  assert sum(len(getattr(m, "fused_groups", ())) for m in modules) == 3
  kept = [m for m in modules if not getattr(m, "fused_groups", ())]
  assert kept and all(not d.is_deleted() for m in kept for _, d in nnx.to_flat_state(nnx.state(m))
                      if isinstance(d.get_value(), jax.Array))
  toks = jnp.asarray(np.random.default_rng(4).integers(0, plain.cfg.vocab_size, 12), jnp.int32)
  a, b = np.asarray(_logits(plain, toks)[0]), np.asarray(_logits(model, toks)[0])
  assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


def test_load_model_joins_and_generates_the_same_tokens():
  """`load_model` joins by default (fuse=False keeps the parts): the same weight bytes and the same
  greedy tokens through a streamed cache (copy waves included)."""
  joined = api.load_model("tiny", page_tokens=16, compile_cache=False)
  parts = api.load_model("tiny", page_tokens=16, compile_cache=False, fuse=False)
  assert api.weight_bytes(joined) == api.weight_bytes(parts)
  leaves = [x for _, leaves in joined.runner.groups for x in leaves]
  assert len(leaves) < len([x for _, leaves in parts.runner.groups for x in leaves])
  prompt = [int(t) for t in np.random.default_rng(5).integers(1, 300, 70)]
  outs = [api.generate(m, api.make_kv(m, 140, pool_pages=12), prompt_tokens=prompt, n_predict=48).tokens
          for m in (joined, parts)]
  assert outs[0] == outs[1]


def test_only_matrices_that_can_be_one_join():
  """Q8_0 qkv / z join with each other and F32 beta / alpha with each other (a quantized file's
  mix); blocks of different formats, or a block format beside a dense matrix, do not join."""
  cfg = config_lib.tiny()
  tensors = weights_lib.random_tensors(cfg, 0)
  for i, name in enumerate(sorted(tensors)):
    if name.endswith(("attn_qkv.weight", "attn_gate.weight")):
      n, k = tensors[name].shape
      tensors[name] = qweights.random_quantized("q8_0", n, k, seed=i)
  model = engine.build_model(cfg, tensors.items())
  fused.fuse_projections(model)
  mixer = model.groups[0].recurrent[0].mixer
  assert mixer.fused_groups == (("attn_qkv", "attn_gate"), ("ssm_beta", "ssm_alpha"))
  assert isinstance(mixer.fused_attn_qkv.get_value(), qweights.QuantizedWeight)
  a = qweights.random_quantized("q8_0", 32, 64, seed=1)
  b = qweights.random_quantized("q4_0", 32, 64, seed=2)
  assert fused._joined([a, b]) is None                                    # pylint: disable=protected-access
  assert fused._joined([a, np.zeros((32, 64), np.float32)]) is None        # pylint: disable=protected-access
  j = fused._joined([a, a])                                               # pylint: disable=protected-access
  assert j.shape == (64, 64) and j.fmt == "q8_0"


@pytest.mark.parametrize("impl", ["xla", "fused"])
def test_joined_quantized_products_equal_the_parts(impl):
  """A joined Q4_0 matrix's product, split, equals each part's product (the same rows)."""
  a = qweights.with_dtype(qweights.random_quantized("q4_0", 48, 64, seed=1), "float32")
  b = qweights.with_dtype(qweights.random_quantized("q4_0", 16, 64, seed=2), "float32")
  a, b = (qweights.QuantizedWeight(w.data, w.fmt, w.k, w.dtype_name, impl) for w in (a, b))

  class M(nnx.Module):
    def __init__(self):
      self.p, self.q = nnx.Param(a), nnx.Param(b)

  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 64)), jnp.float32)
  m = M()
  want = model_lib.products(m, x, ("p", "q"))
  fused.FUSED_PRODUCTS["M"] = (("p", "q"),)
  try:
    assert fused.fuse_projections(m) == 1
  finally:
    del fused.FUSED_PRODUCTS["M"]
  got = model_lib.products(m, x, ("p", "q"))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
