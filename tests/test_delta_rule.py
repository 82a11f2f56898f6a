"""The gated delta rule (`kvjax_pallas.delta_rule`): the chunked form over a prefill's rows and the rows
form over a decode's or verify's few, every implementation against the float64 oracle, the kernels'
options, padding, the checks; the model with the kernels (`load_model(gdn_impl="triton")`): the
logits of the XLA form within float32 rounding, streamed == plain bit for bit, speculation (its
rollback replaying the verify's rows through the rows kernel) == plain greedy.

CPU (default): small shapes, the kernel in interpret mode.
GPU: `KVJAX_TEST_GPU=1 JAX_PLATFORMS=cuda pytest tests/test_delta_rule.py` runs the kernel class
at the 27B's heads (48 x 128) compiled.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import jax.numpy as jnp

from kvjax_pallas.delta_rule import api, reference as ref, rows as rows_kernel, triton

ON_GPU = os.environ.get("KVJAX_TEST_GPU", "0") == "1"
INTERPRET = not ON_GPU
# (rows, heads, dk, dv, options): rows not a multiple of the chunk are padded inside
CASES = ([(256, 48, 128, 128, triton.DeltaRuleOptions()), (1000, 48, 128, 128, triton.DeltaRuleOptions())]
         if ON_GPU else
         [(64, 2, 16, 16, triton.DeltaRuleOptions(chunk=16, block_v=16)),
          (80, 3, 32, 32, triton.DeltaRuleOptions(chunk=32, block_v=16, sub_block=16)),
          (72, 2, 32, 16, triton.DeltaRuleOptions(chunk=64, block_v=16, sub_block=0))])
TOL = 1e-5


def _rel(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def _inputs(seed, s, h, dk, dv):
  return ref.random_inputs(seed, s, h, dk, dv)


@pytest.mark.parametrize("impl", api.IMPLEMENTATIONS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_the_f64_oracle(impl, case):
  s, h, dk, dv, opts = CASES[case]
  args = _inputs(case, s, h, dk, dv)
  want_state, want_o = ref.delta_rule_numpy(*args)
  state, o = api.delta_rule(*[jnp.asarray(x) for x in args], implementation=impl, options=opts,
                            interpret=INTERPRET)
  assert o.shape == (s, h, dv) and state.shape == (h, dk, dv)
  assert _rel(o, want_o) <= TOL and _rel(state, want_state) <= TOL, (_rel(o, want_o), _rel(state, want_state))


def test_every_option_gives_the_same_result():
  """The substitution (row a step, blocks), chunk, value block, the scan in one call or two
  and the precision names change how, not what: each within float32 rounding of the default."""
  s, h, dk, dv = 96, 2, 32, 32
  args = [jnp.asarray(x) for x in _inputs(5, s, h, dk, dv)]
  base = triton.DeltaRuleOptions(chunk=32, block_v=16, sub_block=16)
  want_state, want_o = ref.delta_rule_numpy(*args)
  variants = [dataclasses.replace(base, sub_block=0), dataclasses.replace(base, sub_block=32),
              dataclasses.replace(base, chunk=16, sub_block=16), dataclasses.replace(base, block_v=32),
              dataclasses.replace(base, num_stages=2, num_warps=8), dataclasses.replace(base, split_output=False),
              dataclasses.replace(base, split_output=False, sub_block=0, block_v=32)]
  for opts in [base] + variants:
    state, o = triton.delta_rule_chunked_triton(*args, options=opts, interpret=INTERPRET)
    assert _rel(o, want_o) <= TOL and _rel(state, want_state) <= TOL, opts
  for prec in triton.PRECISIONS:   # the interpreter computes float32 whatever the name
    state, o = triton.delta_rule_chunked_triton(*args, options=base, precision=prec, interpret=INTERPRET)
    assert _rel(o, want_o) <= (1e-2 if prec == "tf32" else TOL), prec


def test_value_blocks_past_the_head_and_no_rows():
  """A value block wider than the value head runs the head as one block; no rows give the state as
  it was and no output; nested lists are taken as arrays."""
  args = _inputs(4, 20, 2, 32, 16)
  want_state, want_o = ref.delta_rule_numpy(*args)
  state, o = api.delta_rule(*args, implementation="triton", interpret=INTERPRET,
                            options=triton.DeltaRuleOptions(chunk=16, block_v=32))
  assert _rel(o, want_o) <= TOL and _rel(state, want_state) <= TOL
  empty = [args[0]] + [x[:0] for x in args[1:]]
  for impl in api.IMPLEMENTATIONS:
    state, o = api.delta_rule(*empty, implementation=impl, interpret=INTERPRET)
    assert o.shape == (0, 2, 16) and np.array_equal(np.asarray(state), args[0])
  lists = [x.tolist() for x in args]
  np.testing.assert_array_equal(np.asarray(api.delta_rule(*lists)[1]), np.asarray(api.delta_rule(*args)[1]))


def test_rows_of_zeros_leave_the_state_alone():
  """Padding rows (k = v = g = beta = 0, as the model masks rows past n_valid) change nothing:
  the state after S rows is the state after S rows and a tail of zeros, and the outputs of the S
  rows are the same."""
  s, h, d = 40, 2, 16
  args = _inputs(9, s, h, d, d)
  padded = [args[0]] + [np.concatenate([x, np.zeros((24,) + x.shape[1:], np.float32)]) for x in args[1:]]
  opts = triton.DeltaRuleOptions(chunk=16, block_v=16)
  st, o = triton.delta_rule_chunked_triton(*args, options=opts, interpret=INTERPRET)
  st_p, o_p = triton.delta_rule_chunked_triton(*padded, options=opts, interpret=INTERPRET)
  np.testing.assert_allclose(np.asarray(st_p), np.asarray(st), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(o_p)[:s], np.asarray(o), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change,what", [
    (dict(k=(10, 2, 16)), "k has shape (10, 2, 16), needs (12, 2, 16)"),
    (dict(g=(12, 3)), "g has shape (12, 3), needs (12, 2)"),
    (dict(state=(2, 16, 8)), "state has shape (2, 16, 8), needs (2, 16, 16)"),
])
def test_operands_that_do_not_agree_are_named(change, what):
  shapes = dict(state=(2, 16, 16), q=(12, 2, 16), k=(12, 2, 16), v=(12, 2, 16), g=(12, 2), beta=(12, 2))
  shapes.update(change)
  args = [jnp.zeros(shapes[n], jnp.float32) for n in ("state", "q", "k", "v", "g", "beta")]
  for impl in api.IMPLEMENTATIONS:
    with pytest.raises(ValueError, match="^delta_rule: " + what.replace("(", r"\(").replace(")", r"\)")):
      api.delta_rule(*args, implementation=impl, interpret=True)


@pytest.mark.parametrize("kw,what", [
    (dict(options=triton.DeltaRuleOptions(chunk=48)), "chunk is 48, needs a power of two >= 16"),
    (dict(options=triton.DeltaRuleOptions(chunk=16, block_v=16, sub_block=32)), "sub_block 32"),
    (dict(options=triton.DeltaRuleOptions(chunk=16, sub_block=8)), "sub_block 8, needs 0 or a power of two >= 16"),
    (dict(options=triton.DeltaRuleOptions(num_warps=0)), "options.num_warps is 0, needs >= 1"),
    (dict(options=triton.DeltaRuleOptions(chunk="64")), "options.chunk must be an int, got '64'"),
    (dict(options={"chunk": 16}), "options must be a DeltaRuleOptions, got dict"),
    (dict(precision="f16"), "precision 'f16', needs one of"),
    (dict(implementation="cuda"), "implementation 'cuda'"),
])
def test_what_the_kernel_cannot_take_is_refused(kw, what):
  args = [jnp.asarray(x) for x in _inputs(1, 20, 2, 32, 32)]
  kw = dict(implementation="triton", interpret=True) | kw
  with pytest.raises(ValueError, match=what):
    api.delta_rule(*args, **kw)
  small = [jnp.asarray(x) for x in _inputs(1, 20, 2, 8, 8)]   # the reference takes any head size
  assert api.delta_rule(*small)[1].shape == (20, 2, 8)
  with pytest.raises(ValueError, match="head_dim \\(dk\\) is 8, needs a power of two >= 16"):
    api.delta_rule(*small, implementation="triton", interpret=True)


# the rows form: (rows, heads, dk, dv, options)
ROW_CASES = ([(1, 48, 128, 128, rows_kernel.RowsOptions()), (4, 48, 128, 128, rows_kernel.RowsOptions()),
              (8, 48, 128, 128, rows_kernel.RowsOptions(block_v=64))] if ON_GPU else
             [(1, 3, 16, 32, rows_kernel.RowsOptions(block_v=16)), (4, 2, 32, 16, rows_kernel.RowsOptions()),
              (6, 2, 16, 16, rows_kernel.RowsOptions(block_v=16))])


@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("impl", api.IMPLEMENTATIONS)
@pytest.mark.parametrize("case", range(len(ROW_CASES)))
def test_rows_form_matches_the_f64_oracle(case, impl, capture):
  """delta_rule_rows: the state after the last row (or after every row, `capture`) and the outputs."""
  s, h, dk, dv, opts = ROW_CASES[case]
  args = _inputs(10 + case, s, h, dk, dv)
  want_state, want_o = ref.delta_rule_numpy(*args)
  state, o = api.delta_rule_rows(*[jnp.asarray(x) for x in args], implementation=impl, capture=capture,
                                 options=opts, interpret=INTERPRET)
  assert o.shape == (s, h, dv) and state.shape == ((s, h, dk, dv) if capture else (h, dk, dv))
  assert _rel(o, want_o) <= TOL and _rel(state[-1] if capture else state, want_state) <= TOL
  if capture:   # row t's state: the oracle over rows 0..t
    for t in range(s):
      assert _rel(state[t], ref.delta_rule_numpy(args[0], *[x[:t + 1] for x in args[1:]])[0]) <= TOL, t


@pytest.mark.parametrize("impl", api.IMPLEMENTATIONS)
@pytest.mark.parametrize("case", range(len(ROW_CASES)))
def test_rows_by_count_and_one_by_one_give_the_captured_states(case, impl):
  """The first n rows (`n_rows`, traced) give the state `capture` keeps after row n - 1 bit for bit (what a
  replayed rollback relies on); rows one call each give the states and outputs of one call over them: bit for
  bit where the kernel is compiled (on a GPU; the interpreter runs XLA's CPU programs, whose fusion of a
  one-row call differs), within float32 rounding in the interpreter."""
  s, h, dk, dv, opts = ROW_CASES[case]
  args = [jnp.asarray(x) for x in _inputs(20 + case, s, h, dk, dv)]
  run = lambda *a, **k: api.delta_rule_rows(*a, implementation=impl, options=opts, interpret=INTERPRET, **k)
  states, o = run(*args, capture=True)
  for n in range(1, s + 1):
    np.testing.assert_array_equal(np.asarray(run(*args, jnp.int32(n))[0]), np.asarray(states[n - 1]))
  state, outs = args[0], []
  for t in range(s):
    state, o_t = run(state, *[x[t:t + 1] for x in args[1:]])
    outs.append(o_t)
    if ON_GPU or impl == "reference":
      np.testing.assert_array_equal(np.asarray(state), np.asarray(states[t]))
    else:
      np.testing.assert_allclose(np.asarray(state), np.asarray(states[t]), rtol=1e-6, atol=1e-6)
  if ON_GPU:
    np.testing.assert_array_equal(np.concatenate(outs), np.asarray(o))
  else:
    np.testing.assert_allclose(np.concatenate(outs), np.asarray(o), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw,what", [
    (dict(options=rows_kernel.RowsOptions(block_v=24)), "block_v is 24, needs a power of two >= 16"),
    (dict(options=rows_kernel.RowsOptions(num_warps=0)), "num_warps is 0, needs an int >= 1"),
    (dict(options=triton.DeltaRuleOptions()), "options must be a RowsOptions, got DeltaRuleOptions"),
    (dict(implementation="cuda"), "implementation 'cuda'"),
])
def test_what_the_rows_kernel_cannot_take_is_refused(kw, what):
  args = [jnp.asarray(x) for x in _inputs(2, 3, 2, 32, 32)]
  with pytest.raises(ValueError, match=what):
    api.delta_rule_rows(*args, **(dict(implementation="triton", interpret=True) | kw))
  with pytest.raises(ValueError, match="^delta_rule: k has shape \\(2, 2, 32\\), needs \\(3, 2, 32\\)"):
    api.delta_rule_rows(args[0], args[1], args[2][:2], *args[3:], implementation="triton", interpret=True)
  small = [jnp.asarray(x) for x in _inputs(1, 3, 2, 8, 8)]   # the reference takes any head size
  assert api.delta_rule_rows(*small)[1].shape == (3, 2, 8)
  with pytest.raises(ValueError, match="head_dim \\(dk\\) is 8, needs a power of two >= 16"):
    api.delta_rule_rows(*small, implementation="triton", interpret=True)


def _tiny_gguf_with_heads_of(head_dim: int, folder) -> str:
  """A tiny GGUF whose Gated DeltaNet heads are `head_dim` wide."""
  from kvjax import gguf_io, tiny, tokenizer, weights
  cfg = tiny.tiny_config(linear_head_dim=head_dim)
  return gguf_io.write_gguf(str(folder / f"tiny-gdn{head_dim}.gguf"), cfg, weights.random_tensors(cfg, 0),
                            tokenizer.tiny_tokenizer_spec())


@pytest.mark.skipif(ON_GPU, reason="the tiny model runs on the CPU")
def test_the_models_prefill_with_the_kernel(tmp_path):
  """load_model(gdn_impl="triton"): the teacher-forced logits of the XLA form within float32
  rounding; a streamed cache gives the plain cache's tokens and logits bit for bit (both prefill
  through the chunked kernel and decode through the rows kernel); speculation (MTP, ngram) gives
  plain greedy's tokens; a bad name, and heads the kernel cannot take, are refused naming gdn_impl."""
  from kvjax import api as kapi
  from tiny_setup import assert_same_logits
  prompt = [int(t) for t in np.random.default_rng(3).integers(0, 381, 70)]
  xla = kapi.load_model("tiny", page_tokens=32)
  model = kapi.load_model("tiny", page_tokens=32, gdn_impl="triton")
  a = np.asarray(kapi.teacher_forced_logits(xla, prompt))
  b = np.asarray(kapi.teacher_forced_logits(model, prompt))
  assert 0 < np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(a))    # another form, float32 rounding apart
  runs = []
  for kv in (None, kapi.make_kv(model, 100, pool_pages=4)):
    rows = []
    res = kapi.generate(model, kv, prompt_tokens=prompt, n_predict=12, ignore_eos=True, ubatch=32,
                        on_logits=lambda _, lg: rows.append(np.asarray(lg)))
    assert res.metrics["gdn_impl"] == "triton"
    runs.append((res.tokens, np.stack(rows)))
  assert runs[0][0] == runs[1][0]
  assert_same_logits(runs[1][1], runs[0][1])
  for draft in ("mtp", "ngram"):   # verify rows through the rows kernel, rollback replaying them through it
    spec = kapi.SpecConfig(draft, n_max=3, ngram_n=2)
    res = kapi.generate(model, kapi.make_kv(model, kapi.context_tokens(70, 12, spec), pool_pages=8),
                        prompt_tokens=prompt, n_predict=12, ignore_eos=True, ubatch=32, spec=spec)
    assert res.tokens == runs[0][0] and res.metrics["verify_forwards"] >= 1, draft
  assert xla.gdn_impl == "xla" and model.gdn_impl == "triton"     # "auto" on a CPU: XLA's form
  with pytest.raises(kapi.ParameterError, match="gdn_impl 'pallas': expected auto, xla or triton"):
    kapi.load_model("tiny", gdn_impl="pallas")
  with pytest.raises(kapi.ParameterError, match="gdn_impl 'triton': the model's Gated DeltaNet heads: "
                                                "delta_rule: head_dim \\(dk\\) is 24, needs a power of two >= 16"):
    kapi.load_model(_tiny_gguf_with_heads_of(24, tmp_path), gdn_impl="triton")


def test_the_rows_form_can_be_set_apart(tmp_path, monkeypatch):
  """KVJAX_GDN_ROWS (for comparisons) sets the form of a decode's and verify's rows apart from gdn_impl's:
  "xla" keeps XLA's token scan beside the chunked kernel, "triton" takes the rows kernel beside XLA's chunked
  form (the rollback replays by it); a bad value, and heads the kernel cannot take, are refused naming the
  variable before the weights are placed."""
  from kvjax import api as kapi
  monkeypatch.setenv("KVJAX_GDN_ROWS", "xla")
  assert kapi.load_model("tiny", page_tokens=32, gdn_impl="triton").runner.gdn_form == ("xla", True)
  monkeypatch.setenv("KVJAX_GDN_ROWS", "triton")
  model = kapi.load_model("tiny", page_tokens=32)
  assert model.gdn_impl == "xla" and model.runner.gdn_form == ("triton", True)
  with pytest.raises(kapi.ParameterError, match="^KVJAX_GDN_ROWS=triton: the model's Gated DeltaNet heads: "
                                                "delta_rule: head_dim \\(dk\\) is 24"):
    kapi.load_model(_tiny_gguf_with_heads_of(24, tmp_path))
  monkeypatch.setenv("KVJAX_GDN_ROWS", "pallas")
  with pytest.raises(kapi.ParameterError, match="^KVJAX_GDN_ROWS=.pallas.: expected xla, triton or fused"):
    kapi.load_model("tiny", page_tokens=32)
  monkeypatch.delenv("KVJAX_GDN_ROWS")
  assert kapi.load_model("tiny", page_tokens=32, gdn_impl="triton").runner.gdn_form == ("triton", True)


def test_auto_picks_the_kernels_on_one_gpu_where_they_take_the_heads():
  """gdn_impl "auto" (load_model's default): "triton" on one GPU for heads the kernels take; "xla"
  on a CPU, across devices (the kernels inside a shard_map are not measured) and for other heads."""
  from kvjax import model as kmodel
  from kvjax import tiny
  cfg, odd = tiny.tiny_config(), tiny.tiny_config(linear_head_dim=24)
  assert kmodel.check_chunk_form(cfg, "auto", "gpu", 1) == "triton"
  assert [kmodel.check_chunk_form(c, "auto", b, n) for c, b, n in
          ((cfg, "cpu", 1), (cfg, "gpu", 2), (odd, "gpu", 1))] == ["xla"] * 3
  assert kmodel.check_chunk_form(odd, "xla", "gpu", 1) == "xla"
  with pytest.raises(ValueError, match="gdn_impl 'triton': the model's Gated DeltaNet heads"):
    kmodel.check_chunk_form(odd, "triton", "gpu", 1)
