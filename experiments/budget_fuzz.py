"""Fuzz the KV budgets of `kvjax.api.make_kv`: every budget is refused up front, or every generation
the cache admits completes with the tokens of plain greedy decoding.

  python -m experiments.budget_fuzz --cases=300 --seed=0

On the tiny model with 16-token pages (prompts cross many pages), draws `--cases` seeded cases
(`sample_cases`): a pool of pages (below the minimum of layers + 1 pages up to every page resident)
or an arena in MiB (too small to ample; fixed or adaptive, plain or phased), with or without
speculative decoding (mtp, ngram; n_max 2-3), small micro-batches, copy units and prefill blocks,
prompts from 1 token to max_tokens - n_predict (- n_max) ending on a page, mid-page, mid-copy-unit.
Each case (`run_case`) is

* refused: `make_kv` raised `api.KVBudgetError` in one line that starts with the parameter it names
  (arena_mib or pool_pages) and says what would do (pages more, or MiB needed), and the budget it
  names is accepted;
* accepted: every generation on the cache (a second, shorter prompt on the same cache now and then,
  through its reset) gave the tokens of a plain cache's greedy run of the same prompt;
* FAIL: anything else (another exception from make_kv or generate, a refusal of another shape,
  other tokens).

Prints the failures, then a table of outcomes per budget kind; exit status 1 on any failure. With
`--out`, writes `cases.jsonl` (each case and its outcome).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import json
import os
import re
import tempfile
import time
import traceback
from typing import Dict, List, Optional, Tuple

import numpy as np
from absl import app, flags

from experiments.lib.tables import outcome_table

PAGE_TOKENS = 16
MAX_TOKENS = (32, 48, 80, 128, 208)   # few capacities: each is a page-table shape to compile
UBATCH = (1, 2, 3, 4, 8)
COPY_PAGES = (1, 2, 4, 8)
PAGE_BYTES = 3400                      # a page of the tiny model's cache (Q8_0 K, Q4_0 V, 16 tokens)


def define_flags():
  """The command line's flags, defined when the module runs as a program (not at import: tests
  import several experiments into one process, and absl refuses a flag name defined twice)."""
  flags.DEFINE_integer("cases", 200, "budgets to draw and judge")
  flags.DEFINE_integer("seed", 0, "generator seed (the same cases for the same seed)")
  flags.DEFINE_integer("first", 0, "judge cases from this index on (the same draws: a long run resumed)")
  flags.DEFINE_string("out", None, "folder for cases.jsonl")
  flags.DEFINE_string("only", "", "judge only these case indices (comma-separated; the same draws)")
  flags.DEFINE_integer("clear_every", 10, "drop jax's compiled programs after every N cases (a long run holds "
                       "thousands otherwise, until the JIT's code memory runs out)")
  flags.DEFINE_string("compile_cache", os.path.join(tempfile.gettempdir(), "kvjax-budget-fuzz-jax"),
                      "JAX's persistent compilation cache for the fuzz (a folder, or off): reruns compile less")


FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Case:
  """One budget and the generations run on it. `prompts`: the prompt lengths generated one after
  the other on the same cache (the later ones through its reset); `gen_ubatch`: generate's
  micro-batch (None: make_kv's)."""
  max_tokens: int
  prompts: Tuple[int, ...]
  n_predict: int = 2
  pool_pages: Optional[int] = None
  arena_mib: Optional[float] = None
  policy: str = "fixed"
  phased: bool = False
  ubatch: int = 4
  copy_pages: int = 8
  prefill_block: object = "auto"
  spec: Optional[Tuple[str, int]] = None     # (draft, n_max)
  gen_ubatch: Optional[int] = None
  seed: int = 0
  block_pages: object = "auto"               # the model's attention partition (copy waves hold whole ones)
  warmup: bool = False                       # generate(warmup=True): every program compiled first

  @property
  def kind(self) -> str:
    budget = "pool" if self.pool_pages is not None else "arena" if self.arena_mib is not None else "plain"
    return "+".join([budget, self.policy] + (["phased"] if self.phased else []) + (["spec"] if self.spec else []))

  def describe(self) -> str:
    budget = f"pool_pages={self.pool_pages}" if self.pool_pages is not None else f"arena_mib={self.arena_mib:.4g}"
    spec = f" spec={self.spec[0]}:{self.spec[1]}" if self.spec else ""
    gen = (f" gen_ubatch={self.gen_ubatch}" if self.gen_ubatch else "") + (" warmup" if self.warmup else "")
    return (f"block_pages={self.block_pages} max_tokens={self.max_tokens} {budget} policy={self.policy} "
            f"phased={self.phased} ubatch={self.ubatch} copy_pages={self.copy_pages} prefill_block={self.prefill_block}{spec}{gen} "
            f"prompts={list(self.prompts)} n_predict={self.n_predict} seed={self.seed}")


class Models(dict):
  """The tiny model by `block_pages`, each loaded once (`compile_cache`: `api.load_model`'s)."""

  def __init__(self, compile_cache=False):
    super().__init__()
    self.compile_cache = compile_cache

  def __missing__(self, block_pages):
    from kvjax import api
    self[block_pages] = api.load_model("tiny", page_tokens=PAGE_TOKENS, block_pages=block_pages,
                                       compile_cache=self.compile_cache)
    return self[block_pages]


def spec_config(case: Case):
  from kvjax import api
  if case.spec is None:
    return None
  draft, n_max = case.spec
  return api.SpecConfig(draft, n_max=n_max, ngram_n=2) if draft == "ngram" else api.SpecConfig(draft, n_max=n_max)


def prompt_tokens(model, n: int, seed: int) -> List[int]:
  """A seeded prompt of n tokens; a repeated motif (ngram drafts find matches) for odd seeds."""
  rng = np.random.default_rng(seed)
  vocab = model.cfg.vocab_size
  if seed % 2:
    motif = rng.integers(1, vocab, 5)
    return [int(t) for t in np.resize(motif, n)]
  return [int(t) for t in rng.integers(1, vocab, n)]


class References:
  """Plain-cache greedy runs by (model, prompt, n_predict, ubatch, max_tokens), computed once."""

  def __init__(self):
    self.runs = {}

  def tokens(self, model, prompt: List[int], n_predict: int, ubatch: int, max_tokens: int) -> List[int]:
    from kvjax import api
    key = (id(model), tuple(prompt), n_predict, ubatch, max_tokens)
    if key not in self.runs:
      kv = api.make_kv(model, max_tokens, ubatch=ubatch)   # a plain cache
      self.runs[key] = api.generate(model, kv, prompt_tokens=prompt, n_predict=n_predict, ignore_eos=True,
                                    ubatch=ubatch).tokens
    return self.runs[key]


def check_refusal(case: Case, e: Exception) -> Optional[str]:
  """None for a refusal of the promised shape, else what is wrong with it."""
  from kvjax import api
  msg = str(e)
  param = "pool_pages" if case.pool_pages is not None else "arena_mib"
  if not isinstance(e, api.KVBudgetError):
    return f"{type(e).__name__} (not KVBudgetError)"
  if "\n" in msg:
    return "message of several lines"
  if param not in e.params or not msg.startswith(param + " "):
    return f"message does not start with {param}"
  if needed_budget(case, msg) is None:
    return "message gives no pages or MiB needed"
  return None


def needed_budget(case: Case, msg: str) -> Optional[float]:
  """The budget a refusal says would do: the pages missing added to the budget given, or the MiB
  named as needed (None: neither)."""
  more = (re.findall(r"(\d+) more pages", msg) or [None])[-1]   # the last: the total where parts come first
  need = re.search(r"([\d.]+) MiB needed", msg)
  if case.pool_pages is not None:
    return None if more is None else case.pool_pages + int(more)
  if need is not None:
    return float(need.group(1))
  return None if more is None else case.arena_mib + int(more) * PAGE_BYTES / 2**20


def make_kv(models: Models, case: Case, budget=None):
  """`api.make_kv` of the case (with `budget` in place of its pool_pages / arena_mib)."""
  from kvjax import api
  pool, arena = case.pool_pages, case.arena_mib
  if budget is not None:
    pool, arena = (budget, None) if pool is not None else (None, budget)
  return api.make_kv(models[case.block_pages], case.max_tokens, arena_mib=arena, pool_pages=pool,
                     copy_pages=case.copy_pages, policy=case.policy, phased=case.phased, ubatch=case.ubatch,
                     prefill_block=case.prefill_block, spec=spec_config(case))


def run_case(models: Models, case: Case, refs: References, caches: Optional[list] = None) -> Tuple[str, str]:
  """-> (outcome "accepted" / "refused" / "FAIL ...", detail); the cache made goes to `caches`."""
  from kvjax import api
  model = models[case.block_pages]
  spec = spec_config(case)
  try:
    kv = make_kv(models, case)
  except Exception as e:  # pylint: disable=broad-except  (judged: only the promised refusal passes)
    bad = check_refusal(case, e)
    if bad is not None:
      return f"FAIL make_kv: {bad}", f"{type(e).__name__}: {e}"
    enough = needed_budget(case, str(e))   # the budget the message names is accepted
    try:
      make_kv(models, case, round(enough, 6) if case.arena_mib is not None else enough)
    except Exception as again:  # pylint: disable=broad-except
      return "FAIL refusal: the budget it names is refused", f"{e} -> {type(again).__name__}: {again}"
    return "refused", str(e)
  if caches is not None:
    caches.append(kv)
  ubatch = case.gen_ubatch or case.ubatch
  for i, n in enumerate(case.prompts):
    prompt = prompt_tokens(model, n, case.seed + i)
    try:
      got = api.generate(model, kv, prompt_tokens=prompt, n_predict=case.n_predict, ignore_eos=True, spec=spec,
                         ubatch=ubatch, warmup=case.warmup and i == 0).tokens
    except Exception as e:  # pylint: disable=broad-except
      tb = traceback.format_exc().strip().splitlines()
      where = next((l.strip() for l in reversed(tb) if l.strip().startswith("File ")), "")
      return f"FAIL generate: {type(e).__name__}", f"prompt {n}: {e} [{where}]; kv {kv.info}"
    want = refs.tokens(model, prompt, case.n_predict, ubatch, case.max_tokens)
    if got != want:
      return "FAIL tokens", f"prompt {n}: {got} != plain {want}; kv {kv.info}"
  return "accepted", kv.info["kv"]


def _prompt_length(rng, most: int, copy_pages: int) -> int:
  """1 .. most tokens: one token, the most, a page's end, mid-page, mid-copy-unit, or any."""
  pt, unit = PAGE_TOKENS, PAGE_TOKENS * copy_pages
  pick = rng.choice(["one", "most", "page_end", "mid_page", "mid_unit", "any"])
  if pick == "one" or most <= 1:
    return 1
  if pick == "most":
    return most
  if pick == "page_end":
    return max(1, most // pt * pt)
  if pick == "mid_page":
    return max(1, min(most, int(rng.integers(0, most // pt + 1)) * pt + int(rng.integers(1, pt))))
  if pick == "mid_unit" and most > unit:
    return min(most, int(rng.integers(0, most // unit + 1)) * unit + int(rng.integers(1, unit)))
  return int(rng.integers(1, most + 1))


def sample_case(rng, seed: int, workspace_mib=None) -> Case:
  """One seeded case. `workspace_mib(max_tokens, ubatch, spec, phased)`: the arena's workspace
  estimate (MiB) the arenas are drawn around (None: a fixed guess)."""
  max_tokens = int(rng.choice(MAX_TOKENS))
  n_layers = 3                                         # the tiny model: 2 attention layers + MTP
  pages = -(-max_tokens // PAGE_TOKENS)
  minimum, resident = n_layers + 1, n_layers * pages + 1
  phased = bool(rng.random() < 0.3)
  arena = phased or rng.random() < 0.4
  spec = None
  if not phased and rng.random() < 0.4:
    spec = (str(rng.choice(["mtp", "ngram"])), int(rng.integers(2, 4)))
  n_predict = int(rng.integers(1, 5))
  ubatch = int(rng.choice(UBATCH))
  if spec is not None:
    ubatch = max(ubatch, spec[1] + 1)                  # a verify fits one micro-batch (an argument check)
  copy_pages = int(rng.choice(COPY_PAGES))
  policy = str(rng.choice(["fixed", "adaptive"]))
  most = max_tokens - n_predict - (spec[1] if spec else 0)
  prompts = [_prompt_length(rng, most, copy_pages)]
  if rng.random() < 0.25:
    prompts.append(_prompt_length(rng, most, copy_pages))
  prefill_block = "auto" if rng.random() < 0.7 else int(rng.choice([0, ubatch, 2 * ubatch, 3 * ubatch + 1, 64]))
  pool_pages = arena_mib = None
  page_mib = PAGE_BYTES / 2**20
  if arena:
    ws = workspace_mib(max_tokens, ubatch, spec, phased) if workspace_mib else (0.66 if spec else 0.1)
    extra = float(rng.choice([rng.uniform(-4, 8), rng.uniform(8, 40), rng.uniform(40, 120), rng.uniform(120, 300)],
                             p=[0.35, 0.3, 0.2, 0.15]))
    arena_mib = round(max(0.001, ws + extra * page_mib), 4)
  else:
    pick = rng.choice(["below", "min", "min+1", "mid", "resident", "over"])
    pool_pages = {"below": max(1, minimum - int(rng.integers(1, 4))), "min": minimum, "min+1": minimum + 1,
                  "mid": int(rng.integers(minimum, resident + 1)), "resident": resident,
                  "over": resident + int(rng.integers(1, 8))}[pick]
  gen_ubatch = None
  if not phased and rng.random() < 0.15:
    gen_ubatch = int(rng.choice([u for u in UBATCH if spec is None or u > spec[1]]))
  block_pages = "auto" if rng.random() < 0.6 else int(rng.choice([2, 4, 12]))
  return Case(max_tokens, tuple(prompts), n_predict, pool_pages, arena_mib, policy, phased, ubatch, copy_pages,
              prefill_block, spec, gen_ubatch, seed, block_pages, bool(rng.random() < 0.1))


def workspace_estimates(model):   # (the partition does not change the reference steps' workspace)
  """`workspace_mib` for `sample_case`: the arena's larger workspace (decode with the verify; the
  prefill's micro-batch where phased), as an ample arena's cache reports it, remembered per shape."""
  from kvjax import api
  memo: Dict[tuple, float] = {}

  def estimate(max_tokens, ubatch, spec, phased):
    key = (max_tokens, ubatch if phased else 0, spec)
    if key not in memo:
      case = Case(max_tokens, (1,), spec=spec, phased=phased, ubatch=ubatch, prefill_block=0)
      info = api.make_kv(model, max_tokens, arena_mib=8.0, phased=phased, ubatch=ubatch, prefill_block=0,
                         spec=spec_config(case)).info
      memo[key] = max(info["decode_workspace_mib"], info.get("prefill_workspace_mib", 0.0))
    return memo[key]
  return estimate


def sample_cases(n: int, seed: int, workspace_mib=None) -> List[Case]:
  rng = np.random.default_rng(seed)
  return [sample_case(rng, seed * 100_003 + i, workspace_mib) for i in range(n)]


def table(records) -> str:
  counts = collections.Counter((r["kind"], r["outcome"].split()[0]) for r in records)
  return outcome_table(counts, ["accepted", "refused", "FAIL"], "budget", 28, 10)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.cases < 1:
    raise app.UsageError(f"--cases must be >= 1, got {FLAGS.cases}")
  import jax
  t0 = time.perf_counter()
  models = Models(False if FLAGS.compile_cache == "off" else FLAGS.compile_cache)
  refs = References()
  only = {int(x) for x in FLAGS.only.split(",") if x.strip()}
  cases = sample_cases(FLAGS.cases, FLAGS.seed, workspace_estimates(models["auto"]))
  records = []
  out = None
  if FLAGS.out:
    os.makedirs(FLAGS.out, exist_ok=True)
    out = open(os.path.join(FLAGS.out, "cases.jsonl"), "a")
  for i, case in enumerate(cases):
    if i < FLAGS.first or (only and i not in only):
      continue
    if records and FLAGS.clear_every and len(records) % FLAGS.clear_every == 0:
      jax.clear_caches()
      gc.collect()
    t = time.perf_counter()
    outcome, detail = run_case(models, case, refs)
    r = dict(i=i, kind=case.kind, case=case.describe(), outcome=outcome, detail=detail,
             s=round(time.perf_counter() - t, 1))
    records.append(r)
    print(f"[{i}] {outcome:<10} {r['s']:>5.1f}s {case.describe()}"
          + (f"\n      {detail}" if outcome.startswith("FAIL") else ""), flush=True)
    if out:
      out.write(json.dumps(r) + "\n")
      out.flush()
  fails = [r for r in records if r["outcome"].startswith("FAIL")]
  print(f"\n{len(records)} cases (seed {FLAGS.seed}), {time.perf_counter() - t0:.0f} s, {len(fails)} failures")
  for r in fails:
    print(f"case {r['i']} {r['outcome']}: {r['case']}\n    {r['detail']}")
  print(table(records))
  return 1 if fails else 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
