"""kvjax.executables: compiled steps stored beside the persistent cache, loaded untraced, and
prepared ahead of their calls on worker threads (kvjax.warmup.prepare)."""

import pickle
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import api, compile_cache, executables
from kvjax.generate import CompileClock


@executables.jit(static_argnames=("power",), donate_argnames=("acc",), params="weights")
def _step(weights, acc, x, *, power):
  w, b = weights
  return acc + (x @ w + b) ** power, jnp.sum(x)


@pytest.fixture
def store(tmp_path):
  """The store in a folder of its own, this process's loaded executables forgotten before and after."""
  before = compile_cache.active()
  compile_cache.enable(str(tmp_path / "cache"))
  executables.clear_loaded()
  yield tmp_path / "cache" / "executables"
  executables.clear_loaded()
  compile_cache.enable(before or False)


def _args(rows=3):
  rng = np.random.default_rng(rows)
  weights = (jnp.asarray(rng.normal(size=(4, 5)), jnp.float32), jnp.asarray(rng.normal(size=(5,)), jnp.float32))
  return weights, jnp.zeros((rows, 5), jnp.float32), jnp.asarray(rng.normal(size=(rows, 4)), jnp.float32)


def test_a_stored_step_is_loaded_untraced_and_computes_what_jit_does(store):
  weights, acc, x = _args()
  want = _step.jitted(weights, jnp.zeros_like(acc), x, power=2)
  first = _step(weights, acc, x, power=2)
  assert [f.name.split("-")[0] for f in store.iterdir()] == ["step"]
  executables.clear_loaded()                      # as a second process: nothing loaded yet
  traced = []
  listener = lambda e, d, fun_name="?", **k: traced.append(fun_name) if e.endswith("jaxpr_trace_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  loaded = executables.STATS["loaded"]
  try:
    with CompileClock() as clock:
      again = _step(weights, jnp.zeros_like(acc), x, power=2)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert executables.STATS["loaded"] == loaded + 1 and clock.loaded == 1 and clock.programs == 0
  assert "_step" not in traced
  for a, b, c in zip(want, first, again):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
  assert acc.is_deleted()                         # the donation holds for the stored executable


def test_the_key_follows_static_arguments_and_shapes_and_a_bad_entry_is_compiled_again(store):
  weights, acc, x = _args()
  _step(weights, acc, x, power=2)
  _step(weights, jnp.zeros((3, 5)), x, power=3)                     # another static argument
  w6, acc6, x6 = _args(6)
  _step(w6, acc6, x6, power=2)                                     # other shapes
  files = sorted(store.iterdir())
  assert len(files) == 3
  for f in files:
    f.write_bytes(b"not a pickle")
  executables.clear_loaded()
  compiled = executables.STATS["compiled"]
  out, _ = _step(weights, jnp.zeros((3, 5)), x, power=2)
  assert executables.STATS["compiled"] == compiled + 1
  np.testing.assert_array_equal(np.asarray(out), np.asarray(_step.jitted(weights, jnp.zeros((3, 5)), x, power=2)[0]))


def test_inside_a_trace_and_with_the_store_off_the_step_is_jit(store):
  weights, acc, x = _args()
  outer = jax.jit(lambda w, a, v: _step(w, a, v, power=2)[0].sum())
  want = float(jnp.sum(_step.jitted(weights, jnp.zeros_like(acc), x, power=2)[0]))
  assert float(outer(weights, jnp.zeros_like(acc), x)) == pytest.approx(want, rel=1e-6)
  assert not any(store.glob("*.pkl")) if store.exists() else True
  compile_cache.disable()
  assert executables.directory() is None
  out, _ = _step(weights, jnp.zeros_like(acc), x, power=2)
  assert float(out.sum()) == pytest.approx(want, rel=1e-6)


def test_a_step_calling_back_into_python_is_not_stored(store):
  @executables.jit
  def noisy(x):
    return jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1

  unstorable = executables.STATS["unstorable"]
  np.testing.assert_array_equal(np.asarray(noisy(jnp.arange(3.0))), [1.0, 3.0, 5.0])
  assert executables.STATS["unstorable"] == unstorable + 1
  assert not store.exists() or not any(store.iterdir())


def test_prepared_steps_compile_on_threads_and_every_call_of_a_generation_finds_its_own(store, monkeypatch):
  """warmup.prepare (run by api.generate as it enters the prefill) makes ready every step the
  generation calls, on a phased streamed cache: no engine step call finds its signature
  unprepared, the prepared compiles are counted at their first call, and the tokens are those of
  the plain cache."""
  monkeypatch.setenv(executables.THREADS_ENV, "2")
  assert executables.ahead()
  model = api.load_model("tiny", page_tokens=16)
  prompt = [int(t) for t in np.random.default_rng(5).integers(3, model.cfg.vocab_size, 150)]
  kv = api.make_kv(model, 200, arena_mib=4, phased=True, policy="adaptive")
  unprepared = executables.STATS["unprepared"]
  res = api.generate(model, kv, prompt_tokens=prompt, n_predict=24, ignore_eos=True)
  assert executables.STATS["unprepared"] == unprepared, "a step was called with a signature nothing prepared"
  by = res.metrics["compile_by_program"]
  assert any(k.startswith("prepared donating_group_step") for k in by) and res.metrics["predicted_compiles"] == 0, by
  monkeypatch.setenv(executables.THREADS_ENV, "1")
  assert not executables.ahead()
  plain = api.generate(model, prompt_tokens=prompt, n_predict=24, ignore_eos=True)
  assert res.tokens == plain.tokens


def test_a_program_from_jax_s_persistent_cache_is_not_stored(store):
  """An executable jax's persistent cache gave, serialized again, lost its code on the CPU (a later
  process failed "Function ... not found"): only programs compiled in the process are written."""
  weights, acc, x = _args(5)
  _step.jitted(weights, acc, x, power=4)            # compiled by jit and written to jax's cache
  jax.clear_caches()
  before = dict(executables.STATS)
  out, _ = _step(weights, jnp.zeros((5, 5)), x, power=4)
  assert executables.STATS["from_jax_cache"] == before["from_jax_cache"] + 1
  assert executables.STATS["written"] == before["written"]
  assert not store.exists() or not any(store.iterdir())
  np.testing.assert_array_equal(np.asarray(out), np.asarray(_step.jitted(weights, jnp.zeros((5, 5)), x, power=4)[0]))


def test_a_later_stage_compiles_after_the_earlier_one(store, monkeypatch):
  """executables.stage: steps prepared in a stage begin compiling once the earlier stage's are done
  (the prefill's programs do not share the worker threads with the decode's)."""
  monkeypatch.setenv(executables.THREADS_ENV, "3")
  spans = []
  compile_ = jax.stages.Lowered.compile

  def timed(self, *a, **k):
    t0 = time.perf_counter()
    out = compile_(self, *a, **k)
    spans.append((t0, time.perf_counter(), self.out_info[0].shape[0]))
    return out

  monkeypatch.setattr(jax.stages.Lowered, "compile", timed)
  with executables.stage() as first:
    for rows in (7, 8):
      w, acc, x = _args(rows)
      _step.prepare(w, acc, x, power=2)
  with executables.stage(after=first):
    w, acc, x = _args(9)
    _step.prepare(w, acc, x, power=2)
  out = _step(w, jnp.zeros((9, 5)), x, power=2)[0]             # waits for its own
  np.testing.assert_array_equal(np.asarray(out), np.asarray(_step.jitted(w, jnp.zeros((9, 5)), x, power=2)[0]))
  for f in first:
    f.result()
  by_rows = {r: (t0, t1) for t0, t1, r in spans}
  assert sorted(by_rows) == [7, 8, 9]
  assert by_rows[9][0] >= max(by_rows[7][1], by_rows[8][1])


def test_the_default_device_keys_its_own_executable(store):
  """Under `jax.default_device(d)` (a tensor-parallel cache's providers, one a device) a step runs
  an executable of device d: on the CPU's 2+ host devices when there are, else the key alone."""
  weights, acc, x = _args(4)
  devices = jax.devices()
  key0 = _step._key((weights, acc, x), {"power": 2}, [weights, acc, x])
  with jax.default_device(devices[-1]):
    key1 = _step._key((weights, acc, x), {"power": 2}, [weights, acc, x])
    if len(devices) > 1:
      w, a, v = jax.device_put((weights, jnp.zeros((4, 5)), x), devices[-1])
      out, _ = _step(w, a, v, power=2)
      assert out.devices() == {devices[-1]}
  assert key0 != key1


def test_an_entry_taking_other_shapes_is_compiled_again(store):
  """A stored executable whose arguments are not the call's (a key that collided, a file copied by
  hand) is not run: the step compiles its own."""
  weights, acc, x = _args(3)
  _step(weights, acc, x, power=2)
  (three,) = list(store.iterdir())
  w2, acc2, x2 = _args(2)
  _step(w2, acc2, x2, power=2)
  (two,) = [f for f in store.iterdir() if f != three]
  entry = pickle.loads(two.read_bytes())
  entry["key"] = pickle.loads(three.read_bytes())["key"]     # the 2-row program under the 3-row key
  three.write_bytes(pickle.dumps(entry))
  executables.clear_loaded()
  before = dict(executables.STATS)
  out, _ = _step(weights, jnp.zeros((3, 5)), x, power=2)
  assert executables.STATS["mismatched"] == before["mismatched"] + 1
  assert executables.STATS["compiled"] == before["compiled"] + 1
  np.testing.assert_array_equal(np.asarray(out), np.asarray(_step.jitted(weights, jnp.zeros((3, 5)), x, power=2)[0]))


def test_the_planar_product_s_setting_keys_its_own_executable(store, monkeypatch):
  """A later process with another KVJAX_PLANAR_PRODUCT (read while tracing) does not load the
  programs stored under the first: the variable is part of the stored key."""
  weights, acc, x = _args()
  monkeypatch.setenv("KVJAX_PLANAR_PRODUCT", "xla")
  _step(weights, acc, x, power=2)
  executables.clear_loaded()                      # as a second process
  monkeypatch.setenv("KVJAX_PLANAR_PRODUCT", "pallas")
  loaded = executables.STATS["loaded"]
  _step(weights, jnp.zeros((3, 5)), x, power=2)
  assert executables.STATS["loaded"] == loaded and len(list(store.iterdir())) == 2


@executables.jit
def _scaled_row(x, i):
  return x[i] * 2


def test_an_int32_argument_is_numpy_with_jnp_int32_s_signature_and_a_device_array_stays(store):
  """`int32_arg`: host values become numpy int32 (moved by the call, no dispatch of their own) with
  the signature of `jnp.int32`'s array, so both find one executable; a device array is not read."""
  dev = jnp.arange(3, dtype=jnp.int32)
  assert executables.int32_arg(dev) is dev
  assert executables.int32_arg(dev.astype(jnp.int16)).dtype == jnp.int32
  for v in (5, np.int64(5), [1, 2]):
    a = executables.int32_arg(v)
    assert isinstance(a, np.ndarray) and a.dtype == np.int32
    assert executables._leaf_sig(a) == executables._leaf_sig(jnp.asarray(v, jnp.int32))   # pylint: disable=protected-access
  x = jnp.arange(12.0).reshape(4, 3)
  compiled = executables.STATS["compiled"]
  got = _scaled_row(x, executables.int32_arg(2))
  again = _scaled_row(x, jnp.int32(3))
  assert executables.STATS["compiled"] == compiled + 1
  np.testing.assert_array_equal(np.asarray(got), [12.0, 14.0, 16.0])
  np.testing.assert_array_equal(np.asarray(again), [18.0, 20.0, 22.0])
