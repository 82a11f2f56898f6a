"""GGUF metadata: what each key must hold, and the `ModelConfig` of a `qwen35` file.

`check_metadata` refuses a key whose value is of the wrong kind (scalar vs array, integer vs
float vs string), not finite or out of range (`METADATA_SCHEMA`); `config_from_metadata` builds
and checks the geometry. Every refusal is a `GGUFError`: one line naming the file, the key,
what was expected and what was found, escaped (`kvjax.text.one_line`). `kvjax.gguf_io` reads the
file and calls these.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Mapping, Optional, Tuple

import numpy as np

from kvjax.config import ARCH, ModelConfig
from kvjax.text import one_line, quote

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFError(ValueError):
  """A GGUF file kvjax cannot use (one-line message: file, what, expected vs found; everything
  read from the file escaped by `kvjax.text.one_line`)."""

  def __init__(self, path, what: str):
    super().__init__(one_line(f"{os.fspath(path)}: {what}"))


# ---- metadata: what each key must hold ---------------------------------------------

def _k(name: str) -> str:
  return f"{ARCH}.{name}"


MAX_DIM = 2**31 - 1    # sizes, counts and lengths: int32 in the compiled model


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_num(v) -> bool:
  return _is_int(v) or isinstance(v, (float, np.floating))


def _kind(v) -> str:
  """How a value read from a file looks, for 'found ...' (escaped, short)."""
  if isinstance(v, list):
    kinds = sorted({_kind(x).split(" ")[0] for x in v})
    return f"an array of {len(v)} {'/'.join(kinds) or 'values'}"
  if isinstance(v, bool):
    return f"bool {v}"
  if _is_int(v):
    return f"integer {v}"
  if isinstance(v, float):
    return f"float {v}"
  if isinstance(v, str):
    return f"string {quote(v)}"
  return quote(v)


# key -> (kind, low, high): "int" (any integer type), "float" (finite number), "str", "ints" /
# "int|ints" (an integer array / a scalar or a per-layer array), "bools", "strs"
_MODEL_KEYS = {
    "block_count": ("int", 1, MAX_DIM), "context_length": ("int", 1, MAX_DIM),
    "embedding_length": ("int", 1, MAX_DIM), "feed_forward_length": ("int", 1, MAX_DIM),
    "attention.head_count": ("int|ints", 0, MAX_DIM), "attention.head_count_kv": ("int|ints", 0, MAX_DIM),
    "attention.key_length": ("int", 1, MAX_DIM), "attention.value_length": ("int", 1, MAX_DIM),
    "attention.layer_norm_rms_epsilon": ("float", 0.0, 1.0),
    "rope.dimension_count": ("int", 2, MAX_DIM), "rope.freq_base": ("float", 0.0, float("inf")),
    "rope.dimension_sections": ("ints", 0, MAX_DIM),
    "ssm.conv_kernel": ("int", 1, MAX_DIM), "ssm.state_size": ("int", 1, MAX_DIM),
    "ssm.group_count": ("int", 1, MAX_DIM), "ssm.time_step_rank": ("int", 1, MAX_DIM),
    "ssm.inner_size": ("int", 1, MAX_DIM), "full_attention_interval": ("int", 1, MAX_DIM),
    "nextn_predict_layers": ("int", 0, MAX_DIM), "attention.recurrent_layers": ("bools", 0, 1),
}
METADATA_SCHEMA = {
    "general.architecture": ("str", None, None), "general.alignment": ("int", 1, 2**31),
    **{_k(k): v for k, v in _MODEL_KEYS.items()},
    "tokenizer.ggml.model": ("str", None, None), "tokenizer.ggml.pre": ("str", None, None),
    "tokenizer.ggml.tokens": ("strs", None, None), "tokenizer.ggml.merges": ("strs", None, None),
    "tokenizer.ggml.token_type": ("ints", -2**31, MAX_DIM),
    "tokenizer.ggml.bos_token_id": ("int", 0, MAX_DIM), "tokenizer.ggml.eos_token_id": ("int", 0, MAX_DIM),
    "tokenizer.ggml.padding_token_id": ("int", 0, MAX_DIM),
}
_BOUND_WORD = {"int": "an integer", "float": "a finite number", "str": "a string",
               "ints": "an array of integers", "int|ints": "an integer or an array of integers",
               "bools": "an array of bools", "strs": "an array of strings"}


def _range_text(lo, hi, kind) -> str:
  if kind == "float":
    return f" > {lo}" + (f" and < {hi}" if hi != float("inf") else "")
  if lo is None:
    return ""
  return f" in [{lo}, {hi}]" if hi != MAX_DIM else f" >= {lo}"


def check_metadata(path, md: Mapping[str, Any], schema: Mapping[str, Tuple] = METADATA_SCHEMA) -> None:
  """Every key of `schema` present in `md` holds the kind of value it must, finite and in range
  (refused with a `GGUFError` naming the key, what it expects and what it found)."""
  for key, (kind, lo, hi) in schema.items():
    if key not in md:
      continue
    v = md[key]
    want = _BOUND_WORD[kind] + ("" if kind in ("str", "strs", "bools") else _range_text(lo, hi, kind))
    fail = lambda found=None: GGUFError(path, f"metadata {key}: expected {want}, found {found or _kind(v)}")
    if kind == "str":
      if not isinstance(v, str):
        raise fail()
    elif kind == "strs":
      if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise fail()
    elif kind == "bools":
      if not isinstance(v, list) or not all(isinstance(x, bool) or (_is_int(x) and x in (0, 1)) for x in v):
        raise fail()
    elif kind == "float":
      if not _is_num(v):
        raise fail()
      if not (math.isfinite(v) and lo < v < hi):
        raise fail(f"{v}")
    else:
      vals = v if isinstance(v, list) else [v]
      if (isinstance(v, list) and kind == "int") or (not isinstance(v, list) and kind == "ints"):
        raise fail()
      if isinstance(v, list) and not v:
        raise fail("an empty array")
      for i, x in enumerate(vals):
        where = f" (entry {i})" if isinstance(v, list) else ""
        if not _is_int(x):
          raise fail(_kind(x) + where)
        if not lo <= x <= hi:
          raise fail(f"{x}{where}")


def _uniform(path, key, v):
  """Scalar, or a per-layer array whose nonzero entries agree -> that scalar."""
  if isinstance(v, list):
    vals = sorted({int(x) for x in v if int(x) != 0})
    if len(vals) != 1:
      raise GGUFError(path, f"metadata {key}: expected one value for all layers, found {vals[:8]}")
    return vals[0]
  return v


def _f32_decimal(v) -> float:
  """A float32 metadata value -> the shortest decimal that rounds to it
  (1e-6 stored as float32 reads back as 1e-06, not 9.99999997e-07)."""
  return float(str(np.float32(v)))


def _block_index(name: str) -> Optional[int]:
  m = _BLK.match(name)
  return int(m.group(1)) if m else None


def config_from_metadata(path, md: Mapping[str, Any], tensor_shapes: Mapping[str, Tuple[int, ...]]) -> ModelConfig:
  """Build (and check) the `ModelConfig` of a `qwen35` GGUF."""
  check_metadata(path, md)
  arch = md.get("general.architecture")
  if arch != ARCH:
    raise GGUFError(path, f"general.architecture: expected {ARCH!r}, found {quote(arch)}")

  def req(name):
    key = _k(name)
    if key not in md:
      raise GGUFError(path, f"missing metadata key {key}")
    return md[key]

  def opt(name, default):
    return md.get(_k(name), default)

  nextn = int(opt("nextn_predict_layers", 0))
  if nextn > 1:
    raise GGUFError(path, f"multi-layer MTP is not supported: {_k('nextn_predict_layers')} "
                    f"expected 0 or 1, found {nextn}")
  block_count = int(req("block_count"))
  blocks_in_file = 1 + max((b for n in tensor_shapes if (b := _block_index(n)) is not None), default=-1)
  if block_count > blocks_in_file:
    raise GGUFError(path, f"metadata {_k('block_count')}: expected at most {blocks_in_file} (the blocks the "
                    f"file has tensors for), found {block_count}")
  num_layers = block_count - nextn
  hq = int(_uniform(path, _k("attention.head_count"), req("attention.head_count")))
  hkv = int(_uniform(path, _k("attention.head_count_kv"), req("attention.head_count_kv")))
  kl, vl = int(req("attention.key_length")), int(req("attention.value_length"))
  conv, state = int(req("ssm.conv_kernel")), int(req("ssm.state_size"))
  groups, rank = int(req("ssm.group_count")), int(req("ssm.time_step_rank"))
  inner = int(req("ssm.inner_size"))
  if hkv <= 0 or hq % hkv:
    raise GGUFError(path, f"inconsistent heads: {_k('attention.head_count')}={hq} is not a "
                    f"multiple of {_k('attention.head_count_kv')}={hkv}")
  if kl != vl:
    raise GGUFError(path, f"inconsistent heads: {_k('attention.key_length')}={kl} must equal "
                    f"{_k('attention.value_length')}={vl}")
  if inner != rank * state:
    raise GGUFError(path, f"inconsistent heads: {_k('ssm.inner_size')} expected "
                    f"time_step_rank*state_size = {rank}*{state} = {rank * state}, found {inner}")
  if groups <= 0 or rank % groups:
    raise GGUFError(path, f"inconsistent heads: {_k('ssm.time_step_rank')}={rank} is not a "
                    f"multiple of {_k('ssm.group_count')}={groups}")
  if num_layers < 1:
    raise GGUFError(path, f"{_k('block_count')}={block_count} leaves no target layers "
                    f"(nextn_predict_layers={nextn})")

  interval = opt("full_attention_interval", None)
  rec_key = _k("attention.recurrent_layers")
  rec = md.get(rec_key)
  if interval is None and rec is None:
    raise GGUFError(path, f"missing metadata key {_k('full_attention_interval')} "
                    f"(or {rec_key})")
  if rec is not None:
    rec = [bool(x) for x in rec]
    if len(rec) < num_layers:
      raise GGUFError(path, f"{rec_key}: expected >= {num_layers} entries, found {len(rec)}")
    if interval is None:
      if all(rec[:num_layers]):
        raise GGUFError(path, f"{rec_key}: no full-attention layer among {num_layers}")
      interval = rec.index(False) + 1
    want = [(i + 1) % int(interval) != 0 for i in range(num_layers)]
    if rec[:num_layers] != want:
      bad = next(i for i in range(num_layers) if rec[i] != want[i])
      raise GGUFError(path, f"{rec_key}: layer {bad} expected recurrent={want[bad]} for "
                      f"full_attention_interval {interval}, found {rec[bad]}")
  sections = tuple(int(s) for s in req("rope.dimension_sections"))

  if "token_embd.weight" not in tensor_shapes:
    raise GGUFError(path, "missing tensor token_embd.weight")
  vocab = int(tensor_shapes["token_embd.weight"][0])
  tokens = md.get("tokenizer.ggml.tokens")
  if tokens is not None and len(tokens) > vocab:
    raise GGUFError(path, f"tokenizer.ggml.tokens: expected <= {vocab} tokens (token_embd rows), "
                    f"found {len(tokens)}")
  try:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=int(req("embedding_length")),
        intermediate_size=int(req("feed_forward_length")),
        num_layers=num_layers,
        num_attention_heads=hq, num_kv_heads=hkv, head_dim=kl,
        rope_dim=int(req("rope.dimension_count")),
        rope_theta=_f32_decimal(req("rope.freq_base")),
        linear_num_key_heads=groups, linear_num_value_heads=rank,
        linear_head_dim=state, conv_kernel=conv,
        full_attention_interval=int(interval),
        rms_eps=_f32_decimal(req("attention.layer_norm_rms_epsilon")),
        context_length=int(req("context_length")),
        mtp_layers=nextn,
        tie_embeddings="output.weight" not in tensor_shapes,
        rope_sections=sections)
  except ValueError as e:
    raise GGUFError(path, str(e)) from None
