"""Train a hybrid target + MTP head on the stdlib corpus and export it to GGUF.

  python -m experiments.train --config=configs/train_code_tiny.py --out=runs/code-tiny
  python -m experiments.train --config=configs/train_code_small.py --out=runs/code-small   # one GPU
  python -m experiments.train --config=configs/train_code_tiny.py --out=runs/code-tiny --resume

(from the repository root; any config field can be overridden, e.g. `--config.steps=200`). Writes
under --out: log.jsonl, checkpoint.npz, tokenizer.json, files.json, <name>.gguf, loss.png,
summary.json (`kvjax.train.run`), and prints a short table last.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", "configs/train_code_tiny.py", "training config")
flags.DEFINE_string("out", None, "output folder", required=True)
flags.DEFINE_bool("resume", False, "continue from <out>/checkpoint.npz")
flags.DEFINE_bool("progress", True, "tqdm progress bar")
FLAGS = flags.FLAGS


def table(s: dict) -> str:
  rows = [("model", s["name"]), ("parameters", f"{s['params']:,}"), ("compute", f"{s['compute_dtype']} on {s['backend']}"),
          ("steps / tokens seen", f"{s['steps']} / {s['tokens_seen']:,}"),
          ("train time s", f"{s['train_s']} (total {s['total_s']})"),
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
  print(table(summary))


if __name__ == "__main__":
  app.run(main)
