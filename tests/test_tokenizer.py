"""kvjax.tokenizer: byte-level BPE, the qwen2-like pre-split, the tiny vocab."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvjax import config, tiny, tokenizer as T


@pytest.fixture(scope="module")
def tok():
  return T.tiny_tokenizer()


def test_tiny_spec_shape_and_determinism():
  a, b = T.tiny_tokenizer_spec(), T.tiny_tokenizer_spec()
  assert a == b
  toks = a["tokens"]
  assert len(toks) == config.TINY_VOCAB == 384 == len(a["token_type"])
  assert len(set(toks)) == len(toks)
  b2u = T.bytes_to_unicode()
  assert toks[:256] == [b2u[i] for i in range(256)]
  assert toks[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  assert a["token_type"][-3:] == [T.TOKEN_CONTROL] * 3 and set(a["token_type"][:-3]) == {T.TOKEN_NORMAL}
  assert toks[a["eos_token_id"]] == "<|endoftext|>"
  # Every merge joins two existing tokens into one that is in the vocab.
  vocab = set(toks)
  for m in a["merges"]:
    l, r = m.split(" ")
    assert l in vocab and r in vocab and l + r in vocab
  assert 125 <= len(a["merges"])  # 384 - 256 - 3 new tokens
  # The most frequent pair of the built-in corpus comes first.
  assert "Ġthe" in toks[256:270]


def test_bytes_to_unicode_is_a_bijection_to_printables():
  m = T.bytes_to_unicode()
  assert len(set(m.values())) == 256
  assert all(c.isprintable() and not c.isspace() for c in m.values())
  assert m[ord("A")] == "A" and m[ord(" ")] == "Ġ" and m[ord("\n")] == "Ċ"


def test_encode_uses_merges_and_specials(tok):
  ids = tok.encode(" the")
  assert len(ids) == 1 and tok.tokens[ids[0]] == "Ġthe"
  s = "<|im_start|>user\nthe cache<|im_end|><|endoftext|>"
  ids = tok.encode(s)
  assert ids[0] == tok.token_to_id["<|im_start|>"]
  assert ids[-2:] == [tok.token_to_id["<|im_end|>"], tok.eos_id]
  assert len(ids) < len(s.encode())  # merges compress
  assert tok.decode(ids) == s
  assert tok.decode(ids, skip_special=True) == "user\nthe cache"
  # Specials can be turned off: then they are ordinary bytes.
  plain = tok.encode("<|im_end|>", allow_special=False)
  assert len(plain) > 1 and tok.decode(plain) == "<|im_end|>"
  assert tok.vocab_size == 384
  with pytest.raises(ValueError, match="outside the vocab"):
    tok.decode([384])


def test_bpe_applies_merges_by_rank():
  # A hand-made vocab: "a b" (rank 0) beats "b c" (rank 1) in "abc".
  b2u = T.bytes_to_unicode()
  toks = [b2u[i] for i in range(256)] + ["ab", "bc", "abc"]
  spec = {"tokens": toks, "merges": ["a b", "ab c", "b c"], "eos_token_id": 0}
  t = T.Tokenizer(spec)
  assert [t.tokens[i] for i in t.encode("abc")] == ["abc"]
  spec2 = {"tokens": toks, "merges": ["b c", "a b", "ab c"], "eos_token_id": 0}
  assert [T.Tokenizer(spec2).tokens[i] for i in T.Tokenizer(spec2).encode("abc")] == ["a", "bc"]


@pytest.mark.parametrize("text,pieces", [
    ("Hello world", ["Hello", " world"]),
    ("I'm here, they'LL go", ["I", "'m", " here", ",", " they", "'LL", " go"]),
    ("abc 12345", ["abc", " ", "1", "2", "3", "4", "5"]),
    ("a  b", ["a", " ", " b"]),
    ("x!!\n\ny", ["x", "!!\n\n", "y"]),
    ("end   ", ["end", "   "]),
    ("\n\n  z", ["\n\n", " ", " z"]),
    ("_under", ["_under"]),
    ("héllo 日本語", ["héllo", " 日本語"]),
])
def test_pretokenize_matches_qwen2_regex_on_common_text(text, pieces):
  # Expected splits are what qwen2's \p{L}/\p{N} regex gives on these strings.
  assert T.pretokenize(text) == pieces


def test_pretokenize_documented_difference():
  # "½" is \p{N} (No) for llama.cpp's regex, but a "letter" for ours.
  assert T.pretokenize("½") == ["½"]
  assert T.pretokenize("a½b") == ["a½b"]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_round_trip_any_unicode(s):
  tok = T.tiny_tokenizer()
  assert "".join(T.pretokenize(s)) == s
  ids = tok.encode(s)
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == s


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "the", " ",
                                 "x", "\n", "é", "🙂", "<|", "|>"]), max_size=20))
def test_round_trip_with_specials(parts):
  tok = T.tiny_tokenizer()
  s = "".join(parts)
  assert tok.decode(tok.encode(s)) == s


def test_bad_specs_refused():
  with pytest.raises(ValueError, match="lacks tokens for"):
    T.Tokenizer({"tokens": ["a", "b"], "merges": []})
  b2u = T.bytes_to_unicode()
  toks = [b2u[i] for i in range(256)]
  with pytest.raises(ValueError, match="eos_token_id 300 outside"):
    T.Tokenizer({"tokens": toks, "eos_token_id": 300})
  with pytest.raises(ValueError, match="not supported"):
    T.from_spec({"model": "llama", "tokens": toks})


def test_load_model_source_tiny_and_path(tmp_path):
  cfg, it, tok = tiny.load_model_source("tiny")
  assert cfg == config.tiny() and tok.vocab_size == cfg.vocab_size
  first = dict(it)
  ref = tiny.tiny_tensors(0)
  assert set(first) == set(ref)
  for k in ref:
    np.testing.assert_array_equal(first[k], ref[k])
  p = tiny.write_tiny_gguf(tmp_path / "m.gguf", seed=0)
  cfg2, it2, tok2 = tiny.load_model_source(str(p))
  assert cfg2 == cfg
  assert tok2.encode("<|im_start|>the ring") == tok.encode("<|im_start|>the ring")
  for k, a in it2:
    np.testing.assert_array_equal(a, ref[k])
  _, it3, _ = tiny.load_model_source("tiny:5")
  assert not np.array_equal(dict(it3)["token_embd.weight"], ref["token_embd.weight"])
  with pytest.raises(FileNotFoundError, match="no such file"):
    tiny.load_model_source(str(tmp_path / "nope.gguf"))


def _learn_bpe_naive(text, vocab_size, num_special):
  """Recount every pair after every merge (the definition the incremental learner must match)."""
  import collections
  b2u = T.bytes_to_unicode()
  tokens = [b2u[b] for b in range(256)]
  words = {tuple(b2u[b] for b in w.encode()): c
           for w, c in sorted(collections.Counter(T.pretokenize(text)).items())}
  merges = []
  while len(tokens) < vocab_size - num_special:
    pairs = collections.Counter()
    for w, c in words.items():
      for p in zip(w, w[1:]):
        pairs[p] += c
    best = min(pairs, key=lambda p: (-pairs[p], p))
    merges.append(f"{best[0]} {best[1]}")
    if best[0] + best[1] not in tokens:
      tokens.append(best[0] + best[1])
    new = collections.Counter()
    for w, c in words.items():
      out, i = [], 0
      while i < len(w):
        if i + 1 < len(w) and (w[i], w[i + 1]) == best:
          out.append(w[i] + w[i + 1])
          i += 2
        else:
          out.append(w[i])
          i += 1
      new[tuple(out)] += c
    words = new
  return tokens, merges


def test_learn_bpe_matches_naive_recount():
  import os
  import sysconfig
  with open(os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py"), encoding="utf-8") as f:
    text = f.read()[:12000]
  assert T.learn_bpe(text, 400, 3) == _learn_bpe_naive(text, 400, 3)
