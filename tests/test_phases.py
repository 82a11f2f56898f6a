"""Phase arena wired to the streamed KV; adaptive resident/ring policy in the runtime."""

import numpy as np
import pytest

from kvjax.streaming import arena as arena_lib
from kvjax import engine, workspace
from kvjax.streaming import StreamedKV, adaptive_staging_reserve_pages, fixed_split, staging_reserve_pages
from kvjax.streaming import policy as policy_lib
from kvjax.streaming.phases import AdaptiveStreamedKV, PhasedKV
from tiny_setup import assert_same_logits, build_tiny_runner, generate_logged

UBATCH = 64


@pytest.fixture(scope="module")
def setup():
  return build_tiny_runner(2, page_tokens=16)


def test_prefill_decode_prefill_across_two_requests(setup):
  cfg, runner, layout = setup
  ws_prefill = workspace.group_step_workspace_bytes(runner, UBATCH)
  ws_decode = workspace.group_step_workspace_bytes(runner, 1)
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
    plain, plain_logits = generate_logged(runner, engine.PlainKV(cfg, layout, max_tokens), prompt, 40,
                                          ubatch=UBATCH)
    phased.reset()
    got, logits = generate_logged(runner, phased, prompt, 40, ubatch=UBATCH, on_phase=on_phase)
    assert got.tokens == plain.tokens, f"request {request}"
    assert_same_logits(logits, plain_logits, f"request {request}")
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
  plain, plain_logits = generate_logged(runner, engine.PlainKV(cfg, layout, max_tokens), prompt, 60, ubatch=UBATCH)
  kv = AdaptiveStreamedKV(cfg, layout, max_tokens, pool_pages=48, copy_pages=2)
  got, logits = generate_logged(runner, kv, prompt, 60, ubatch=UBATCH)
  assert got.tokens == plain.tokens
  assert_same_logits(logits, plain_logits)
  # the policy ran once per forward and moved the split at least once (entering decode)
  assert len(kv.decisions) == kv.counters["forwards"]
  assert any(d.partition_changed for d in kv.decisions)
  # the runtime placed the policy's per-layer capacities for the last forward, page by page
  _check_placement(kv, len(prompt) + 59)
  assert kv.counters["rebinds"] >= 1
  assert kv.counters["streamed_pages"] > 0


def _check_placement(kv, tokens):
  """The pool holds what `policy.layout` says: layer a's capacity, its first min(active, capacity)
  pages resident at its region, byte for byte the host history's pages (a streamed layer's last
  region pages are its open region: the rows of the copy unit it writes)."""
  lay = policy_lib.layout(kv.policy_config, kv.policy_state, tokens)
  assert kv.stream.resident_pages_per_layer == lay.capacities
  pool = np.asarray(kv.pool_pn)
  lt = kv.layout
  for a, l in enumerate(lay.layers):
    hist, h = kv.history_of(a)
    assert (l.cache_id, l.cache_layer) == ((policy_lib.TARGET_CACHE, a) if hist.name == "target"
                                           else (policy_lib.MTP_CACHE, 0))
    live = min(l.resident_live_pages, int(hist.tokens[h]) // lt.page_tokens)  # full pages
    base = int(kv.resident_base[a])
    open_page = int(kv.open_page[a])
    if open_page >= 0:     # a streamed layer: the region's last o pages are its open region
      cap, o = lay.capacities[a], kv.device.open_pages(a)
      live = min(live, cap - o)
      rows = int(kv.open_rows[a])
      assert rows == int(hist.tokens[h]) - open_page * lt.page_tokens > 0, f"layer {a}"
      for i in range(-(-rows // lt.page_tokens)):       # the unit's pages that hold committed rows
        slot, page = pool[base + cap - o + i], hist.pages_lpn[h, open_page + i]
        n = min(lt.page_tokens, rows - i * lt.page_tokens)
        k, v = n * lt.k_row_bytes, n * lt.v_row_bytes
        np.testing.assert_array_equal(slot[:k], page[:k], err_msg=f"layer {a} open region K rows")
        np.testing.assert_array_equal(slot[lt.v_offset:lt.v_offset + v], page[lt.v_offset:lt.v_offset + v],
                                      err_msg=f"layer {a} open region V rows")
    np.testing.assert_array_equal(pool[base:base + live], hist.pages_lpn[h, :live], err_msg=f"layer {a}")


def test_adaptive_concentrated_capacities_and_waves(setup):
  """Decode concentrates the streaming into the fewest layers (the others hold every active page):
  a 20-page pool of 3 layers (resident 4 a layer, ring 8) at 5 active pages places (2, 5, 5)
  (the deficit 3 in layer floor(0 * 3 / 1) = 0), rebinding from the prefill's uniform (4, 4, 4);
  the minimum adaptive pool (4 pages: ring 1) streams every layer in copy waves (its prefill
  admission is refused: no ring covers 1.1 x 3 pages). Tokens equal the plain cache's."""
  cfg, runner, layout = setup
  max_tokens = 96
  prompt = list(np.random.default_rng(8).integers(0, cfg.vocab_size, 70))
  # the plain cache of the other tests' capacity (its logits do not depend on it): programs shared
  plain, plain_logits = generate_logged(runner, engine.PlainKV(cfg, layout, 256), prompt, 6, ubatch=UBATCH)
  for pool, caps in ((20, (2, 5, 5)), (4, (1, 1, 1))):
    kv = AdaptiveStreamedKV(cfg, layout, max_tokens, pool_pages=pool, copy_pages=2)
    got, logits = generate_logged(runner, kv, prompt, 6, ubatch=UBATCH)
    assert got.tokens == plain.tokens, pool
    assert_same_logits(logits, plain_logits, f"pool {pool}")
    assert kv.stream.resident_pages_per_layer == caps
    _check_placement(kv, len(prompt) + 5)
    m = kv.metrics()
    assert m["policy_decisions"] == m["forwards"]
    if pool == 20:
      # the staging cap is the ring of the split the policy aims at for 96 tokens (6 pages a layer,
      # all resident: a 2-page ring), so layer 0's 4 streamed pages go in copy waves of 2
      assert m["capacities"] == "1x2,2x5" and m["rebinds"] >= 1
      assert kv.wave_cap == 2 and m["waved_layers"] >= 1
      assert m["admission_refusals"] == 0
    else:   # 5 pages a layer, 1 resident: 4 streamed through 1 slot -> 4 waves a layer in decode
      assert m["capacities"] == "3x1" and m["waved_layers"] >= 5 * 2 and m["waves_per_forward"] > 4
      assert m["admission_refusals"] == 1


def test_adaptive_policy_rebinds_on_arena_change(setup):
  """The adaptive provider inside the phase arena: each phase's pool (the decode one larger by the
  workspace difference) rebinds the policy (`policy.rebind`: a fresh state on that pool, one step
  at the committed length) and places its capacities; tokens equal the plain cache's."""
  cfg, runner, layout = setup
  ws_prefill = workspace.group_step_workspace_bytes(runner, UBATCH)
  ws_decode = workspace.group_step_workspace_bytes(runner, 1)
  max_tokens = 256
  kv = AdaptiveStreamedKV(cfg, layout, max_tokens, pool_pages=20, copy_pages=2, pinned=False)
  phased = PhasedKV(kv, ws_prefill + 56 * layout.page_bytes, ws_prefill, ws_decode, max_tokens)
  pre, dec = phased.pool_pages["prefill"], phased.pool_pages["decode"]
  assert dec > pre
  prompt = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 150))
  plain, plain_logits = generate_logged(runner, engine.PlainKV(cfg, layout, max_tokens), prompt, 30, ubatch=UBATCH)
  seen = []

  def on_phase(p):
    tokens = int(kv.histories["target"].tokens.max())
    phased.enter(p)
    want = policy_lib.rebind(kv.policy_config, kv.policy_config.pool_bytes, tokens)
    seen.append((p, kv.stream.pool_pages, kv.policy_state.pages, tokens))
    assert kv.policy_state == want.decision.next
    assert kv.stream.resident_pages_per_layer == want.layout.capacities

  got, logits = generate_logged(runner, phased, prompt, 30, ubatch=UBATCH, on_phase=on_phase)
  assert got.tokens == plain.tokens
  assert_same_logits(logits, plain_logits)
  assert seen == [("prefill", pre, pre, 0), ("decode", dec, dec, 150)]
  m = phased.metrics()
  assert m["policy_rebinds"] == 2 and m["streamed_pages"] > 0
  assert m["policy_decisions"] == m["forwards"] + 2      # a decision a forward + one a rebind
  _check_placement(kv, len(prompt) + 29)
  reserve = max(adaptive_staging_reserve_pages(p, max_tokens, layout, 2, pinned=False, n_layers=kv.n_layers,
                                               wave_pages=kv.wave_pages) for p in (pre, dec))
  assert 0 < m["staging_peak_bytes"] <= reserve * layout.page_bytes
