"""Byte-level BPE tokenizer built from a GGUF `tokenizer.ggml.*` spec.

A spec is a plain dict with the keys of GGUF's tokenizer arrays, without the
`tokenizer.ggml.` prefix: `tokens` (strings in GPT-2's byte-to-unicode
alphabet), `merges` ("left right", by rank), `token_type` (1 normal,
3 control, 4 user-defined, ...), `eos_token_id`, `bos_token_id`,
`padding_token_id`, `model` ("gpt2"), `pre` ("qwen2").

Pre-tokenizer: qwen2's split regex

    (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}
    | ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+

rewritten for the standard `re` module (the `regex` package, which knows
`\\p{L}` / `\\p{N}`, is not available). Difference: `re` has no Unicode
categories, so "letter" is `[^\\W\\d_]` (letters plus the non-decimal numerals
of categories Nl / No such as "½" or "Ⅻ") and "number" is `\\d` (decimal
digits, Nd). Text containing Nl / No characters may therefore split
differently from llama.cpp; ASCII and ordinary letters/digits split the same.
Special tokens (control / user-defined, e.g. `<|im_start|>`) are matched whole
before pre-splitting. `decode(encode(s)) == s` for every string without lone
surrogates.
"""

from __future__ import annotations

import collections
import functools
import heapq
import re
from typing import Any, Dict, Iterable, List, Mapping, Tuple

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

_L = r"[^\W\d_]"          # letter (approximates \p{L})
_N = r"\d"                # number (approximates \p{N})
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    rf"|(?:[^\r\n\w]|_)?{_L}+"
    rf"|{_N}"
    r"| ?(?:[^\s\w]|_)+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
    r"|(?s:.)"
)
_PRE_RE = re.compile(PRETOKENIZE_PATTERN)


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> Dict[int, str]:
  """GPT-2's reversible byte -> printable unicode character map."""
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
  out, extra = {}, 0
  for b in range(256):
    if b in keep:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + extra)
      extra += 1
  return out


def pretokenize(text: str) -> List[str]:
  """Split text (without special tokens) into pre-tokens; "".join(...) == text."""
  return _PRE_RE.findall(text)


class Tokenizer:
  """Byte-level BPE (merges applied by rank) over a GGUF tokenizer spec."""

  def __init__(self, spec: Mapping[str, Any]):
    tokens = list(spec["tokens"])
    if not tokens:
      raise ValueError("tokenizer spec has no tokens")
    types = list(spec.get("token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
      raise ValueError(f"token_type has {len(types)} entries, tokens has {len(tokens)}")
    self.tokens: List[str] = tokens
    self.token_type: List[int] = [int(t) for t in types]
    self.token_to_id: Dict[str, int] = {}
    for i, t in enumerate(tokens):
      self.token_to_id.setdefault(t, i)
    self.ranks: Dict[Tuple[str, str], int] = {}
    for r, m in enumerate(spec.get("merges") or []):
      a, sep, b = m.partition(" ")
      if not sep:
        raise ValueError(f"merge {r} {m!r} is not 'left right'")
      self.ranks.setdefault((a, b), r)
    self._b2u = bytes_to_unicode()
    self._u2b = {u: b for b, u in self._b2u.items()}
    missing = [b for b, u in self._b2u.items() if u not in self.token_to_id]
    if missing:
      raise ValueError(f"byte-level vocab lacks tokens for {len(missing)} bytes (first {missing[0]})")
    self.special_ids = [i for i, t in enumerate(self.token_type)
                        if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    specials = sorted({tokens[i] for i in self.special_ids}, key=len, reverse=True)
    self._special_re = (re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")
                        if specials else None)
    self.eos_id = int(spec["eos_token_id"]) if spec.get("eos_token_id") is not None else None
    self.bos_id = int(spec["bos_token_id"]) if spec.get("bos_token_id") is not None else None
    self.pad_id = (int(spec["padding_token_id"]) if spec.get("padding_token_id") is not None
                   else self.eos_id)
    for name, v in (("eos", self.eos_id), ("bos", self.bos_id), ("padding", self.pad_id)):
      if v is not None and not 0 <= v < len(tokens):
        raise ValueError(f"{name}_token_id {v} outside the vocab of {len(tokens)} tokens")
    self._cache: Dict[str, Tuple[int, ...]] = {}

  @property
  def vocab_size(self) -> int:
    return len(self.tokens)

  def _bpe(self, piece: str) -> Tuple[int, ...]:
    hit = self._cache.get(piece)
    if hit is not None:
      return hit
    word = [self._b2u[b] for b in piece.encode("utf-8", errors="surrogatepass")]
    ranks = self.ranks
    while len(word) > 1:
      best, best_rank = None, None
      for pair in zip(word, word[1:]):
        r = ranks.get(pair)
        if r is not None and (best_rank is None or r < best_rank):
          best, best_rank = pair, r
      if best is None:
        break
      merged, i = [], 0
      while i < len(word):
        if i + 1 < len(word) and word[i] == best[0] and word[i + 1] == best[1]:
          merged.append(best[0] + best[1])
          i += 2
        else:
          merged.append(word[i])
          i += 1
      word = merged
    ids: List[int] = []
    for sym in word:
      tid = self.token_to_id.get(sym)
      if tid is None:  # merge result absent from the vocab: fall back to bytes
        ids.extend(self.token_to_id[c] for c in sym)
      else:
        ids.append(tid)
    out = tuple(ids)
    if len(self._cache) < 100_000:
      self._cache[piece] = out
    return out

  def encode(self, text: str, allow_special: bool = True) -> List[int]:
    """Text -> token ids (special tokens in the text map to their ids)."""
    chunks = self._special_re.split(text) if (allow_special and self._special_re) else [text]
    ids: List[int] = []
    for k, chunk in enumerate(chunks):
      if not chunk:
        continue
      if k % 2 == 1:  # a captured special token
        ids.append(self.token_to_id[chunk])
        continue
      for piece in pretokenize(chunk):
        ids.extend(self._bpe(piece))
    return ids

  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    """Token ids -> text (invalid UTF-8 becomes U+FFFD)."""
    out: List[str] = []
    buf = bytearray()
    for i in ids:
      i = int(i)
      if not 0 <= i < len(self.tokens):
        raise ValueError(f"token id {i} outside the vocab of {len(self.tokens)} tokens")
      tok = self.tokens[i]
      if self.token_type[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
        out.append(buf.decode("utf-8", errors="replace"))
        buf.clear()
        if not skip_special:
          out.append(tok)
        continue
      for ch in tok:
        b = self._u2b.get(ch)
        if b is None:
          buf.extend(ch.encode("utf-8"))
        else:
          buf.append(b)
    out.append(buf.decode("utf-8", errors="replace"))
    return "".join(out)


# ---- the tiny built-in model's own vocab ---------------------------------------

TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A streamed cache keeps the most
recent pages of the history on the device and brings older pages back in a
ring, so the model can attend to a long context with little memory. The
history lives on the host, where every page is written once and read many
times. When the draft head proposes tokens, the target model checks them in
one pass, and the accepted tokens are appended to the cache. Numbers such as
1, 2, 3, 10, 42 and 2048 appear in the text; so do words like "the", "that",
"this", "there", "then" and "these". In the beginning there was the token, and
the token was in the vocabulary, and the vocabulary was small but sufficient.
"""

TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def learn_bpe(text, vocab_size: int, num_special: int) -> Tuple[List[str], List[str]]:
  """Deterministic byte-level BPE training: -> (tokens without specials, merges).

  `text` is a string or an iterable of strings (pre-split separately, e.g. one per file). Pair
  counts are weighted by pre-token frequency; ties go to the lexicographically smallest pair.
  Stops when `vocab_size - num_special` tokens exist. Pair counts are kept up to date
  incrementally (only the words containing the merged pair are re-counted) and the best pair is
  taken from a lazily invalidated heap, so a merge costs the words it touches, not the corpus.
  """
  b2u = bytes_to_unicode()
  tokens = [b2u[b] for b in range(256)]
  known = set(tokens)
  target = vocab_size - num_special
  if target < 256:
    raise ValueError(f"vocab_size {vocab_size} leaves fewer than 256 byte tokens")
  freq: Dict[str, int] = collections.Counter()
  for part in ([text] if isinstance(text, str) else text):
    freq.update(pretokenize(part))
  words = [[b2u[b] for b in w.encode("utf-8", errors="surrogatepass")] for w in sorted(freq)]
  counts = [freq[w] for w in sorted(freq)]
  pairs: Dict[Tuple[str, str], int] = collections.Counter()
  where: Dict[Tuple[str, str], set] = collections.defaultdict(set)
  for i, w in enumerate(words):
    for p in zip(w, w[1:]):
      pairs[p] += counts[i]
      where[p].add(i)
  heap = [(-c, p) for p, c in pairs.items()]
  heapq.heapify(heap)
  merges: List[str] = []
  while len(tokens) < target:
    while heap and (pairs.get(heap[0][1], 0) != -heap[0][0] or heap[0][0] == 0):
      heapq.heappop(heap)
    if not heap:
      raise ValueError(f"corpus too small: only {len(tokens)} of {target} tokens learned")
    best = heap[0][1]
    merges.append(f"{best[0]} {best[1]}")
    new = best[0] + best[1]
    if new not in known:
      known.add(new)
      tokens.append(new)
    changed = set()
    for i in sorted(where.pop(best)):
      w, c = words[i], counts[i]
      for p in zip(w, w[1:]):
        pairs[p] -= c
        changed.add(p)
      out, j = [], 0
      while j < len(w):
        if j + 1 < len(w) and w[j] == best[0] and w[j + 1] == best[1]:
          out.append(new)
          j += 2
        else:
          out.append(w[j])
          j += 1
      words[i] = out
      for p in zip(out, out[1:]):
        pairs[p] += c
        where[p].add(i)
        changed.add(p)
    for p in changed:
      if pairs[p] > 0:
        heapq.heappush(heap, (-pairs[p], p))
      else:
        del pairs[p]
        where.pop(p, None)
  return tokens, merges


@functools.lru_cache(maxsize=4)
def _tiny_spec_cached(vocab_size: int):
  tokens, merges = learn_bpe(TINY_CORPUS, vocab_size, len(TINY_SPECIALS))
  first_special = len(tokens)
  tokens = tokens + list(TINY_SPECIALS)
  types = [TOKEN_NORMAL] * first_special + [TOKEN_CONTROL] * len(TINY_SPECIALS)
  return tuple(tokens), tuple(merges), tuple(types), first_special


def tiny_tokenizer_spec(vocab_size: int | None = None) -> Dict[str, Any]:
  """The tiny built-in model's tokenizer spec: exactly `config.TINY_VOCAB` tokens
  (256 bytes, merges learned from `TINY_CORPUS`, then `<|endoftext|>` (eos,
  bos, padding), `<|im_start|>`, `<|im_end|>`)."""
  if vocab_size is None:
    from kvjax.config import TINY_VOCAB
    vocab_size = TINY_VOCAB
  tokens, merges, types, eos = _tiny_spec_cached(int(vocab_size))
  return {
      "model": "gpt2",
      "pre": "qwen2",
      "tokens": list(tokens),
      "token_type": list(types),
      "merges": list(merges),
      "eos_token_id": eos,
      "bos_token_id": eos,
      "padding_token_id": eos,
  }


def tiny_tokenizer() -> Tokenizer:
  return Tokenizer(tiny_tokenizer_spec())


def from_spec(spec: Mapping[str, Any]) -> Tokenizer:
  """A `Tokenizer` for a spec (e.g. `GGUFModel.tokenizer_spec`); BPE "gpt2" only."""
  model = spec.get("model", "gpt2")
  if model != "gpt2":
    raise ValueError(f"tokenizer.ggml.model {model!r} is not supported (expected 'gpt2' byte-level BPE)")
  return Tokenizer(spec)
