"""The training corpus: the Python standard library's own source, split into whole files.

    files = corpus.stdlib_files()                     # sorted relative paths of every .py file
    split = corpus.split_files(files, heldout_percent=2)
    texts = corpus.read_texts(root, split.train)      # UTF-8 text per file
    spec = corpus.learn_tokenizer(texts, vocab_size=512)
    stream = corpus.token_stream(tok, texts)          # one int32 array, files separated by eos

The file list is deterministic (sorted relative paths under `sysconfig.get_paths()["stdlib"]`,
without `site-packages`), and the held-out split is a pure function of a file's relative path
(an md5 bucket), so the same corpus gives the same split on every machine. Files that are not
valid UTF-8 are left out (and listed as such by `read_texts`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import os
import sysconfig
from typing import Dict, List, Sequence, Tuple

import numpy as np

from kvjax import tokenizer as tok_lib

SPECIALS = ("<|endoftext|>",)


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> List[str]:
  """Sorted relative paths of the `.py` files under `root` (the stdlib), skipping site-packages."""
  root = root or stdlib_root()
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
    rel = os.path.relpath(dirpath, root)
    out += [os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".py")]
  return sorted(out)


@dataclasses.dataclass(frozen=True)
class Split:
  train: Tuple[str, ...]
  heldout: Tuple[str, ...]


def path_hash(relpath: str) -> int:
  """A stable hash of a relative path (md5 of its '/'-separated form), the same on every machine."""
  return int.from_bytes(hashlib.md5(relpath.replace(os.sep, "/").encode()).digest()[:4], "little")


def is_heldout(relpath: str, heldout_percent: float) -> bool:
  """A file is held out when its `path_hash` falls in the first `heldout_percent`."""
  return path_hash(relpath) % 10000 < heldout_percent * 100


def split_files(files: Sequence[str], heldout_percent: float = 2.0) -> Split:
  if not 0 < heldout_percent < 100:
    raise ValueError(f"heldout_percent must be in (0, 100), got {heldout_percent}")
  held = tuple(f for f in files if is_heldout(f, heldout_percent))
  return Split(tuple(f for f in files if f not in set(held)), held)


def read_texts(root: str, files: Sequence[str], max_bytes: int = 0) -> Dict[str, str]:
  """relpath -> text for the files that decode as UTF-8, in order, stopping before the first file
  that would take the total past `max_bytes` (0: all)."""
  out, total = {}, 0
  for f in files:
    with open(os.path.join(root, f), "rb") as fh:
      raw = fh.read()
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError:
      continue
    if max_bytes and total + len(raw) > max_bytes:
      break
    out[f] = text
    total += len(raw)
  return out


def learn_tokenizer(texts: Sequence[str], vocab_size: int, max_bytes: int = 0) -> Dict:
  """A byte-level BPE spec learned from `texts` (the first `max_bytes` of them; 0: all), with
  `<|endoftext|>` as eos / bos / padding, in the GGUF `tokenizer.ggml.*` form."""
  sample, total = [], 0
  for t in texts:
    if max_bytes and total >= max_bytes:
      break
    sample.append(t)
    total += len(t)
  tokens, merges = tok_lib.learn_bpe(sample, vocab_size, len(SPECIALS))
  eos = len(tokens)
  return {"model": "gpt2", "pre": "qwen2", "tokens": tokens + list(SPECIALS),
          "token_type": [tok_lib.TOKEN_NORMAL] * eos + [tok_lib.TOKEN_CONTROL] * len(SPECIALS),
          "merges": merges, "eos_token_id": eos, "bos_token_id": eos, "padding_token_id": eos}


def token_stream(tok: tok_lib.Tokenizer, texts: Sequence[str]) -> np.ndarray:
  """Every text's tokens followed by eos, concatenated: one int32 array."""
  parts = []
  for t in texts:
    parts.append(np.asarray(tok.encode(t, allow_special=False), np.int32))
    parts.append(np.asarray([tok.eos_id], np.int32))
  return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def batch_windows(stream: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  """[B, length] windows of `stream` at `starts`."""
  return stream[starts[:, None] + np.arange(length)[None, :]]


def window_starts(n_tokens: int, length: int, batch: int, step: int, seed: int) -> np.ndarray:
  """The window starts of batch `step`: a pure function of (seed, step), so a resumed run draws
  the same batches."""
  rng = np.random.default_rng([seed, step])
  return rng.integers(0, n_tokens - length, size=batch)


def eval_windows(n_tokens: int, length: int, max_windows: int) -> np.ndarray:
  """Evenly spaced, non-overlapping window starts over a held-out stream."""
  n = min(max_windows, max(n_tokens // length, 1))
  stride = max((n_tokens - length) // n, 1) if n > 1 else 0
  return np.arange(n) * stride


def ngram_baselines(train: np.ndarray, prev: np.ndarray, nxt: np.ndarray, vocab: int) -> Dict[str, float]:
  """Cross-entropy (nats/token) of the held-out tokens `nxt` (each after `prev`) under add-one
  unigram and interpolated bigram models fitted on the training stream: the losses a trained
  model must beat, on the same tokens its held-out loss covers."""
  uni = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
  p_uni = uni / uni.sum()
  ce_uni = float(-np.mean(np.log(p_uni[nxt])))
  pairs = collections.Counter(zip(train[:-1].tolist(), train[1:].tolist()))
  ctx = np.bincount(train[:-1], minlength=vocab).astype(np.float64)
  lam = 0.9   # bigram weight where the context was seen, the rest from the unigram
  logs = []
  for a, b in zip(prev.tolist(), nxt.tolist()):
    w = lam if ctx[a] else 0.0
    pb = pairs.get((a, b), 0) / ctx[a] if ctx[a] else 0.0
    logs.append(math.log(w * pb + (1 - w) * p_uni[b]))
  return {"unigram_loss": ce_uni, "bigram_loss": float(-np.mean(logs))}


def prompt_tokens(tok: tok_lib.Tokenizer, n_tokens: int, heldout_percent: float = 2.0,
                  root: str | None = None) -> List[int]:
  """The first `n_tokens` tokens of the corpus read as one text stream, held-out files first (then
  the training files), files separated by eos: a benchmark prompt of real text. Files are read
  and tokenized one at a time until there are enough tokens."""
  if n_tokens < 1:
    raise ValueError(f"prompt of {n_tokens} tokens: at least 1 is needed")
  root = root or stdlib_root()
  split = split_files(stdlib_files(root), heldout_percent)
  out: List[int] = []
  for f in split.heldout + split.train:
    for text in read_texts(root, [f]).values():
      out += tok.encode(text, allow_special=False) + [tok.eos_id]
    if len(out) >= n_tokens:
      return [int(t) for t in out[:n_tokens]]
  raise ValueError(f"the corpus under {root} holds {len(out)} tokens; the prompt needs {n_tokens}")
