"""Speculative decoding: drafts verified by the target, recurrent-state rollback (replay, device and host),
KV truncation of the target's and the MTP's histories, the oracle drafter, ngram + MTP."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import engine, generate, speculative
from kvjax.streaming import StreamConfig, StreamedKV, fixed_split
from kvjax.model import RecurrentState
from kvjax.streaming.host_history import HostHistory
from tiny_setup import build_tiny_runner

N = 48
N_MTP = 20        # the MTP runs compared round by round (committed tokens cross a page boundary at 80)
P_MIN = 0.03      # the tiny MTP head's top-1 probabilities spread around it (0.02 .. 0.05)


def _streamed(cfg, layout, max_tokens, pool_pages=12):
  return StreamedKV(cfg, layout, max_tokens, fixed_split(pool_pages, 3, max_tokens, layout, copy_pages=2))


@pytest.fixture(scope="module")
def setup():
  cfg, runner, layout = build_tiny_runner(0, page_tokens=16)
  prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 70)]
  plain = generate.generate(runner, engine.PlainKV(cfg, layout, 70 + N + 8), prompt, N, ubatch=32)
  return cfg, layout, runner, prompt, plain.tokens


def _plain_mtp_run(runner, kv, prompt, n):
  """Plain greedy decoding, one token a forward, with the MTP head following it one row a step
  (row i = target hidden at i, token i + 1): the histories a run without speculation writes."""
  seq = generate.SequenceState(runner, kv)
  logits, hn = generate.prefill(seq, prompt, 32, with_hidden=True)
  toks = [int(np.argmax(logits))]
  generate.mtp_rows(runner, kv, hn, prompt[1:] + toks, 0, 32)
  while len(toks) < n:
    logits, hn = seq.forward([toks[-1]], with_hidden=True)
    toks.append(int(np.argmax(logits)))
    runner.mtp_forward(hn, np.array(toks[-1:], np.int32), seq.pos - 1, 1, kv)
  return toks


def _history_at(final: HostHistory, tokens: int) -> HostHistory:
  h = HostHistory(final.name, final.layout, final.n_layers, final.max_pages, final.copy_pages, pinned=False)
  h.pages_lpn[:] = final.pages_lpn
  h.tokens[:] = final.tokens
  h.truncate(tokens)
  return h


@pytest.fixture(scope="module")
def mtp_runs(setup):
  """MTP drafting (p_min P_MIN; the tiny head's drafts are nearly all rejected) on the plain cache with
  device rollback and on a streamed cache with host rollback. After every round of the streamed run
  its histories are compared with the plain run's at the same committed length. The reference run
  writes its host histories through a streamed cache whose pool holds every page resident (7 pages
  a layer; the histories do not depend on the split): nothing streams, so its steps are the plain
  cache's executables (same pool shape) and a streaming fault cannot cancel out on both sides."""
  cfg, layout, runner, prompt, truth = setup
  max_tokens = 70 + N + 8
  ref = _streamed(cfg, layout, max_tokens, pool_pages=24)
  assert ref.stream.resident_pages_per_layer == (7, 7, 7) and ref.pool_pn.shape[0] == 24
  assert _plain_mtp_run(runner, ref, prompt, N_MTP) == truth[:N_MTP]
  runs = {}
  for cache, rollback in (("plain", "device"), ("streamed", "host")):
    kv = engine.PlainKV(cfg, layout, max_tokens) if cache == "plain" else _streamed(cfg, layout, max_tokens)
    rounds = []

    def on_round(info, kv=kv, cache=cache, rounds=rounds):
      info = dict(info, logits=np.asarray(info["logits"])[:1 + len(info["drafts"])])
      if cache == "streamed":
        committed = info["pos"] + info["accepted"] + 1
        info["checks"] = {}
        for name, n_tokens in (("target", committed), ("mtp", int(kv.histories["mtp"].tokens[0]))):
          want, got = _history_at(ref.histories[name], n_tokens), kv.histories[name]
          info["checks"][name] = (n_tokens, np.array_equal(got.tokens, want.tokens),
                                  np.array_equal(got.pages_lpn, want.pages_lpn))
      rounds.append(info)
    res = speculative.generate_speculative(
        runner, kv, prompt, N_MTP, speculative.SpecConfig("mtp", n_max=3, p_min=P_MIN, rollback=rollback),
        ubatch=32, on_round=on_round)
    runs[cache] = (res, rounds, kv)
  return runs


def test_rejected_rounds_leave_the_histories_a_plain_run_writes(mtp_runs):
  """After every round the streamed target's and MTP's host histories equal, byte for byte over
  the whole buffer, those of a plain run at the same committed length (a truncation that left
  rejected rows behind, or forgot their bytes but not their count, fails here)."""
  res, rounds, kv = mtp_runs["streamed"]
  assert kv.metrics()["streamed_pages"] > 0 and kv.metrics()["ring_wraps"] > 0
  rejected = [r for r in rounds if r["accepted"] < len(r["drafts"])]
  assert len(rejected) >= N_MTP // 4
  for r in rounds:
    n_target, *target_ok = r["checks"]["target"]
    assert target_ok == [True, True], f"target history after the round at {r['pos']}"
    n_mtp, *mtp_ok = r["checks"]["mtp"]
    assert mtp_ok == [True, True], f"MTP history after the round at {r['pos']}"
  # the MTP history follows the target's (catch-up rows) after every round but the last
  assert all(r["checks"]["mtp"][0] == r["checks"]["target"][0] for r in rounds[:-1])
  assert res.metrics["spec_rollback"] == "host" and res.metrics["rollback_h2d_bytes"] > 0


def _suffix_bytes(kv, mtp_tokens):
  """Bytes a lease uploads for the MTP layer's committed pages past its resident capacity (one pass
  over its suffix): whole copy units, from the one holding the first suffix page to the last sealed
  one, and the open unit whole when a page past them holds tokens."""
  lay, c = kv.layout, kv.copy_unit
  cap = kv.stream.resident_pages_per_layer[-1]
  content, sealed = -(-mtp_tokens // lay.page_tokens), mtp_tokens // lay.page_tokens // c * c
  pages = (sealed - cap // c * c if sealed > cap else 0) + (c if content > max(sealed, cap) else 0)
  return pages * lay.page_bytes


def test_mtp_lease_loads_the_suffix_once_a_round(setup, mtp_runs):
  """Every round's catch-up + drafting runs under one ring lease that loads the MTP's streamed
  suffix (committed pages past its resident ones) once: the bytes equal the suffix computed from
  the page geometry, and they are all the MTP forwards upload (drafts and catch-up stage nothing)."""
  _, _, _, prompt, _ = setup
  res, rounds, kv = mtp_runs["streamed"]
  m = res.metrics
  assert kv.counters["mtp_lease_refused"] == 0 and kv.lease is None
  want = [_suffix_bytes(kv, r["pos"]) for r in rounds[:-1]]     # MTP committed at the catch-up = C
  assert [r["lease_bytes"] for r in rounds[:-1]] == want and rounds[-1]["lease_bytes"] == 0
  pages = {-(-r["pos"] // kv.layout.page_tokens) for r in rounds[:-1]}
  assert len(pages) == 2 and min(want) > 0                       # the suffix grew by a page mid-run
  assert m["mtp_leases"] == m["verify_forwards"] == len(rounds)
  assert m["mtp_lease_bytes"] == _suffix_bytes(kv, len(prompt)) + sum(want)
  assert sum(len(r["drafts"]) > 1 for r in rounds) >= 3          # rounds with several MTP forwards
  assert m["mtp_h2d_bytes_per_round"] == m["mtp_lease_bytes_per_round"] > 0


def test_mtp_lease_holds_the_end_of_the_ring(mtp_runs):
  """A lease places the MTP suffix's host bytes in the last ring slots; a target forward meanwhile
  uses only the slots before them; a rebind reloads the lease; a lease the ring cannot hold is
  refused (the MTP then streams per forward); the lease must cover the committed tokens."""
  _, _, kv = mtp_runs["streamed"]
  kv.truncate("target", 80)
  kv.truncate("mtp", 80)
  lay, hist = kv.layout, kv.histories["mtp"]
  cap, ring = kv.stream.resident_pages_per_layer[-1], kv.stream.ring_slots
  assert cap == 1 and kv.copy_unit == 2
  # pages 1..4 hold the 80 tokens: units [0, 2) and [2, 4) sealed, [4, 6) the open unit (page 4)
  assert kv.lease_mtp(90) == _suffix_bytes(kv, 80) == 6 * lay.page_bytes
  ls = kv.lease
  assert (ls.first_slot, ls.slots) == (ring - 5, 5)           # pages 1..5 of the MTP layer (to 90 tokens)

  def leased_bytes():
    pool = np.asarray(kv.pool_pn)
    return pool[kv.ring_base + ls.first_slot:kv.ring_base + ls.first_slot + 4]

  assert np.array_equal(leased_bytes(), hist.pages_lpn[0, cap:5])
  kv.begin_forward(80, 1, (0, 1))
  for a in (0, 1):
    table = np.asarray(kv._layer_plans[a].table_t)[:lay.pages_for(81)]   # pylint: disable=protected-access
    assert table.max() < kv.ring_base + ls.first_slot
  kv.rebind(kv.stream)
  assert kv.counters["mtp_lease_reloads"] == 1 and np.array_equal(leased_bytes(), hist.pages_lpn[0, cap:5])
  with pytest.raises(RuntimeError, match="already holds"):
    kv.lease_mtp(90)
  kv.release_lease()
  assert kv.lease is None
  with pytest.raises(ValueError, match="below the MTP's 80 committed tokens"):
    kv.lease_mtp(79)
  small = StreamedKV(kv.cfg, lay, 128, StreamConfig(6, (1, 1, 1), 2))      # a 3-slot ring
  assert small.lease_mtp(64) == 0 and small.lease.slots == 3              # 4 pages, 1 resident
  small.release_lease()
  assert small.lease_mtp(65) == 0 and small.lease is None and small.counters["mtp_lease_refused"] == 1


def test_a_refused_lease_drafts_as_the_plain_cache(setup, mtp_runs):
  """A ring too small for the MTP's lease (3 slots): every round's lease is refused, the MTP layer
  streams per forward and the next round drafts at its start (one forward a step), with the plain
  cache's drafts round by round (the one-program drafting after the catch-up needs the lease)."""
  cfg, layout, runner, prompt, truth = setup
  kv = StreamedKV(cfg, layout, 70 + N + 8, StreamConfig(6, (1, 1, 1), 2))
  rounds = []
  res = speculative.generate_speculative(
      runner, kv, prompt, N_MTP, speculative.SpecConfig("mtp", n_max=3, p_min=P_MIN, rollback="device"),
      ubatch=32, on_round=rounds.append)
  plain, p_rounds, _ = mtp_runs["plain"]
  assert kv.counters["mtp_lease_refused"] >= len(rounds) - 1 > 0
  assert res.tokens == plain.tokens == truth[:N_MTP]
  assert [r["drafts"] for r in rounds] == [r["drafts"] for r in p_rounds]
  assert max(len(r["drafts"]) for r in rounds) > 1


def test_verify_logits_are_the_same_bits_on_every_cache_and_rollback(setup, mtp_runs):
  _, _, _, _, truth = setup
  (plain, p_rounds, _), (streamed, s_rounds, _) = mtp_runs["plain"], mtp_runs["streamed"]
  assert plain.tokens == streamed.tokens == truth[:N_MTP]
  assert [r["drafts"] for r in p_rounds] == [r["drafts"] for r in s_rounds]
  for a, b in zip(p_rounds, s_rounds):
    assert np.array_equal(a["logits"], b["logits"]), f"verify forward at {a['pos']}"


def test_mtp_drafting_in_one_program_equals_step_by_step(setup, mtp_runs, monkeypatch):
  """The round's MTP draft steps run as one device program (`Runner.mtp_draft`, one call a round
  with more than one draft step; under the streamed cache's ring lease too), with the drafts and the
  probabilities (same bits) of one MTP forward a step; on the plain cache nothing compiles after the
  first round (a streamed cache's staged shapes: `kvjax.warmup`, tests/test_warmup.py)."""
  cfg, layout, runner, prompt, _ = setup
  calls = []
  fused = runner.mtp_draft
  for cache in ("plain", "streamed"):
    res, rounds, _ = mtp_runs[cache]
    assert cache != "plain" or res.metrics["predicted_compiles"] == 0
    kv = engine.PlainKV(cfg, layout, 70 + N + 8) if cache == "plain" else _streamed(cfg, layout, 70 + N + 8)
    monkeypatch.setattr(runner, "mtp_draft", lambda *a, **k: calls.append(1) or fused(*a, **k))
    steps = []
    monkeypatch.setattr(runner, "mtp_draft_steps", None)       # step by step
    speculative.generate_speculative(
        runner, kv, prompt, N_MTP, speculative.SpecConfig("mtp", n_max=3, p_min=P_MIN),
        ubatch=32, on_round=lambda info, steps=steps: steps.append((info["drafts"], info["draft_p"])))
    monkeypatch.undo()
    assert not calls
    assert [(r["drafts"], r["draft_p"]) for r in rounds] == steps, cache
  counters = mtp_runs["streamed"][2].counters     # MTP, verify and decode layouts kept by key
  assert counters["layout_hits"] > counters["layout_changes"] > 0
  kv = engine.PlainKV(cfg, layout, 70 + N + 8)
  monkeypatch.setattr(runner, "mtp_draft", lambda *a, **k: calls.append(k.get("span")) or fused(*a, **k))
  res = speculative.generate_speculative(runner, kv, prompt, N_MTP, speculative.SpecConfig("mtp", n_max=3),
                                         ubatch=32)
  # the first round drafts at its start; every round that may be followed by another drafts the
  # next one's on the device, from its row j (position traced, laid out over `span`)
  assert calls[0] is None and None not in calls[1:]
  assert res.metrics["verify_forwards"] - 1 <= len(calls) <= res.metrics["verify_forwards"] and len(calls) > 3


def test_p_min_stops_mtp_drafting(mtp_runs):
  """Each MTP round drafts while the top-1 probability is >= p_min, up to n_max."""
  _, rounds, _ = mtp_runs["plain"]
  stops = set()
  for r in rounds:
    p = r["draft_p"]
    assert all(x >= P_MIN for x in p[:len(r["drafts"])])
    if len(r["drafts"]) < 3 and r["pos"] + 3 < 70 + N_MTP - 1:   # not cut by the tokens left
      assert len(p) == len(r["drafts"]) + 1 and p[-1] < P_MIN
      stops.add("p_min")
    elif len(r["drafts"]) == 3:
      stops.add("n_max")
  assert stops == {"p_min", "n_max"}      # both ends were exercised


def test_eos_inside_accepted_drafts_ends_generation(setup):
  cfg, layout, runner, prompt, truth = setup
  eos = truth[2]                         # the second draft of the first round
  assert eos not in truth[:2]
  want = generate.generate(runner, engine.PlainKV(cfg, layout, 70 + N + 8), prompt, N, ubatch=32, eos_id=eos)
  assert want.tokens == truth[:3]
  res = speculative.generate_speculative(runner, engine.PlainKV(cfg, layout, 70 + N + 8), prompt, N,
                                         speculative.SpecConfig("oracle", n_max=3, oracle_acceptance=1.0),
                                         ubatch=32, eos_id=eos, oracle_tokens=truth)
  assert res.tokens == want.tokens
  assert res.metrics["verify_forwards"] == 1 and res.metrics["draft_accepted"] >= 2


def test_oracle_drafter_plants_seeded_rejections():
  truth = list(range(100, 160))
  a = speculative.OracleDrafter(truth, 0.5, 7, 384)
  b = speculative.OracleDrafter(truth, 0.5, 7, 384)
  rounds = [a(k, 5) for k in range(0, 50, 5)]
  assert rounds == [b(k, 5) for k in range(0, 50, 5)]              # seeded
  for k, d in zip(range(0, 50, 5), rounds):
    good = [x == t for x, t in zip(d, truth[k:k + 5])]
    assert good == [True] * (len(d) - 1) + [good[-1]] if d else True  # only the last can be wrong
    assert len(d) == 5 or not good[-1]                                  # a rejection ends the round
  assert any(len(d) < 5 for d in rounds) and any(len(d) > 1 for d in rounds)
  assert speculative.OracleDrafter(truth, 1.0, 0, 384)(3, 4) == truth[3:7]
  assert speculative.OracleDrafter(truth, 0.0, 0, 384)(3, 4) == [truth[3] + 1]


def test_narrow_micro_batch_is_refused_before_anything_runs(setup):
  cfg, layout, runner, prompt, _ = setup
  kv = _streamed(cfg, layout, 70 + N + 8)
  draft = speculative.SpecConfig("ngram+mtp", n_max=3, ngram_m=48)
  assert draft.verify_width == 49
  with pytest.raises(ValueError, match=r"micro-batch of 32 rows .* at least 49 rows"):
    speculative.generate_speculative(runner, kv, prompt, N, draft, ubatch=32)
  assert kv.histories["target"].tokens[0] == 0 and kv.counters["forwards"] == 0


GRID_N = 12
DRAFTS = {"mtp": dict(draft="mtp", n_max=3), "ngram": dict(draft="ngram", n_max=3, ngram_n=1),
          "ngram+mtp": dict(draft="ngram+mtp", n_max=2, ngram_n=1, ngram_m=3),
          "oracle-0.3": dict(draft="oracle", n_max=3, oracle_acceptance=0.3),
          "oracle-0.9": dict(draft="oracle", n_max=3, oracle_acceptance=0.9)}   # verify width 4 for all


@pytest.mark.parametrize("cache,rollback", [("plain", "replay"), ("plain", "device"), ("streamed", "replay"),
                                           ("streamed", "host")])
@pytest.mark.parametrize("drafter", list(DRAFTS))
def test_greedy_output_equals_plain_for_every_drafter_cache_and_rollback(setup, drafter, cache, rollback):
  cfg, layout, runner, prompt, truth = setup
  max_tokens = 70 + N + 8
  kv = engine.PlainKV(cfg, layout, max_tokens) if cache == "plain" else _streamed(cfg, layout, max_tokens)
  draft = speculative.SpecConfig(**DRAFTS[drafter], rollback=rollback)
  res = speculative.generate_speculative(runner, kv, prompt, GRID_N, draft, ubatch=32,
                                         oracle_tokens=truth[:GRID_N] if drafter.startswith("oracle") else None)
  assert res.tokens == truth[:GRID_N]
  m = res.metrics
  assert m["spec_type"] == draft.draft and m["spec_rollback"] == rollback
  assert m["draft_generated"] > 0 and m["verify_forwards"] < GRID_N
  assert sum(int(w) for w in m["verify_ms_by_width"]) >= 2
  rounds = np.asarray(m["draft_rounds"])      # [drafts, accepted] per verify round
  assert len(rounds) == m["verify_forwards"]
  assert rounds.sum(0).tolist() == [m["draft_generated"], m["draft_accepted"]]
  if rollback == "host":
    assert m["rollback_d2h_bytes"] > 0
  phases = m["phase_ms_per_round"]      # the round's host wall time, phase by phase
  assert {"draft", "verify", "rollback", "read", "truncate"} <= set(phases) <= {
      "draft", "verify", "rollback", "read", "truncate", "lease", "mtp_catch_up"}
  assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= m["round_ms_mean"] * 1.001
  assert ("mtp_catch_up" in phases) == ("lease" in phases) == draft.uses_mtp


def test_oracle_with_mtp_cost_drafts_the_oracle_and_leases_every_round(setup):
  """oracle_mtp: the oracle's drafts are verified (its acceptance), while the MTP head catches up and
  drafts under its lease every round (its cost); the output is plain greedy's."""
  cfg, layout, runner, prompt, truth = setup
  kv = _streamed(cfg, layout, 70 + N + 8)
  draft = speculative.SpecConfig("oracle", n_max=3, oracle_acceptance=0.9, oracle_mtp=True, rollback="host")
  rounds = []
  res = speculative.generate_speculative(runner, kv, prompt, GRID_N, draft, ubatch=32, oracle_tokens=truth[:GRID_N],
                                         on_round=rounds.append)
  m = res.metrics
  assert res.tokens == truth[:GRID_N] and m["draft_accepted"] > m["verify_forwards"] // 2
  assert {r["drafter"] for r in rounds} == {"oracle"} and all(r["draft_p"] for r in rounds)   # MTP drafted too
  # a lease for the first round, one a round after it; the last round's catch-up may be one no round
  # uses (whether another round follows is known at the round's read, after it is dispatched)
  assert m["verify_forwards"] <= m["mtp_leases"] <= m["verify_forwards"] + 1 and m["mtp_lease_bytes_per_round"] > 0
  with pytest.raises(ValueError, match="spec.draft must be 'oracle'"):
    speculative.SpecConfig("mtp", oracle_mtp=True)


def test_mtp_lease_beside_copy_waves_equals_plain(setup):
  """A 3-slot ring, smaller than the target layers' streamed pages (copy waves), and an MTP
  resident region of 4 pages: the MTP suffix (1-2 pages) is leased at the end of the ring every
  round, the target's waves use the ring whole; the output is plain greedy's. (About 40 s of CPU:
  the wave steps compile for this pool.)"""
  cfg, layout, runner, prompt, truth = setup
  kv = StreamedKV(cfg, layout, 70 + N + 8, StreamConfig(9, (1, 1, 4), 2))
  res = speculative.generate_speculative(runner, kv, prompt, GRID_N, speculative.SpecConfig("mtp", n_max=3),
                                         ubatch=32)
  m = res.metrics
  assert res.tokens == truth[:GRID_N] and m["waved_layers"] > 0
  assert m["mtp_lease_refused"] == 0 and m["mtp_leases"] == m["verify_forwards"]
  assert m["mtp_lease_bytes_per_round"] == m["mtp_h2d_bytes_per_round"] >= layout.page_bytes


def test_long_ngram_and_mtp_with_host_rollback_equals_plain(setup):
  """1,000 generated tokens: ngram rounds (wide, often accepted once greedy decoding of the
  random-weight model falls into a cycle) and MTP rounds (narrow, mostly rejected), host-staged
  rollback: the output is plain greedy's. (The plain cache: on a streamed one each new page count
  compiles the steps again, minutes on CPU; the short grid covers streamed caches.)"""
  cfg, layout, runner, prompt, _ = setup
  n = 1000
  max_tokens = 70 + n + 8
  truth = generate.generate(runner, engine.PlainKV(cfg, layout, max_tokens), prompt, n, ubatch=32).tokens
  kv = engine.PlainKV(cfg, layout, max_tokens)
  res = speculative.generate_speculative(
      runner, kv, prompt, n, speculative.SpecConfig("ngram+mtp", n_max=3, ngram_n=3, ngram_m=6,
                                                    rollback="host"), ubatch=32)
  assert res.tokens == truth
  m = res.metrics
  assert m["ngram_rounds"] > 0 and m["draft_accepted"] > 0 and m["draft_accepted"] < m["draft_generated"]


def test_rollback_state_is_the_captured_row(setup):
  """capture_states returns the state after each row; row j equals the state after decoding rows
  0..j one forward a row. (The verify width and the setup's cache: the compiled steps are shared.)"""
  cfg, layout, runner, prompt, _ = setup
  rows = np.array(prompt[:4], np.int32)
  kv = engine.PlainKV(cfg, layout, 70 + N + 8)
  cap = runner.forward(rows, 0, 4, runner.zero_states(), kv, chunked=False, capture_states=True)
  kv2, states = engine.PlainKV(cfg, layout, 70 + N + 8), runner.zero_states()
  for j in range(4):
    states = runner.forward(rows[j:j + 1], j, 1, states, kv2, chunked=False).rec_states
    got = engine.select_row(cap.rec_states, j)
    ga = [np.asarray(x) for x in jax.tree.leaves(got)]
    ra = [np.asarray(x) for x in jax.tree.leaves(states)]
    assert len(ga) == len(ra) == 2 * sum(runner.n_recurrent)  # conv + delta state per GDN layer
    # one row a forward vs 4 in one: float rounding apart, within 1e-4 of the state's largest value
    # (4e-6 / 4.4 with XLA's optimised CPU code, 2.8e-4 / 4.4 unoptimised as the suite compiles:
    # tests/conftest.py); the neighbouring row's state is far outside that
    scale = max(float(np.abs(y).max()) for y in ra)
    for x, y in zip(ga, ra):
      np.testing.assert_allclose(x, y, rtol=0, atol=1e-4 * scale)
    if j:
      other = [np.asarray(x) for x in jax.tree.leaves(engine.select_row(cap.rec_states, j - 1))]
      assert max(float(np.abs(x - y).max()) for x, y in zip(other, ra)) > 1e-2 * scale
  first = jax.tree.leaves(engine.select_row(cap.rec_states, 0))
  last = jax.tree.leaves(engine.select_row(cap.rec_states, 3))
  assert any(not np.allclose(a, b) for a, b in zip(first, last))  # the rows really differ


@pytest.fixture(scope="module")
def kernel_runner():
  """The tiny model's runner with its delta rule through the Pallas kernels (interpreted)."""
  return build_tiny_runner(0, page_tokens=16, gdn_form="triton")[1]


@pytest.mark.parametrize("form", ["xla", "triton"])
def test_replayed_rows_give_the_captured_states_bit_for_bit(setup, kernel_runner, form):
  """capture_states="replay" keeps the rows' inputs (a few per cent of the states' bytes); the
  states after row j rebuilt from the states before the verify are the captured row j's bits, for
  every j, from a zero state and from a state mid-sequence: in XLA's form and through the rows
  kernel (`gdn_form`: the rollback replays by the runner's form)."""
  cfg, layout, runner, prompt, _ = setup
  if form == "triton":
    runner = kernel_runner
  assert runner.gdn_form == (form, form == "triton")
  kv = engine.PlainKV(cfg, layout, 70 + N + 8)
  before = runner.forward(np.array(prompt[:5], np.int32), 0, 5, runner.zero_states(), kv, chunked=False).rec_states
  for start, states in ((0, runner.zero_states()), (5, before)):
    rows = np.array(prompt[start:start + 4], np.int32)
    cap = runner.forward(rows, start, 4, states, engine.PlainKV(cfg, layout, 70 + N + 8), chunked=False,
                         capture_states=True)
    rep = runner.forward(rows, start, 4, states, engine.PlainKV(cfg, layout, 70 + N + 8), chunked=False,
                         capture_states="replay")
    np.testing.assert_array_equal(np.asarray(rep.logits_rv), np.asarray(cap.logits_rv))
    kept = sum(x.nbytes for x in jax.tree.leaves(rep.rec_states))
    assert kept == 4 * speculative.replay_row_bytes(cfg) < sum(x.nbytes for x in jax.tree.leaves(cap.rec_states))
    roll = speculative.ReplayRollback(runner)
    for j in range(4):
      want = jax.tree.leaves(engine.select_row(cap.rec_states, j))
      got = jax.tree.leaves(roll.states_after(rep.rec_states, j, 4, states))
      assert len(want) == len(got) and all(np.array_equal(a, b) for a, b in zip(want, got)), (start, j)
      # the layers stepped one by one, and two at a time (`REPLAY_CHUNK_BYTES`): the same bits
      one_state = sum(x.nbytes for x in jax.tree.leaves(jax.tree.leaves(
          states, is_leaf=lambda x: isinstance(x, RecurrentState))[0]))
      for chunk in (1, 2 * one_state):
        with mock.patch.object(speculative, "REPLAY_CHUNK_BYTES", chunk):
          got = jax.tree.leaves(speculative._replay.__wrapped__(states, rep.rec_states, jnp.int32(j), runner.gdn_form))
        assert all(np.array_equal(a, b) for a, b in zip(want, got)), (start, j, chunk)


def test_host_rollback_restores_the_captured_rows_bit_for_bit(setup):
  cfg, layout, runner, prompt, _ = setup
  rows = np.array(prompt[:4], np.int32)
  cap = runner.forward(rows, 0, 4, runner.zero_states(), engine.PlainKV(cfg, layout, 70 + N + 8),
                       chunked=False, capture_states=True)
  host = speculative.HostRollback()
  live = runner.forward(rows, 0, 4, runner.zero_states(), engine.PlainKV(cfg, layout, 70 + N + 8),
                        chunked=False, capture_states=True, on_group_states=host.sink()).rec_states
  for j in range(4):
    want = jax.tree.leaves(engine.select_row(cap.rec_states, j))
    got = jax.tree.leaves(host.states_after(live, j, 4))
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
  one_row = sum(x.nbytes for x in want)
  assert host.d2h_bytes == 3 * one_row and host.h2d_bytes == 3 * one_row   # rows 0..2 out, each back once
  assert host.stage_peak == min(len(live), host.SLOTS)


def test_host_rollback_stage_holds_two_groups_and_restores_any_row():
  """Five groups' captured states (4 rows each) through the stage: at most two groups' snapshots
  are on their way to the host at once; every row j comes back with its bits."""
  rng = np.random.default_rng(0)
  groups = [(jax.numpy.asarray(rng.standard_normal((4, 3, 5)), jax.numpy.float32),
             jax.numpy.asarray(rng.integers(0, 9, (4, 2)), jax.numpy.int32)) for _ in range(5)]
  for j in range(4):
    host = speculative.HostRollback()
    take = host.sink()
    live = []
    for g, captured in enumerate(groups):
      live.append(take(g, captured))
      assert len(host._inflight) <= host.SLOTS        # pylint: disable=protected-access
    assert host.stage_peak == host.SLOTS
    after = host.states_after(tuple(live), j, 4)
    for g, captured in enumerate(groups):
      for a, b in zip(after[g], captured):
        assert np.array_equal(np.asarray(a), np.asarray(b[j])), (g, j)
    assert host.d2h_bytes == sum(x.nbytes for c in groups for x in c) * 3 // 4
    assert host.h2d_bytes == (0 if j == 3 else sum(x.nbytes for c in groups for x in c) // 4)


def test_ngram_index_drafts_what_the_scan_drafts():
  rng = np.random.default_rng(0)
  for n in (1, 2, 3):
    toks = [int(t) for t in rng.integers(0, 4, size=300)]   # a small vocabulary: many repeats
    index = speculative.NgramIndex(n, toks[:5])
    for i in range(5, len(toks) + 1):
      for m in (1, 3):
        assert index.draft(m) == speculative.ngram_draft(toks[:i], n, m), (n, i, m)
      index.extend(toks[i:i + 1])
  with pytest.raises(ValueError, match="ngram_n"):
    speculative.NgramIndex(0)


def test_draft_params_and_ngram():
  assert speculative.ngram_draft([1, 2, 3, 9, 1, 2, 3], 3, 2) == [9, 1]
  assert speculative.ngram_draft([1, 2, 3], 3, 2) == []
  assert speculative.ngram_draft([5, 6, 7, 8, 5, 6], 2, 4) == [7, 8, 5, 6]
  with pytest.raises(ValueError, match="n_max"):
    speculative.SpecConfig(n_max=0)
  with pytest.raises(ValueError, match="spec.draft"):
    speculative.SpecConfig(draft="eagle")
  with pytest.raises(ValueError, match="rollback"):
    speculative.SpecConfig(rollback="disk")
  with pytest.raises(ValueError, match="oracle_acceptance"):
    speculative.SpecConfig(draft="oracle", oracle_acceptance=1.5)
  assert speculative.SpecConfig("ngram", n_max=3).verify_width == 4
  assert speculative.SpecConfig("ngram+mtp", n_max=5, ngram_m=2).verify_width == 6


def test_one_spec_config_from_the_command_line_to_the_round():
  """One class from the API to the round; its flags, config keys and metric names come from its
  fields (llama.cpp's spellings where they differ); a bad field is the API's error naming spec.<field>."""
  from kvjax import api, cli, spec_config  # pylint: disable=import-outside-toplevel
  assert api.SpecConfig is speculative.SpecConfig is spec_config.SpecConfig
  assert [spec_config.flag_name(f) for f in spec_config.FIELDS] == [
      "spec-type", "spec-draft-n-max", "spec-draft-p-min", "spec-ngram-size-n", "spec-ngram-size-m",
      "spec-oracle-acceptance", "spec-oracle-seed", "spec-rollback", "spec-oracle-mtp"]
  assert [spec_config.config_key(f) for f in ("draft", "n_max", "rollback")] == ["spec_type", "spec_n_max",
                                                                                   "spec_rollback"]
  e = pytest.raises(api.ParameterError, speculative.SpecConfig, n_max=0).value
  assert e.params == ("spec.n_max",) and e.renamed(cli.FLAG_OF) == "--spec-draft-n-max must be >= 1, got 0"
  want = speculative.SpecConfig("ngram+mtp", n_max=5, p_min=0.1, ngram_n=2, ngram_m=7, rollback="host")
  values = {spec_config.flag_name(f): getattr(want, f) for f in spec_config.FIELDS}
  assert spec_config.from_flags({**values, "spec-type": "ngram-simple,draft-mtp"}.__getitem__) == want
  assert spec_config.from_flags({**values, "spec-type": "none"}.__getitem__) is None
  cfg = {spec_config.config_key(f): getattr(want, f) for f in spec_config.FIELDS}
  assert spec_config.from_config(cfg) == want and spec_config.from_config({"spec_type": "none"}) is None
  assert spec_config.from_config({"spec_type": "oracle"}) == speculative.SpecConfig("oracle")
