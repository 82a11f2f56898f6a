"""experiments.soak_stream, short: speculative rounds with planted rejections on the adaptive
streamed cache through a small pool, with failed host-to-device copies retried: tokens equal plain
greedy decoding, the host history equals the plain cache of the same rounds byte for byte."""

import pytest

from experiments import soak_stream


@pytest.mark.slow
def test_short_soak():
  r = soak_stream.soak(steps=16, prompt_tokens=40, page_tokens=16, pool_pages=8, copy_pages=2, n_max=3,
                       wrong_every=3, fault_every=8)
  assert r["tokens_equal_plain_greedy"] and r["tokens_equal_spec_plain"]
  assert r["history_bytes_equal_spec_plain"]
  assert r["faults_injected"] >= 3 and r["retries"] == r["faults_injected"]
  assert r["accepted"] < r["drafts"]          # planted rejections happened
  assert r["ring_wraps"] > 0 and r["staging_live_bytes_after"] == 0
