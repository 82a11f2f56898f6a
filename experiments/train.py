"""Train a hybrid target + MTP head on the stdlib corpus and export it to GGUF.

  python -m experiments.train --config=configs/train_code_tiny.py --out=runs/code-tiny
  python -m experiments.train --config=configs/train_code_small.py --out=runs/code-small   # one GPU
  python -m experiments.train --config=configs/train_code_tiny.py --out=runs/code-tiny --resume
  python -m experiments.train ... --acceptance_contexts=256,1024   # then the acceptance study

(from the repository root; any config field can be overridden, e.g. `--config.steps=200`). Writes
under --out: log.jsonl, checkpoint.npz, best.npz (the lowest held-out loss's parameters, exported
when config.export_best), tokenizer.json, files.json, <name>.gguf, loss.png,
summary.json (`kvjax.train.run`), and prints a short table last. A bad config field (`kvjax.train.check_config`),
an unknown one (with the closest field) or a missing config file is refused before the corpus is read
or --out is touched, in one line `train: error: ...` naming the field (exit status 2; 1 for a bad file,
e.g. a damaged checkpoint).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from ml_collections import config_flags

DEFAULT_CONFIG = "configs/train_code_tiny.py"


def define_flags():
  """The flags, defined when the module runs as a program (see experiments/acceptance.py)."""
  config_flags.DEFINE_config_file("config", None, f"training config (default {DEFAULT_CONFIG})")
  flags.DEFINE_string("out", None, "output folder", required=True)
  flags.DEFINE_bool("resume", False, "continue from <out>/checkpoint.npz")
  flags.DEFINE_bool("progress", True, "tqdm progress bar (on a terminal only)")
  flags.DEFINE_list("acceptance_contexts", [], "after training, run the acceptance study (experiments.acceptance) "
                    "on the exported GGUF at these contexts; results under <out>/acceptance")
  flags.DEFINE_integer("acceptance_prompts", 4, "held-out prompts per context for the acceptance study")


FLAGS = flags.FLAGS


def table(s: dict) -> str:
  rows = [("model", s["name"]), ("parameters", f"{s['params']:,}"), ("compute", f"{s['compute_dtype']} on {s['backend']}"),
          ("steps / tokens seen", f"{s['steps']} / {s['tokens_seen']:,}"),
          ("train time s", f"{s['train_s']} (total {s['total_s']})"),
          ("exported step", f"{s['export_step']} (last step's held-out loss {s['final_heldout_loss']:.3f})"),
          ("held-out loss (ppl)", f"{s['heldout_loss']:.3f} ({s['heldout_ppl']:.2f})"),
          ("held-out MTP loss (t+2)", f"{s['heldout_mtp_loss']:.3f}"),
          ("unigram loss (ppl)", f"{s['unigram_loss']:.3f} ({s['unigram_ppl']:.2f})"),
          ("bigram loss (ppl)", f"{s['bigram_loss']:.3f} ({s['bigram_ppl']:.2f})"),
          ("gguf", f"{s['gguf']} ({s['gguf_bytes'] / 2**20:.2f} MiB)")]
  w = max(len(k) for k, _ in rows)
  return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def acceptance_contexts(values) -> list:
  """--acceptance_contexts as positive ints, checked before training (else `checks.fail`)."""
  from kvjax import checks
  try:
    contexts = [int(c) for c in values]
  except ValueError:
    contexts = []
  if len(contexts) != len(values) or any(c < 1 for c in contexts):
    checks.fail("train", f"--acceptance_contexts {','.join(values)}: expected positive ints, e.g. 256,1024")
  if contexts and FLAGS.acceptance_prompts < 1:
    checks.fail("train", f"--acceptance_prompts {FLAGS.acceptance_prompts}: must be at least 1")
  return contexts


def main(argv):
  from kvjax import checks
  if len(argv) > 1:
    checks.fail("train", f"unexpected arguments: {argv[1:]} (flags take the form --config.FIELD=value)")
  if FLAGS.config is None:
    checks.fail("train", f"--config is required, e.g. --config={DEFAULT_CONFIG}")
  contexts = acceptance_contexts(FLAGS.acceptance_contexts)
  from kvjax import api
  try:
    summary = api.train(FLAGS.config, FLAGS.out, resume=FLAGS.resume, progress=FLAGS.progress and sys.stderr.isatty())
  except (api.ParameterError, ValueError) as e:   # bad config fields, a corpus without files, a bad checkpoint
    msg = e.renamed({"out": "--out"}) if isinstance(e, api.ParameterError) else str(e)
    checks.fail("train", msg, 2 if isinstance(e, api.ParameterError) else 1)
  acc = None
  if contexts:
    acc = run_acceptance(summary["gguf"], contexts, FLAGS.acceptance_prompts, os.path.join(FLAGS.out, "acceptance"))
  print(table(summary))
  if acc:
    print(acc)


def run_acceptance(gguf: str, contexts, prompts: int, out: str) -> str:
  """experiments.acceptance on the exported model (MTP and ngram, n_max 3 and 5, p_min 0)."""
  from experiments import acceptance
  from kvjax import api
  model = api.load_model(gguf, page_tokens=64)
  rows = acceptance.study(model, contexts, prompts, 64, ["mtp", "ngram", "both"], [3, 5])
  os.makedirs(out, exist_ok=True)
  acceptance.write_csv(rows, os.path.join(out, "acceptance.csv"))
  summary = acceptance.summarize(rows)
  acceptance.write_csv(summary, os.path.join(out, "summary.csv"))
  acceptance.plot(summary, os.path.join(out, "acceptance.png"), f"{os.path.basename(gguf)}: greedy, p_min 0")
  return acceptance.table(summary)


def flags_parser(argv):
  """`checks.flags_parser("train", "config")`, with --config (when not given) `DEFAULT_CONFIG`, so an
  unknown `--config.FIELD` is checked against it too (the flag has no default: ml_collections would
  apply the overrides to a default as the flag is defined, and fail with a traceback)."""
  from kvjax import checks
  if not any(a == "--config" or a.startswith("--config=") for a in argv[1:]):
    argv = argv[:1] + [f"--config={DEFAULT_CONFIG}"] + argv[1:]
  return checks.flags_parser("train", "config", DEFAULT_CONFIG,
                             ("model", "steps", "batch_size", "seq_len", "lr", "corpus_root"))(argv)


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=flags_parser)
