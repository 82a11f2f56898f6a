"""Seeded structural and semantic mutations of a valid GGUF file, and the oracle that judges them.

`Gguf.parse(data)` reads a well-formed file into records (header, key/value records with their
raw payloads, tensor infos, tensor data); `Gguf.to_bytes()` writes them back (offsets recomputed
as the running padded total unless `keep_offsets`), so a mutation edits records, not byte soup.
`mutations(data, seed, n)` yields `Case(cls, what, data, expect)`:

  expect "refuse"  the file is corrupt or impossible: it must be refused (one `GGUFError` line)
  expect "same"    refused, or accepted as the very same model (config, tokenizer, tensors)
  expect "any"     refused, or accepted as some valid model (a changed value that is still
                   valid, a data byte: GGUF has no checksums); every tensor must load finite

`judge(path, case, original)` opens the file the way `kvjax generate` does (config, tokenizer,
every tensor) and returns the outcome: "refused", "accepted_same", "accepted_changed", or a
failure ("FAIL ..."): a traceback, a memory error, a multi-line or unnamed or unescaped message,
an accepted "refuse" case, a changed "same" case.
"""

from __future__ import annotations

import dataclasses
import math
import random
import struct
from typing import Iterator, List, Optional, Tuple

import numpy as np

VT_UINT8, VT_INT8, VT_UINT16, VT_INT16, VT_UINT32, VT_INT32, VT_FLOAT32, VT_BOOL, VT_STRING, VT_ARRAY, \
    VT_UINT64, VT_INT64, VT_FLOAT64 = range(13)
_FMT = {VT_UINT8: "<B", VT_INT8: "<b", VT_UINT16: "<H", VT_INT16: "<h", VT_UINT32: "<I", VT_INT32: "<i",
        VT_FLOAT32: "<f", VT_BOOL: "<B", VT_UINT64: "<Q", VT_INT64: "<q", VT_FLOAT64: "<d"}
_QSIZE = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18)}   # F32 F16 BF16 Q8_0 Q4_0


def _str(b: bytes) -> bytes:
  return struct.pack("<Q", len(b)) + b


def enc(vtype: int, value) -> bytes:
  """The payload of a value (what follows its type id)."""
  if vtype == VT_STRING:
    return _str(value if isinstance(value, bytes) else value.encode())
  if vtype == VT_ARRAY:
    sub, items = value
    out = struct.pack("<IQ", sub, len(items))
    return out + b"".join(enc(sub, x) for x in items)
  return struct.pack(_FMT[vtype], value)


@dataclasses.dataclass
class KV:
  key: bytes
  vtype: int
  payload: bytes


@dataclasses.dataclass
class TInfo:
  name: bytes
  dims: List[int]         # ggml order (innermost first)
  ttype: int
  offset: int


@dataclasses.dataclass
class Gguf:
  version: int
  kvs: List[KV]
  infos: List[TInfo]
  data: List[bytes]       # each tensor's bytes, unpadded
  n_tensors: Optional[int] = None   # header counts (None: the record counts)
  n_kv: Optional[int] = None

  @property
  def alignment(self) -> int:
    for kv in self.kvs:
      if kv.key == b"general.alignment" and kv.vtype == VT_UINT32:
        return struct.unpack("<I", kv.payload)[0]
    return 32

  def copy(self) -> "Gguf":
    return Gguf(self.version, [dataclasses.replace(k) for k in self.kvs],
                [dataclasses.replace(t, dims=list(t.dims)) for t in self.infos], list(self.data),
                self.n_tensors, self.n_kv)

  @staticmethod
  def parse(buf: bytes) -> "Gguf":
    """A well-formed file (no checks: this reads the fuzzer's own seed file)."""
    pos = 4
    version, n_t, n_kv = struct.unpack_from("<IQQ", buf, pos)
    pos += 20

    def skip(vtype, pos):
      if vtype == VT_STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
      if vtype == VT_ARRAY:
        sub, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if sub in (VT_STRING, VT_ARRAY):
          for _ in range(n):
            pos = skip(sub, pos)
          return pos
        return pos + n * struct.calcsize(_FMT[sub])
      return pos + struct.calcsize(_FMT[vtype])

    kvs = []
    for _ in range(n_kv):
      klen = struct.unpack_from("<Q", buf, pos)[0]
      key = bytes(buf[pos + 8:pos + 8 + klen])
      pos += 8 + klen
      vtype = struct.unpack_from("<I", buf, pos)[0]
      pos += 4
      end = skip(vtype, pos)
      kvs.append(KV(key, vtype, bytes(buf[pos:end])))
      pos = end
    infos = []
    for _ in range(n_t):
      nlen = struct.unpack_from("<Q", buf, pos)[0]
      name = bytes(buf[pos + 8:pos + 8 + nlen])
      pos += 8 + nlen
      nd = struct.unpack_from("<I", buf, pos)[0]
      dims = list(struct.unpack_from(f"<{nd}Q", buf, pos + 4))
      pos += 4 + 8 * nd
      ttype, off = struct.unpack_from("<IQ", buf, pos)
      pos += 12
      infos.append(TInfo(name, dims, ttype, off))
    g = Gguf(version, kvs, infos, [])
    a = g.alignment
    start = (pos + a - 1) // a * a
    for t in infos:
      block, size = _QSIZE[t.ttype]
      n = math.prod(t.dims) // block * size
      g.data.append(bytes(buf[start + t.offset:start + t.offset + n]))
    return g

  def to_bytes(self, keep_offsets: bool = False) -> bytes:
    a = self.alignment if 1 <= self.alignment <= 4096 else 32   # laid out sanely even for a bad value
    out = bytearray(b"GGUF")
    out += struct.pack("<IQQ", self.version, len(self.infos) if self.n_tensors is None else self.n_tensors,
                       len(self.kvs) if self.n_kv is None else self.n_kv)
    for kv in self.kvs:
      out += _str(kv.key) + struct.pack("<I", kv.vtype) + kv.payload
    total, offsets = 0, []
    for t, d in zip(self.infos, self.data):
      offsets.append(t.offset if keep_offsets else total)
      total += (len(d) + a - 1) // a * a
    for t, off in zip(self.infos, offsets):
      out += _str(t.name) + struct.pack("<I", len(t.dims)) + struct.pack(f"<{len(t.dims)}Q", *t.dims)
      out += struct.pack("<IQ", t.ttype, off)
    out += b"\0" * (-len(out) % a)
    for d in self.data:
      out += d + b"\0" * (-len(d) % a)
    return bytes(out)

  def index(self, key: bytes) -> int:
    return next(i for i, kv in enumerate(self.kvs) if kv.key == key)


@dataclasses.dataclass
class Case:
  cls: str        # the mutation class (counted by the script)
  what: str       # this instance
  data: bytes
  expect: str     # "refuse", "same", "any"


# ---- the mutation classes ---------------------------------------------------------------

ARCH = b"qwen35."
INT_KEYS = [ARCH + k for k in (b"block_count", b"context_length", b"embedding_length", b"feed_forward_length",
                               b"attention.head_count", b"attention.head_count_kv", b"attention.key_length",
                               b"attention.value_length", b"rope.dimension_count", b"ssm.conv_kernel",
                               b"ssm.state_size", b"ssm.group_count", b"ssm.time_step_rank", b"ssm.inner_size",
                               b"full_attention_interval", b"nextn_predict_layers")]
FLOAT_KEYS = [ARCH + b"attention.layer_norm_rms_epsilon", ARCH + b"rope.freq_base"]
ESCAPES = "\x1b]0;owned\x07\x1b[2J\r\n\u202e"

# (vtype, value, label) replacements; each refused for an integer key
_BAD_INTS = [(VT_UINT32, 0, "0"), (VT_INT32, -1, "-1"), (VT_INT64, -(2**40), "-2^40"), (VT_UINT64, 2**63, "2^63"),
             (VT_UINT64, 2**31, "2^31"), (VT_FLOAT32, float("inf"), "float inf"),
             (VT_FLOAT32, float("nan"), "float nan"), (VT_FLOAT32, 2.0, "float 2.0"),
             (VT_STRING, "abc", "string"), (VT_BOOL, 1, "bool"),
             (VT_ARRAY, (VT_STRING, ["a", "b"]), "string array")]
_BAD_FLOATS = [(VT_FLOAT32, float("nan"), "nan"), (VT_FLOAT32, float("inf"), "inf"),
               (VT_FLOAT32, float("-inf"), "-inf"), (VT_FLOAT32, 0.0, "0"), (VT_FLOAT32, -1e-6, "negative"),
               (VT_FLOAT64, float("nan"), "f64 nan"), (VT_STRING, "1e-6", "string"),
               (VT_ARRAY, (VT_FLOAT32, [1.0, 2.0]), "float array")]


def _set(g: Gguf, key: bytes, vtype: int, value) -> Gguf:
  g = g.copy()
  kv = KV(key, vtype, enc(vtype, value))
  try:
    g.kvs[g.index(key)] = kv
  except StopIteration:
    g.kvs.append(kv)
  return g


def _drop_key(g: Gguf, key: bytes) -> Gguf:
  g = g.copy()
  del g.kvs[g.index(key)]
  return g


def _semantic(g: Gguf, rng: random.Random) -> Tuple[str, str, Gguf, str]:
  """A key given a value of the wrong kind, non-finite, out of range, or impossible."""
  pick = rng.randrange(9)
  if pick <= 2:
    key = rng.choice(INT_KEYS)
    vt, v, label = rng.choice(_BAD_INTS)
    if key.endswith(b"nextn_predict_layers") and label == "0":
      return "meta_int", f"{key.decode()} = 0", _set(g, key, vt, v), "any"
    return "meta_int", f"{key.decode()} = {label}", _set(g, key, vt, v), "refuse"
  if pick == 3:
    key = rng.choice(FLOAT_KEYS)
    vt, v, label = rng.choice(_BAD_FLOATS)
    return "meta_float", f"{key.decode()} = {label}", _set(g, key, vt, v), "refuse"
  if pick == 4:
    key, (vt, v, label) = rng.choice([
        (ARCH + b"rope.dimension_sections", (VT_UINT32, 11, "scalar")),
        (ARCH + b"rope.dimension_sections", (VT_STRING, "11,11,10,0", "string")),
        (ARCH + b"rope.dimension_sections", (VT_ARRAY, (VT_INT32, [11, -1, 10, 0]), "negative entry")),
        (ARCH + b"rope.dimension_sections", (VT_ARRAY, (VT_FLOAT32, [11.0, 11.0]), "float array")),
        (b"tokenizer.ggml.tokens", (VT_UINT32, 5, "scalar")),
        (b"tokenizer.ggml.tokens", (VT_ARRAY, (VT_INT32, [1, 2, 3]), "int array")),
        (b"tokenizer.ggml.tokens", (VT_ARRAY, (VT_STRING, ["a", "b"]), "2 tokens (bytes missing)")),
        (b"tokenizer.ggml.merges", (VT_UINT32, 5, "scalar")),
        (b"tokenizer.ggml.merges", (VT_ARRAY, (VT_INT32, [1, 2]), "int array")),
        (b"tokenizer.ggml.merges", (VT_ARRAY, (VT_STRING, ["nospace"]), "merge without a space")),
        (b"tokenizer.ggml.token_type", (VT_ARRAY, (VT_INT32, [1, 1]), "2 entries")),
        (b"tokenizer.ggml.token_type", (VT_STRING, "1", "string")),
        (b"tokenizer.ggml.bos_token_id", (VT_FLOAT32, float("inf"), "inf")),
        (b"tokenizer.ggml.eos_token_id", (VT_UINT32, 10**6, "1e6")),
        (b"tokenizer.ggml.eos_token_id", (VT_INT32, -1, "-1")),
        (b"tokenizer.ggml.model", (VT_STRING, "llama", "spm")),
        (b"tokenizer.ggml.model", (VT_UINT32, 1, "int")),
        (b"general.architecture", (VT_STRING, "qwen35" + ESCAPES, "escapes")),
        (b"general.architecture", (VT_UINT32, 35, "int")),
        (ARCH + b"attention.recurrent_layers", (VT_ARRAY, (VT_UINT32, [7] * 9), "non-bool")),
        (ARCH + b"attention.recurrent_layers", (VT_ARRAY, (VT_BOOL, [1] * 9), "no attention layer")),
    ])
    return "meta_other", f"{key.decode()} = {label}", _set(g, key, vt, v), "refuse"
  if pick == 5:
    vt, v, label = rng.choice([(VT_UINT32, 0, "0"), (VT_UINT32, 3, "3"), (VT_INT32, -1, "-1"),
                               (VT_INT32, -32, "-32"), (VT_UINT64, 2**40, "2^40 u64"),
                               (VT_STRING, "32", "string"), (VT_UINT32, 2**31 + 1, "2^31+1")])
    return "alignment", f"general.alignment = {label}", _set(g, b"general.alignment", vt, v), "refuse"
  if pick == 6:   # impossible geometry with well-typed values
    key, v = rng.choice([(ARCH + b"rope.dimension_count", 3), (ARCH + b"rope.dimension_count", 1024),
                         (ARCH + b"block_count", 2**31 - 1), (ARCH + b"block_count", 100),
                         (ARCH + b"attention.head_count", 5), (ARCH + b"attention.head_count_kv", 4),
                         (ARCH + b"ssm.inner_size", 100), (ARCH + b"embedding_length", 65),
                         (ARCH + b"nextn_predict_layers", 2), (ARCH + b"full_attention_interval", 3),
                         (ARCH + b"attention.key_length", 32)])
    return "meta_geometry", f"{key.decode()} = {v}", _set(g, key, VT_UINT32, v), "refuse"
  if pick == 7:
    keys = [kv.key for kv in g.kvs if kv.key.startswith(ARCH) and kv.key != ARCH + b"nextn_predict_layers"]
    key = rng.choice(keys + [b"general.architecture"])
    return "meta_missing", f"{key.decode()} removed", _drop_key(g, key), "refuse"
  # the alignment changed and the file laid out for it: the same model
  a = rng.choice([1, 8, 16, 64, 256])
  return "alignment_ok", f"general.alignment = {a} (laid out for it)", _set(g, b"general.alignment", VT_UINT32, a), "same"


def _structural(g: Gguf, rng: random.Random) -> Tuple[str, str, Gguf, str, bool]:
  """Broken records: duplicates, bad offsets, type ids, dims, counts. -> (..., keep_offsets)."""
  pick = rng.randrange(10)
  g = g.copy()
  i = rng.randrange(len(g.infos))
  t = g.infos[i]
  if pick == 0:
    kv = g.kvs[rng.randrange(len(g.kvs))]
    if rng.random() < 0.5:
      g.kvs.append(dataclasses.replace(kv))
      return "duplicate", f"key {kv.key.decode()} twice (same value)", g, "refuse", False
    g.kvs.insert(0, KV(ARCH + b"context_length", VT_UINT32, enc(VT_UINT32, 4096)))
    return "duplicate", "context_length twice (4096 first)", g, "refuse", False
  if pick == 1:
    j = rng.randrange(len(g.infos))
    g.infos.append(dataclasses.replace(g.infos[j], dims=list(g.infos[j].dims)))
    g.data.append(g.data[j])
    return "duplicate", f"tensor {g.infos[j].name.decode()} twice", g, "refuse", False
  if pick == 2:
    new = rng.choice([1, 30, 8, 2, 99, 16, 26, 41])   # F16 BF16 Q8_0 Q4_0, unknown, IQ2_XXS, I32?, unknown
    old = t.ttype
    t.ttype = new
    return "type_id", f"tensor {t.name.decode()} type {old} -> {new}", g, "refuse", rng.random() < 0.5
  if pick == 3:   # offsets: keep the records, break one offset
    ok = Gguf.parse(g.to_bytes())
    g = ok.copy()
    t = g.infos[i]
    how = rng.choice(["+1", "+alignment", "-alignment", "swap", "overlap", "past end", "2^63"])
    if how == "+1":
      t.offset += 1
    elif how == "+alignment":
      t.offset += g.alignment
    elif how == "-alignment":
      t.offset = max(0, t.offset - g.alignment) if t.offset else g.alignment
    elif how == "swap":
      j = (i + 1) % len(g.infos)
      t.offset, g.infos[j].offset = g.infos[j].offset, t.offset
      if t.offset == g.infos[j].offset:
        t.offset += 32
    elif how == "overlap":
      t.offset = g.infos[i - 1].offset if i else 32
    elif how == "past end":
      t.offset = 1 << 32
    else:
      t.offset = 2**63
    return "offset", f"tensor {t.name.decode()} offset {how}", g, "refuse", True
  if pick == 4:
    how = rng.choice(["0 dims", "5 dims", "dim 0", "dim 2^62", "dim + 32", "dims swapped"])
    if how == "0 dims":
      t.dims = []
    elif how == "5 dims":
      t.dims = t.dims + [1] * (5 - len(t.dims))
    elif how == "dim 0":
      t.dims[0] = 0
    elif how == "dim 2^62":
      t.dims[-1] = 2**62
    elif how == "dim + 32":
      t.dims[0] += 32
    else:
      if len(t.dims) < 2 or t.dims[0] == t.dims[1]:
        t.dims = t.dims + [2]
      else:
        t.dims = t.dims[::-1]
    return "dims", f"tensor {t.name.decode()} {how}", g, "refuse", False
  if pick == 5:
    how = rng.choice(["n_kv 2^63", "n_tensors 2^63", "n_kv + 1", "n_tensors - 1", "n_tensors + 1", "n_kv - 1"])
    if how == "n_kv 2^63":
      g.n_kv = 2**63
    elif how == "n_tensors 2^63":
      g.n_tensors = 2**63
    elif how == "n_kv + 1":
      g.n_kv = len(g.kvs) + 1
    elif how == "n_kv - 1":
      g.n_kv = len(g.kvs) - 1
    elif how == "n_tensors - 1":
      g.n_tensors = len(g.infos) - 1
    else:
      g.n_tensors = len(g.infos) + 1
    return "counts", how, g, "refuse", False
  if pick == 6:
    how = rng.choice(["key length 2^63", "array count 2^63", "string array count 2^62", "value type 13",
                      "value type 2^31", "array of type 99", "nested arrays", "bool byte 7"])
    if how == "key length 2^63":
      return "lengths", how, _raw_kv(g, struct.pack("<Q", 2**63) + b"k"), "refuse", False
    if how == "array count 2^63":
      return "lengths", how, _raw_kv(g, _str(b"x.arr") + struct.pack("<IIQ", VT_ARRAY, VT_UINT32, 2**63)), \
          "refuse", False
    if how == "string array count 2^62":
      return "lengths", how, _raw_kv(g, _str(b"x.arr") + struct.pack("<IIQ", VT_ARRAY, VT_STRING, 2**62)), \
          "refuse", False
    if how == "value type 13":
      return "lengths", how, _raw_kv(g, _str(b"x.v") + struct.pack("<I", 13) + b"\0" * 8), "refuse", False
    if how == "value type 2^31":
      return "lengths", how, _raw_kv(g, _str(b"x.v") + struct.pack("<I", 2**31) + b"\0" * 8), "refuse", False
    if how == "array of type 99":
      return "lengths", how, _raw_kv(g, _str(b"x.arr") + struct.pack("<IIQ", VT_ARRAY, 99, 1) + b"\0" * 8), \
          "refuse", False
    if how == "nested arrays":
      inner = struct.pack("<IQ", VT_ARRAY, 1) * 4 + struct.pack("<IQ", VT_UINT8, 0)
      return "lengths", how, _raw_kv(g, _str(b"x.arr") + struct.pack("<I", VT_ARRAY) + inner), "refuse", False
    return "lengths", how, _raw_kv(g, _str(b"x.b") + struct.pack("<I", VT_BOOL) + b"\x07"), "refuse", False
  if pick == 7:
    how = rng.choice(["renamed", "escape name", "non-UTF-8 name", "empty name", "64-byte name", "extra tensor",
                      "removed"])
    if how == "renamed":
      t.name = t.name + b"_x"
    elif how == "escape name":
      t.name = (t.name.decode() + ESCAPES).encode()
    elif how == "non-UTF-8 name":
      t.name = t.name[:3] + b"\xff\xfe" + t.name[3:]
    elif how == "empty name":
      t.name = b""
    elif how == "64-byte name":
      t.name = b"blk.0." + b"a" * 58
    elif how == "extra tensor":
      g.infos.append(TInfo(b"blk.0.extra.weight", [32], 0, 0))
      g.data.append(b"\0" * 128)
    else:
      del g.infos[i]
      del g.data[i]
    return "names", f"tensor {how}", g, "refuse", False
  if pick == 8:
    how = rng.choice(["version 1", "version 4", "version 2^31", "magic GGML", "escape key duplicated"])
    if how.startswith("version"):
      g.version = {"version 1": 1, "version 4": 4, "version 2^31": 2**31}[how]
    elif how == "magic GGML":
      return "header", how, g, "refuse", False      # patched below in `mutations`
    else:
      kv = KV(("x." + ESCAPES).encode(), VT_UINT32, enc(VT_UINT32, 1))
      g.kvs += [kv, dataclasses.replace(kv)]
    return "header", how, g, "refuse", False
  # non-finite tensor data written as valid records
  arr = np.frombuffer(g.data[i], np.uint8).copy()
  if t.ttype == 0 and len(arr) >= 4:
    k = rng.randrange(len(arr) // 4) * 4
    arr[k:k + 4] = np.frombuffer(np.float32(rng.choice([np.nan, np.inf, -np.inf])).tobytes(), np.uint8)
  g.data[i] = arr.tobytes()
  return "nonfinite", f"tensor {t.name.decode()}: a NaN / inf value", g, "refuse", False


def _raw_kv(g: Gguf, record: bytes) -> Gguf:
  """Append a raw (possibly malformed) key/value record: key, type id and payload bytes."""
  g = g.copy()
  klen = struct.unpack_from("<Q", record)[0]
  if klen > len(record):
    g.kvs.append(KV(b"", 0, b""))
    g._raw_tail = record  # type: ignore[attr-defined]
    return g
  key = record[8:8 + klen]
  g.kvs.append(KV(key, struct.unpack_from("<I", record, 8 + klen)[0], record[12 + klen:]))
  return g


def _bytes_of(g: Gguf, keep_offsets: bool) -> bytes:
  raw = getattr(g, "_raw_tail", None)
  if raw is None:
    return g.to_bytes(keep_offsets)
  # a record whose key length is impossible: write it in place of the last record
  h = g.copy()
  h.kvs = g.kvs[:-1]
  h.n_kv = len(g.kvs)
  out = h.to_bytes(keep_offsets)
  head = 24 + sum(8 + len(kv.key) + 4 + len(kv.payload) for kv in h.kvs)
  return out[:head] + raw + out[head:]


def _region_flip(data: bytes, g: Gguf, rng: random.Random) -> Tuple[str, str, bytes, str]:
  """A random bit flip in one region: header fields, metadata, tensor infos, tensor data; or a
  truncation; or bytes appended."""
  kv_end = 24 + sum(8 + len(kv.key) + 4 + len(kv.payload) for kv in g.kvs)
  info_end = kv_end + sum(8 + len(t.name) + 4 + 8 * len(t.dims) + 12 for t in g.infos)
  a = g.alignment
  data_start = (info_end + a - 1) // a * a
  region = rng.choice(["header", "metadata", "tensor_infos", "data", "truncate", "append"])
  b = bytearray(data)
  if region == "truncate":
    n = rng.randrange(len(data))
    return "truncate", f"cut at {n} of {len(data)}", bytes(b[:n]), "refuse"
  if region == "append":
    n = rng.choice([1, 31, 32, 4096])
    return "truncate", f"{n} bytes appended", bytes(b) + bytes(rng.randrange(256) for _ in range(n)), "refuse"
  lo, hi = {"header": (0, 24), "metadata": (24, kv_end), "tensor_infos": (kv_end, info_end),
            "data": (data_start, len(data))}[region]
  pos = rng.randrange(lo, hi)
  bit = rng.randrange(8)
  b[pos] ^= 1 << bit
  # a flip in a header count, a name or a record length breaks the structure; in metadata values and
  # tensor data it may give another valid file (GGUF has no checksums): judged for validity then
  expect = {"header": "same", "metadata": "any", "tensor_infos": "refuse", "data": "any"}[region]
  return f"flip_{region}", f"bit {bit} of byte {pos}", bytes(b), expect


def mutations(data: bytes, seed: int, n: int) -> Iterator[Case]:
  """`n` seeded cases from the valid file `data` (the same cases for the same seed)."""
  base = Gguf.parse(data)
  rng = random.Random(seed)
  for _ in range(n):
    kind = rng.random()
    if kind < 0.35:
      cls, what, out, expect = _region_flip(data, base, rng)
      yield Case(cls, what, out, expect)
    elif kind < 0.65:
      cls, what, g, expect = _semantic(base, rng)
      yield Case(cls, what, g.to_bytes(), expect)
    else:
      cls, what, g, expect, keep = _structural(base, rng)
      out = _bytes_of(g, keep)
      if what == "magic GGML":
        out = b"GGML" + out[4:]
      yield Case(cls, what, out, expect)


# ---- the oracle -------------------------------------------------------------------------

def load_like_generate(path: str):
  """What `kvjax generate --model PATH` reads from a file: config, tokenizer, every tensor."""
  from kvjax import tiny
  cfg, it, tok = tiny.load_model_source(path)
  tensors = {name: a for name, a in it}
  return cfg, tok, tensors


def _same(loaded, original) -> bool:
  cfg, tok, tensors = loaded
  ocfg, otok, otensors = original
  if cfg != ocfg or (tok is None) != (otok is None) or set(tensors) != set(otensors):
    return False
  if tok is not None and (tok.tokens != otok.tokens or tok.ranks != otok.ranks or tok.eos_id != otok.eos_id
                          or tok.token_type != otok.token_type or tok.bos_id != otok.bos_id):
    return False
  return all(np.array_equal(tensors[k], otensors[k]) for k in tensors)


def judge(path: str, case: Case, original) -> str:
  """The outcome of one case (see the module docstring)."""
  from kvjax.gguf_io import GGUFError
  try:
    loaded = load_like_generate(path)
  except GGUFError as e:
    msg = str(e)
    if "\n" in msg or "\r" in msg:
      return "FAIL multi-line message"
    if not msg.startswith(path + ": "):
      return "FAIL message does not name the file"
    if any(ord(c) < 32 or 0x7f <= ord(c) < 0xa0 or c == "\u202e" for c in msg):
      return "FAIL unescaped control character"
    return "refused"
  except MemoryError:
    return "FAIL MemoryError"
  except RecursionError:
    return "FAIL RecursionError"
  except Exception as e:  # noqa: BLE001  (the point: no other exception may escape)
    return f"FAIL traceback {type(e).__name__}: {str(e)[:80]}"
  if case.expect == "refuse":
    return "FAIL accepted"
  same = _same(loaded, original)
  if case.expect == "same" and not same:
    return "FAIL accepted as a different model"
  return "accepted_same" if same else "accepted_changed"
