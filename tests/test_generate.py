"""kvjax.generate: sampling, micro-batched prefill, the decode loop, teacher-forced logits, the
compile clock, and cache capacity.

Tiny model, float32 compute, float32 KV pages, CPU. Row counts used: 1 (decode),
16 / 64 / 128 (micro-batches), 32 (teacher forcing), 100 (one-shot prompt).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import config, engine, weights
from kvjax.generate import (CompileClock, SamplingParams, SequenceState, generate, prefill, sample_token,
                            teacher_forced_logits)
from kvjax_pallas.page_layout import PageLayout
import reference_model

F32_ROUNDING = 2e-5  # see tests/test_model.py: two float32 evaluation orders of the same math


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def cfg():
  return config.tiny()


@pytest.fixture(scope="module")
def runner(cfg):
  m = engine.build_model(cfg, weights.random_tensors(cfg, 0).items())
  return engine.Runner(m, PageLayout(cfg.num_kv_heads, cfg.head_dim, "f32", "f32", page_tokens=16))


def prompt_of(cfg, n, seed=0):
  return [int(t) for t in np.random.default_rng(500 + seed).integers(0, cfg.vocab_size, n)]


def kv_of(cfg, runner, max_tokens=64):
  return engine.PlainKV(cfg, runner.layout, max_tokens=max_tokens)


def gen(cfg, runner, sampling=SamplingParams(), n_predict=12, prompt=None, **kw):
  prompt = prompt_of(cfg, 12) if prompt is None else prompt
  return generate(runner, kv_of(cfg, runner), prompt, n_predict, sampling=sampling, ubatch=16, **kw)


@pytest.fixture(scope="module")
def greedy(cfg, runner):
  return gen(cfg, runner).tokens


@pytest.fixture(scope="module")
def teacher_logits(cfg, runner, greedy):
  """Logits of prompt + greedy[:-1] in ONE forward (32 rows, 23 valid): rows 11.. predict greedy."""
  seq = prompt_of(cfg, 12) + greedy[:-1]
  toks = np.zeros((32,), np.int32)
  toks[:len(seq)] = seq
  out = runner.forward(toks, 0, len(seq), runner.zero_states(), kv_of(cfg, runner))
  return np.asarray(out.logits_rv[11:])  # [12, V]


# ---------------------------------------------------------------------------
# greedy decoding
# ---------------------------------------------------------------------------

def test_greedy_is_deterministic(cfg, runner, greedy):
  again = gen(cfg, runner)
  assert again.tokens == greedy and len(greedy) == 12
  m = again.metrics
  assert m["prompt_tokens"] == 12 and m["decode_tokens"] == 12
  # the `greedy` fixture compiled every step of this run already
  assert m["compile_ms"] == m["prompt_compile_ms"] == m["predicted_compile_ms"] == 0.0
  assert len(set(greedy)) > 2  # a non-degenerate sequence


def test_greedy_equals_argmax_of_teacher_forced_logits(cfg, runner, greedy, teacher_logits):
  """Decoding token by token picks exactly the argmaxes of the full-sequence forward."""
  assert teacher_logits.shape == (12, cfg.vocab_size)
  assert list(np.argmax(teacher_logits, -1)) == greedy
  # the comparison is not decided by float noise: clear top-1 margins
  top2 = np.sort(teacher_logits, -1)[:, -2:]
  assert np.min(top2[:, 1] - top2[:, 0]) > 1e-3


def test_teacher_forced_logits_in_micro_batches(cfg, runner, greedy, teacher_logits):
  """`teacher_forced_logits` (prefill's micro-batches of 16 rows, every row kept) against the one
  forward: rows 11.. are the greedy tokens' logits, equal within float32 rounding, same argmaxes."""
  seq = prompt_of(cfg, 12) + greedy[:-1]
  got = teacher_forced_logits(runner, kv_of(cfg, runner), seq, ubatch=16)
  assert got.dtype == np.float32 and got.shape == (23, cfg.vocab_size)
  assert rel(got[11:], teacher_logits) < 1e-4
  assert list(np.argmax(got[11:], -1)) == greedy


def test_generate_reports_its_compilation():
  """`CompileClock` counts jax's tracing + compiling: a new jitted shape costs time, a cached one none."""
  f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
  with CompileClock() as cold:
    jax.block_until_ready(f(jnp.ones((7, 3))))
  with CompileClock() as warm:
    jax.block_until_ready(f(jnp.ones((7, 3))))
  assert cold.seconds > 0 and warm.seconds == 0.0
  with CompileClock() as outside:
    pass
  jax.block_until_ready(f(jnp.ones((5, 3))))   # compiles after the clock left: not counted
  assert outside.seconds == 0.0


def test_top_k_1_equals_greedy(cfg, runner, greedy):
  for seed in (0, 5):
    assert gen(cfg, runner, SamplingParams(temperature=1.5, top_k=1, seed=seed)).tokens == greedy


# ---------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------

def test_sampling_reproducible_and_seed_dependent(cfg, runner, greedy):
  sp = lambda s: SamplingParams(temperature=1.0, top_k=50, seed=s)  # noqa: E731
  a = gen(cfg, runner, sp(0)).tokens
  assert gen(cfg, runner, sp(0)).tokens == a
  others = [gen(cfg, runner, sp(s)).tokens for s in (1, 2, 3)]
  assert all(o != a for o in others), others
  assert a != greedy and len(a) == 12


def test_sampled_tokens_lie_in_top_k_of_teacher_forced_logits(cfg, runner):
  prompt = prompt_of(cfg, 12)
  res = gen(cfg, runner, SamplingParams(temperature=2.0, top_k=5, seed=11))
  seq = prompt + res.tokens[:-1]
  toks = np.zeros((32,), np.int32)
  toks[:len(seq)] = seq
  out = runner.forward(toks, 0, len(seq), runner.zero_states(), kv_of(cfg, runner))
  logits = np.asarray(out.logits_rv[11:])
  top5 = np.argsort(-logits, -1)[:, :5]
  assert all(t in top5[i] for i, t in enumerate(res.tokens)), (res.tokens, top5)
  assert any(t != top5[i, 0] for i, t in enumerate(res.tokens))  # not just greedy


N_SAMPLES = 1500


def _freqs(logits_v, params, n=N_SAMPLES):
  counts = np.zeros(logits_v.shape[0])
  for step in range(n):
    counts[sample_token(logits_v, params, step)] += 1
  return counts / n


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.5, 0), (1.0, 2), (2.0, 3)])
def test_sample_token_distribution(temperature, top_k):
  """Empirical frequencies over 1500 steps match softmax(logits / T) restricted to the top k."""
  p = np.array([0.45, 0.25, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0])
  logits = jnp.asarray(np.log(np.maximum(p, 1e-30)), jnp.float32)
  want = np.maximum(p, 1e-30) ** (1.0 / temperature)
  if top_k:
    want[np.argsort(-p)[top_k:]] = 0.0
  want /= want.sum()
  got = _freqs(logits, SamplingParams(temperature=temperature, top_k=top_k, seed=3))
  sigma = np.sqrt(want * (1 - want) / N_SAMPLES)
  assert np.all(np.abs(got - want) <= 4.5 * sigma + 1e-12), (got, want)
  assert np.all(got[want == 0] == 0)


def test_sample_token_reproducible_per_seed_and_step():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal(384), jnp.float32)
  a = [sample_token(logits, SamplingParams(1.0, 0, 7), s) for s in range(40)]
  b = [sample_token(logits, SamplingParams(1.0, 0, 7), s) for s in range(40)]
  c = [sample_token(logits, SamplingParams(1.0, 0, 8), s) for s in range(40)]
  assert a == b and a != c
  assert len(set(a)) > 10  # the step index really changes the draw
  assert sample_token(logits, SamplingParams(), 3) == int(np.argmax(np.asarray(logits)))


@pytest.mark.parametrize("kw,what", [({"temperature": -0.1}, "temperature"),
                                     ({"temperature": float("nan")}, "temperature"),
                                     ({"top_k": -1}, "top_k")])
def test_sampling_params_refuse_bad_values(kw, what):
  with pytest.raises(ValueError, match=what):
    SamplingParams(**kw)


# ---------------------------------------------------------------------------
# the decode loop
# ---------------------------------------------------------------------------

def test_eos_stops_and_on_token_streams(cfg, runner, greedy):
  eos = greedy[4]
  first = greedy.index(eos)
  seen = []
  res = gen(cfg, runner, eos_id=eos, on_token=seen.append)
  assert res.tokens == greedy[:first + 1] and res.tokens[-1] == eos
  assert seen == res.tokens
  one = gen(cfg, runner, n_predict=1)
  assert one.tokens == greedy[:1]


def test_decode_runs_with_the_heap_frozen_and_gives_it_back(cfg, runner, greedy):
  """A full collection in the decode walks only the decode's objects: the heap alive as the decode
  starts is frozen while it runs, unfrozen after; a caller's own freeze is left as it was."""
  import gc
  assert gc.get_freeze_count() == 0
  frozen = []
  res = gen(cfg, runner, on_token=lambda t: frozen.append(gc.get_freeze_count()))
  assert res.tokens == greedy
  assert len(frozen) == len(greedy) and min(frozen) > 0
  assert gc.get_freeze_count() == 0
  gc.freeze()
  try:
    mine = gc.get_freeze_count()
    gen(cfg, runner, n_predict=2)
    assert gc.get_freeze_count() > mine // 2   # not unfrozen (frozen objects may still die)
  finally:
    gc.unfreeze()


def test_sequence_forwards_write_their_states_in_place_with_the_plain_bits(cfg, runner):
  """`SequenceState.forward` (prefill and decode) donates its recurrent states to the group steps
  (`Runner.forward(donate=True)`): the states it gave are deleted after the call, `prime` keeps its
  position and states' values, and the logits equal a chain of non-donating forwards bit for bit."""
  prompt = prompt_of(cfg, 9, seed=3)
  seq = SequenceState(runner, kv_of(cfg, runner))
  given = jax.tree_util.tree_leaves(seq.rec_states)
  seq.forward(prompt)
  assert all(a.is_deleted() for a in given)
  kept = [np.asarray(a) for a in jax.tree_util.tree_leaves(seq.rec_states)]
  seq.prime()
  assert seq.pos == 9 and all(np.array_equal(a, np.asarray(b))
                              for a, b in zip(kept, jax.tree_util.tree_leaves(seq.rec_states)))
  kv = kv_of(cfg, runner)
  out = runner.forward(np.asarray(prompt, np.int32), 0, 9, runner.zero_states(), kv)
  for i, tok in enumerate([5, 17, 2]):
    mine = np.asarray(seq.forward([tok]))
    before = out.rec_states
    out = runner.forward(np.array([tok], np.int32), 9 + i, 1, before, kv)
    assert np.array_equal(mine, np.asarray(out.logits_rv[0])), i
    assert not any(a.is_deleted() for a in jax.tree_util.tree_leaves(before))   # donate=False keeps its inputs


def test_donation_off_keeps_the_states_given(cfg, runner, monkeypatch):
  """`KVJAX_DONATE_STATES=0`: a sequence's forwards leave the states they were given alive (the
  comparison setting); the logits are the donating forwards' bit for bit."""
  prompt = prompt_of(cfg, 7, seed=4)
  donating = SequenceState(runner, kv_of(cfg, runner))
  want = np.asarray(donating.forward(prompt))
  monkeypatch.setenv("KVJAX_DONATE_STATES", "0")
  seq = SequenceState(runner, kv_of(cfg, runner))
  given = jax.tree_util.tree_leaves(seq.rec_states)
  assert np.array_equal(np.asarray(seq.forward(prompt)), want)
  assert not any(a.is_deleted() for a in given)


def test_empty_prompt_refused(cfg, runner):
  with pytest.raises(ValueError, match="empty prompt"):
    gen(cfg, runner, prompt=[])


# ---------------------------------------------------------------------------
# micro-batched prefill
# ---------------------------------------------------------------------------

def test_prefill_micro_batches_give_the_same_logits(cfg, runner):
  """A 100-token prompt in micro-batches of 16 (7 calls, last has 4 valid rows),
  64 (2 calls, last 36 valid) and 128 (1 padded call) vs one unpadded call."""
  prompt = prompt_of(cfg, 100, seed=1)
  one = runner.forward(np.asarray(prompt, np.int32), 0, 100, runner.zero_states(), kv_of(cfg, runner, 128))
  base = np.asarray(one.logits_rv)
  # Two float32 evaluation orders differ by up to the sum of their errors against the float64
  # oracle, and either may be the larger: so each path is held to the oracle (the float32 class
  # of error: F32_ROUNDING, or twice the one-call path's own error where that is larger) and the
  # two to each other within twice that. Seen: on an AVX-512 EPYC the one call 2.2e-5 from the
  # oracle and the 16-row micro-batches 3.8e-5 from it; on another EPYC (2026-12-01) the one
  # call 7.9e-6, the micro-batches 1.7e-5, the two 2.5e-5 apart.
  want = reference_model.forward(cfg, weights.random_tensors(cfg, 0), np.asarray(prompt))
  bound = max(F32_ROUNDING, 2 * rel(base, want))
  assert bound < 1e-4, bound
  finals = {}
  for ub in (16, 64, 128):
    seq = SequenceState(runner, kv_of(cfg, runner, 128))
    rows = [np.asarray(seq.forward(prompt[i:i + ub], pad_to=ub, all_logits=True))
            for i in range(0, 100, ub)]
    got = np.concatenate(rows)
    assert got.shape == base.shape and seq.pos == 100
    e_oracle, e = rel(got, want), rel(got, base)
    assert e_oracle < bound, f"ubatch {ub}: rel err {e_oracle:.2e} vs the oracle (bound {bound:.2e})"
    assert e < 2 * bound, f"ubatch {ub}: rel err {e:.2e} vs one call (bound {2 * bound:.2e})"
    for x, y in zip(jax.tree_util.tree_leaves(seq.rec_states), jax.tree_util.tree_leaves(one.rec_states)):
      assert rel(x, y) < F32_ROUNDING
    # generate.prefill does the same and returns the last row
    seq2 = SequenceState(runner, kv_of(cfg, runner, 128))
    last = np.asarray(prefill(seq2, prompt, ubatch=ub))
    assert rel(last, got[-1]) < 1e-6  # head over 1 row vs all rows: matmul rounding only
    finals[ub] = last
  assert rel(finals[16], finals[128]) < bound


# ---------------------------------------------------------------------------
# cache capacity
# ---------------------------------------------------------------------------

def test_plain_kv_refuses_past_capacity_and_stays_usable(cfg, runner):
  prompt = prompt_of(cfg, 30, seed=2)
  extra = prompt_of(cfg, 5, seed=3)
  kv = kv_of(cfg, runner, max_tokens=32)
  assert kv.max_tokens == 32
  seq = SequenceState(runner, kv)
  prefill(seq, prompt, ubatch=16)
  pool_before = np.asarray(kv.pool_pn)
  states_before = [np.asarray(x) for x in jax.tree_util.tree_leaves(seq.rec_states)]
  with pytest.raises(ValueError, match=r"35 tokens needed, cache holds 32 \(3 more"):
    seq.forward(extra)
  # the refused call changed nothing ...
  assert seq.pos == 30
  np.testing.assert_array_equal(np.asarray(kv.pool_pn), pool_before)
  for x, y in zip(jax.tree_util.tree_leaves(seq.rec_states), states_before):
    np.testing.assert_array_equal(np.asarray(x), y)
  # ... and the cache is still usable: the last 2 slots give the same logits as
  # a sequence that never saw the refused call
  got = [np.asarray(seq.forward([t])) for t in extra[:2]]
  ref_seq = SequenceState(runner, kv_of(cfg, runner, max_tokens=32))
  prefill(ref_seq, prompt, ubatch=16)
  want = [np.asarray(ref_seq.forward([t])) for t in extra[:2]]
  np.testing.assert_array_equal(np.stack(got), np.stack(want))
  # now exactly full: one more token is refused with "1 more"
  with pytest.raises(ValueError, match=r"\(1 more"):
    seq.forward(extra[2:3])
  assert seq.pos == 32


def test_generate_past_capacity_says_how_many_tokens_are_missing(cfg, runner):
  prompt = prompt_of(cfg, 30, seed=2)
  kv = kv_of(cfg, runner, max_tokens=32)
  # prompt 30 -> decode forwards at positions 30, 31 fit, the third needs slot 33
  with pytest.raises(ValueError, match=r"33 tokens needed, cache holds 32 \(1 more"):
    generate(runner, kv, prompt, n_predict=5, ubatch=16)


def test_prefill_of_too_long_prompt_is_refused_before_any_work(cfg, runner):
  """A 40-token prompt into a 32-token cache: refused up front, saying 8 tokens are
  missing, with the sequence left at its earlier state (nothing prefilled)."""
  kv = kv_of(cfg, runner, max_tokens=32)
  seq = SequenceState(runner, kv)
  with pytest.raises(ValueError, match=r"40 tokens needed, cache holds 32 \(8 more"):
    prefill(seq, prompt_of(cfg, 40, seed=4), ubatch=16)
  assert seq.pos == 0, f"prefill refused after feeding {seq.pos} tokens"
  assert not np.asarray(kv.pool_pn).any()
