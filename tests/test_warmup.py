"""Compile once: a generation's compiled programs do not follow the history (kvjax.warmup,
kvjax.compile_cache, the `compiles` metrics).

Small pages (16 tokens) and small pools, so that a generation crosses hundreds of page and
copy-unit boundaries and streams in copy waves."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvjax import api, compile_cache, engine
from kvjax.streaming import staging

N_PROMPT = 200
N_PREDICT = 40


@pytest.fixture(scope="module")
def model():
  # the run's persistent compilation cache (tests/conftest.py): a program loaded from it still
  # counts as compiled in the metrics these tests read
  return api.load_model("tiny", page_tokens=16)


def _prompt(model, n, seed=0):
  return [int(t) for t in np.random.default_rng(seed).integers(3, model.cfg.vocab_size, n)]


def _two_prompts(model, kv, spec=None):
  """Generations of N_PROMPT and 2 * N_PROMPT tokens on one cache -> their results."""
  return [api.generate(model, kv, prompt_tokens=_prompt(model, n), n_predict=N_PREDICT, ignore_eos=True, spec=spec)
          for n in (N_PROMPT, 2 * N_PROMPT)]


CASES = {
    "fixed": dict(pool_pages=12),                                  # copy waves every forward
    "adaptive": dict(pool_pages=30, policy="adaptive"),
    "phased": dict(arena_mib=6, policy="adaptive", phased=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_nothing_compiles_after_the_first_token_nor_for_a_longer_prompt(model, case):
  kv = api.make_kv(model, 2 * N_PROMPT + N_PREDICT + 8, **CASES[case])
  first, second = _two_prompts(model, kv)
  for res in (first, second):
    assert res.metrics["predicted_compiles"] == 0, res.metrics
    assert res.metrics["forwards"] > 0
  # the doubled prompt crosses more page and copy-unit boundaries with the programs compiled already
  assert second.metrics["compiles"] == 0, second.metrics
  # the prefill compiled its programs (or loaded them whole, stored by an earlier test of the run)
  assert first.metrics["prompt_compiles"] + first.metrics["executables_loaded"] > 0
  if case == "fixed":
    assert first.metrics["waves"] > 0 and second.metrics["waves"] > first.metrics["waves"]
  plain = api.generate(model, prompt_tokens=_prompt(model, 2 * N_PROMPT), n_predict=N_PREDICT, ignore_eos=True)
  assert second.tokens == plain.tokens


@pytest.mark.parametrize("draft", ["mtp", "ngram"])
def test_speculative_rounds_compile_nothing_after_the_first(model, draft):
  spec = api.SpecConfig(draft, n_max=3, ngram_n=2)
  kv = api.make_kv(model, 2 * N_PROMPT + N_PREDICT + 8, pool_pages=16, spec=spec)
  first, second = _two_prompts(model, kv, spec)
  assert first.metrics["predicted_compiles"] == 0 and second.metrics["compiles"] == 0, second.metrics
  assert first.metrics["verify_forwards"] > 3
  plain = api.generate(model, prompt_tokens=_prompt(model, 2 * N_PROMPT), n_predict=N_PREDICT, ignore_eos=True)
  assert second.tokens == plain.tokens


def test_warmup_leaves_nothing_to_compile(model):
  """After `api.warmup` a generation compiles nothing at all, with copy waves of every forward shape."""
  kv = api.make_kv(model, 2 * N_PROMPT + N_PREDICT + 8, pool_pages=20, policy="adaptive")
  w = api.warmup(model, kv)
  assert w["compiles"] + w["executables_loaded"] > 0
  res = api.generate(model, kv, prompt_tokens=_prompt(model, 2 * N_PROMPT, seed=3), n_predict=N_PREDICT,
                     ignore_eos=True)
  assert res.metrics["compiles"] == 0 and res.metrics["compile_ms"] == 0.0, res.metrics


def test_staged_arrays_come_in_the_shapes_the_cache_declares(model, monkeypatch):
  """Every staged array a long generation places (layers, copy waves, refills, the MTP lease) has
  one of `StreamedKV.staged_shapes()`: 1..16 copy units or one page, whatever the history's length."""
  seen = set()
  place = engine.place_staged

  def recording(pool, rows, pieces):
    seen.add((int(rows.shape[0]), int(pieces.shape[0])))
    return place(pool, rows, pieces)

  recording.__wrapped__ = place.__wrapped__
  monkeypatch.setattr(engine.Runner, "place_step", staticmethod(recording))
  kv = api.make_kv(model, 2 * N_PROMPT + N_PREDICT + 8, pool_pages=24, copy_pages=4)
  api.generate(model, kv, prompt_tokens=_prompt(model, 2 * N_PROMPT), n_predict=N_PREDICT, ignore_eos=True)
  declared = set(kv.provider.staged_shapes())
  assert seen and seen <= declared, (seen, declared)
  assert max(n for n, _ in seen) > kv.provider.copy_unit      # pieces of several units did occur
  c = kv.provider.copy_unit
  assert all(n == 1 or n % c == 0 and n <= c * staging.MAX_PIECE_UNITS for n, _ in declared)


SECOND_PROCESS = """
import json, sys, jax
from kvjax import api, workspace
hits, measured, traced = [], [], []
jax.monitoring.register_event_listener(lambda e, **k: hits.append(e) if e.endswith("cache_hits") else None)
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, fun_name="?", **k: traced.append(fun_name) if e.endswith("jaxpr_trace_duration") else None)
analyse = workspace.workspace_bytes_from_compiled
workspace.workspace_bytes_from_compiled = lambda c: measured.append(1) or analyse(c)
model = api.load_model("tiny", page_tokens=16)
arena = api.make_kv(model, 120, arena_mib=4, phased=True)
kv = api.make_kv(model, 120, pool_pages=8)
res = api.generate(model, kv, prompt_tokens=list(range(3, 83)), n_predict=8, ignore_eos=True)
print(json.dumps({"hits": len(hits), "dir": res.metrics["compile_cache_dir"], "tokens": res.tokens,
                  "loaded": res.metrics["executables_loaded"], "traced": sorted(set(traced)),
                  "measured": len(measured), "workspaces": str(arena.plan.workspaces)}))
"""


def test_a_second_process_loads_the_programs_from_the_persistent_cache(tmp_path, monkeypatch):
  """A fresh process compiles and writes the programs, a second one loads them (same tokens);
  KVJAX_COMPILE_CACHE_DIR=off turns the cache off (checked in this process: the variable is read
  when a model is loaded)."""
  env = dict(os.environ, KVJAX_COMPILE_CACHE_DIR=str(tmp_path / "jax"), JAX_PLATFORMS="cpu")
  runs = []
  for _ in range(2):
    p = subprocess.run([sys.executable, "-c", SECOND_PROCESS], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
  assert runs[0]["dir"] == str(tmp_path / "jax") and any((tmp_path / "jax").iterdir())
  # the second process compiled from disk: the engine's steps loaded whole (kvjax.executables), not
  # even traced, the other programs from jax's cache
  assert runs[0]["hits"] == 0 and runs[0]["loaded"] == 0 and runs[1]["hits"] > 5 and runs[1]["loaded"] >= 8, runs
  assert "_layer_group" in runs[0]["traced"] and not {"_layer_group", "_head_step", "place_staged"} & set(runs[1]["traced"])
  assert runs[0]["tokens"] == runs[1]["tokens"]
  # the arena's workspaces (decode and prefill steps) measured by compiling once, then read back
  assert runs[0]["measured"] == 2 and runs[1]["measured"] == 0, runs
  assert runs[0]["workspaces"] == runs[1]["workspaces"]
  assert len(list((tmp_path / "jax" / "measured").iterdir())) == 2
  before = compile_cache.active()
  compile_cache.enable(str(tmp_path / "on"))      # on, as in a process without the variable
  monkeypatch.setenv(compile_cache.ENV, "off")
  try:
    off = api.load_model("tiny", page_tokens=16)
    assert compile_cache.active() is None
    res = api.generate(off, prompt_tokens=[3, 4, 5, 6], n_predict=1, ignore_eos=True)
    assert res.metrics["compile_cache_dir"] == "" and len(res.tokens) == 1
  finally:
    compile_cache.enable(before or False)


def test_remembered_measures_once_per_description_and_survives_a_bad_entry(tmp_path):
  """compile_cache.remembered: a value measured once for a description, read back from the cache's
  `measured/` folder by a process that has not seen it (the memo cleared), measured again for
  another description or where the entry is unreadable; with the cache off nothing is written."""
  before = compile_cache.active()
  calls = []

  def measure(v):
    return lambda: calls.append(v) or v

  compile_cache.enable(str(tmp_path / "c"))
  try:
    compile_cache._MEMO.clear()
    assert compile_cache.remembered("probe", "program a", measure(11)) == 11
    assert compile_cache.remembered("probe", "program a", measure(99)) == 11     # this process's
    compile_cache._MEMO.clear()
    assert compile_cache.remembered("probe", "program a", measure(99)) == 11     # from disk
    assert compile_cache.remembered("probe", "program b", measure(22)) == 22
    assert calls == [11, 22]
    (entry,) = [f for f in (tmp_path / "c" / "measured").iterdir() if
                json.loads(f.read_text())["value"] == 11]
    entry.write_text("{not json")
    compile_cache._MEMO.clear()
    assert compile_cache.remembered("probe", "program a", measure(33)) == 33
    assert json.loads(entry.read_text())["value"] == 33
    compile_cache.disable()
    compile_cache._MEMO.clear()
    assert compile_cache.remembered("probe", "program c", measure(44)) == 44
    assert sorted(f.name.split("-")[0] for f in (tmp_path / "c" / "measured").iterdir()) == ["probe"] * 2
  finally:
    compile_cache._MEMO.clear()
    compile_cache.enable(before or False)


def test_priming_a_new_phase_pool_refills_it_before_the_first_decode_and_changes_no_bit(model):
  """`SequenceState.prime` (run by `generate` once the phase arena enters its decode layout): a
  forward of no row uploads the new pool's resident pages, so that the first decode forward after
  it uploads no more than the second; the logits of the decode are those of an unprimed one."""
  from kvjax import generate as gen_lib
  prompt = _prompt(model, 150, seed=7)
  runs = []
  for primed in (False, True):
    kv = api.make_kv(model, 200, arena_mib=4, phased=True, policy="adaptive")
    prov = kv.provider
    seq = gen_lib.SequenceState(model.runner, prov)
    prov.enter("prefill")
    gen_lib.prefill(seq, prompt, 64)
    prov.enter("decode")
    h2d = [prov.metrics()["h2d_bytes"]]
    if primed:
      seq.prime()
      h2d.append(prov.metrics()["h2d_bytes"])
    logits = []
    for tok in (5, 9, 11):
      logits.append(np.asarray(seq.forward([tok])))
      h2d.append(prov.metrics()["h2d_bytes"])
    assert seq.pos == 153
    runs.append((np.diff(h2d), logits))
  (cold, plain_logits), (primed, primed_logits) = runs
  assert primed[0] > 0 and primed[1] <= primed[2], primed      # the refill came with the primer
  assert cold[0] > cold[1], cold                                   # unprimed: with the first decode
  for a, b in zip(plain_logits, primed_logits):
    np.testing.assert_array_equal(a, b)
