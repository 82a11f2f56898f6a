"""Every KV budget `make_kv` takes serves: for each budget, `make_kv` refuses with a one-line
`api.KVBudgetError` (a `ParameterError` and a `StreamBudgetError`: the one type to catch) that
starts with the parameter it names (arena_mib or pool_pages) and says what is missing, and the
budget it names is accepted; or every generation the cache admits completes with the tokens of
plain greedy decoding. A few corner budgets on the tiny model with 16-token pages (prompts cross
many pages), judged as `experiments.budget_fuzz` judges its seeded random ones
(`python -m experiments.budget_fuzz --cases=N`)."""

import pytest

from experiments import budget_fuzz
from experiments.budget_fuzz import Case
from kvjax import api
from kvjax.streaming import StreamBudgetError, StreamConfig, policy as policy_lib

LAYERS = 3                    # the tiny model: 2 attention layers + its MTP layer
MAX_TOKENS = 80               # 5 pages a layer
RESIDENT = LAYERS * 5 + 1     # the pool that holds every page
UBATCH = 4                    # one micro-batch shape for the module (fewer programs to compile)


@pytest.fixture(scope="module")
def models():
  m = budget_fuzz.Models()
  m["auto"]    # loaded once for the module
  return m


@pytest.fixture(scope="module")
def refs():
  return budget_fuzz.References()


def judge(models, refs, case, caches=None):
  outcome, detail = budget_fuzz.run_case(models, case, refs, caches)
  assert not outcome.startswith("FAIL"), (outcome, detail, case.describe())
  return outcome, detail


def refusal(models, case):
  """make_kv's refusal of `case` (judged: one line, the parameter first, the budget it names taken)."""
  outcome, detail = judge(models, None, case)
  assert outcome == "refused", detail
  with pytest.raises(api.KVBudgetError) as e:
    budget_fuzz.make_kv(models, case)
  assert isinstance(e.value, StreamBudgetError) and isinstance(e.value, api.ParameterError)
  return str(e.value)


def test_minimum_pool_streams_in_copy_waves(models, refs):
  """The minimum pool (1 resident page a layer + 1 ring slot) holds no layer's streamed pages: the
  layers stream in copy waves through a 1-slot ring, and the tokens are plain greedy's (a prompt
  ending mid-page and mid-copy-unit)."""
  caches = []
  case = Case(MAX_TOKENS, (45,), 2, pool_pages=LAYERS + 1, ubatch=UBATCH, copy_pages=2)
  assert judge(models, refs, case, caches)[0] == "accepted"
  assert caches[0].metrics()["waved_layers"] > 0


def test_minimum_pool_plus_one_adaptive_two_prompts(models, refs):
  """The minimum pool + 1 under the adaptive policy; a second, longer prompt through the cache's
  reset (the longest prompt the capacity takes)."""
  case = Case(MAX_TOKENS, (21, MAX_TOKENS - 2), 2, pool_pages=LAYERS + 2, policy="adaptive", ubatch=UBATCH,
              copy_pages=2)
  assert judge(models, refs, case)[0] == "accepted"


def test_all_resident_pool_with_ngram_drafts(models, refs):
  """Every page resident, speculative decoding (ngram drafts over a repeated motif: odd seed)."""
  caches = []
  case = Case(MAX_TOKENS, (33,), 3, pool_pages=RESIDENT, ubatch=UBATCH, copy_pages=2, spec=("ngram", 3), seed=1)
  assert judge(models, refs, case, caches)[0] == "accepted"
  assert caches[0].info["kv"] == "all pages resident"


def test_pool_below_minimum_refused(models):
  msg = refusal(models, Case(MAX_TOKENS, (5,), pool_pages=LAYERS))
  assert msg.startswith("pool_pages 3: ") and "the minimum is 4 pages" in msg and "1 more pages" in msg


def test_phased_arena_tiny_refused_then_just_enough_serves(models, refs):
  """A phased arena too small is refused with the least arena that holds the cache (the prefill
  phase's workspace of a micro-batch beside its smallest KV region); that arena is accepted and
  serves plain greedy's tokens, 0.001 MiB less is refused. (The prefill block the arena sizes
  leaves that region whole: it once took half of what was left beside the workspace in hidden
  rows alone, and its KV rows on top overran the region, so every arena near the least one was
  refused, the MiB the refusal named too.)"""
  msg = refusal(models, Case(MAX_TOKENS, (5,), arena_mib=0.05, phased=True, ubatch=UBATCH, copy_pages=2))
  assert msg.startswith("arena_mib 0.05: too small: at least ") and "the prefill phase" in msg and "ubatch" in msg
  enough = budget_fuzz.needed_budget(Case(MAX_TOKENS, (5,), arena_mib=0.05), msg)
  case = Case(MAX_TOKENS, (70,), 2, arena_mib=enough, phased=True, ubatch=UBATCH, copy_pages=2)
  assert judge(models, refs, case)[0] == "accepted"
  refusal(models, Case(MAX_TOKENS, (5,), arena_mib=round(enough - 0.001, 3), phased=True, ubatch=UBATCH,
                       copy_pages=2))


def test_adaptive_arena_below_policy_minimum_refused(models):
  """An adaptive arena whose pool, beside the staging of any split the policy may pick, is under
  the policy's minimum (layers + 1 pages): refused with the arena that holds it (the policy's own
  error once escaped make_kv)."""
  for phased in (False, True):
    msg = refusal(models, Case(MAX_TOKENS, (5,), arena_mib=0.2152, policy="adaptive", phased=phased, ubatch=UBATCH))
    assert "at least" in msg and "any split the adaptive policy picks" in msg and msg.endswith(" MiB more")


def test_pool_minimum_counts_the_copy_wave_ring(models):
  """With 2-page attention partitions a pool whose layers stream in copy waves needs a ring of 2
  slots: the minimum the refusal names is that pool (it once named layers + 1, itself refused)."""
  for policy in ("fixed", "adaptive"):
    msg = refusal(models, Case(128, (5,), pool_pages=1, policy=policy, block_pages=2))
    assert "the minimum is 4 pages" in msg and "and 5 where its layers stream in copy waves of whole 2-page" in msg
    assert msg.endswith(f"4 more pages ({4 * 3400 / 2**20:.3g} MiB) needed, or fewer rows a forward (ubatch)")


def test_adaptive_ring_holds_a_wide_partition(models):
  """Partitions wider than the policy's own ring hint (8 slots): its ring never shrinks below one
  partition (or a layer's pages), in every pool it takes and after a rebind to another pool, so the
  copy waves of a layer it leaves more streamed pages than the ring holds fit. (A 16-page pool of
  12-page partitions at 256 tokens once stopped mid-prefill: "ring too small ... 10 slots".)"""
  model = models[12]
  least = None
  for pool in range(LAYERS + 1, 30):
    try:
      kv = api.make_kv(model, 256, pool_pages=pool, policy="adaptive", ubatch=8)
    except api.KVBudgetError as e:
      assert least is None and str(e).startswith(f"pool_pages {pool}: ") and "and 15 where" in str(e)
      continue
    least = least or pool
    for p in (pool, max(least, pool - 3)):
      provider = kv.provider
      if p != provider.stream.pool_pages:
        provider.rebind(StreamConfig(p, (1,) * LAYERS, provider.stream.copy_pages))
      assert policy_lib.budget(provider.policy_config).minimum_ring_slots >= 12, (pool, p)
      assert provider.stream.ring_slots >= 12, (pool, p, provider.stream)
  assert least == 15


def test_a_pool_smaller_than_a_partition_caps_the_partition(models, refs):
  """A pool whose ring cannot hold one attention partition of the kernels' "auto" choice (a few
  pages for 128-row chunks over 800 tokens) is not refused: the plan caps the partition at what its
  ring holds (`KVPlan.partition_cap_pages`), the layers stream in copy waves of such partitions, and
  the tokens are plain greedy's: any pool of layers + 1 pages runs."""
  own = models["auto"].runner.partition_pages(128, 800)
  assert own > 1
  for policy, pool in (("fixed", LAYERS + 1), ("adaptive", LAYERS + 2)):
    caches = []
    case = Case(800, (700,), 2, pool_pages=pool, ubatch=128, copy_pages=1, policy=policy)
    assert judge(models, refs, case, caches)[0] == "accepted", policy
    plan = caches[0].plan
    assert plan.partition_cap_pages is not None and plan.partition_cap_pages < own, (policy, plan)
    assert caches[0].info["partition_cap_pages"] == plan.partition_cap_pages
    assert caches[0].metrics()["waved_layers"] > 0


def test_a_capped_partition_compiles_nothing_across_page_boundaries(models):
  """The capped partition is fixed for the cache's life (a static argument that does not follow the
  history): a decode of 40 tokens crossing page and copy-unit boundaries (16-token pages, 1-page
  units) compiles nothing after its first token."""
  case = Case(800, (300,), 40, pool_pages=LAYERS + 1, ubatch=128, copy_pages=1)
  kv = budget_fuzz.make_kv(models, case)
  assert kv.plan.partition_cap_pages is not None
  res = api.generate(models["auto"], kv, prompt_tokens=[t % 200 + 3 for t in range(300)], n_predict=40,
                     ignore_eos=True, ubatch=128)
  assert len(res.tokens) == 40 and res.metrics["predicted_compiles"] == 0, res.metrics["compile_by_program"]


@pytest.mark.parametrize("pool", [LAYERS + 1, LAYERS + 4, 2 * LAYERS + 4])
def test_the_plan_counts_a_decode_forwards_ring_fills_in_advance(models, pool):
  """`KVPlan.decode_cost` (made before the cache is built) gives the ring fills (copy waves) and
  streamed pages of every decode forward, at every context from a prompt ending mid-page across
  page boundaries: the cost of a small pool is known before anything is allocated."""
  from kvjax import generate
  case = Case(MAX_TOKENS, (30,), 2, pool_pages=pool, ubatch=UBATCH, copy_pages=1)
  cache = budget_fuzz.make_kv(models, case)
  kv = cache.provider
  seq = generate.SequenceState(models["auto"].runner, kv)
  for lo in range(0, 30, UBATCH):    # the prompt in micro-batches of the planned width
    seq.forward(list(range(3 + lo, 3 + min(30, lo + UBATCH))), pad_to=UBATCH)
    seq.pos = min(30, lo + UBATCH)
  fills = []
  for _ in range(40):                # tokens 31..70: pages 2..5 of 16 tokens
    before, streamed = kv.counters["waves"], kv.counters["streamed_pages"]
    cost = cache.plan.decode_cost(seq.pos)
    seq.forward([7])
    assert kv.counters["waves"] - before == cost.ring_fills, (pool, seq.pos, cost)
    assert kv.counters["streamed_pages"] - streamed == cost.streamed_pages, (pool, seq.pos, cost)
    fills.append(cost.ring_fills)
  assert max(fills) > 0 and (pool > LAYERS + 1 or cache.plan.decode_cost(70).waved_layers > 0), fills
