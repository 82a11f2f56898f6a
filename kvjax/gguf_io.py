"""GGUF reader (metadata -> `ModelConfig`, tensors one at a time) and writer.

Reading parses the GGUF header itself (so every refusal can name the file and
the tensor) and memory-maps the file; `load_tensor` / `iter_tensors`
dequantize one tensor at a time, so a 27B file is never held as more than one
float32 tensor. Writing uses `gguf.GGUFWriter` in llama.cpp's `qwen35`
conventions.

    model = read_gguf("model.gguf")       # validates everything at open time
    cfg = model.config                     # kvjax.config.ModelConfig
    for name, w in model.iter_tensors():   # numpy [out, in] (GGUF order reversed)
      ...
    write_gguf(path, cfg, tensors, tokenizer_spec, weight_type="q8_0")

Every refusal raises `GGUFError` (a `ValueError`) with a one-line message
naming the file, the tensor or key, and what was expected vs found; what each
metadata key must hold, and the config built from them, are in `kvjax.gguf_meta`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from kvjax import config as config_lib
from kvjax import tokenizer as tok_lib
from kvjax.config import ARCH, ModelConfig
from kvjax.gguf_meta import (_BLK, METADATA_SCHEMA, GGUFError, _is_int, _k, check_metadata,  # noqa: F401
                             config_from_metadata)
from kvjax.qweights import QuantizedWeight
from kvjax.text import quote

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

WEIGHT_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0}


# ---- low-level header parsing ----------------------------------------------

_SCALAR = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h",
    VT.UINT32: "<I", VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<B",
    VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d",
}
_NP_SCALAR = {
    VT.UINT8: "<u1", VT.INT8: "<i1", VT.UINT16: "<u2", VT.INT16: "<i2",
    VT.UINT32: "<u4", VT.INT32: "<i4", VT.FLOAT32: "<f4", VT.BOOL: "u1",
    VT.UINT64: "<u8", VT.INT64: "<i8", VT.FLOAT64: "<f8",
}
# the fewest bytes one value of a type takes (a string: its 8-byte length; an array: type + count)
_MIN_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALAR.items()}, VT.STRING: 8, VT.ARRAY: 12}
MAX_ARRAY_DEPTH = 2
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64    # ggml's name buffer, NUL included: names of at most 63 bytes


class _Truncated(Exception):
  pass


class _Bad(Exception):
  """A malformed value met while parsing (turned into a `GGUFError` naming the key or tensor)."""


def _vtype(raw: int, what: str):
  try:
    return VT(raw)
  except ValueError:
    raise _Bad(f"{what}: expected a GGUF value type 0-{max(VT)}, found unknown type id {raw}") from None


class _Cursor:
  """Little-endian reads from a bytes-like buffer; `_Truncated` past the end."""

  def __init__(self, buf):
    self.buf, self.pos = buf, 0

  @property
  def left(self) -> int:
    return len(self.buf) - self.pos

  def take(self, n: int):
    if n < 0 or n > self.left:
      raise _Truncated(f"need {n} bytes at offset {self.pos}, file has {len(self.buf)}")
    out = self.buf[self.pos:self.pos + n]
    self.pos += n
    return out

  def scalar(self, vtype):
    fmt = _SCALAR[vtype]
    v = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
    if vtype == VT.BOOL:
      if v > 1:
        raise _Bad(f"expected a bool (0 or 1), found byte {v}")
      return bool(v)
    return v

  def raw_string(self) -> bytes:
    return bytes(self.take(self.scalar(VT.UINT64)))

  def string(self) -> str:
    return self.raw_string().decode("utf-8", errors="surrogateescape")

  def count(self, vtype, what: str) -> int:
    """An array's element count, checked against the bytes left (no huge allocation)."""
    n = self.scalar(VT.UINT64)
    if n * _MIN_BYTES[vtype] > self.left:
      raise _Truncated(f"{what}: array of {n} {vtype.name} values needs at least "
                       f"{n * _MIN_BYTES[vtype]} bytes at offset {self.pos}, file has {len(self.buf)}")
    return n

  def value(self, vtype, what: str, depth: int = 0):
    if vtype == VT.STRING:
      return self.string()
    if vtype == VT.ARRAY:
      if depth >= MAX_ARRAY_DEPTH:
        raise _Bad(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
      sub = _vtype(self.scalar(VT.UINT32), f"{what} array element")
      count = self.count(sub, what)
      if sub in (VT.STRING, VT.ARRAY):
        return [self.value(sub, what, depth + 1) for _ in range(count)]
      dt = np.dtype(_NP_SCALAR[sub])
      arr = np.frombuffer(self.take(count * dt.itemsize), dtype=dt)
      if sub == VT.BOOL:
        if arr.size and arr.max() > 1:
          raise _Bad(f"{what}: expected bools (0 or 1), found byte {int(arr.max())}")
        arr = arr.astype(bool)
      return arr.tolist()
    return self.scalar(vtype)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor of a GGUF file: ggml type, numpy shape ([out, in]), byte range."""

  name: str
  ggml_type: QT
  shape: Tuple[int, ...]
  offset: int          # absolute byte offset in the file
  nbytes: int

  @property
  def type_name(self) -> str:
    return self.ggml_type.name


def _supported_types():
  traits = getattr(gguf.quants, "_type_traits", {})
  return {QT.F32, QT.F16, QT.BF16} | {t for t in traits if t not in (QT.F64,)}


SUPPORTED_TYPES = frozenset(_supported_types())


# ---- the model file --------------------------------------------------------------



class GGUFModel:
  """An opened, validated `qwen35` GGUF file (memory-mapped)."""

  def __init__(self, path):
    self.path = os.fspath(path)
    try:
      self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
      raise GGUFError(self.path, f"cannot open: {e}") from None
    try:
      self._parse()
    except _Truncated as e:
      raise GGUFError(self.path, f"truncated file: {e}") from None
    self._validate()

  # -- parsing --
  def _parse(self):
    """The header, checked as ggml's reader checks it, before anything is trusted: known value
    types, unique keys and tensor names, alignment a power of two, at most 4 dims, known tensor
    types, each tensor's offset the running padded total of the tensors before it, the data inside
    the file (and no bytes after it)."""
    path, mm = self.path, self._mm
    cur = _Cursor(memoryview(mm))
    magic = bytes(cur.take(4)) if len(mm) >= 4 else bytes(mm)
    if magic != GGUF_MAGIC:
      raise GGUFError(path, f"not a GGUF file: magic expected {GGUF_MAGIC!r}, found {magic!r}")
    version = cur.scalar(VT.UINT32)
    if version not in (2, 3):
      raise GGUFError(path, f"GGUF version expected 2 or 3, found {version}")
    n_tensors, n_kv = cur.scalar(VT.UINT64), cur.scalar(VT.UINT64)
    for n, what, least in ((n_kv, "metadata keys", 8 + 4 + 1), (n_tensors, "tensors", 8 + 4 + 4 + 8)):
      if n * least > cur.left:
        raise _Truncated(f"header claims {n} {what} (at least {n * least} bytes), file has {len(mm)}")
    md: Dict[str, Any] = {}
    types: Dict[str, Any] = {}
    for i in range(n_kv):
      key = self._name(cur.raw_string(), f"metadata key #{i}")
      if key in md:
        raise GGUFError(path, f"metadata {key}: duplicated key (keys must be unique)")
      try:
        vtype = _vtype(cur.scalar(VT.UINT32), f"metadata {key}")
        md[key] = cur.value(vtype, f"metadata {key}")
      except _Bad as e:
        raise GGUFError(path, str(e) if str(e).startswith("metadata ") else f"metadata {key}: {e}") from None
      types[key] = vtype
    align = md.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in md and types["general.alignment"] != VT.UINT32:
      raise GGUFError(path, f"metadata general.alignment: expected a UINT32, found {types['general.alignment'].name}"
                      f" {quote(align)}")
    if not (_is_int(align) and align >= 1 and align & (align - 1) == 0):
      raise GGUFError(path, f"metadata general.alignment: expected a power of two >= 1, found {quote(align)}")
    raw_infos = []
    for i in range(n_tensors):
      name = self._name(cur.raw_string(), f"tensor #{i}")
      n_dims = cur.scalar(VT.UINT32)
      if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise GGUFError(path, f"tensor {name}: expected 1-{GGML_MAX_DIMS} dims, found {n_dims}")
      dims = [cur.scalar(VT.UINT64) for _ in range(n_dims)]
      raw_type = cur.scalar(VT.UINT32)
      offset = cur.scalar(VT.UINT64)
      raw_infos.append((name, dims, raw_type, offset))
    data_start = (cur.pos + align - 1) // align * align
    infos: Dict[str, TensorInfo] = {}
    total = 0          # the running padded total: where the next tensor must start
    for name, dims, raw_type, offset in raw_infos:
      if name in infos:
        raise GGUFError(path, f"tensor {name}: duplicated name (tensor names must be unique)")
      if min(dims) < 1:
        raise GGUFError(path, f"tensor {name}: expected dims >= 1, found {dims}")
      try:
        qt = QT(raw_type)
      except ValueError:
        raise GGUFError(path, f"tensor {name}: unsupported tensor type: expected one of "
                        f"{sorted(t.name for t in SUPPORTED_TYPES)}, found unknown type id {raw_type}") from None
      if qt not in SUPPORTED_TYPES:
        raise GGUFError(path, f"tensor {name}: unsupported tensor type: expected one of "
                        f"{sorted(t.name for t in SUPPORTED_TYPES)}, found {qt.name}")
      block, tsize = gguf.GGML_QUANT_SIZES[qt]
      if dims[0] % block:
        raise GGUFError(path, f"tensor {name}: {qt.name} rows need a multiple of {block} values, "
                        f"found shape {tuple(reversed(dims))}")
      n = math.prod(dims)                  # python ints: no overflow
      nbytes = n // block * tsize
      if offset != total:
        raise GGUFError(path, f"tensor {name}: data offset expected {total} (the tensors before it, each "
                        f"padded to the alignment {align}), found {offset}")
      start = data_start + offset
      if start + nbytes > len(mm):
        raise _Truncated(f"tensor {name} needs bytes [{start}, {start + nbytes}), file has {len(mm)}")
      infos[name] = TensorInfo(name, qt, tuple(int(d) for d in reversed(dims)), start, nbytes)
      total = offset + (nbytes + align - 1) // align * align
    end = data_start + total
    if infos and len(mm) not in (end, data_start + offset + nbytes):
      raise GGUFError(path, f"file size expected {end} (the end of the last tensor's data), found {len(mm)}")
    self.metadata: Dict[str, Any] = md
    self.metadata_types: Dict[str, Any] = types
    self._infos = infos

  def _name(self, raw: bytes, what: str) -> str:
    """A key or tensor name: UTF-8 text (names are compared and printed, escaped)."""
    try:
      name = raw.decode("utf-8")
    except UnicodeDecodeError:
      raise GGUFError(self.path, f"{what}: expected a UTF-8 name, found {quote(raw)}") from None
    if not name or (what.startswith("tensor") and len(raw) >= GGML_MAX_NAME):
      raise GGUFError(self.path, f"{what}: expected a name of 1-{GGML_MAX_NAME - 1} bytes, found "
                      f"{len(raw)} bytes {quote(name)}")
    return name

  def _validate(self):
    path = self.path
    shapes = {n: i.shape for n, i in self._infos.items()}
    cfg = config_from_metadata(path, self.metadata, shapes)
    block_count = cfg.num_layers + cfg.mtp_layers
    mtp_blocks = sorted({int(m.group(1)) for n in shapes if (m := _BLK.match(n))
                         and m.group(2).startswith("nextn.")})
    if len(mtp_blocks) > 1:
      raise GGUFError(path, f"multi-layer MTP is not supported: expected at most one MTP block, "
                      f"found nextn tensors in blocks {mtp_blocks}")
    for name in shapes:
      m = _BLK.match(name)
      if m and int(m.group(1)) >= block_count:
        raise GGUFError(path, f"tensor {name}: block {m.group(1)} beyond block_count {block_count}"
                        + (" (multi-layer MTP is not supported)" if name.split(".")[2] == "nextn" else ""))
    expected = config_lib.gguf_tensor_shapes(cfg, include_optional=True)
    required = config_lib.required_tensor_names(cfg)
    for name in sorted(required, key=_tensor_order):
      if name not in shapes:
        raise GGUFError(path, f"missing tensor {name}: expected shape {expected[name]}")
    for name, shape in shapes.items():
      if name not in expected:   # as llama.cpp: every tensor of the file is used
        raise GGUFError(path, f"tensor {name}: not a tensor of this {ARCH} model (block_count "
                        f"{block_count}, nextn_predict_layers {cfg.mtp_layers})")
      if tuple(shape) != tuple(expected[name]):
        raise GGUFError(path, f"tensor {name}: wrong shape: expected {tuple(expected[name])}, "
                        f"found {tuple(shape)}")
      qt = self._infos[name].ggml_type
      if len(shape) == 1 and qt != QT.F32:   # as llama.cpp writes them: never converted or quantized
        raise GGUFError(path, f"tensor {name}: 1-D tensors are stored as F32, found {qt.name}")
    self.config: ModelConfig = cfg
    self.tokenizer_spec: Dict[str, Any] = {
        k[len("tokenizer.ggml."):]: v for k, v in self.metadata.items()
        if k.startswith("tokenizer.ggml.")}
    self._tokenizer = self._build_tokenizer()

  def _build_tokenizer(self):
    """The tokenizer of `tokenizer.ggml.*`, or None when the file has no `tokenizer.ggml.tokens`
    (then only token ids can be given). Its own checks are refused as `GGUFError`s."""
    spec = self.tokenizer_spec
    if "tokens" not in spec:
      return None
    n = len(spec["tokens"])
    if "token_type" in spec and len(spec["token_type"]) != n:
      raise GGUFError(self.path, f"metadata tokenizer.ggml.token_type: expected {n} entries (one per token), "
                      f"found {len(spec['token_type'])}")
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
      if key in spec and spec[key] >= n:
        raise GGUFError(self.path, f"metadata tokenizer.ggml.{key}: expected a token id < {n} (the tokens), "
                        f"found {spec[key]}")
    try:
      return tok_lib.from_spec(spec)
    except ValueError as e:
      raise GGUFError(self.path, f"tokenizer.ggml.*: {e}") from None

  @property
  def tokenizer(self):
    """`kvjax.tokenizer.Tokenizer` of the file, None when it has no token list."""
    return self._tokenizer

  # -- tensors --
  def tensor_names(self) -> list:
    return list(self._infos)

  def tensor_info(self, name: str) -> TensorInfo:
    try:
      return self._infos[name]
    except KeyError:
      raise GGUFError(self.path, f"no tensor named {name}") from None

  def raw_bytes(self, name: str) -> np.ndarray:
    """The stored bytes of `name` (a read-only view into the memory map)."""
    info = self.tensor_info(name)
    return self._mm[info.offset:info.offset + info.nbytes]

  def load_tensor(self, name: str, dtype=np.float32) -> np.ndarray:
    """Dequantize `name` -> numpy array of GGUF shape ([out, in]) and `dtype`."""
    info = self.tensor_info(name)
    raw = self.raw_bytes(name)
    shape = info.shape or (1,)
    if info.ggml_type == QT.F32:
      out = raw.view("<f4").reshape(shape)
    elif info.ggml_type == QT.F16:
      out = raw.view("<f2").reshape(shape)
    elif info.ggml_type == QT.BF16:
      out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    else:
      block, tsize = gguf.GGML_QUANT_SIZES[info.ggml_type]
      rows = raw.reshape(-1, shape[-1] // block * tsize)
      out = gguf.quants.dequantize(np.asarray(rows), info.ggml_type).reshape(shape)
    out = np.array(out, dtype=dtype, copy=True).reshape(info.shape)
    if not np.isfinite(out).all():
      bad = np.flatnonzero(~np.isfinite(out.reshape(-1)))
      raise GGUFError(self.path, f"tensor {name}: expected finite values, found {bad.size} NaN / inf "
                      f"(first at flat index {bad[0]})")
    return out

  def iter_tensors(self, dtype=np.float32, names: Optional[Sequence[str]] = None
                   ) -> Iterator[Tuple[str, np.ndarray]]:
    """Yield `(name, array)` one tensor at a time (file order unless `names`)."""
    for name in (names if names is not None else self.tensor_names()):
      yield name, self.load_tensor(name, dtype)

  def close(self):
    mm = getattr(self, "_mm", None)
    if mm is not None and getattr(mm, "_mmap", None) is not None:
      mm._mmap.close()
    self._mm = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __repr__(self):
    return f"GGUFModel({self.path!r}, {len(self._infos)} tensors, {self.config})"


def read_gguf(path) -> GGUFModel:
  """Open and validate a `qwen35` GGUF file (raises `GGUFError`)."""
  return GGUFModel(path)


# ---- writer -------------------------------------------------------------------------

def _tensor_order(name: str):
  m = _BLK.match(name)
  if name == "token_embd.weight":
    return (0, 0, name)
  if m:
    return (1, int(m.group(1)), m.group(2))
  return (2, 0, name)


def _stored_type(name: str, ndim: int, weight_type: str) -> QT:
  """llama.cpp's choice: matrices in `weight_type`, 1-D tensors and ssm_conv1d in F32."""
  if ndim < 2 or name.endswith("ssm_conv1d.weight"):
    return QT.F32
  return WEIGHT_TYPES[weight_type]


def _encode_tensor(arr: np.ndarray, qt: QT) -> np.ndarray:
  arr = np.ascontiguousarray(arr, dtype=np.float32)
  if qt == QT.F32:
    return arr
  if qt == QT.F16:
    return arr.astype(np.float16)
  return gguf.quants.quantize(arr, qt)  # BF16 / Q8_0 as uint8 bytes, ggml-exact


DEFAULT_TOKEN_KEYS = ("model", "pre", "tokens", "token_type", "merges",
                      "bos_token_id", "eos_token_id", "padding_token_id")


def write_gguf(path, config: ModelConfig, tensors: Mapping[str, np.ndarray],
               tokenizer_spec: Optional[Mapping[str, Any]] = None,
               weight_type: str = "f32", name: str = "kvjax") -> str:
  """Write a `qwen35` GGUF in llama.cpp conventions; returns `path`.

  `tensors` maps GGUF names to numpy arrays of GGUF shape ([out, in]); every
  tensor of `config.gguf_tensor_shapes(config)` that is not optional must be
  present. Matrices are stored as `weight_type` ("f32", "f16", "bf16",
  "q8_0", "q4_0"); 1-D tensors and `ssm_conv1d` stay F32. A `QuantizedWeight` (numpy bytes in a
  block format, e.g. Q4_K) is written as it is.
  """
  path = os.fspath(path)
  if weight_type not in WEIGHT_TYPES:
    raise GGUFError(path, f"weight_type expected one of {sorted(WEIGHT_TYPES)}, found {weight_type!r}")
  expected = config_lib.gguf_tensor_shapes(config, include_optional=True)
  for t in sorted(config_lib.required_tensor_names(config), key=_tensor_order):
    if t not in tensors:
      raise GGUFError(path, f"missing tensor {t}: expected shape {expected[t]}")
  for t, a in tensors.items():
    if t not in expected:
      raise GGUFError(path, f"tensor {t}: not part of a {ARCH} model with this config")
    shape = tuple(a.shape) if isinstance(a, QuantizedWeight) else tuple(np.shape(a))
    if shape != tuple(expected[t]):
      raise GGUFError(path, f"tensor {t}: wrong shape: expected {tuple(expected[t])}, found {shape}")

  w = gguf.GGUFWriter(path, ARCH)
  w.add_name(name)
  w.add_uint32(_k("block_count"), config.num_layers + config.mtp_layers)
  w.add_uint32(_k("context_length"), config.context_length)
  w.add_uint32(_k("embedding_length"), config.hidden_size)
  w.add_uint32(_k("feed_forward_length"), config.intermediate_size)
  w.add_uint32(_k("attention.head_count"), config.num_attention_heads)
  w.add_uint32(_k("attention.head_count_kv"), config.num_kv_heads)
  w.add_uint32(_k("attention.key_length"), config.head_dim)
  w.add_uint32(_k("attention.value_length"), config.head_dim)
  w.add_float32(_k("attention.layer_norm_rms_epsilon"), config.rms_eps)
  w.add_uint32(_k("rope.dimension_count"), config.rope_dim)
  w.add_float32(_k("rope.freq_base"), config.rope_theta)
  w.add_array(_k("rope.dimension_sections"), [int(s) for s in config.rope_sections])
  w.add_uint32(_k("ssm.conv_kernel"), config.conv_kernel)
  w.add_uint32(_k("ssm.state_size"), config.linear_head_dim)
  w.add_uint32(_k("ssm.group_count"), config.linear_num_key_heads)
  w.add_uint32(_k("ssm.time_step_rank"), config.linear_num_value_heads)
  w.add_uint32(_k("ssm.inner_size"), config.linear_value_dim)
  w.add_uint32(_k("full_attention_interval"), config.full_attention_interval)
  w.add_uint32(_k("nextn_predict_layers"), config.mtp_layers)
  w.add_uint32("general.file_type", {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}[weight_type])

  spec = dict(tokenizer_spec or {})
  w.add_tokenizer_model(str(spec.get("model", "gpt2")))
  w.add_tokenizer_pre(str(spec.get("pre", "qwen2")))
  if spec.get("tokens") is not None:
    w.add_token_list(list(spec["tokens"]))
  if spec.get("token_type") is not None:
    w.add_token_types([int(t) for t in spec["token_type"]])
  if spec.get("merges") is not None:
    w.add_token_merges(list(spec["merges"]))
  for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
    if spec.get(key) is not None:
      w.add_uint32(f"tokenizer.ggml.{key}", int(spec[key]))
  for key, val in spec.items():  # anything else (e.g. add_bos_token) passes through
    if key in DEFAULT_TOKEN_KEYS or val is None:
      continue
    full = f"tokenizer.ggml.{key}"
    if isinstance(val, bool):
      w.add_bool(full, val)
    elif isinstance(val, int):
      w.add_uint32(full, val)
    elif isinstance(val, float):
      w.add_float32(full, val)
    elif isinstance(val, str):
      w.add_string(full, val)
    else:
      w.add_array(full, list(val))

  for t in sorted(tensors, key=_tensor_order):
    if isinstance(tensors[t], QuantizedWeight):    # bytes already in a block format: as they are
      if tensors[t].scales is not None:
        raise GGUFError(path, f"tensor {t}: weights repacked into planes (weights_impl 'planar') are not ggml "
                              f"blocks; load the model with another weights_impl to write it")
      w.add_tensor(t, np.asarray(tensors[t].data, np.uint8), raw_dtype=QT[tensors[t].fmt.upper()])
      continue
    arr = np.asarray(tensors[t])
    qt = _stored_type(t, arr.ndim, weight_type)
    if qt != QT.F32 and arr.shape[-1] % gguf.GGML_QUANT_SIZES[qt][0]:
      raise GGUFError(path, f"tensor {t}: {qt.name} needs rows of a multiple of "
                      f"{gguf.GGML_QUANT_SIZES[qt][0]}, found shape {arr.shape}")
    data = _encode_tensor(arr, qt)
    w.add_tensor(t, data, raw_dtype=qt if data.dtype == np.uint8 else None)
  try:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
  finally:
    w.close()
  return path
