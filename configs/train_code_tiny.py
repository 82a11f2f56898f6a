"""`code-tiny`: the model shipped as `--model code-tiny` (about 1 M parameters, 3 Gated DeltaNet +
1 gated attention + MTP, BPE of 1,024 tokens), about 15 minutes on 2 idle CPU cores.

  python -m experiments.train --config=configs/train_code_tiny.py --out=runs/code-tiny

Fields: `kvjax.train.base_config` (every field, with what it means); this preset is its defaults.
"""

from kvjax import train


def get_config():
  return train.base_config()
