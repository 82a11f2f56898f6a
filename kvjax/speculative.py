"""Speculative decoding (greedy): drafts verified by the target, with recurrent-state rollback.

One round, read top to bottom (C = committed tokens, b = the next token, already chosen):

1. **draft**: the configured drafter proposes d_1..d_k (k <= its widest draft):
   * MTP: d_1 comes from the catch-up rows (step 4 of the previous round, or the prompt);
     each further draft feeds the MTP's own hidden state and last draft back in; drafting
     stops early when the draft's top-1 probability falls below `p_min`. The previous round
     drafted them on the device already (step 5); the first round drafts here;
   * ngram-simple: the tokens that followed the latest earlier occurrence of the last
     `ngram_n` tokens; with ngram + MTP, ngram proposes the wide round when it finds a match
     and MTP the narrow one otherwise;
   * oracle (cost studies): the target's own greedy continuation with planted rejections.
2. **verify**: the target runs the rows [b, d_1..d_k] at positions C..C+k in the scan form
   with per-row recurrent states captured; the rows' argmaxes and j (the number of leading drafts
   equal to the argmax of the row before them) are computed on the device and stay there.
3. **lease**: the MTP ring lease (`StreamedKV.lease_mtp`) for the catch-up and the next round's
   drafting, to the furthest row they may write: the MTP layer's streamed suffix is loaded once
   and held; the lease ends before the next verify forward, which gets the whole ring.
4. **catch-up**: the MTP head runs rows (target hidden of verify row i, argmax of row i) for
   every verify row (for i <= j: the accepted drafts, then the next token b'), replacing its draft
   rows with ones built on the target's real hidden states; row j proposes the next round's d_1.
5. **next drafts** from row j at MTP position C + j + 1, a traced position (MTP only).
6. **rollback**: the recurrent states become the ones after row j (`ReplayRollback` rebuilds them
   from the verify's inputs, `DeviceRollback` keeps every row's on the device: both with j
   traced, before the read; `HostRollback` passes them through a two-group device stage into
   host snapshots, and only a rejection copies one back, after the read).
7. **read**: the host's one wait of the round: the argmaxes, then the next round's candidates.
8. **accept and truncate**: b, d_1..d_j are committed and b' = argmax of row j is next; the
   forwards' KV rows were kept back on the device (`defer_rows`) and are published now, up to row
   j only (the rejected rows never reach the host histories).

With greedy verification the output equals plain greedy decoding whenever the verify rows compute the same
argmax as one-row decode steps (tested on CPU). The round reads its configuration from `SpecConfig`
(`kvjax.spec_config`; the API's `kvjax.api.SpecConfig` is the same class)."""

from __future__ import annotations

import collections
import functools
import time
from typing import Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import executables
from kvjax.engine import KVProvider, Runner, recurrent_state_bytes, select_row
from kvjax.workspace import group_step_workspace_bytes
from kvjax.model import replay_state
from kvjax.generate import CompileClock, GenerationResult, SequenceState, generate, generation_metrics, heap_frozen, \
    mtp_rows, pick_row, prefill
from kvjax.spec_config import SpecConfig, config_key


def check_ubatch(spec: SpecConfig, ubatch: int, max_tokens: Optional[int] = None) -> int:
  """The verify width (clamped to the context `max_tokens`); a micro-batch narrower than it is
  refused, naming the width needed."""
  width = spec.verify_width if max_tokens is None else min(spec.verify_width, max_tokens)
  if ubatch < width:
    raise ValueError(f"micro-batch of {ubatch} rows is narrower than the verify width {width} (1 + the "
                     f"widest {spec.draft} draft): a micro-batch of at least {width} rows is needed")
  return width


def ngram_draft(history: Sequence[int], n: int, m: int) -> List[int]:
  """ngram-simple: find the latest earlier occurrence of the last `n` tokens; propose up to `m` tokens that followed it
  (none when the key never occurred before). The plain backward scan (`NgramIndex` gives the same drafts at a cost
  independent of the history's length)."""
  if len(history) <= n:
    return []
  key = list(history[-n:])
  for start in range(len(history) - n - 1, -1, -1):
    if list(history[start:start + n]) == key:
      return list(history[start + n:start + n + m])
  return []


class NgramIndex:
  """ngram-simple over a growing token history, incrementally: `latest[key]` is the latest start of the n tokens `key`
  that some token follows, updated as tokens are appended (`extend`), so a round's draft (`draft(m)`, equal to
  `ngram_draft(tokens, n, m)`) costs a dictionary lookup whatever the history's length. `tokens` is the history itself
  (committed tokens only: the speculative loop appends accepted tokens and never takes any back)."""

  def __init__(self, n: int, tokens: Sequence[int] = ()):
    if n < 1:
      raise ValueError(f"ngram_n must be >= 1, got {n}")
    self.n = n
    self.tokens: List[int] = []
    self.latest: Dict[tuple, int] = {}
    self.extend(tokens)

  def extend(self, tokens: Sequence[int]) -> None:
    toks, n = self.tokens, self.n
    for t in tokens:
      toks.append(int(t))
      start = len(toks) - n - 1          # the n tokens at `start` now have a follower
      if start >= 0:
        self.latest[tuple(toks[start:start + n])] = start

  def draft(self, m: int) -> List[int]:
    toks, n = self.tokens, self.n
    if len(toks) <= n:
      return []
    start = self.latest.get(tuple(toks[-n:]))
    return [] if start is None else toks[start + n:start + n + m]


class OracleDrafter:
  """Drafts the target's own greedy continuation `truth` (the tokens plain greedy decoding generates), each kept with
  probability `acceptance` (seeded); the first draft not kept is replaced by a wrong token and ends the round. Called as
  `drafter(n_generated, m)`."""

  def __init__(self, truth: Sequence[int], acceptance: float, seed: int, vocab_size: int):
    self.truth = [int(t) for t in truth]
    self.acceptance, self.vocab = acceptance, vocab_size
    self.rng = np.random.default_rng(seed)

  def __call__(self, n_generated: int, m: int) -> List[int]:
    out = []
    for t in self.truth[n_generated:n_generated + m]:
      if self.rng.random() < self.acceptance:
        out.append(t)
      else:
        out.append((t + 1) % self.vocab)    # a planted rejection
        break
    return out


def verify_state_bytes(runner: Runner, spec: SpecConfig) -> int:
  """Device bytes a verify forward's captured recurrent states hold beyond the live state (one row): rollback "device"
  keeps every group's states of the other W - 1 rows until the rollback; "host" holds at most `HostRollback.SLOTS`
  groups' W - 1 rows in its stage."""
  rows = spec.verify_width - 1
  if spec.rollback == "replay":   # every row's inputs of every layer (`model.ReplayRows`)
    return spec.verify_width * replay_row_bytes(runner.cfg)
  every, largest = recurrent_state_bytes(runner)
  return rows * (every if spec.rollback == "device" else HostRollback.SLOTS * largest)


def replay_row_bytes(cfg) -> int:
  """Bytes one verify row's `ReplayRows` take over every Gated DeltaNet layer (float32)."""
  hv, d = cfg.linear_num_value_heads, cfg.linear_head_dim
  return 4 * (cfg.conv_dim + 2 * hv * d + 2 * hv) * len(cfg.recurrent_layers)


def decode_workspace_bytes(runner: Runner, max_tokens: int, spec: Optional[SpecConfig] = None):
  """-> (device bytes the arena holds beside the pool after the prompt, of which the verify's
  captured recurrent states): the larger scratch of a one-row decode forward and of `spec`'s
  verify forward, plus the states that verify captures."""
  ws = group_step_workspace_bytes(runner, 1, max_tokens)
  if spec is None or spec.verify_width == 1:
    return ws, 0
  states = verify_state_bytes(runner, spec)
  verify = group_step_workspace_bytes(runner, spec.verify_width, max_tokens, verify=ROLLBACKS[spec.rollback].capture)
  return max(ws, verify) + states, states


class DeviceRollback:
  """Every verify row's recurrent states stay on the device; rollback selects row j."""
  name = "device"
  capture = True     # the verify forward's `capture_states`
  traced = True      # `states_after` takes j as a device scalar (before the round's read)

  def __init__(self, runner=None):   # (every rollback is made from the runner: `ReplayRollback` reads its form)
    self.d2h_bytes = self.h2d_bytes = 0

  def sink(self):
    return None

  def states_after(self, captured, j: int, n_rows: int, before=None):
    del n_rows, before
    return select_row(captured, j)


class ReplayRollback:
  """The verify keeps its rows' inputs, not the states after them (`capture="replay"`: per Gated DeltaNet layer and
  row the conv inputs, keys, values, decay and beta, ~2-3 % of a state); rollback rebuilds the states after row j
  from the states before the verify (`model.replay_state` by the runner's delta rule form, one compiled call for
  every group, j traced): no state copies in the arena, none across the link."""
  name = "replay"
  capture = "replay"
  traced = True

  def __init__(self, runner=None):
    self.d2h_bytes = self.h2d_bytes = 0
    self.form = getattr(runner, "gdn_form", ("xla", False))

  def sink(self):
    return None

  def states_after(self, captured, j: int, n_rows: int, before=None):
    del n_rows
    return _replay(before, captured, executables.int32_arg(j), form=self.form)


REPLAY_CHUNK_BYTES = 32 << 20   # states stepped together by one `_replay` kernel, at most


@functools.partial(jax.jit, static_argnames=("form",))
def _replay(before, captured, j, form=("xla", False)):
  """`replay_state` (by `form`) of every Gated DeltaNet layer (before[g][i], captured[g][i]) -> the same nesting.
  Layers of the same shapes step together (`jax.vmap` over a stack of them, at most `REPLAY_CHUNK_BYTES` of
  states at a time): one kernel a step for a chunk of layers rather than one a layer, since layer by layer a 27B's
  48 layers launched ~500 kernels of a few microseconds each (3.3-4.4 ms of host time a round on an H100,
  2026-12-05). The same arithmetic a row, batched."""
  pairs = [(b, r) for bg, rg in zip(before, captured) for b, r in zip(bg, rg)]
  groups: Dict[tuple, List[int]] = {}
  for i, pair in enumerate(pairs):
    groups.setdefault(tuple((x.shape, x.dtype) for x in jax.tree.leaves(pair)), []).append(i)
  out: List = [None] * len(pairs)
  for idx in groups.values():
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pairs[idx[0]][0]))
    per = max(1, REPLAY_CHUNK_BYTES // max(1, state_bytes))
    for lo in range(0, len(idx), per):
      chunk = idx[lo:lo + per]
      if len(chunk) == 1:
        out[chunk[0]] = replay_state(*pairs[chunk[0]], j, form)
        continue
      b_l, r_l = jax.tree.map(lambda *xs: jnp.stack(xs), *[pairs[i] for i in chunk])
      res_l = jax.vmap(functools.partial(replay_state, form=form), in_axes=(0, 0, None))(b_l, r_l, j)
      for k, i in enumerate(chunk):
        out[i] = jax.tree.map(lambda x, k=k: x[k], res_l)
  it = iter(out)
  return tuple(tuple(next(it) for _ in bg) for bg in before)


class HostRollback:
  """Recurrent checkpoints through a two-slot device stage into pinned host snapshots.

  During the verify forward each group's captured states (rows 0..R-1) are split as soon as its
  step is dispatched (one program): row R-1 stays on the device as the live state (all drafts
  accepted), rows 0..R-2 leave for pinned host memory by asynchronous copies (`jax.device_put` to
  the `pinned_host` memory kind: the host does not wait, and the copies run beside the verify's
  host-to-device stream). At most `SLOTS` groups' snapshots are on their way at a time (the one
  being produced and the one draining: `stage_peak` counts it); a third waits for the oldest copy
  to land. On rejection (j < R-1) row j of every group is copied back to the device.
  """
  name = "host"
  SLOTS = 2
  capture = True
  traced = False     # which snapshot comes back is the host's choice: after the round's read

  def __init__(self, runner=None):
    self.d2h_bytes = self.h2d_bytes = 0
    self.stage_peak = 0                               # groups in the device stage at once
    self._snapshots: Dict[int, list] = {}             # group -> per leaf, its rows' host arrays
    self._inflight: collections.deque = collections.deque()
    self._treedefs: Dict[int, object] = {}

  def sink(self):
    self._snapshots.clear()
    return self._take

  def _take(self, group: int, captured):
    leaves, self._treedefs[group] = jax.tree_util.tree_flatten(captured)
    while len(self._inflight) >= self.SLOTS:
      self._land()
    rows, live = _split_rows(leaves)
    self._inflight.append((group, _to_host(rows)))
    self.stage_peak = max(self.stage_peak, len(self._inflight))
    return jax.tree_util.tree_unflatten(self._treedefs[group], live)

  def _land(self):
    group, host = self._inflight.popleft()
    jax.block_until_ready(host)
    self.d2h_bytes += sum(int(h.nbytes) for h in jax.tree_util.tree_leaves(host))
    self._snapshots[group] = host

  def states_after(self, live, j: int, n_rows: int, before=None):
    del before
    while self._inflight:
      self._land()
    if j == n_rows - 1:
      return live
    out = []
    for g in range(len(live)):
      rows = [_to_device(leaf_rows[j]) for leaf_rows in self._snapshots[g]]
      self.h2d_bytes += sum(int(leaf_rows[j].nbytes) for leaf_rows in self._snapshots[g])
      out.append(jax.tree_util.tree_unflatten(self._treedefs[g], rows))
    return tuple(out)


@jax.jit
def _split_rows(leaves):
  """Captured states [R, ...] a leaf -> (per leaf its rows 0..R-2 as separate arrays, rows R-1)."""
  return [tuple(a[i] for i in range(a.shape[0] - 1)) for a in leaves], [a[-1] for a in leaves]


def _to_host(tree):
  """Device arrays -> their copies in pinned host memory (asynchronous), or numpy arrays where the
  device has no pinned host memory."""
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves or not _has_pinned_host(leaves[0]):
    return jax.tree_util.tree_map(np.asarray, tree)
  return jax.device_put(tree, jax.tree_util.tree_map(lambda a: a.sharding.with_memory_kind("pinned_host"), tree))


def _to_device(x):
  if isinstance(x, np.ndarray):
    return jax.device_put(x, jax.devices()[0])
  return jax.device_put(x, x.sharding.with_memory_kind("device"))


def _has_pinned_host(a) -> bool:
  dev = next(iter(a.devices()))
  return any(m.kind == "pinned_host" for m in getattr(dev, "addressable_memories", lambda: [])())


ROLLBACKS = {r.name: r for r in (DeviceRollback, HostRollback, ReplayRollback)}


@jax.jit
def _top1(logits_v):
  """-> (the top-1 token, its probability), device scalars (as `_mtp_draft_steps` computes them)."""
  p = jax.nn.softmax(logits_v.astype(jnp.float32))
  i = jnp.argmax(p).astype(jnp.int32)
  return i, p[i]


def _forget(runner: Runner, kv: KVProvider) -> None:
  kv.truncate("target", 0)
  if runner.mtp_layer is not None:
    kv.truncate("mtp", 0)


def _h2d(kv) -> int:
  return int(getattr(kv, "counters", {}).get("h2d_bytes", 0))


def generate_speculative(runner: Runner, kv: KVProvider, prompt: Sequence[int], n_predict: int,
                         spec: SpecConfig = SpecConfig(), ubatch: int = 256,
                         eos_id: Optional[int] = None,
                         drafter: Optional[Callable[[Sequence[int], int], List[int]]] = None,
                         oracle_tokens: Optional[Sequence[int]] = None,
                         on_round: Optional[Callable[[dict], None]] = None,
                         on_phase: Optional[Callable[[str], None]] = None) -> GenerationResult:
  """Greedy generation of up to `n_predict` tokens with drafts verified by the target.

  `drafter(history, m) -> up to m tokens`, when given, replaces the configured drafter (a research
  hook; `history` is the committed tokens, the loop's own list grown in place: copy it to keep it).
  The oracle drafter needs plain greedy's tokens: `oracle_tokens`, or (None) a plain greedy run on
  `kv` first (then forgotten; its decode rate is reported as `plain_decode_tps`).
  `on_round(info)` is called after every round (see `speculate`); `on_phase("prefill")` before the
  prefill, inside its timing (as `kvjax.generate.generate`'s).

  Metrics add, under the drafter's `spec_type` ("mtp", "ngram", "ngram+mtp", "oracle", or "custom"
  for `drafter`) and `spec_rollback` (`SpecConfig`'s draft and rollback by their config keys): `draft_generated`, `draft_accepted`,
  `draft_acceptance` (accepted / generated), `acceptance_by_position` (per draft position, of the
  rounds that drafted it), `verify_forwards`, `realized_verify_width` (committed tokens per verify
  forward, the reference design's definition; `tokens_per_verify` is the same number),
  `verify_rows_mean` (rows with content per verify forward: 1 + drafts), `verify_ms_by_width`, `ngram_rounds`,
  `mtp_h2d_bytes_per_round` (uploads of the MTP forwards of a round), `mtp_leases` /
  `mtp_lease_bytes` / `mtp_lease_bytes_per_round` (ring leases taken for catch-up + drafting and the
  MTP suffix bytes they loaded: one pass over the suffix a lease), `rollback_d2h_bytes` /
  `rollback_h2d_bytes` (host snapshots and restores), `draft_rounds` ([drafts, accepted] per round).
  """
  prompt = [int(t) for t in prompt]
  check_ubatch(spec, ubatch)
  if spec.uses_mtp and drafter is None and runner.mtp_layer is None:
    raise ValueError("MTP drafting needs an MTP head (nextn_predict_layers = 1); use draft 'ngram'")
  plain_tps = None
  if spec.draft == "oracle" and drafter is None and oracle_tokens is None:
    plain = generate(runner, kv, prompt, n_predict, ubatch=ubatch, eos_id=eos_id)
    oracle_tokens, plain_tps = plain.tokens, plain.metrics["decode_tps"]
    _forget(runner, kv)
  seq = SequenceState(runner, kv)
  with CompileClock() as prefill_clock:
    t0 = time.perf_counter()
    if on_phase:
      on_phase("prefill")
    # prefill the target; keep every row's post-norm hidden for the MTP catch-up
    logits, hn_se = prefill(seq, prompt, ubatch, with_hidden=True)
    b = int(jnp.argmax(logits))
    # MTP catch-up over the prompt: rows (hn_i, x_{i+1}) for i < C, with x_C = b
    mtp_next = mtp_catch_up(runner, kv, hn_se, prompt[1:] + [b], 0, ubatch) \
        if spec.uses_mtp and drafter is None else None
    t1 = time.perf_counter()
  first_round = []
  with CompileClock() as decode_clock, heap_frozen():
    out_tokens, stats = speculate(seq, b, n_predict, spec, prompt, ubatch, eos_id, drafter, oracle_tokens,
                                  mtp_next, on_round, lambda: first_round.append(decode_clock.programs))
    t2 = time.perf_counter()
  first = first_round[0] if first_round else decode_clock.programs
  metrics = generation_metrics(kv, len(prompt), len(out_tokens), t0, t1, t2,
                               (prefill_clock.seconds, decode_clock.seconds),
                               (prefill_clock.programs, first, decode_clock.programs - first),
                               (prefill_clock, decode_clock))
  metrics.update(stats)
  if plain_tps is not None:
    metrics["plain_decode_tps"] = plain_tps
  return GenerationResult(out_tokens, metrics)


class PhaseClock:
  """Host wall time of a round's phases, summed by name (`ms`). `start(name)` ends the phase
  running (-> its ms) and begins `name`; `stop()` ends it. Each phase is also a profiler trace
  annotation `spec:<name>` (`jax.profiler.TraceAnnotation`, ~1 us when no trace runs), so a device
  timeline can tell what the device did during it (`experiments/lib/timeline.py`, `phase_windows`)."""
  PREFIX = "spec:"

  def __init__(self):
    self.ms: Dict[str, float] = collections.defaultdict(float)
    self._name, self._t0, self._note = None, 0.0, None

  def start(self, name: str) -> float:
    ms = self.stop()
    self._note = jax.profiler.TraceAnnotation(self.PREFIX + name)
    self._note.__enter__()
    self._name, self._t0 = name, time.perf_counter()
    return ms

  def stop(self) -> float:
    if self._name is None:
      return 0.0
    ms = (time.perf_counter() - self._t0) * 1e3
    self._note.__exit__(None, None, None)
    self.ms[self._name] += ms
    self._name = self._note = None
    return ms


def speculate(seq: SequenceState, b: int, n_predict: int, spec: SpecConfig, prompt: Sequence[int],
              ubatch: int = 256, eos_id: Optional[int] = None,
              drafter: Optional[Callable[[Sequence[int], int], List[int]]] = None,
              oracle_tokens: Optional[Sequence[int]] = None, mtp_next=None,
              on_round: Optional[Callable[[dict], None]] = None,
              on_first_round: Optional[Callable[[], None]] = None):
  """The decode loop from a sequence whose `seq.pos` tokens are committed, `b` chosen next and
  (with MTP drafting) `mtp_next` = `mtp_catch_up`'s result over them. -> (tokens, stats).

  `on_round(info)` after every round: `pos` (C), `drafts`, `target` (argmax of every verify row),
  `accepted` (j), `logits` (the verify forward's [W, V], a device array: rows 1 + k on are padding), `draft_p` (MTP top-1 probabilities, `stop_drafts`),
  `drafter` ("mtp", "ngram", "oracle", "custom"), `lease_bytes` (loaded by the MTP ring lease taken
  for this round's catch-up and the next round's drafting; 0 without one).
  """
  runner, kv = seq.runner, seq.kv
  prompt = [int(t) for t in prompt]
  use_mtp = spec.uses_mtp and drafter is None
  spec_type = spec.draft if drafter is None else "custom"
  if drafter is None and spec.draft == "oracle":
    if oracle_tokens is None:
      raise ValueError("the oracle drafter needs plain greedy's tokens (oracle_tokens)")
    oracle = OracleDrafter(oracle_tokens, spec.oracle_acceptance, spec.oracle_seed, runner.cfg.vocab_size)
    drafter = lambda history, m: oracle(len(history) - len(prompt), m)  # pylint: disable=unnecessary-lambda-assignment
  rollback = ROLLBACKS[spec.rollback](runner)
  width = spec.verify_width
  width_max = spec.verify_width - 1
  drafted_at = np.zeros((max(width_max, 1),), np.int64)
  accepted_at = np.zeros_like(drafted_at)
  verify_ms: Dict[int, List[float]] = collections.defaultdict(list)
  out_tokens: List[int] = []
  drafted = accepted = rounds = ngram_rounds = mtp_h2d = lease_bytes = leases = 0
  round_lengths: List[List[int]] = []   # [drafts, accepted] of every verify round
  clock = PhaseClock()   # host wall time of each round's phases, each a profiler trace annotation
  # the committed tokens (prompt + output), grown in place; ngram drafting indexes them as they come
  index = NgramIndex(spec.ngram_n, prompt) if spec.uses_ngram and drafter is None else None
  history = index.tokens if index is not None else list(prompt)
  commit = index.extend if index is not None else history.extend
  # the MTP's candidates for the round at hand, drafted on the device at the end of the previous
  # round from its row j (one program; not with ngram + MTP, whose MTP drafts only where ngram finds
  # nothing, nor where drafting goes step by step): None makes the round draft them itself
  device_drafting = use_mtp and not spec.uses_ngram and runner.mtp_draft_steps is not None
  cands = None
  t_loop = time.perf_counter()
  if use_mtp:     # the first round's drafting runs under a ring lease taken after the prompt's catch-up
    h2d0 = _h2d(kv)
    lease_bytes += kv.lease_mtp(seq.pos + spec.n_max - 1)
    leases += 1
    mtp_h2d += _h2d(kv) - h2d0
  kv.defer_rows(True)      # each forward's rows are published once the round knows how many it keeps
  try:
    while len(out_tokens) < n_predict:
      out_tokens.append(b)
      commit((b,))
      if (eos_id is not None and b == eos_id) or len(out_tokens) >= n_predict:
        break
      c = seq.pos                      # committed target tokens; b sits at position c
      room = n_predict - len(out_tokens)
      clock.start("draft")
      # 1. draft
      drafts, draft_p, source = [], [], spec_type
      if drafter is not None:
        drafts = [int(t) for t in drafter(history, min(spec.n_max, room))][:room]
      elif spec.uses_ngram:
        drafts = index.draft(min(spec.ngram_width, room))
        source = "ngram"
        ngram_rounds += bool(drafts)
      if use_mtp and (not drafts or spec.oracle_mtp):
        if cands is None:
          h2d0 = _h2d(kv)
          cands = mtp_candidates(runner, kv, mtp_next, c, min(spec.n_max, room), spec.p_min,
                                 steps=spec.n_max - 1)
          mtp_h2d += _h2d(kv) - h2d0
        mtp_drafts, draft_p = stop_drafts(cands, min(spec.n_max, room), spec.p_min)
        if not drafts:
          drafts, source = mtp_drafts, "mtp"
      cands = None
      drafted += len(drafts)
      drafted_at[:len(drafts)] += 1
      # 2. verify: rows [b, d_1..d_k], scan form, per-row states captured (padded to the verify
      # width: one compiled shape; padding rows are inert); the MTP's ring lease ends first: the
      # target gets the whole ring. Its argmaxes and the accepted count j stay on the device.
      kv.release_lease()
      rows = [b] + drafts
      clock.start("verify")
      t_verify = time.perf_counter()
      before = seq.rec_states
      vout = runner.forward(_padded(rows, width), c, len(rows), before, kv,
                            logits_rows=np.arange(width), chunked=False, capture_states=rollback.capture,
                            on_group_states=rollback.sink())
      target_r, j_r = _accept(vout.logits_rv, _padded(drafts, width - 1, -1))
      round_lease, next_cands = 0, None
      catch_up = use_mtp and len(out_tokens) + 1 < n_predict     # another round may draft with the MTP
      h2d0 = _h2d(kv)
      if catch_up:
        # 3. the MTP's ring lease for its catch-up and the next round's drafting, to the furthest
        # row they may write (the verify's rows, then n_max - 1 draft steps); its uploads queue
        # behind the verify's
        clock.start("lease")
        end = min(c + width + spec.n_max - 1, kv.max_tokens)
        round_lease = kv.lease_mtp(end)
        lease_bytes += round_lease
        leases += 1
        # 4. MTP catch-up over every verify row, on the target's hidden states, each row fed its
        # argmax (up to row j: the accepted drafts, then the next b); row j proposes the next d_1
        clock.start("mtp_catch_up")
        mtp_next = mtp_catch_up(runner, kv, vout.hn_se, target_r, c, ubatch, pad_to=width, row=j_r)
        if device_drafting:    # 5. the next round's drafts from row j, at MTP positions c + j + 1..
          next_cands = draft_on_device(runner, kv, mtp_next, c + 1 + j_r, room - 1 - j_r, spec,
                                       span=(c, end - c))
      # 6. rollback: the recurrent states after row j (j traced; the host's way waits for the read)
      clock.start("rollback")
      if rollback.traced:
        seq.rec_states = rollback.states_after(vout.rec_states, j_r, width, before)
      mtp_h2d += _h2d(kv) - h2d0 if use_mtp else 0
      # 7. the round's one read: the verify's argmaxes (the verify's time: its dispatch to them),
      # then the next round's MTP candidates
      clock.start("read")
      target = [int(t) for t in np.asarray(target_r)[:len(rows)]]
      verify_ms[len(rows)].append((time.perf_counter() - t_verify) * 1e3)
      if next_cands is not None:
        cands = list(zip(*jax.device_get(next_cands)))
      # 8. accept (j as the device found it: the drafts agreeing with the argmaxes)
      clock.start("truncate")     # accepting counts as truncating
      j = 0
      while j < len(drafts) and drafts[j] == target[j]:
        j += 1
      accepted += j
      accepted_at[:j] += 1
      rounds += 1
      round_lengths.append([len(drafts), j])
      out_tokens.extend(drafts[:j])
      commit(drafts[:j])
      if eos_id is not None and eos_id in drafts[:j]:
        out_tokens = out_tokens[:out_tokens.index(eos_id, len(out_tokens) - j) + 1]
        clock.stop()
        break
      # 9. the rows past j leave the KV histories: the kept-back rows are published up to row j
      seq.pos = c + j + 1
      kv.truncate("target", seq.pos)
      if use_mtp:
        kv.truncate("mtp", seq.pos)
      b = target[j]
      if not rollback.traced:
        clock.start("rollback")
        seq.rec_states = rollback.states_after(vout.rec_states, j, width, before)
      clock.stop()
      if on_round is not None:
        on_round(dict(pos=c, drafts=drafts, target=target, accepted=j, logits=vout.logits_rv,
                      draft_p=draft_p, drafter=source, lease_bytes=round_lease))
      if rounds == 1 and on_first_round is not None:
        on_first_round()
  finally:
    kv.defer_rows(False)
  kv.release_lease()
  out_tokens = out_tokens[:n_predict]
  stats = {   # the drafter and the rollback under their config keys: spec_type, spec_rollback
      config_key("draft"): spec_type, config_key("rollback"): rollback.name,
      "draft_generated": drafted, "draft_accepted": accepted,
      "draft_acceptance": accepted / drafted if drafted else 0.0,
      "acceptance_by_position": [float(a / d) if d else 0.0 for a, d in zip(accepted_at, drafted_at)],
      "verify_forwards": rounds,
      "realized_verify_width": (accepted + rounds) / rounds if rounds else 0.0,
      "tokens_per_verify": (accepted + rounds) / rounds if rounds else 0.0,
      "verify_rows_mean": (drafted + rounds) / rounds if rounds else 0.0,
      "verify_ms_by_width": {str(w): float(np.mean(v)) for w, v in sorted(verify_ms.items())},
      "verify_ms_mean": float(np.mean([x for v in verify_ms.values() for x in v])) if rounds else 0.0,
      "ngram_rounds": ngram_rounds, "draft_rounds": round_lengths,
      "rollback_d2h_bytes": rollback.d2h_bytes, "rollback_h2d_bytes": rollback.h2d_bytes,
      "round_ms_mean": (time.perf_counter() - t_loop) * 1e3 / rounds if rounds else 0.0,
      "phase_ms_per_round": {k: v / rounds for k, v in clock.ms.items()} if rounds else {},
  }
  if use_mtp:
    stats["mtp_h2d_bytes_per_round"] = mtp_h2d / rounds if rounds else 0.0
    stats.update(mtp_leases=leases, mtp_lease_bytes=lease_bytes,
                 mtp_lease_bytes_per_round=lease_bytes / leases if leases else 0.0)
  return out_tokens, stats


def mtp_candidates(runner: Runner, kv: KVProvider, mtp_next, c: int, limit: int, p_min: float,
                   steps: Optional[int] = None) -> List[tuple]:
  """The MTP's draft candidates for the round at position c: [(token, top-1 probability)], `mtp_next`
  = (d_1, its probability, the MTP hidden that proposed it) first, then up to `limit` - 1 draft
  steps while the candidates reach `p_min` (`stop_drafts` makes them drafts).

  The steps run as one device program (`Runner.mtp_draft`, `steps` = the widest round's steps,
  n_max - 1, so every round runs the same program) and the host reads the candidates once; step by
  step (a forward and a read a step) where the MTP layer streams in copy waves (a streamed cache
  without its ring lease) or the runner has no such program (`ShardedRunner`)."""
  d, p, h = mtp_next
  steps = limit - 1 if steps is None else steps
  if limit <= 1 or steps < 1:
    return [jax.device_get((d, p))]
  if _drafts_in_one_program(runner, kv):
    return list(zip(*jax.device_get(runner.mtp_draft(h, d, p, c, steps, limit - 1, p_min, kv))))
  return _mtp_draft_stepwise(runner, kv, mtp_next, c, limit, p_min)


def _drafts_in_one_program(runner: Runner, kv: KVProvider) -> bool:
  return runner.mtp_draft_steps is not None and getattr(kv, "lease", True) is not None


def draft_on_device(runner: Runner, kv: KVProvider, mtp_next, pos, room, spec: SpecConfig, span):
  """`mtp_candidates` left on the device, for a round whose position `pos` and room (tokens it may
  still make) are device scalars: (tokens, probabilities) [steps + 1], -1 past the last candidate,
  where the MTP layer drafts in one program (`span`: the positions laid out for it); None where it
  cannot (the round's lease refused: the next round drafts at its start, `mtp_candidates`)."""
  d, p, h = mtp_next
  if not _drafts_in_one_program(runner, kv):
    return None
  if spec.n_max <= 1:
    return d[None], p[None]
  limit = jnp.minimum(spec.n_max, room) - 1
  return runner.mtp_draft(h, d, p, pos, spec.n_max - 1, limit, spec.p_min, kv, span=span)


def stop_drafts(cands: Sequence[tuple], limit: int, p_min: float):
  """Candidates -> (drafts: up to `limit`, stopping at the first below top-1 probability `p_min`;
  the probability of every candidate looked at: the drafts', then the one that stopped them)."""
  drafts, probs = [], []
  for d, p in cands:
    if p < 0:        # not reached (`_mtp_draft_steps` stopped before it)
      break
    probs.append(float(p))
    if p < p_min:
      break
    drafts.append(int(d))
    if len(drafts) == limit:
      break
  return drafts, probs


def _mtp_draft_stepwise(runner: Runner, kv: KVProvider, mtp_next, c: int, limit: int, p_min: float):
  """The candidates of `mtp_candidates`, one MTP forward and one host read a step."""
  d, p, h = mtp_next
  d, p = jax.device_get((d, p))
  cands = [(d, p)]
  while len(cands) < limit and p >= p_min:
    # the MTP row (its own hidden for x_{c+i}, draft d_i) sits at MTP cache position c + i - 1
    lg, h = runner.mtp_forward(h, np.array([d], np.int32), c + len(cands) - 1, 1, kv)
    d, p = jax.device_get(_top1(lg[0]))
    cands.append((d, p))
  return cands


def mtp_catch_up(runner: Runner, kv: KVProvider, hn_se, next_tokens, mtp_pos: int,
                 ubatch: int, pad_to: Optional[int] = None, row=None):
  """MTP rows (hn_se[i], next_tokens[i]) at MTP cache positions mtp_pos + i. With `pad_to`, one
  forward of that many rows: `next_tokens` a list (the rest padding) or a device array of them all
  (every row the cache holds is written; the rows kept are the caller's `truncate`). -> (draft, p,
  hm) of row `row` (default: the last token's; a device scalar too), device values (the round's
  drafting reads them with its own candidates)."""
  if pad_to is None:
    logits_v, hm = mtp_rows(runner, kv, hn_se, next_tokens, mtp_pos, ubatch)
  else:
    on_device_ = isinstance(next_tokens, jax.Array)
    n = min(pad_to, kv.max_tokens - mtp_pos) if on_device_ else len(next_tokens)
    tokens = next_tokens if on_device_ else _padded(next_tokens, pad_to)
    logits_rv, hm = runner.mtp_forward(hn_se[:pad_to], tokens, mtp_pos, n, kv)
    r = n - 1 if row is None else row
    logits_v, hm = pick_row(logits_rv, r), pick_row(hm, r, keepdims=True)
  d, p = _top1(logits_v)
  return d, p, hm


@jax.jit
def _accept(logits_rv, drafts_k):
  """-> (the argmax of every verify row [W] int32, j: how many leading drafts equal the argmax of
  the row before them, a device scalar). `drafts_k` [W - 1]: the drafts, -1 past them."""
  target = jnp.argmax(logits_rv, axis=-1).astype(jnp.int32)
  agree = (drafts_k == target[:drafts_k.shape[0]]).astype(jnp.int32)
  return target, jnp.sum(jnp.cumprod(agree))


def _padded(tokens: Sequence[int], width: int, fill: int = 0) -> np.ndarray:
  out = np.full((width,), fill, np.int32)
  out[:len(tokens)] = tokens
  return out
