"""Phase arena wired to the streamed KV; adaptive resident/ring policy in the runtime."""

import numpy as np
import pytest

from kvjax.streaming import arena as arena_lib
from kvjax import engine, generate
from kvjax.streaming import StreamedKV, fixed_split, staging_reserve_pages
from kvjax.streaming.phases import AdaptiveStreamedKV, PhasedKV
from tiny_setup import build_tiny_runner

UBATCH = 64


@pytest.fixture(scope="module")
def setup():
  return build_tiny_runner(2, page_tokens=16)


def test_prefill_decode_prefill_across_two_requests(setup):
  cfg, runner, layout = setup
  ws_prefill = engine.group_step_workspace_bytes(runner, UBATCH)
  ws_decode = engine.group_step_workspace_bytes(runner, 1)
  assert ws_prefill > ws_decode + 2 * layout.page_bytes  # the micro-batch step needs more scratch
  max_tokens = 256
  arena_bytes = ws_prefill + 64 * layout.page_bytes
  n_layers = cfg.num_attention_layers + 1
  kv = StreamedKV(cfg, layout, max_tokens, fixed_split(20, n_layers, max_tokens, layout, 2))
  phased = PhasedKV(kv, arena_bytes, ws_prefill, ws_decode, max_tokens)
  pre, dec = phased.pool_pages["prefill"], phased.pool_pages["decode"]
  # the decode KV region is larger than the prefill one by the workspace difference (whole pages)
  regions = phased.region_pages
  diff_pages = (ws_prefill - ws_decode) / layout.page_bytes
  assert abs((regions["decode"] - regions["prefill"]) - diff_pages) <= 1.0
  # each region holds its pool plus the staging reserve of that pool's in-flight uploads
  assert dec > pre
  for phase, pool in (("prefill", pre), ("decode", dec)):
    split = phased.split_for(regions[phase])
    reserve = staging_reserve_pages(split, max_tokens, layout, kv.prefetch_depth, pinned=False)
    assert split.pool_pages == pool and 0 < reserve and pool + reserve <= regions[phase]

  phases_seen, pools_seen = [], []

  def on_phase(p):
    phased.enter(p)
    phases_seen.append(p)
    pools_seen.append(kv.stream.pool_pages)

  rng = np.random.default_rng(0)
  for request in range(2):
    prompt = list(rng.integers(0, cfg.vocab_size, 150 + 20 * request))
    plain = generate.generate(runner, engine.PlainKV(cfg, layout, max_tokens), prompt, 40, ubatch=UBATCH)
    phased.reset()
    got = generate.generate(runner, phased, prompt, 40, ubatch=UBATCH, on_phase=on_phase)
    assert got.tokens == plain.tokens, f"request {request}"
  assert phases_seen == ["prefill", "decode", "prefill", "decode"]
  assert pools_seen == [pre, dec, pre, dec]
  assert phased.arena.generation >= 4
  assert kv.metrics()["rebinds"] == 2   # reset starts the counters again: this request's prefill and decode
  assert int(kv.pool_pn.shape[0]) == dec
  # the staging buffers the provider held never exceeded the reserve carved for them
  peak = kv.metrics()["staging_peak_bytes"]
  reserve = staging_reserve_pages(kv.stream, max_tokens, layout, kv.prefetch_depth, pinned=False)
  assert 0 < peak <= reserve * layout.page_bytes, (peak, reserve * layout.page_bytes)


def test_phase_arena_refuses_too_small_budget(setup):
  cfg, runner, layout = setup
  kv = StreamedKV(cfg, layout, 256, fixed_split(20, 3, 256, layout, 2))
  with pytest.raises(arena_lib.CapacityError, match="missing"):
    PhasedKV(kv, arena_bytes=1000, prefill_workspace_bytes=900, decode_workspace_bytes=10, max_tokens=256)
  # a budget that holds a page but cannot stream the context: refused with the pages missing
  with pytest.raises(ValueError, match="more pages"):
    PhasedKV(kv, arena_bytes=6 * layout.page_bytes, prefill_workspace_bytes=0, decode_workspace_bytes=0,
             max_tokens=256)
  assert kv.stream.pool_pages == 20  # the bound provider is untouched


def test_adaptive_policy_split_streams_identically(setup):
  cfg, runner, layout = setup
  max_tokens = 400
  prompt = list(np.random.default_rng(5).integers(0, cfg.vocab_size, 300))
  plain = generate.generate(runner, engine.PlainKV(cfg, layout, max_tokens), prompt, 60, ubatch=UBATCH)
  kv = AdaptiveStreamedKV(cfg, layout, max_tokens, pool_pages=48, copy_pages=2)
  got = generate.generate(runner, kv, prompt, 60, ubatch=UBATCH)
  assert got.tokens == plain.tokens
  # the policy ran once per forward and moved the split at least once (entering decode)
  assert len(kv.decisions) == kv.counters["forwards"]
  assert any(d.partition_changed for d in kv.decisions)
  r = kv.policy_state.resident_pages_per_layer
  assert kv.stream.resident_pages_per_layer == (r,) * 3
  assert kv.counters["streamed_pages"] > 0


def test_adaptive_policy_receives_feedback(setup):
  """The feedback window is fed from the provider's counters and reaches the policy."""
  cfg, runner, layout = setup
  max_tokens = 400
  prompt = list(np.random.default_rng(6).integers(0, cfg.vocab_size, 300))
  kv = AdaptiveStreamedKV(cfg, layout, max_tokens, pool_pages=48, copy_pages=2)
  kv.timing_interval = 1  # time one upload every forward
  generate.generate(runner, kv, prompt, 30, ubatch=UBATCH)
  used = [d for d in kv.decisions if d.feedback_used]
  assert used, "no decision used feedback"
  assert kv.counters["timed_bytes"] > 0 and kv.counters["timed_copy_ms"] > 0
  assert kv.counters["ring_peak_slots"] > 0
  fb = kv.window.feedback()
  assert fb.available and 0.0 <= fb.copy_busy_ratio <= 1.0
  assert fb.samples == kv.window.samples and fb.misses <= fb.samples
