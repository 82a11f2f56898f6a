"""kvjax.streaming.plan: the one place a budget becomes pages (pure arithmetic on plain data)."""

import subprocess
import sys

import pytest

from kvjax.streaming import budget
from kvjax.streaming.plan import KVGeometry, Workspaces, plan_kv
from kvjax_pallas.page_layout import PageLayout

LAYOUT = PageLayout(2, 64, "q8_0", "q4_0", 16)
GEOMETRY = KVGeometry(n_target_layers=2, n_layers=3, layout=LAYOUT, wave_pages=2, block_row_bytes=512)
WS = Workspaces(decode_bytes=80_000, prefill_bytes=400_000)
MAX_TOKENS = 600


def smallest_arena(**kw):
  """The least arena the plan takes: refused one byte below, with the least it needs named."""
  with pytest.raises(budget.StreamBudgetError) as e:
    plan_kv(GEOMETRY, MAX_TOKENS, arena_bytes=1, workspaces=WS, pinned=False, **kw)
  msg = str(e.value)
  assert msg.startswith("too small: at least ") and msg.endswith(" MiB more"), msg
  lo, hi = 1, 1 << 30
  while lo < hi:      # the boundary, found without trusting the message
    mid = (lo + hi) // 2
    try:
      plan_kv(GEOMETRY, MAX_TOKENS, arena_bytes=mid, workspaces=WS, pinned=False, **kw)
      hi = mid
    except budget.StreamBudgetError:
      lo = mid + 1
  return lo, msg


@pytest.mark.parametrize("policy,phased", [("fixed", False), ("adaptive", False), ("fixed", True), ("adaptive", True)])
def test_the_least_arena_is_the_one_the_refusal_names(policy, phased):
  least, msg = smallest_arena(policy=policy, phased=phased)
  named = float(msg.split("at least ")[1].split(" MiB")[0])
  assert least <= named * 2**20 < least + 1100, (least, named)   # the MiB named, rounded up to 0.001
  p = plan_kv(GEOMETRY, MAX_TOKENS, arena_bytes=least, workspaces=WS, pinned=False, policy=policy, phased=phased)
  # what the plan accepts fits its arena: pool + staging beside the workspace, in every phase
  assert p.pool_pages + p.staging_reserve_pages <= (least - WS.decode_bytes) // LAYOUT.page_bytes
  for name, phase in p.phases:
    assert phase.split.pool_pages >= 1 and phase.region_pages >= phase.split.pool_pages, (name, phase)
  assert p.info()["kv"] == ("streamed+phased" if phased else "streamed")


def test_a_pool_of_pages_is_refused_below_the_minimum_and_split_above():
  n = GEOMETRY.n_layers
  with pytest.raises(budget.StreamBudgetError, match="more pages"):
    plan_kv(GEOMETRY, MAX_TOKENS, pool_pages=n, pinned=False)
  p = plan_kv(GEOMETRY, MAX_TOKENS, pool_pages=n + 2, pinned=False)    # a page a layer + a 2-page partition
  assert p.split.pool_pages == n + 2 and p.split.ring_slots >= GEOMETRY.wave_pages
  assert p.copy_unit_pages <= max(1, p.split.ring_slots) and p.staging_reserve_pages > 0
  every = n * LAYOUT.pages_for(MAX_TOKENS) + 1
  whole = plan_kv(GEOMETRY, MAX_TOKENS, pool_pages=every, pinned=False)
  assert whole.all_pages_resident and whole.describe() == "all pages resident"
  assert not p.all_pages_resident


def test_a_larger_arena_never_gives_a_smaller_pool():
  pools = [plan_kv(GEOMETRY, MAX_TOKENS, arena_bytes=a, workspaces=WS, pinned=False).pool_pages
           for a in range(1_500_000, 4_000_000, 97_531)]
  assert pools == sorted(pools) and pools[-1] > pools[0]


def test_plain_plan_and_bad_arguments():
  p = plan_kv(GEOMETRY, MAX_TOKENS)
  assert not p.streamed and p.describe() == "plain" and p.info() == {
      "kv": "plain", "ctx_size": MAX_TOKENS, "page_tokens": 16, "kv_layout": LAYOUT.describe()}
  with pytest.raises(ValueError, match="exactly one"):
    plan_kv(GEOMETRY, MAX_TOKENS, arena_bytes=10**7, pool_pages=8, workspaces=WS)
  with pytest.raises(ValueError, match="phased"):
    plan_kv(GEOMETRY, MAX_TOKENS, pool_pages=8, phased=True)


def test_the_plan_imports_no_jax():
  code = "import sys; import kvjax.streaming.plan, kvjax.memory_report; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  assert out.strip() == "False"


def test_a_pool_below_the_auto_partition_caps_it_a_given_partition_is_refused():
  wide = KVGeometry(2, 3, LAYOUT, wave_pages=8, partition_auto=True)
  p = plan_kv(wide, MAX_TOKENS, pool_pages=6, copy_pages=1, pinned=False)   # 3 layers: a ring of 3 at most
  assert p.partition_cap_pages == p.wave_pages and 1 <= p.wave_pages < 8
  with pytest.raises(budget.StreamBudgetError):   # one page more for the partition would not fit
    plan_kv(KVGeometry(2, 3, LAYOUT, wave_pages=p.wave_pages + 1), MAX_TOKENS, pool_pages=6, copy_pages=1,
            pinned=False)
  assert plan_kv(wide, MAX_TOKENS, pool_pages=200, copy_pages=1, pinned=False).partition_cap_pages is None
  fixed = KVGeometry(2, 3, LAYOUT, wave_pages=8, partition_auto=False)   # a partition the user gave stays
  with pytest.raises(budget.StreamBudgetError, match="more pages"):
    plan_kv(fixed, MAX_TOKENS, pool_pages=6, copy_pages=1, pinned=False)
  with pytest.raises(budget.StreamBudgetError, match="the minimum is 4 pages"):   # below layers + 1: refused
    plan_kv(wide, MAX_TOKENS, pool_pages=3, copy_pages=1, pinned=False)
