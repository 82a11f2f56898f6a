"""kvjax.corpus: the deterministic stdlib file list and whole-file split, batches as a pure function of
(seed, step), eos-separated token streams, and the n-gram baselines."""

import numpy as np
import pytest

from kvjax import corpus, tokenizer as tok_lib


def test_file_list_and_split_are_deterministic_and_disjoint():
  files = corpus.stdlib_files()
  assert files == sorted(files) and len(files) > 100
  assert not any("site-packages" in f for f in files)
  a, b = corpus.split_files(files, 2.0), corpus.split_files(list(reversed(files)), 2.0)
  assert set(a.heldout) == set(b.heldout) and set(a.train) == set(b.train)
  assert not set(a.train) & set(a.heldout) and set(a.train) | set(a.heldout) == set(files)
  assert 0.005 < len(a.heldout) / len(files) < 0.05     # ~2 % of the files
  assert corpus.is_heldout("a/b.py", 2.0) == corpus.is_heldout("a/b.py", 2.0)
  with pytest.raises(ValueError, match="heldout_percent"):
    corpus.split_files(files, 0)


def test_window_starts_are_a_function_of_seed_and_step():
  a = corpus.window_starts(10_000, 65, 8, step=7, seed=3)
  assert np.array_equal(a, corpus.window_starts(10_000, 65, 8, step=7, seed=3))
  assert not np.array_equal(a, corpus.window_starts(10_000, 65, 8, step=8, seed=3))
  assert a.min() >= 0 and a.max() <= 10_000 - 65
  w = corpus.batch_windows(np.arange(10_000), a, 65)
  assert w.shape == (8, 65) and np.array_equal(w[:, 0], a) and np.all(np.diff(w, axis=1) == 1)


def test_token_stream_separates_files_with_eos():
  spec = corpus.learn_tokenizer(["def f(x):\n    return x\n"] * 3, vocab_size=270)
  tok = tok_lib.from_spec(spec)
  texts = ["x = 1\n", "def f(): pass\n"]
  s = corpus.token_stream(tok, texts)
  eos = np.flatnonzero(s == tok.eos_id)
  assert len(eos) == 2 and eos[-1] == len(s) - 1
  assert tok.decode(s[:eos[0]]) == texts[0] and tok.decode(s[eos[0] + 1:eos[1]]) == texts[1]


def test_bigram_beats_unigram_on_predictable_text():
  train = np.tile(np.arange(10), 200)
  held = np.tile(np.arange(10), 20)
  b = corpus.ngram_baselines(train, held[:-1], held[1:], 16)
  assert b["unigram_loss"] == pytest.approx(np.log(10), rel=0.01)   # 10 equally likely tokens (+1 smoothing)
  assert b["bigram_loss"] < 0.2 < b["unigram_loss"]
