"""Speculative decoding with the attached MTP head (greedy), with recurrent-state rollback.

One round, read top to bottom (C = committed tokens, b = the next token, already chosen):

1. **draft**: the MTP head proposes d_1..d_k. d_1 comes from the catch-up rows
   (step 4 of the previous round, or the prompt); each further draft feeds the
   MTP's own hidden state and last draft back in. Drafting stops early when the
   draft's top-1 probability falls below `p_min`.
2. **verify**: the target runs the rows [b, d_1..d_k] at positions C..C+k in the
   scan form with per-row recurrent states captured.
3. **accept**: j = the number of leading drafts equal to the target's argmax;
   the tokens b, d_1..d_j are committed and b' = argmax of row j is next.
   **Rollback**: the recurrent states become the ones captured after row j;
   rejected KV rows are truncated from the provider (host history).
4. **catch-up**: the MTP head runs rows (target hidden of verify row i, token
   i+1) for i = 0..j, replacing its draft rows with ones built on the target's
   real hidden states; its last row proposes the next round's d_1.

With greedy verification the output equals plain greedy decoding whenever the
verify rows compute the same logits as one-row decode steps (same scan form,
same attention code; tested on CPU).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.engine import KVProvider, Runner, select_row
from kvjax.generate import CompileClock, GenerationResult, SequenceState, generation_metrics, mtp_rows, prefill


@dataclasses.dataclass(frozen=True)
class DraftParams:
  """Drafting: `kind` "mtp" (the attached MTP head) or "ngram" (ngram-simple: the tokens that
  followed the latest earlier occurrence of the last `ngram_n` tokens). At most `n_max` drafts per
  round (verify width 1 + n_max); MTP drafting stops below top-1 probability `p_min`."""
  kind: str = "mtp"
  n_max: int = 3
  p_min: float = 0.0
  ngram_n: int = 12

  def __post_init__(self):
    if self.kind not in ("mtp", "ngram"):
      raise ValueError(f"draft kind must be 'mtp' or 'ngram', got {self.kind!r}")
    if self.n_max < 1:
      raise ValueError(f"draft n_max must be >= 1, got {self.n_max}")
    if not 0.0 <= self.p_min <= 1.0:
      raise ValueError(f"draft p_min must be in [0, 1], got {self.p_min}")
    if self.ngram_n < 1:
      raise ValueError(f"ngram_n must be >= 1, got {self.ngram_n}")


def ngram_draft(history: Sequence[int], n: int, m: int) -> List[int]:
  """ngram-simple: find the latest earlier occurrence of the last `n` tokens; propose up to `m`
  tokens that followed it (none when the key never occurred before)."""
  if len(history) <= n:
    return []
  key = list(history[-n:])
  for start in range(len(history) - n - 1, -1, -1):
    if list(history[start:start + n]) == key:
      return list(history[start + n:start + n + m])
  return []


def _top1(logits_v):
  p = jax.nn.softmax(logits_v.astype(jnp.float32))
  i = int(jnp.argmax(p))
  return i, float(p[i])


def generate_speculative(runner: Runner, kv: KVProvider, prompt: Sequence[int], n_predict: int,
                         draft: DraftParams = DraftParams(), ubatch: int = 256,
                         eos_id: Optional[int] = None,
                         drafter: Optional[Callable[[Sequence[int], int], List[int]]] = None
                         ) -> GenerationResult:
  """Greedy generation of up to `n_predict` tokens with drafts verified by the target.

  `drafter(history, m) -> up to m tokens`, when given, replaces the MTP / ngram drafter (a
  research hook: e.g. an oracle with planted errors to exercise rejection and rollback).

  Metrics add, under the drafter's name `spec_type` ("mtp", "ngram", or "custom" for `drafter`):
  `draft_generated`, `draft_accepted`, `draft_acceptance` (accepted / generated), `verify_forwards`,
  `realized_verify_width` (rows per verify forward) and `draft_rounds` ([drafts, accepted] per round).
  """
  spec_type = draft.kind if drafter is None else "custom"
  use_mtp = draft.kind == "mtp" and drafter is None
  if drafter is None and draft.kind == "ngram":
    drafter = lambda history, m: ngram_draft(history, draft.ngram_n, m)  # pylint: disable=unnecessary-lambda-assignment
  if use_mtp and runner.mtp_layer is None:
    raise ValueError("MTP drafting needs an MTP head (nextn_predict_layers = 1); use kind='ngram'")
  prompt = [int(t) for t in prompt]
  seq = SequenceState(runner, kv)
  with CompileClock() as prefill_clock:
    t0 = time.perf_counter()
    # prefill the target; keep every row's post-norm hidden for the MTP catch-up
    logits, hn_se = prefill(seq, prompt, ubatch, with_hidden=True)
    b = int(jnp.argmax(logits))
    # MTP catch-up over the prompt: rows (hn_i, x_{i+1}) for i < C, with x_C = b
    if use_mtp:
      d1, p1, hm = _mtp_catch_up(runner, kv, hn_se, prompt[1:] + [b], 0, ubatch)
    t1 = time.perf_counter()

  out_tokens: List[int] = []
  drafted = accepted = rounds = 0
  round_lengths: List[List[int]] = []   # [drafts, accepted] of every verify round
  with CompileClock() as decode_clock:
    while len(out_tokens) < n_predict:
      out_tokens.append(b)
      if (eos_id is not None and b == eos_id) or len(out_tokens) >= n_predict:
        break
      c = seq.pos                      # committed target tokens; b sits at position c
      room = n_predict - len(out_tokens)
      # 1. draft
      drafts = []
      limit = min(draft.n_max, room)
      if use_mtp:
        d, p, h = d1, p1, hm
        while len(drafts) < limit and p >= draft.p_min:
          drafts.append(d)
          if len(drafts) == limit:
            break
          # the MTP row (its own hidden for x_{c+i}, draft d_i) sits at MTP cache position c + i - 1
          lg, h = runner.mtp_forward(h, np.array([d], np.int32), c + len(drafts) - 1, 1, kv)
          d, p = _top1(lg[0])
      else:
        drafts = [int(t) for t in drafter(prompt + out_tokens, limit)][:limit]
      drafted += len(drafts)
      # 2. verify: rows [b, d_1..d_k], scan form, per-row states captured
      rows = [b] + drafts
      vout = runner.forward(np.array(rows, np.int32), c, len(rows), seq.rec_states, kv,
                            logits_rows=np.arange(len(rows)), chunked=False, capture_states=True)
      target = [int(t) for t in np.asarray(jnp.argmax(vout.logits_rv, axis=-1))]
      # 3. accept + rollback
      j = 0
      while j < len(drafts) and drafts[j] == target[j]:
        j += 1
      accepted += j
      rounds += 1
      round_lengths.append([len(drafts), j])
      out_tokens.extend(drafts[:j])
      if eos_id is not None and eos_id in drafts[:j]:
        out_tokens = out_tokens[:out_tokens.index(eos_id, len(out_tokens) - j) + 1]
        break
      seq.rec_states = select_row(vout.rec_states, j)
      seq.pos = c + j + 1
      kv.truncate("target", seq.pos)
      b = target[j]
      if len(out_tokens) >= n_predict:
        break
      if not use_mtp:
        continue
      # 4. MTP catch-up on the accepted rows; its last row proposes the next d_1
      kv.truncate("mtp", c)   # draft rows from MTP position c on are rebuilt on the target's hidden states
      d1, p1, hm = _mtp_catch_up(runner, kv, vout.hn_se[:j + 1], drafts[:j] + [b], c, ubatch)
    t2 = time.perf_counter()
  out_tokens = out_tokens[:n_predict]
  metrics = generation_metrics(kv, len(prompt), len(out_tokens), t0, t1, t2,
                               (prefill_clock.seconds, decode_clock.seconds))
  metrics.update({
      "spec_type": spec_type,
      "draft_generated": drafted, "draft_accepted": accepted,
      "draft_acceptance": accepted / drafted if drafted else 0.0,
      "verify_forwards": rounds,
      "realized_verify_width": (drafted + rounds) / rounds if rounds else 0.0,
      "draft_rounds": round_lengths,
  })
  return GenerationResult(out_tokens, metrics)


def _mtp_catch_up(runner: Runner, kv: KVProvider, hn_se, next_tokens: Sequence[int], mtp_pos: int,
                  ubatch: int):
  """MTP rows (hn_se[i], next_tokens[i]) at MTP cache positions mtp_pos + i. -> (draft, p, hm_last)."""
  logits_v, hm = mtp_rows(runner, kv, hn_se, next_tokens, mtp_pos, ubatch)
  d, p = _top1(logits_v)
  return d, p, hm
