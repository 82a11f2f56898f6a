"""kvjax.gguf_io: round trips, metadata -> config, and every refusal."""

import gguf
import numpy as np
import pytest

from kvjax import config, gguf_io, quant, tiny, tokenizer
from kvjax.gguf_io import GGUFError

import jax.numpy as jnp

ARCH = "qwen35"


@pytest.fixture(scope="module")
def cfg():
  return config.tiny()


@pytest.fixture(scope="module")
def tensors(cfg):
  return tiny.tiny_tensors(seed=1)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
  return tiny.write_tiny_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", seed=1)


def base_meta(cfg):
  """qwen35 metadata, written independently of gguf_io.write_gguf."""
  return {
      "block_count": cfg.num_layers + cfg.mtp_layers, "context_length": cfg.context_length,
      "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
      "attention.head_count": cfg.num_attention_heads,
      "attention.head_count_kv": cfg.num_kv_heads,
      "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
      "attention.layer_norm_rms_epsilon": float(cfg.rms_eps),
      "rope.dimension_count": cfg.rope_dim, "rope.freq_base": float(cfg.rope_theta),
      "rope.dimension_sections": list(cfg.rope_sections),
      "ssm.conv_kernel": cfg.conv_kernel, "ssm.state_size": cfg.linear_head_dim,
      "ssm.group_count": cfg.linear_num_key_heads,
      "ssm.time_step_rank": cfg.linear_num_value_heads,
      "ssm.inner_size": cfg.linear_value_dim,
      "full_attention_interval": cfg.full_attention_interval,
      "nextn_predict_layers": cfg.mtp_layers,
  }


def build(path, cfg, tensors, arch=ARCH, meta=None):
  """Write a GGUF straight through gguf.GGUFWriter (meta overrides; None drops a key)."""
  md = base_meta(cfg)
  md.update(meta or {})
  w = gguf.GGUFWriter(str(path), arch)
  for k, v in md.items():
    if v is None:
      continue
    key = f"{arch}.{k}"
    if isinstance(v, list):
      w.add_array(key, v)
    elif isinstance(v, float):
      w.add_float32(key, v)
    else:
      w.add_uint32(key, v)
  for name, a in tensors.items():
    w.add_tensor(name, np.ascontiguousarray(a, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def refuse(path, *needles):
  with pytest.raises(GGUFError) as ei:
    gguf_io.read_gguf(path)
  msg = str(ei.value)
  assert "\n" not in msg, msg
  assert str(path) in msg, msg
  for n in needles:
    assert n in msg, f"{n!r} not in {msg!r}"
  return msg


# ---- good files ---------------------------------------------------------------

def test_metadata_to_config(good, cfg):
  m = gguf_io.read_gguf(good)
  assert m.config == cfg
  md = m.metadata
  assert md["general.architecture"] == ARCH
  assert md[f"{ARCH}.block_count"] == cfg.num_layers + 1 == 9
  assert md[f"{ARCH}.nextn_predict_layers"] == 1
  assert md[f"{ARCH}.ssm.inner_size"] == cfg.linear_num_value_heads * cfg.linear_head_dim
  assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen2"
  spec = m.tokenizer_spec
  assert len(spec["tokens"]) == config.TINY_VOCAB == cfg.vocab_size
  assert spec["tokens"][spec["eos_token_id"]] == "<|endoftext|>"
  for k, v in tokenizer.tiny_tokenizer_spec().items():
    assert spec[k] == v, k
  assert tokenizer.from_spec(spec).encode("the cache") == tokenizer.tiny_tokenizer().encode("the cache")
  assert set(m.tensor_names()) == set(config.gguf_tensor_shapes(cfg))
  for name, shape in config.gguf_tensor_shapes(cfg).items():
    assert m.tensor_info(name).shape == shape


def test_f32_round_trip_exact(good, tensors):
  m = gguf_io.read_gguf(good)
  it = m.iter_tensors()
  assert iter(it) is it  # a generator: one tensor at a time
  seen = 0
  for name, a in it:
    assert a.dtype == np.float32 and a.flags.writeable
    np.testing.assert_array_equal(a, tensors[name])
    seen += 1
  assert seen == len(tensors)
  assert m.load_tensor("output_norm.weight", np.float64).dtype == np.float64


@pytest.mark.parametrize("wt,qt,tol", [("q8_0", "Q8_0", 0.02), ("f16", "F16", 1e-3), ("bf16", "BF16", 8e-3)])
def test_quantized_round_trip_idempotent(tmp_path, cfg, tensors, wt, qt, tol):
  spec = tokenizer.tiny_tokenizer_spec()
  p1 = gguf_io.write_gguf(tmp_path / "a.gguf", cfg, tensors, spec, weight_type=wt)
  m1 = gguf_io.read_gguf(p1)
  assert m1.config == cfg
  back = dict(m1.iter_tensors())
  for name, a in back.items():
    info = m1.tensor_info(name)
    want_t = qt if (a.ndim == 2 and "ssm_conv1d" not in name) else "F32"
    assert info.type_name == want_t, name
    scale = np.abs(tensors[name]).max()
    assert np.abs(a - tensors[name]).max() <= tol * scale, name
  # Quantizing the dequantized weights again gives the same bytes.
  p2 = gguf_io.write_gguf(tmp_path / "b.gguf", cfg, back, spec, weight_type=wt)
  assert open(p1, "rb").read() == open(p2, "rb").read()
  if wt == "q8_0":  # the file's bytes are the codec's bytes
    name = "blk.3.attn_q.weight"
    raw = m1.raw_bytes(name).reshape(tensors[name].shape[0], -1)
    np.testing.assert_array_equal(raw, np.asarray(quant.encode_jit(jnp.asarray(tensors[name]), kind="q8_0")))
    np.testing.assert_array_equal(back[name], np.asarray(quant.decode_jit(jnp.asarray(raw), kind="q8_0")))


def test_other_reader_agrees(tmp_path, cfg, tensors):
  p = gguf_io.write_gguf(tmp_path / "q.gguf", cfg, tensors, tokenizer.tiny_tokenizer_spec(),
                         weight_type="q8_0")
  r = gguf.GGUFReader(p)
  assert r.fields["general.architecture"].contents() == ARCH
  assert r.fields[f"{ARCH}.nextn_predict_layers"].contents() == 1
  assert len(r.fields["tokenizer.ggml.tokens"].contents()) == config.TINY_VOCAB
  ours = gguf_io.read_gguf(p)
  assert len(r.tensors) == len(tensors)
  for t in r.tensors:
    want = config.gguf_tensor_shapes(cfg)[t.name]
    assert tuple(int(d) for d in reversed(t.shape)) == want  # ggml lists dims reversed
    assert t.tensor_type.name == ours.tensor_info(t.name).type_name
    assert t.tensor_type.name == ("Q8_0" if len(want) == 2 and "ssm_conv1d" not in t.name else "F32")
    np.testing.assert_array_equal(
        gguf.quants.dequantize(t.data, t.tensor_type).reshape(want), ours.load_tensor(t.name))


def test_tied_embeddings_and_no_mtp(tmp_path):
  c = config.tiny(tie_embeddings=True, mtp_layers=0)
  from kvjax.weights import random_tensors
  ts = random_tensors(c, seed=2)
  assert "output.weight" not in ts
  p = gguf_io.write_gguf(tmp_path / "t.gguf", c, ts, tokenizer.tiny_tokenizer_spec())
  m = gguf_io.read_gguf(p)
  assert m.config == c and m.config.tie_embeddings and m.config.mtp_layers == 0
  assert m.metadata[f"{ARCH}.block_count"] == c.num_layers


def test_recurrent_layers_array_accepted(tmp_path, cfg, tensors):
  pattern = [(i + 1) % 4 != 0 for i in range(cfg.num_layers)] + [False]
  p = build(tmp_path / "r.gguf", cfg, tensors,
            meta={"full_attention_interval": None, "attention.recurrent_layers": pattern})
  assert gguf_io.read_gguf(p).config == cfg
  bad = list(pattern)
  bad[5] = False
  p = build(tmp_path / "r2.gguf", cfg, tensors,
            meta={"full_attention_interval": None, "attention.recurrent_layers": bad})
  refuse(p, "attention.recurrent_layers", "layer 5", "expected recurrent=True", "found False")


def test_writer_refuses_bad_input(tmp_path, cfg, tensors):
  ts = dict(tensors)
  del ts["blk.2.ssm_a"]
  with pytest.raises(GGUFError, match="missing tensor blk.2.ssm_a"):
    gguf_io.write_gguf(tmp_path / "x.gguf", cfg, ts, None)
  ts = dict(tensors, **{"blk.0.ffn_up.weight": np.zeros((3, 3), np.float32)})
  with pytest.raises(GGUFError, match=r"blk.0.ffn_up.weight: wrong shape: expected \(128, 64\), found \(3, 3\)"):
    gguf_io.write_gguf(tmp_path / "x.gguf", cfg, ts, None)
  with pytest.raises(GGUFError, match="weight_type"):
    gguf_io.write_gguf(tmp_path / "x.gguf", cfg, tensors, None, weight_type="q4_k")


# ---- refusals -------------------------------------------------------------------

def test_refuse_bad_magic(tmp_path, good):
  data = bytearray(open(good, "rb").read())
  data[0:4] = b"GGML"
  p = tmp_path / "magic.gguf"
  p.write_bytes(bytes(data))
  refuse(p, "not a GGUF file", "expected b'GGUF'", "found b'GGML'")
  q = tmp_path / "empty.gguf"
  q.write_bytes(b"GG")
  refuse(q, "not a GGUF file")


@pytest.mark.parametrize("keep", [10, 300, 0.5, -1])
def test_refuse_truncated(tmp_path, good, keep):
  data = open(good, "rb").read()
  n = keep if isinstance(keep, int) and keep > 0 else (len(data) - 1 if keep == -1 else int(len(data) * keep))
  p = tmp_path / "trunc.gguf"
  p.write_bytes(data[:n])
  msg = refuse(p, "truncated file")
  if keep in (0.5, -1):  # the data section is cut: the message names the tensor and sizes
    assert "tensor " in msg and f"file has {n}" in msg


def test_refuse_wrong_architecture(tmp_path, cfg, tensors):
  p = build(tmp_path / "llama.gguf", cfg, tensors, arch="llama")
  refuse(p, "general.architecture", "expected 'qwen35'", "found 'llama'")


def test_refuse_missing_tensor(tmp_path, cfg, tensors):
  ts = {k: v for k, v in tensors.items() if k != "blk.3.attn_k.weight"}
  p = build(tmp_path / "miss.gguf", cfg, ts)
  refuse(p, "missing tensor blk.3.attn_k.weight", "expected shape (128, 64)")
  ts = {k: v for k, v in tensors.items() if k != "blk.8.nextn.eh_proj.weight"}
  refuse(build(tmp_path / "miss2.gguf", cfg, ts), "missing tensor blk.8.nextn.eh_proj.weight")


def test_refuse_wrong_shape(tmp_path, cfg, tensors):
  ts = dict(tensors)
  ts["blk.1.ssm_out.weight"] = np.zeros((64, 96), np.float32)
  p = build(tmp_path / "shape.gguf", cfg, ts)
  refuse(p, "tensor blk.1.ssm_out.weight", "wrong shape", "expected (64, 128)", "found (64, 96)")


def _patch_type(src, dst, name, new_type):
  data = bytearray(open(src, "rb").read())
  key = len(name).to_bytes(8, "little") + name.encode()
  pos = data.find(key)
  assert pos > 0 and data.find(key, pos + 1) == -1
  p = pos + len(key)
  n_dims = int.from_bytes(data[p:p + 4], "little")
  t = p + 4 + 8 * n_dims
  assert int.from_bytes(data[t:t + 4], "little") == 0  # F32 before the patch
  data[t:t + 4] = int(new_type).to_bytes(4, "little")
  dst.write_bytes(bytes(data))
  return dst


def test_refuse_unsupported_type(tmp_path, good):
  p = _patch_type(good, tmp_path / "t99.gguf", "blk.2.ssm_beta.weight", 99)
  refuse(p, "tensor blk.2.ssm_beta.weight", "unsupported tensor type", "found unknown type id 99")
  p = _patch_type(good, tmp_path / "ti32.gguf", "blk.2.ssm_beta.weight", gguf.GGMLQuantizationType.I32)
  refuse(p, "tensor blk.2.ssm_beta.weight", "unsupported tensor type", "found I32")


@pytest.mark.parametrize("meta,needles", [
    ({"attention.head_count": 5}, ["inconsistent heads", "head_count=5", "head_count_kv=2"]),
    ({"ssm.inner_size": 100}, ["ssm.inner_size", "expected", "4*32 = 128", "found 100"]),
    ({"attention.value_length": 32}, ["key_length=64", "value_length=32"]),
    ({"ssm.group_count": 3}, ["time_step_rank=4", "group_count=3"]),
])
def test_refuse_inconsistent_heads(tmp_path, cfg, tensors, meta, needles):
  p = build(tmp_path / "heads.gguf", cfg, tensors, meta=meta)
  refuse(p, *needles)


def test_refuse_multi_layer_mtp(tmp_path, cfg, tensors):
  p = build(tmp_path / "n2.gguf", cfg, tensors, meta={"nextn_predict_layers": 2, "block_count": 10})
  refuse(p, "multi-layer MTP is not supported", "nextn_predict_layers", "found 2")
  ts = dict(tensors)
  for k, v in tensors.items():  # a second MTP block stored as blk.9
    if k.startswith("blk.8."):
      ts["blk.9." + k[len("blk.8."):]] = v
  p = build(tmp_path / "two.gguf", cfg, ts)
  refuse(p, "multi-layer MTP is not supported", "blocks [8, 9]")


def test_refuse_missing_key(tmp_path, cfg, tensors):
  p = build(tmp_path / "key.gguf", cfg, tensors, meta={"ssm.state_size": None})
  refuse(p, "missing metadata key qwen35.ssm.state_size")


# ---- every refusal branch of the validating reader -------------------------------------

from experiments.lib import gguf_fuzz as gf  # noqa: E402


@pytest.fixture(scope="module")
def records(good):
  return gf.Gguf.parse(open(good, "rb").read())


def _write(tmp_path, data, name="m.gguf"):
  p = tmp_path / name
  p.write_bytes(data)
  return p


def _set(g, key, vtype, value):
  return gf._set(g, key.encode(), vtype, value).to_bytes()


@pytest.mark.parametrize("key,vtype,value,needles", [
    ("qwen35.context_length", gf.VT_UINT32, 0, ["qwen35.context_length", "expected an integer >= 1", "found 0"]),
    ("qwen35.context_length", gf.VT_FLOAT32, float("inf"), ["expected an integer", "found float inf"]),
    ("qwen35.block_count", gf.VT_UINT64, 2**63, ["block_count", "found 9223372036854775808"]),
    ("qwen35.block_count", gf.VT_UINT32, 100, ["block_count", "expected at most 9", "found 100"]),
    ("qwen35.embedding_length", gf.VT_STRING, "abc", ["embedding_length", "found string 'abc'"]),
    ("qwen35.embedding_length", gf.VT_ARRAY, (gf.VT_UINT32, [64, 64]), ["embedding_length", "array of 2"]),
    ("qwen35.attention.head_count", gf.VT_ARRAY, (gf.VT_UINT32, [6, 3]), ["expected one value for all layers"]),
    ("qwen35.rope.freq_base", gf.VT_FLOAT32, float("nan"), ["rope.freq_base", "finite number > 0.0", "found nan"]),
    ("qwen35.attention.layer_norm_rms_epsilon", gf.VT_FLOAT32, -1.0, ["rms_epsilon", "found -1.0"]),
    ("qwen35.rope.dimension_sections", gf.VT_UINT32, 11, ["dimension_sections", "array of integers"]),
    ("qwen35.rope.dimension_count", gf.VT_UINT32, 3, ["rope dims 3 must be even"]),
    ("qwen35.nextn_predict_layers", gf.VT_INT32, -1, ["nextn_predict_layers", "found -1"]),
    ("qwen35.attention.recurrent_layers", gf.VT_ARRAY, (gf.VT_UINT32, [7] * 9), ["array of bools"]),
    ("tokenizer.ggml.tokens", gf.VT_UINT32, 5, ["tokenizer.ggml.tokens", "array of strings", "found integer 5"]),
    ("tokenizer.ggml.merges", gf.VT_ARRAY, (gf.VT_STRING, ["nospace"]), ["tokenizer.ggml.*", "not 'left right'"]),
    ("tokenizer.ggml.token_type", gf.VT_ARRAY, (gf.VT_INT32, [1, 1]), ["token_type", "expected 384 entries"]),
    ("tokenizer.ggml.eos_token_id", gf.VT_UINT32, 10**6, ["eos_token_id", "token id < 384"]),
    ("tokenizer.ggml.model", gf.VT_STRING, "llama", ["not supported"]),
    ("general.architecture", gf.VT_STRING, "qwen35" + gf.ESCAPES, ["general.architecture", "\\x1b]0;owned\\x07"]),
    ("general.alignment", gf.VT_UINT32, 0, ["general.alignment", "power of two", "found 0"]),
    ("general.alignment", gf.VT_UINT32, 3, ["general.alignment", "found 3"]),
    ("general.alignment", gf.VT_INT32, -32, ["general.alignment", "expected a UINT32, found INT32"]),
])
def test_refuse_bad_metadata(tmp_path, records, key, vtype, value, needles):
  msg = refuse(_write(tmp_path, _set(records, key, vtype, value)), *needles)
  assert "\x1b" not in msg and "\x07" not in msg


def test_refuse_duplicates_and_names(tmp_path, records):
  g = records.copy()
  g.kvs.insert(0, gf.KV(b"qwen35.context_length", gf.VT_UINT32, gf.enc(gf.VT_UINT32, 4096)))
  refuse(_write(tmp_path, g.to_bytes(), "k.gguf"), "qwen35.context_length", "duplicated key")
  g = records.copy()
  g.infos.append(g.infos[3])
  g.data.append(g.data[3])
  refuse(_write(tmp_path, g.to_bytes(), "t.gguf"), g.infos[3].name.decode(), "duplicated name")
  for name, needles in [(b"blk.0.\xff\xfe", ["tensor #", "UTF-8", "\\udcff"]), (b"", ["1-63 bytes"]),
                        (b"x" * 64, ["1-63 bytes", "found 64 bytes"])]:
    g = records.copy()
    g.infos[0].name = name
    refuse(_write(tmp_path, g.to_bytes(), "n.gguf"), *needles)
  g = records.copy()
  g.infos.append(gf.TInfo("blk.0.a\x1b[2J".encode(), [32], 0, 0))
  g.data.append(b"\0" * 128)
  msg = refuse(_write(tmp_path, g.to_bytes(), "esc.gguf"), "not a tensor of this qwen35 model", "\\x1b[2J")
  assert "\x1b" not in msg
  g = records.copy()
  bad = gf._raw_kv(g, gf._str(b"x.v") + gf.struct.pack("<I", 13) + b"\0" * 8)
  refuse(_write(tmp_path, gf._bytes_of(bad, False), "v.gguf"), "x.v", "unknown type id 13")
  nested = gf.struct.pack("<IQ", gf.VT_ARRAY, 1) * 3 + gf.struct.pack("<IQ", gf.VT_UINT8, 0)
  bad = gf._raw_kv(g, gf._str(b"x.a") + gf.struct.pack("<I", gf.VT_ARRAY) + nested)
  refuse(_write(tmp_path, gf._bytes_of(bad, False), "a.gguf"), "x.a", "nested deeper")
  bad = gf._raw_kv(g, gf._str(b"x.b") + gf.struct.pack("<I", gf.VT_BOOL) + b"\x07")
  refuse(_write(tmp_path, gf._bytes_of(bad, False), "b.gguf"), "x.b", "found byte 7")
  bad = gf._raw_kv(g, gf._str(b"x.c") + gf.struct.pack("<IIQ", gf.VT_ARRAY, gf.VT_UINT32, 2**63))
  refuse(_write(tmp_path, gf._bytes_of(bad, False), "c.gguf"), "truncated file", "x.c")


def test_refuse_bad_tensor_records(tmp_path, records):
  def edit(fn, keep=False):
    g = records.copy()
    fn(g)
    return _write(tmp_path, g.to_bytes(keep_offsets=keep), "e.gguf")

  first = records.infos[0].name.decode()
  second = records.infos[1].name.decode()
  refuse(edit(lambda g: setattr(g.infos[0], "dims", [])), first, "expected 1-4 dims, found 0")
  refuse(edit(lambda g: setattr(g.infos[0], "dims", [1] * 5)), first, "found 5")
  refuse(edit(lambda g: setattr(g.infos[0], "dims", [0, 64])), first, "expected dims >= 1")
  refuse(edit(lambda g: setattr(g.infos[0], "dims", [33, 64])) if records.infos[0].ttype else
         edit(lambda g: (setattr(g.infos[0], "ttype", 8), setattr(g.infos[0], "dims", [33, 64]))),
         first, "rows need a multiple of 32")

  refuse(_write(tmp_path, _shifted(records, 1, 1), "o.gguf"), second, "data offset expected", "found")
  g = records.copy()
  g.n_tensors = 2**63
  refuse(_write(tmp_path, g.to_bytes(), "n.gguf"), "truncated file", "header claims")
  g = records.copy()
  g.version = 4
  refuse(_write(tmp_path, g.to_bytes(), "ver.gguf"), "GGUF version expected 2 or 3, found 4")
  refuse(_write(tmp_path, open(_write(tmp_path, records.to_bytes(), "ok.gguf"), "rb").read() + b"x" * 32,
                "app.gguf"), "file size expected")
  name = "blk.2.ssm_a"   # 16 bytes in F32; as F16 the same padded slot: refused by the F32 rule
  g = records.copy()
  i = [t.name for t in g.infos].index(name.encode())
  g.infos[i].ttype = 1
  refuse(_write(tmp_path, g.to_bytes(), "f16.gguf"), name, "1-D tensors are stored as F32, found F16")
  g = records.copy()
  g.infos.append(gf.TInfo(b"blk.0.extra.weight", [32], 0, 0))
  g.data.append(b"\0" * 128)
  refuse(_write(tmp_path, g.to_bytes(), "x.gguf"), "blk.0.extra.weight", "not a tensor of this")
  g = records.copy()
  g.data[0] = np.float32([np.nan] * (len(g.data[0]) // 4)).tobytes()
  p = _write(tmp_path, g.to_bytes(), "nan.gguf")
  m = gguf_io.read_gguf(p)
  with pytest.raises(GGUFError, match=f"tensor {first}: expected finite values"):
    m.load_tensor(first)


def _shifted(records, i, by):
  g = gf.Gguf.parse(records.to_bytes())
  g.infos[i].offset += by
  return g.to_bytes(keep_offsets=True)


def test_file_without_tokenizer_loads_without_one(tmp_path, records):
  g = gf._drop_key(records, b"tokenizer.ggml.tokens")
  g = gf._drop_key(g, b"tokenizer.ggml.merges")
  m = gguf_io.read_gguf(_write(tmp_path, g.to_bytes()))
  assert m.tokenizer is None and m.config == config.tiny()


@pytest.mark.parametrize("kw", [dict(num_kv_heads=0), dict(rms_eps=float("nan")), dict(context_length=0),
                                dict(rope_theta=-1.0), dict(hidden_size=True)])
def test_model_config_refuses_non_positive_sizes(kw):
  """`ModelConfig` itself: sizes >= 1 and finite positive floats, checked before anything divides."""
  with pytest.raises(ValueError, match="expected positive sizes and positive finite floats, found " + list(kw)[0]):
    config.tiny(**kw)


# ---- the refusal branches the tests above leave out (one crafted file each) ------------------

@pytest.mark.parametrize("key,vtype,value,needles", [
    ("tokenizer.ggml.model", gf.VT_UINT32, 7, ["tokenizer.ggml.model", "expected a string", "found integer 7"]),
    ("qwen35.rope.freq_base", gf.VT_STRING, "1e4", ["rope.freq_base", "expected a finite number > 0.0",
                                                    "found string '1e4'"]),
    ("qwen35.rope.dimension_sections", gf.VT_ARRAY, (gf.VT_INT32, []),
     ["rope.dimension_sections", "expected an array of integers >= 0", "found an empty array"]),
    ("qwen35.rope.dimension_sections", gf.VT_ARRAY, (gf.VT_INT32, [11, -3, 0, 0]),
     ["rope.dimension_sections", ">= 0", "found -3 (entry 1)"]),
    ("qwen35.block_count", gf.VT_UINT32, 1, ["qwen35.block_count=1 leaves no target layers",
                                             "nextn_predict_layers=1"]),
    ("qwen35.attention.recurrent_layers", gf.VT_ARRAY, (gf.VT_BOOL, [True] * 3),
     ["qwen35.attention.recurrent_layers", "expected >= 8 entries, found 3"]),
    ("tokenizer.ggml.tokens", gf.VT_ARRAY, (gf.VT_STRING, [f"t{i}" for i in range(400)]),
     ["tokenizer.ggml.tokens", "expected <= 384 tokens (token_embd rows), found 400"]),
    ("tokenizer.ggml.bos_token_id", gf.VT_UINT32, 384, ["tokenizer.ggml.bos_token_id", "token id < 384",
                                                        "found 384"]),
    ("tokenizer.ggml.padding_token_id", gf.VT_UINT32, 999, ["padding_token_id", "token id < 384", "found 999"]),
])
def test_refuse_bad_metadata_more(tmp_path, records, key, vtype, value, needles):
  refuse(_write(tmp_path, _set(records, key, vtype, value)), *needles)


def test_refuse_layer_pattern_without_attention(tmp_path, records):
  """Neither full_attention_interval nor recurrent_layers, or a pattern with no attention layer."""
  g = gf._drop_key(records, b"qwen35.full_attention_interval")
  refuse(_write(tmp_path, g.to_bytes(), "none.gguf"), "missing metadata key qwen35.full_attention_interval",
         "(or qwen35.attention.recurrent_layers)")
  g = gf._set(g, b"qwen35.attention.recurrent_layers", gf.VT_ARRAY, (gf.VT_BOOL, [True] * 9))
  refuse(_write(tmp_path, g.to_bytes(), "all.gguf"), "qwen35.attention.recurrent_layers",
         "no full-attention layer among 8")


def test_refuse_missing_embedding_and_blocks_beyond_block_count(tmp_path, cfg, tensors):
  ts = {k: v for k, v in tensors.items() if k != "token_embd.weight"}
  refuse(build(tmp_path / "emb.gguf", cfg, ts), "missing tensor token_embd.weight")
  # block_count 8 without MTP: the file's MTP block 8 lies beyond it (its nextn tensors written first)
  ts = dict(sorted(tensors.items(), key=lambda kv: ".nextn." not in kv[0]))
  p = build(tmp_path / "mtp.gguf", cfg, ts, meta={"block_count": 8, "nextn_predict_layers": 0})
  refuse(p, "tensor blk.8.nextn.", "block 8 beyond block_count 8 (multi-layer MTP is not supported)")
  ts = dict(tensors, **{"blk.9.attn_norm.weight": np.ones((cfg.hidden_size,), np.float32)})
  p = build(tmp_path / "b9.gguf", cfg, ts, meta={"block_count": 9})
  msg = refuse(p, "tensor blk.9.attn_norm.weight: block 9 beyond block_count 9")
  assert "MTP" not in msg


def test_refuse_unopenable_path_and_unknown_tensor(tmp_path, good):
  refuse(tmp_path, "cannot open", "Is a directory")
  refuse(tmp_path / "absent.gguf", "cannot open", "No such file")
  m = gguf_io.read_gguf(good)
  with pytest.raises(GGUFError) as e:
    m.tensor_info("blk.0.nope")
  assert str(e.value) == f"{good}: no tensor named blk.0.nope"


def test_writer_refuses_foreign_tensor_and_unquantizable_rows(tmp_path, cfg, tensors):
  ts = dict(tensors, **{"blk.0.extra.weight": np.zeros((4,), np.float32)})
  with pytest.raises(GGUFError, match=r"x.gguf: tensor blk.0.extra.weight: not part of a qwen35 model"):
    gguf_io.write_gguf(tmp_path / "x.gguf", cfg, ts, None)
  c = config.tiny(hidden_size=48)         # rows of 48 values: not whole Q8_0 blocks of 32
  from kvjax.weights import random_tensors
  with pytest.raises(GGUFError, match=r"y.gguf: tensor \S+: Q8_0 needs rows of a multiple of 32, found shape "
                                      r"\(\d+, 48\)"):
    gguf_io.write_gguf(tmp_path / "y.gguf", c, random_tensors(c, 0), None, weight_type="q8_0")
