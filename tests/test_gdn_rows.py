"""kvjax_pallas.delta_rule.gdn_rows: a Gated DeltaNet layer's rows from its projections in one kernel (conv,
gates, norms, delta rule) against the jnp reference, padding rows as no-ops, the new conv window, the rows it
hands a replayed rollback (the rows kernel over them by count = the kernel's own states), the checks, the Triton
lowering; the model with `KVJAX_GDN_ROWS=fused`: streamed == plain bit for bit, speculation == plain greedy.

CPU (default): small heads, interpreted. GPU: `KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda,cpu pytest tests/test_gdn_rows.py
-k gpu` at the 27B's heads, compiled."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from kvjax_pallas.delta_rule import api, gdn_rows as gr

SMALL = gr.GdnHeads(2, 4, 16, 4, 1e-6)
BIG = gr.GdnHeads(16, 48, 128, 4, 1e-6)


def _inputs(hd, s, seed=0, extra=64):
  """(conv window, the joined projections [S, C + extra + 2H], weights, state, starts)."""
  rng = np.random.default_rng(seed)
  c, h, d = hd.conv_dim, hd.value_heads, hd.head_dim
  f = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
  y = f(s, c + extra + 2 * h)
  starts = (0, c + extra, c + extra + h)
  return (f(hd.conv_kernel - 1, c), y, f(c, hd.conv_kernel, scale=0.5), f(h), -jnp.asarray(rng.random(h) + 0.5,
                                                                                             jnp.float32),
          f(h, d, d, scale=0.1), starts)


@pytest.mark.parametrize("s,n_valid", [(1, 1), (4, 4), (4, 2), (3, 0)])
def test_gdn_rows_is_its_reference(s, n_valid):
  """Outputs, state and the new conv window of the interpreted kernel equal the jnp reference within float32
  rounding; rows at and past n_valid leave the state alone (n_valid 0: the state as it was, the window too)."""
  cs, y, w, dtb, ah, st, starts = _inputs(SMALL, s, seed=s + n_valid)
  got = gr.gdn_rows(cs, y, y, y, w, dtb, ah, st, n_valid, hd=SMALL, starts=starts, interpret=True)
  want = gr.gdn_rows_reference(cs, y, y, y, w, dtb, ah, st, n_valid, hd=SMALL, starts=starts)
  for name, a, b in zip(("o", "state", "conv"), got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)
  if n_valid == 0:
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(st), rtol=1e-6)
    assert np.array_equal(np.asarray(got[2]), np.asarray(cs))


def test_replayed_rows_by_count_give_the_kernels_states():
  """With `rows`, the kernel hands back each row's delta-rule inputs: the rows kernel over the first j + 1 of them
  equals this kernel's own state after j + 1 rows (trip count j + 1), bit for bit; the outputs and state with `rows`
  are those without."""
  cs, y, w, dtb, ah, st, starts = _inputs(SMALL, 4, seed=9)
  full = gr.gdn_rows(cs, y, y, y, w, dtb, ah, st, 3, hd=SMALL, starts=starts, rows=True, interpret=True)
  plain = gr.gdn_rows(cs, y, y, y, w, dtb, ah, st, 3, hd=SMALL, starts=starts, interpret=True)
  for a, b in zip(full[:3], plain):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  k, v, g, beta = full[3:]
  assert np.all(np.asarray(g)[3] == 0) and np.all(np.asarray(beta)[3] == 0)   # the padding row: a no-op
  for j in range(4):
    replay, _ = api.delta_rule_rows(st, k, k, v, g, beta, j + 1, implementation="triton", interpret=True)
    by_count = gr.gdn_rows(cs, y, y, y, w, dtb, ah, st, 3, j + 1, hd=SMALL, starts=starts, interpret=True)[1]
    assert np.array_equal(np.asarray(replay), np.asarray(by_count)), j


def test_captured_states_and_windows_are_those_by_count():
  """`capture`: the state after row t equals the kernel's state with trip count t + 1 bit for bit, the conv window
  after row t is rows t + 1 .. t + K - 1 of [window; rows] (padding rows' inputs included, as XLA's form captures
  them), and the outputs are those without capture."""
  cs, y, w, dtb, ah, st, starts = _inputs(SMALL, 4, seed=11)
  o, states, windows = gr.gdn_rows(cs, y, y, y, w, dtb, ah, st, 3, hd=SMALL, starts=starts, capture=True,
                                   interpret=True)
  plain = gr.gdn_rows(cs, y, y, y, w, dtb, ah, st, 3, hd=SMALL, starts=starts, interpret=True)
  assert np.array_equal(np.asarray(o), np.asarray(plain[0])) and states.shape == (4,) + st.shape
  xpad = np.concatenate([np.asarray(cs), np.asarray(y)[:, :SMALL.conv_dim]])
  for t in range(4):
    by_count = gr.gdn_rows(cs, y, y, y, w, dtb, ah, st, 3, t + 1, hd=SMALL, starts=starts, interpret=True)[1]
    assert np.array_equal(np.asarray(states[t]), np.asarray(by_count)), t
    assert np.array_equal(np.asarray(windows[t]), xpad[t + 1:t + 4]), t


def test_what_gdn_rows_cannot_take_is_refused():
  cs, y, w, dtb, ah, st, starts = _inputs(SMALL, 2)
  with pytest.raises(ValueError, match=r"^gdn_rows: conv_w must be \(128, 4\), got \(128, 3\)$"):
    gr.gdn_rows(cs, y, y, y, w[:, :3], dtb, ah, st, 2, hd=SMALL, starts=starts, interpret=True)
  with pytest.raises(ValueError, match=r"^gdn_rows: b must be \[2, >= 196\] \(columns 192..196\), got \(2, 195\)$"):
    gr.gdn_rows(cs, y, y[:, :195], y, w, dtb, ah, st, 2, hd=SMALL, starts=starts, interpret=True)
  with pytest.raises(ValueError, match=r"^gdn_rows: state must be \(4, 16, 16\)"):
    gr.gdn_rows(cs, y, y, y, w, dtb, ah, st[:, :8], 2, hd=SMALL, starts=starts, interpret=True)
  with pytest.raises(ValueError, match=r"head_dim \(dk\) is 24"):
    gr.gdn_rows(cs, y, y, y, w, dtb, ah, st, 2, hd=gr.GdnHeads(2, 4, 24, 4, 1e-6), starts=starts, interpret=True)


def test_gdn_rows_lowers_for_the_triton_backend():
  """At the 27B's heads (16 key, 48 value heads of 128; the joined output's 16,480 columns), with and without the
  rows, the kernel passes Pallas' Triton lowering for a CUDA target."""
  from jax import export
  from kvjax_pallas.delta_rule import triton
  if triton._pltriton is None:   # pylint: disable=protected-access
    pytest.skip("this jax has no Pallas Triton backend")
  f32, c = jnp.float32, BIG.conv_dim
  args = [jax.ShapeDtypeStruct(shape, f32) for shape in ((3, c), (4, 16480), (c, 4), (48,), (48,), (48, 128, 128))]
  args += [jax.ShapeDtypeStruct((), jnp.int32)] * 2
  for rows in (False, True):
    fn = lambda cs, y, w, dtb, ah, st, nv, n, rows=rows: gr.gdn_rows(cs, y, y, y, w, dtb, ah, st, nv, n, hd=BIG,
                                                                     starts=(0, 16384, 16432), rows=rows)
    exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 1


def test_gpu_gdn_rows_compiled():
  """Compiled (KVJAX_TEST_GPU=1), at the 27B's heads: the reference within float32 rounding; rows one call each
  equal rows together bit for bit; the rows kernel over the handed rows by count equals the kernel's state by
  count bit for bit (what the replayed rollback needs)."""
  cs, y, w, dtb, ah, st, starts = _inputs(BIG, 4, seed=3, extra=6144)
  got = gr.gdn_rows(cs, y, y, y, w, dtb, ah, st, 4, hd=BIG, starts=starts, rows=True)
  want = gr.gdn_rows_reference(cs, y, y, y, w, dtb, ah, st, 4, hd=BIG, starts=starts)
  for a, b in zip(got[:3], want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  c1, s1 = cs, st
  for t in range(4):
    o, s1, c1 = gr.gdn_rows(c1, y[t:t + 1], y[t:t + 1], y[t:t + 1], w, dtb, ah, s1, 1, hd=BIG, starts=starts)
    assert np.array_equal(np.asarray(o[0]), np.asarray(got[0][t])), t
  assert np.array_equal(np.asarray(s1), np.asarray(got[1])) and np.array_equal(np.asarray(c1), np.asarray(got[2]))
  k, v, g, beta = got[3:]
  for j in range(4):
    replay, _ = api.delta_rule_rows(st, k, k, v, g, beta, j + 1, implementation="triton")
    by_count = gr.gdn_rows(cs, y, y, y, w, dtb, ah, st, 4, j + 1, hd=BIG, starts=starts)[1]
    assert np.array_equal(np.asarray(replay), np.asarray(by_count)), j


def test_the_model_with_fused_rows(monkeypatch):
  """KVJAX_GDN_ROWS=fused: the decode's and verify's rows through this kernel (interpreted): the first decode row's
  logits within float32 rounding of XLA's form; a streamed cache's tokens and logits the plain cache's bit for bit;
  speculation (MTP, ngram; the replayed rollback steps the handed rows through the rows kernel, the device and host
  rollbacks keep the states the kernel captures) gives plain greedy's tokens."""
  from kvjax import api as kapi
  from tiny_setup import assert_same_logits
  prompt = [int(t) for t in np.random.default_rng(4).integers(0, 381, 40)]
  xla = kapi.load_model("tiny", page_tokens=32)
  monkeypatch.setenv("KVJAX_GDN_ROWS", "fused")
  model = kapi.load_model("tiny", page_tokens=32)
  assert model.runner.gdn_form == ("fused", True)
  runs = []
  for m, kv in ((xla, None), (model, None), (model, kapi.make_kv(model, 60, pool_pages=4))):
    rows = []
    res = kapi.generate(m, kv, prompt_tokens=prompt, n_predict=10, ignore_eos=True, ubatch=32,
                        on_logits=lambda _, lg: rows.append(np.asarray(lg)))
    runs.append((res.tokens, np.stack(rows)))
  a, b = runs[0][1][1], runs[1][1][1]                  # the first decode row (after the same prefill and token)
  assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(a))
  assert runs[1][0] == runs[2][0]
  assert_same_logits(runs[2][1], runs[1][1])
  for draft, rollback in (("mtp", "replay"), ("ngram", "replay"), ("mtp", "device"), ("ngram", "host")):
    spec = kapi.SpecConfig(draft, n_max=3, ngram_n=2, rollback=rollback)
    res = kapi.generate(model, kapi.make_kv(model, kapi.context_tokens(40, 10, spec), pool_pages=8),
                        prompt_tokens=prompt, n_predict=10, ignore_eos=True, ubatch=32, spec=spec)
    assert res.tokens == runs[1][0] and res.metrics["verify_forwards"] >= 1, (draft, rollback)
