"""kvjax.streaming.provider fault paths: a host-to-device copy that fails mid-forward leaves no
staging bytes, counters or donated buffers behind; the same forward retried on the same provider
gives the plain cache's logits bit for bit; `reset` clears every counter."""

import numpy as np
import pytest

from kvjax import engine
from kvjax.streaming import StreamedKV, fixed_split
from experiments.lib.faults import RetryingRunner, copy_faults
from tiny_setup import build_tiny_runner


@pytest.fixture(scope="module")
def tiny_runner():
  return build_tiny_runner(0, page_tokens=16)


def decode(runner, kv, prompt, steps, fault_every=0):
  """Prefill + greedy decode with `runner.forward`; a host-to-device copy fails after every
  `fault_every` - 1 good ones, and the failed forward is retried with the same arguments
  (`RetryingRunner`). -> (logits per step, faults injected)."""
  with copy_faults(every=fault_every) as faults:
    run = RetryingRunner(runner)

    def forward(tokens, pos, states):
      return run.forward(np.asarray(tokens, np.int32), pos, len(tokens), states, kv)

    out = forward(prompt, 0, runner.zero_states())
    logits = [np.asarray(out.logits_rv[-1])]
    pos, states = len(prompt), out.rec_states
    for _ in range(steps):
      out = forward([int(np.argmax(logits[-1]))], pos, states)
      logits.append(np.asarray(out.logits_rv[-1]))
      pos, states = pos + 1, out.rec_states
  assert run.retries == faults.injected
  return logits, faults.injected


def test_failed_copies_retried_give_plain_logits_and_clean_counters(tiny_runner):
  cfg, runner, layout = tiny_runner
  prompt = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 50))
  steps, max_tokens = 8, 256    # the capacity of tests/test_streaming.py's caches on 16-token pages
  plain, _ = decode(runner, engine.PlainKV(cfg, layout, max_tokens), prompt, steps)

  def streamed():
    stream = fixed_split(pool_pages=6, n_layers=cfg.num_attention_layers + 1, max_tokens=max_tokens,
                         layout=layout, copy_pages=2)
    return StreamedKV(cfg, layout, max_tokens, stream)

  clean_kv = streamed()
  clean, _ = decode(runner, clean_kv, prompt, steps)
  kv = streamed()
  faulty, faults = decode(runner, kv, prompt, steps, fault_every=9)
  assert faults >= 3
  for step, (a, b, c) in enumerate(zip(plain, clean, faulty)):
    np.testing.assert_array_equal(b, a, err_msg=f"step {step}: streamed vs plain")
    np.testing.assert_array_equal(c, a, err_msg=f"step {step}: streamed with failed copies vs plain")
  # nothing of the failed forwards stays counted: the staging peak is the clean run's
  assert kv.stager.refill_bytes == 0 and kv.stager.held_bytes == clean_kv.stager.held_bytes
  assert kv.counters["staging_peak_bytes"] == clean_kv.counters["staging_peak_bytes"] > 0
  assert kv.counters["forwards"] == clean_kv.counters["forwards"] == steps + 1
  assert kv.d2h_bytes == clean_kv.d2h_bytes
  # the host history holds exactly the clean run's bytes
  for name, hist in kv.histories.items():
    np.testing.assert_array_equal(hist.pages_lpn, clean_kv.histories[name].pages_lpn)

  kv.reset()
  assert all(v == 0 for v in kv.counters.values()), kv.counters
  assert kv.d2h_bytes == 0 and kv.stager.refill_bytes == 0 and not kv.stager.stage and not kv._pending
  again, _ = decode(runner, kv, prompt, 2)
  for a, b in zip(again, plain):
    np.testing.assert_array_equal(a, b)
