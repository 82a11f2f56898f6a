"""Speculative decoding: drafts verified by the target, recurrent-state rollback, KV truncation."""

import jax
import numpy as np
import pytest

from kvjax import engine, generate, speculative
from kvjax.streaming import StreamedKV, fixed_split
from tiny_setup import build_tiny_runner

N = 48


@pytest.fixture(scope="module")
def setup():
  cfg, runner, layout = build_tiny_runner(0, page_tokens=16)
  prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 70)]
  plain = generate.generate(runner, engine.PlainKV(cfg, layout, 70 + N + 8), prompt, N, ubatch=32)
  return cfg, layout, runner, prompt, plain.tokens


def _oracle(prompt, truth, wrong_every):
  """Proposes the true continuation, with the 2nd draft wrong on every `wrong_every`-th round."""
  rounds = [0]

  def drafter(history, m):
    rounds[0] += 1
    k = len(history) - len(prompt)       # tokens generated so far
    d = list(truth[k:k + m])
    if wrong_every and rounds[0] % wrong_every == 0 and len(d) >= 2:
      d[1] = (d[1] + 1) % 384
    return d
  return drafter


@pytest.mark.parametrize("wrong_every", [0, 2, 1])
def test_oracle_drafts_accept_reject_and_roll_back(setup, wrong_every):
  cfg, layout, runner, prompt, truth = setup
  kv = engine.PlainKV(cfg, layout, 70 + N + 8)
  res = speculative.generate_speculative(runner, kv, prompt, N, speculative.DraftParams("ngram", n_max=4),
                                         ubatch=32, drafter=_oracle(prompt, truth, wrong_every))
  assert res.tokens == truth
  m = res.metrics
  assert m["draft_accepted"] > 0 and m["spec_type"] == "custom"   # the oracle drafter
  assert m["draft_acceptance"] == m["draft_accepted"] / m["draft_generated"]
  rounds = np.asarray(m["draft_rounds"])      # [drafts, accepted] per verify round
  assert len(rounds) == m["verify_forwards"] and rounds.sum(0).tolist() == [m["draft_generated"],
                                                                          m["draft_accepted"]]
  if wrong_every == 1:   # the oracle's second draft is always wrong: at most one accepted a round
    assert rounds[:, 1].max() <= 1 and (rounds[:, 0] >= 2).any()
  if wrong_every == 0:
    assert m["draft_accepted"] == m["draft_generated"]
    assert m["verify_forwards"] < N // 3          # 4 drafts + 1 per forward
  else:
    assert m["draft_accepted"] < m["draft_generated"]   # rejections happened and rolled back
  assert m["realized_verify_width"] > 1.5


def test_streamed_speculative_equals_plain(setup):
  cfg, layout, runner, prompt, truth = setup
  max_tokens = 70 + N + 8
  kv = StreamedKV(cfg, layout, max_tokens, fixed_split(12, 3, max_tokens, layout, copy_pages=2))
  res = speculative.generate_speculative(runner, kv, prompt, N, speculative.DraftParams("ngram", n_max=3),
                                         ubatch=32, drafter=_oracle(prompt, truth, 2))
  assert res.tokens == truth
  assert kv.metrics()["streamed_pages"] > 0
  # rejected rows were truncated from the host history: it holds the committed tokens only (the
  # prompt and the generated tokens fed back; the last one may or may not have been fed)
  assert kv.histories["target"].tokens[0] in (70 + N - 1, 70 + N)


def test_mtp_drafting_equals_plain_greedy(setup):
  """The attached MTP head drafts (random weights: few acceptances); output is unchanged."""
  cfg, layout, runner, prompt, truth = setup
  kv = engine.PlainKV(cfg, layout, 70 + N + 8)
  res = speculative.generate_speculative(runner, kv, prompt, N, speculative.DraftParams("mtp", n_max=3),
                                         ubatch=32)
  assert res.tokens == truth
  assert res.metrics["draft_generated"] >= N // 2 and res.metrics["spec_type"] == "mtp"


def test_ngram_drafting_equals_plain_greedy_and_names_its_drafter(setup):
  cfg, layout, runner, prompt, truth = setup
  kv = engine.PlainKV(cfg, layout, 70 + N + 8)
  res = speculative.generate_speculative(runner, kv, prompt, N, speculative.DraftParams("ngram", n_max=3, ngram_n=2),
                                         ubatch=32)
  assert res.tokens == truth
  m = res.metrics
  assert m["spec_type"] == "ngram" and 0 <= m["draft_accepted"] <= m["draft_generated"]
  assert not any(k.startswith("mtp_") for k in m)


def test_rollback_state_is_the_captured_row(setup):
  """capture_states returns the state after each row; row j equals a forward over rows 0..j."""
  cfg, layout, runner, prompt, _ = setup
  rows = np.array(prompt[:5], np.int32)
  kv = engine.PlainKV(cfg, layout, 32)
  cap = runner.forward(rows, 0, 5, runner.zero_states(), kv, chunked=False, capture_states=True)
  for j in (0, 2, 4):
    kv2 = engine.PlainKV(cfg, layout, 32)
    ref = runner.forward(rows[:j + 1], 0, j + 1, runner.zero_states(), kv2, chunked=False)
    got = engine.select_row(cap.rec_states, j)
    ga = [np.asarray(x) for x in jax.tree.leaves(got)]
    ra = [np.asarray(x) for x in jax.tree.leaves(ref.rec_states)]
    assert len(ga) == len(ra) == 2 * sum(runner.n_recurrent)  # conv + delta state per GDN layer
    for x, y in zip(ga, ra):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  first = jax.tree.leaves(engine.select_row(cap.rec_states, 0))
  last = jax.tree.leaves(engine.select_row(cap.rec_states, 4))
  assert any(not np.allclose(a, b) for a, b in zip(first, last))  # the rows really differ


def test_draft_params_and_ngram():
  assert speculative.ngram_draft([1, 2, 3, 9, 1, 2, 3], 3, 2) == [9, 1]
  assert speculative.ngram_draft([1, 2, 3], 3, 2) == []
  assert speculative.ngram_draft([5, 6, 7, 8, 5, 6], 2, 4) == [7, 8, 5, 6]
  with pytest.raises(ValueError, match="n_max"):
    speculative.DraftParams(n_max=0)
  with pytest.raises(ValueError, match="kind"):
    speculative.DraftParams(kind="eagle")
