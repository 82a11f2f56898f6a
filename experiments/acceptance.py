"""Acceptance study: how often drafts are accepted on held-out code, by draft position and context.

  python -m experiments.acceptance --model=code-tiny --out=runs/acceptance
  python -m experiments.acceptance --model=/path/to/model.gguf --contexts=256,1024,4096 --out=runs/acc

Prompts are held-out files of the Python standard library (the training split's rule,
`kvjax.corpus`): prompt i is `context` tokens of the held-out token stream starting at held-out
file i. For each context, prompt, drafter ("mtp", "ngram"; "both" where `kvjax.api.SpecConfig`
offers a combined drafter) and n_max, one greedy speculative generation of `n_predict` tokens
(`kvjax.api.generate`, p_min from --p_min) is checked token for token against plain greedy
decoding, and its verify rounds give:

  acc_pos_i      drafts at position i accepted / drafts made at position i (i = 1 .. n_max);
                 acc_pos_1 is the first-draft acceptance
  cond_pos_i     the same among rounds whose drafts 1 .. i-1 were accepted
  accepted_len   tokens committed per verify forward (accepted drafts + the target's own token)
  verify_rows    rows per verify forward (1 + drafts; accepted_len is the realized verify width)

Writes `<out>/acceptance.csv` (one row per generation), `<out>/acceptance.png` (acceptance by
position and verify rows against context) and prints a table (means over prompts) last.
Works with any qwen35 GGUF that has a tokenizer (MTP rows need nextn_predict_layers = 1).
"""

from __future__ import annotations

import csv
import os
from typing import Dict, List, Sequence

import numpy as np
from absl import app, flags

def define_flags():
  """The command line's flags, defined when the module runs as a program (not at import: tests
  import several experiments into one process, and absl refuses a flag name defined twice)."""
  flags.DEFINE_string("model", "code-tiny", "'code-tiny' or a GGUF path")
  flags.DEFINE_list("contexts", [], "prompt lengths in tokens (default: 256, 512, ... up to the model's limit)")
  flags.DEFINE_integer("prompts", 4, "held-out prompts per context")
  flags.DEFINE_integer("n_predict", 64, "tokens generated per prompt")
  flags.DEFINE_list("drafters", ["mtp", "ngram", "both"], "mtp, ngram, both")
  flags.DEFINE_list("n_max", ["3", "5"], "drafts per round")
  flags.DEFINE_float("p_min", 0.0, "MTP drafting stops below this top-1 probability")
  flags.DEFINE_integer("ngram_n", 3, "ngram-simple key length")
  flags.DEFINE_integer("ngram_m", 0, "ngram-simple draft length (the wide round of 'both'; 0: n_max)")
  flags.DEFINE_integer("page_tokens", 64, "KV page size")
  flags.DEFINE_string("out", "runs/acceptance", "output folder")


FLAGS = flags.FLAGS


def heldout_stream(model, max_bytes: int = 2_000_000) -> np.ndarray:
  """The held-out files of this machine's stdlib in the model's tokenizer, eos-separated, and the
  start of each file in the stream."""
  from kvjax import api, corpus
  root = corpus.stdlib_root()
  split = corpus.split_files(corpus.stdlib_files(root), 2.0)
  texts = list(corpus.read_texts(root, split.heldout, max_bytes).values())
  starts, parts, n = [], [], 0
  eos = model.tokenizer.eos_id
  for t in texts:
    if not t:
      continue
    ids = api.encode(model, t) + ([eos] if eos is not None else [])
    starts.append(n)
    parts.append(ids)
    n += len(ids)
  return np.asarray([t for p in parts for t in p], np.int64), np.asarray(starts)


def default_contexts(limit: int, margin: int) -> List[int]:
  out, c = [], 256
  while c + margin <= limit:
    out.append(c)
    c *= 2
  if limit - margin > (out[-1] if out else 0):
    out.append(limit - margin)
  return out


def position_acceptance(rounds: Sequence[Sequence[int]], n_max: int):
  """Per draft position i = 1..n_max, from the rounds' [drafts, accepted]:
  -> (acc: rounds whose i-th draft was accepted / rounds that drafted at least i,
      cond: the same among rounds whose drafts 1..i-1 were all accepted); NaN where none counts."""
  r = np.asarray(rounds, np.int64).reshape(-1, 2)
  acc, cond = [], []
  for i in range(1, n_max + 1):
    made = r[:, 0] >= i
    reached = made & (r[:, 1] >= i - 1)
    ok = int((r[:, 1] >= i).sum())
    acc.append(ok / int(made.sum()) if made.any() else float("nan"))
    cond.append(ok / int(reached.sum()) if reached.any() else float("nan"))
  return acc, cond


def spec_for(api, drafter: str, n_max: int, p_min: float, ngram_n: int, ngram_m: int = 0):
  """The API's SpecConfig for a drafter name, or None where the API has no such drafter. "both":
  ngram's match (up to `ngram_m` drafts, 0: n_max) when there is one, MTP's n_max otherwise."""
  draft = {"mtp": "mtp", "ngram": "ngram"}.get(drafter)
  if drafter == "both":
    draft = next((d for d in api.DRAFTS if "mtp" in d and "ngram" in d), None)
  if draft is None:
    return None
  return api.SpecConfig(draft, n_max=n_max, p_min=p_min, ngram_n=ngram_n,
                        ngram_m=ngram_m if draft != "mtp" else 0)


def study(model, contexts: Sequence[int], prompts: int, n_predict: int, drafters: Sequence[str],
          n_maxes: Sequence[int], p_min: float = 0.0, ngram_n: int = 3, log=print,
          ngram_m: int = 0) -> List[Dict]:
  """One row per (context, prompt, drafter, n_max); see the module docstring."""
  from kvjax import api
  stream, starts = heldout_stream(model)
  rows, skipped = [], set()
  for ctx in contexts:
    usable = [int(s) for s in starts if s + ctx <= len(stream)][:prompts]
    for p, s0 in enumerate(usable):
      prompt = stream[s0:s0 + ctx].tolist()
      plain = api.generate(model, prompt_tokens=prompt, n_predict=n_predict, ignore_eos=True).tokens
      for drafter in drafters:
        for n_max in n_maxes:
          spec = spec_for(api, drafter, n_max, p_min, ngram_n, ngram_m)
          if spec is None:
            if drafter not in skipped:
              log(f"skipped {drafter}: kvjax.api.SpecConfig offers no such drafter (drafts: {api.DRAFTS})")
              skipped.add(drafter)
            continue
          res = api.generate(model, prompt_tokens=prompt, n_predict=n_predict, ignore_eos=True, spec=spec)
          m = res.metrics
          acc, cond = position_acceptance(m["draft_rounds"], max(n_max, spec.ngram_m))
          row = {"context": ctx, "prompt": p, "drafter": drafter, "n_max": n_max, "p_min": p_min,
                 "matches_greedy": res.tokens == plain, "draft_generated": m["draft_generated"],
                 "draft_accepted": m["draft_accepted"], "verify_forwards": m["verify_forwards"],
                 "accepted_len": (m["draft_accepted"] + m["verify_forwards"]) / max(m["verify_forwards"], 1),
                 "verify_rows": m["verify_rows_mean"],
                 "ngram_share": m["ngram_rounds"] / max(m["verify_forwards"], 1)}
          row.update({f"acc_pos_{i + 1}": a for i, a in enumerate(acc)})
          row.update({f"cond_pos_{i + 1}": a for i, a in enumerate(cond)})
          rows.append(row)
  return rows


def summarize(rows: List[Dict]) -> List[Dict]:
  """Means over prompts per (context, drafter, n_max)."""
  keys = sorted({(r["drafter"], r["n_max"], r["context"]) for r in rows})
  out = []
  for d, n, c in keys:
    rs = [r for r in rows if (r["drafter"], r["n_max"], r["context"]) == (d, n, c)]
    gen = sum(r["draft_generated"] for r in rs)
    s = {"drafter": d, "n_max": n, "context": c, "prompts": len(rs),
         "acceptance": sum(r["draft_accepted"] for r in rs) / gen if gen else float("nan"),
         "accepted_len": float(np.mean([r["accepted_len"] for r in rs])),
         "verify_rows": float(np.mean([r["verify_rows"] for r in rs])),
         "ngram_share": float(np.mean([r.get("ngram_share", 0.0) for r in rs])),
         "all_match_greedy": all(r["matches_greedy"] for r in rs)}
    for i in range(1, max(int(k[8:]) for k in rs[0] if k.startswith("acc_pos_")) + 1):
      for key in (f"acc_pos_{i}", f"cond_pos_{i}"):
        vals = [r[key] for r in rs if not np.isnan(r[key])]
        s[key] = float(np.mean(vals)) if vals else float("nan")
    out.append(s)
  return out


def table(summary: List[Dict]) -> str:
  head = f"{'drafter':<7} {'n_max':>5} {'ctx':>6} {'acc@1':>6} {'acc@2':>6} {'acc@3':>6} {'accept':>7} " \
         f"{'len':>5} {'rows':>6} {'ngram':>6} {'=greedy':>7}"
  lines = [head]
  for s in summary:
    pos = [f"{s.get(f'acc_pos_{i}', float('nan')):6.3f}" for i in (1, 2, 3)]
    lines.append(f"{s['drafter']:<7} {s['n_max']:>5} {s['context']:>6} {' '.join(pos)} {s['acceptance']:7.3f} "
                 f"{s['accepted_len']:5.2f} {s['verify_rows']:6.2f} {s.get('ngram_share', 0.0):6.2f} "
                 f"{str(s['all_match_greedy']):>7}")
  return "\n".join(lines)


def write_csv(rows: List[Dict], path: str) -> None:
  cols = []
  for r in rows:
    cols += [k for k in r if k not in cols]
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)


def plot(summary: List[Dict], path: str, title: str):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  for k, (d, n) in enumerate(sorted({(s["drafter"], s["n_max"]) for s in summary})):
    ss = [s for s in summary if (s["drafter"], s["n_max"]) == (d, n)]
    ctx = [s["context"] for s in ss]
    for i in range(1, n + 1):
      a1.plot(ctx, [s[f"acc_pos_{i}"] for s in ss], marker="o", color=f"C{k}", alpha=1.0 - 0.15 * (i - 1),
              label=f"{d} n_max {n}" if i == 1 else None, ls="-" if i == 1 else ":")
    a2.plot(ctx, [s["verify_rows"] for s in ss], marker="o", color=f"C{k}", label=f"{d} n_max {n}")
  for a in (a1, a2):
    a.set_xscale("log", base=2)
    a.set_xlabel("context (tokens)")
  a1.set_ylabel("acceptance at draft position (solid: 1st, dotted: later)")
  a2.set_ylabel("verify rows (1 + drafts) / verify")
  a1.legend(fontsize=7)
  a2.legend(fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv):
  del argv
  import logging
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)   # its backend probe: "Unable to initialize backend 'tpu'"
  from kvjax import api
  model = api.load_model(FLAGS.model, page_tokens=FLAGS.page_tokens)
  n_maxes = [int(n) for n in FLAGS.n_max]
  contexts = ([int(c) for c in FLAGS.contexts] if FLAGS.contexts
              else default_contexts(model.cfg.context_length, FLAGS.n_predict + max(n_maxes)))
  rows = study(model, contexts, FLAGS.prompts, FLAGS.n_predict, FLAGS.drafters, n_maxes, FLAGS.p_min,
               FLAGS.ngram_n, ngram_m=FLAGS.ngram_m)
  os.makedirs(FLAGS.out, exist_ok=True)
  write_csv(rows, os.path.join(FLAGS.out, "acceptance.csv"))
  summary = summarize(rows)
  write_csv(summary, os.path.join(FLAGS.out, "summary.csv"))
  plot(summary, os.path.join(FLAGS.out, "acceptance.png"), f"{FLAGS.model}: greedy, p_min {FLAGS.p_min}")
  print(table(summary))


if __name__ == "__main__":
  define_flags()
  from kvjax import checks
  app.run(checks.one_line_errors("acceptance", main), flags_parser=checks.flags_parser(
      "acceptance", values={"contexts": (int, 1), "n_max": (int, 1), "drafters": (("mtp", "ngram", "both"),),
                            "prompts": (int, 1), "n_predict": (int, 1)}))
