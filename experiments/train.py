"""Train a hybrid target + MTP head on the stdlib corpus and export it to GGUF.

  python -m experiments.train --config=configs/train_code_tiny.py --out=runs/code-tiny
  python -m experiments.train --config=configs/train_code_small.py --out=runs/code-small   # one GPU
  python -m experiments.train --config=configs/train_code_tiny.py --out=runs/code-tiny --resume
  python -m experiments.train ... --acceptance_contexts=256,1024   # then the acceptance study

(from the repository root; any config field can be overridden, e.g. `--config.steps=200`). Writes
under --out: log.jsonl, checkpoint.npz, best.npz (the lowest held-out loss's parameters, exported
when config.export_best), tokenizer.json, files.json, <name>.gguf, loss.png,
summary.json (`kvjax.train.run`), and prints a short table last.
"""

from __future__ import annotations

import os

from absl import app, flags
from ml_collections import config_flags


def define_flags():
  """The flags, defined when the module runs as a program (see experiments/acceptance.py)."""
  config_flags.DEFINE_config_file("config", "configs/train_code_tiny.py", "training config")
  flags.DEFINE_string("out", None, "output folder", required=True)
  flags.DEFINE_bool("resume", False, "continue from <out>/checkpoint.npz")
  flags.DEFINE_bool("progress", True, "tqdm progress bar")
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


def main(argv):
  del argv
  from kvjax import api
  summary = api.train(FLAGS.config, FLAGS.out, resume=FLAGS.resume, progress=FLAGS.progress)
  acc = None
  if FLAGS.acceptance_contexts:
    acc = run_acceptance(summary["gguf"], [int(c) for c in FLAGS.acceptance_contexts], FLAGS.acceptance_prompts,
                         os.path.join(FLAGS.out, "acceptance"))
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


if __name__ == "__main__":
  define_flags()
  app.run(main)
