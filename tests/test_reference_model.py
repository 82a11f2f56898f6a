"""Sanity tests of the float64 numpy reference model itself (tests/reference_model.py)."""

import numpy as np
import pytest

import reference_model as ref
from kvjax import config
from kvjax.weights import random_tensors

S = 10


@pytest.fixture(scope="module")
def cfg():
  return config.tiny()


@pytest.fixture(scope="module")
def tensors(cfg):
  return random_tensors(cfg, seed=3)


@pytest.fixture(scope="module")
def tokens(cfg):
  return np.random.default_rng(0).integers(0, cfg.vocab_size, S)


@pytest.fixture(scope="module")
def base(cfg, tensors, tokens):
  return ref.forward(cfg, tensors, tokens, return_hidden=True)


def _rel(a, b):
  return np.max(np.abs(a - b)) / np.max(np.abs(b))


# ---- shapes and plumbing -------------------------------------------------------

def test_shapes_and_finite(cfg, tensors, tokens, base):
  logits, hn = base
  assert logits.shape == (S, cfg.vocab_size) and logits.dtype == np.float64
  assert hn.shape == (S, cfg.hidden_size) and hn.dtype == np.float64
  assert np.all(np.isfinite(logits))
  # Output head is `output.weight` when present.
  np.testing.assert_allclose(logits, hn @ tensors["output.weight"].astype(np.float64).T,
                             rtol=1e-12, atol=1e-12)
  m = ref.mtp_logits(cfg, tensors, tokens)
  assert m.shape == (S - 1, cfg.vocab_size) and np.all(np.isfinite(m))
  # Random weights keep activations O(1): logits are neither tiny nor exploding.
  assert 0.1 < np.std(logits) < 100.0 and 0.1 < np.std(m) < 100.0


def test_tied_embeddings_use_token_embd():
  cfg = config.tiny(tie_embeddings=True)
  t = random_tensors(cfg, seed=1)
  assert "output.weight" not in t
  logits, hn = ref.forward(cfg, t, np.arange(5), return_hidden=True)
  np.testing.assert_allclose(logits, hn @ t["token_embd.weight"].astype(np.float64).T,
                             rtol=1e-12, atol=1e-12)


def test_bad_inputs_are_refused(cfg, tensors):
  with pytest.raises(ValueError, match=r"\[0, 384\)"):
    ref.forward(cfg, tensors, np.array([1, cfg.vocab_size]))
  with pytest.raises(ValueError, match="1-D"):
    ref.forward(cfg, tensors, np.zeros((2, 2), int))
  missing = {k: v for k, v in tensors.items() if k != "blk.3.attn_k.weight"}
  with pytest.raises(KeyError, match="blk.3.attn_k.weight"):
    ref.forward(cfg, missing, np.arange(3))
  bad = dict(tensors)
  bad["blk.0.ssm_a"] = np.zeros(7)
  with pytest.raises(ValueError, match="blk.0.ssm_a"):
    ref.forward(cfg, bad, np.arange(3))
  with pytest.raises(ValueError, match="at least 2"):
    ref.mtp_logits(cfg, tensors, np.arange(1))
  with pytest.raises(ValueError, match="unknown KV cache kind"):
    ref.forward(cfg, tensors, np.arange(3), kv_roundtrip=("q5_0", "f16"))


# ---- causality -----------------------------------------------------------------

def test_target_is_causal(cfg, tensors, tokens, base):
  logits = base[0]
  t = 4
  changed = tokens.copy()
  changed[t + 1:] = (changed[t + 1:] + 17) % cfg.vocab_size
  logits2 = ref.forward(cfg, tensors, changed)
  np.testing.assert_allclose(logits2[:t + 1], logits[:t + 1], rtol=0, atol=1e-11)
  # ... and later rows do see the change (so the test above is not vacuous).
  assert np.max(np.abs(logits2[t + 1:] - logits[t + 1:])) > 1e-3


def test_prefix_forward_matches(cfg, tensors, tokens, base):
  """Running only a prefix gives the same rows (no dependence on sequence length)."""
  np.testing.assert_allclose(ref.forward(cfg, tensors, tokens[:6]), base[0][:6],
                             rtol=0, atol=1e-11)


def test_mtp_row_depends_only_on_tokens_up_to_t_plus_1(cfg, tensors, tokens):
  m = ref.mtp_logits(cfg, tensors, tokens)
  t = 3
  later = tokens.copy()
  later[t + 2:] = (later[t + 2:] + 5) % cfg.vocab_size
  m2 = ref.mtp_logits(cfg, tensors, later)
  np.testing.assert_allclose(m2[:t + 1], m[:t + 1], rtol=0, atol=1e-11)
  assert np.max(np.abs(m2[t + 1:] - m[t + 1:])) > 1e-3
  # Row t does depend on token t+1 (the embedded token), rows before it do not.
  nxt = tokens.copy()
  nxt[t + 1] = (nxt[t + 1] + 1) % cfg.vocab_size
  m3 = ref.mtp_logits(cfg, tensors, nxt)
  np.testing.assert_allclose(m3[:t], m[:t], rtol=0, atol=1e-11)
  assert np.max(np.abs(m3[t] - m[t])) > 1e-3


def test_mtp_head_fallbacks(cfg, tokens):
  """Without shared_head_{norm,head}, the MTP head uses output_norm / output."""
  t_min = random_tensors(cfg, seed=5, include_optional=False)
  assert "blk.8.nextn.shared_head_head.weight" not in t_min
  t_full = dict(t_min)
  t_full["blk.8.nextn.shared_head_norm.weight"] = t_min["output_norm.weight"]
  t_full["blk.8.nextn.shared_head_head.weight"] = t_min["output.weight"]
  a = ref.mtp_logits(cfg, t_min, tokens)
  b = ref.mtp_logits(cfg, t_full, tokens)
  np.testing.assert_array_equal(a, b)
  # Changing the shared head changes the result (it is really used).
  t_full["blk.8.nextn.shared_head_norm.weight"] = t_min["output_norm.weight"] * 1.5
  assert _rel(ref.mtp_logits(cfg, t_full, tokens), a) > 1e-3


def test_mtp_first_row_by_hand(cfg, tensors, tokens):
  """Row 0 sees one MTP row: its attention is softmax over a single key = v."""
  eps = cfg.rms_eps
  f64 = lambda n: tensors[n].astype(np.float64)
  _, hn = ref.forward(cfg, tensors, tokens[:2], return_hidden=True)
  p = "blk.8."
  e = ref.rms(f64("token_embd.weight")[tokens[1]], f64(p + "nextn.enorm.weight"), eps)
  hh = ref.rms(hn[0], f64(p + "nextn.hnorm.weight"), eps)
  u = np.concatenate([e, hh]) @ f64(p + "nextn.eh_proj.weight").T
  h = ref.rms(u, f64(p + "attn_norm.weight"), eps)
  D, Hq = cfg.head_dim, cfg.num_attention_heads
  gate = (h @ f64(p + "attn_q.weight").T).reshape(Hq, 2 * D)[:, D:]
  v = (h @ f64(p + "attn_v.weight").T).reshape(cfg.num_kv_heads, D)
  o = np.stack([v[j // cfg.q_per_kv] for j in range(Hq)])
  u = u + (o * (1 / (1 + np.exp(-gate)))).reshape(-1) @ f64(p + "attn_output.weight").T
  h = ref.rms(u, f64(p + "post_attention_norm.weight"), eps)
  g = h @ f64(p + "ffn_gate.weight").T
  u = u + (g / (1 + np.exp(-g)) * (h @ f64(p + "ffn_up.weight").T)) @ f64(p + "ffn_down.weight").T
  hm = ref.rms(u, f64(p + "nextn.shared_head_norm.weight"), eps)
  want = hm @ f64(p + "nextn.shared_head_head.weight").T
  got = ref.mtp_logits(cfg, tensors, tokens[:2])
  np.testing.assert_allclose(got[0], want, rtol=1e-10, atol=1e-10)


# ---- Gated DeltaNet recurrence -------------------------------------------------

def _rand_gdn(rng, S, Hk, Hv, d):
  q = ref.l2norm(rng.standard_normal((S, Hk, d)), 1e-6) / np.sqrt(d)
  k = ref.l2norm(rng.standard_normal((S, Hk, d)), 1e-6)
  v = rng.standard_normal((S, Hv, d))
  g = -rng.uniform(0.05, 2.0, (S, Hv))
  beta = rng.uniform(0.1, 0.9, (S, Hv))
  return q, k, v, g, beta


def test_gdn_two_tokens_closed_form():
  rng = np.random.default_rng(7)
  Hk, Hv, d = 2, 4, 8
  q, k, v, g, beta = _rand_gdn(rng, 2, Hk, Hv, d)
  o = ref.gated_delta_rule(q, k, v, g, beta)
  for j in range(Hv):
    kh = j % Hk  # tiled GGUF order
    k1, k2, q1, q2 = k[0, kh], k[1, kh], q[0, kh], q[1, kh]
    b1, b2, a2 = beta[0, j], beta[1, j], np.exp(g[1, j])
    # S1 = b1 k1 v1^T  ->  o1 = b1 (k1.q1) v1
    o1 = b1 * (k1 @ q1) * v[0, j]
    # d2 = b2 (v2 - a2 b1 (k1.k2) v1);  S2 = a2 S1 + k2 d2^T
    d2 = b2 * (v[1, j] - a2 * b1 * (k1 @ k2) * v[0, j])
    o2 = a2 * b1 * (k1 @ q2) * v[0, j] + (k2 @ q2) * d2
    np.testing.assert_allclose(o[0, j], o1, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(o[1, j], o2, rtol=1e-12, atol=1e-14)


def test_gdn_matches_parallel_matrix_form():
  """Whole-sequence closed form: (I + A) D = diag(beta) V, O = (M * QK^T) D."""
  rng = np.random.default_rng(11)
  T, Hk, Hv, d = 9, 2, 4, 8
  q, k, v, g, beta = _rand_gdn(rng, T, Hk, Hv, d)
  o = ref.gated_delta_rule(q, k, v, g, beta)
  for j in range(Hv):
    K, Q = k[:, j % Hk], q[:, j % Hk]
    G = np.cumsum(g[:, j])
    decay = np.exp(G[:, None] - G[None, :])
    A = np.tril(beta[:, j, None] * decay * (K @ K.T), -1)
    Dm = np.linalg.solve(np.eye(T) + A, beta[:, j, None] * v[:, j])
    O = np.tril(decay * (Q @ K.T)) @ Dm
    np.testing.assert_allclose(o[:, j], O, rtol=1e-10, atol=1e-12)


def test_gdn_value_heads_tile_key_heads():
  """Value head j must read key head j % Hk, not j // (Hv/Hk)."""
  rng = np.random.default_rng(2)
  q, k, v, g, beta = _rand_gdn(rng, 4, 2, 4, 8)
  o = ref.gated_delta_rule(q, k, v, g, beta)
  # Value head 1 alone with key head 1 (tiled) vs key head 0 (grouped).
  o_tiled = ref.gated_delta_rule(q[:, 1:2], k[:, 1:2], v[:, 1:2], g[:, 1:2], beta[:, 1:2])
  o_grouped = ref.gated_delta_rule(q[:, 0:1], k[:, 0:1], v[:, 1:2], g[:, 1:2], beta[:, 1:2])
  np.testing.assert_array_equal(o[:, 1], o_tiled[:, 0])
  assert np.max(np.abs(o[:, 1] - o_grouped[:, 0])) > 1e-3


def test_causal_conv_by_hand():
  rng = np.random.default_rng(4)
  x = rng.standard_normal((5, 3))
  w = rng.standard_normal((3, 4))
  c = ref.causal_conv_silu(x, w)
  # t = 1: xpad = [0, 0, 0, x0, x1, ...] -> w[:,2]*x0 + w[:,3]*x1
  pre = w[:, 2] * x[0] + w[:, 3] * x[1]
  np.testing.assert_allclose(c[1], pre / (1 + np.exp(-pre)), rtol=1e-13)
  pre = w[:, 0] * x[1] + w[:, 1] * x[2] + w[:, 2] * x[3] + w[:, 3] * x[4]
  np.testing.assert_allclose(c[4], pre / (1 + np.exp(-pre)), rtol=1e-13)


def test_l2norm_eps_placement():
  x = np.array([[3e-4, 4e-4]])
  # eps inside the sqrt of the SUM (not the mean): |x|^2 = 2.5e-7.
  np.testing.assert_allclose(ref.l2norm(x, 1e-6), x / np.sqrt(2.5e-7 + 1e-6), rtol=1e-14)


# ---- RoPE ----------------------------------------------------------------------

def test_rope_relative_position_property():
  rng = np.random.default_rng(5)
  D, rd, theta = 64, 16, 1e7
  q = rng.standard_normal((1, 1, D))
  k = rng.standard_normal((1, 1, D))
  def dot(m, n):
    return float(ref.rope(q, [m], rd, theta)[0, 0] @ ref.rope(k, [n], rd, theta)[0, 0])
  for m, n in [(5, 2), (40, 3), (1000, 999)]:
    for c in (1, 17, 4096):
      np.testing.assert_allclose(dot(m + c, n + c), dot(m, n), rtol=1e-9)
  assert abs(dot(5, 2) - dot(6, 2)) > 1e-6  # position difference does matter
  # Partial: dims >= rope_dim untouched, rotation preserves the norm, pos 0 = identity.
  r = ref.rope(q, [123], rd, theta)
  np.testing.assert_array_equal(r[..., rd:], q[..., rd:])
  np.testing.assert_allclose(np.linalg.norm(r), np.linalg.norm(q), rtol=1e-13)
  np.testing.assert_allclose(ref.rope(q, [0], rd, theta), q, rtol=0, atol=0)


def test_rope_neox_pairs():
  D, rd, theta = 8, 4, 100.0
  x = np.zeros((1, 1, D))
  x[0, 0, 1] = 1.0  # dim 1 pairs with dim 1 + rd/2 = 3, inv_freq = theta^(-2/4)
  ang = 7 * theta ** (-0.5)
  r = ref.rope(x, [7], rd, theta)[0, 0]
  np.testing.assert_allclose(r, [0, np.cos(ang), 0, np.sin(ang), 0, 0, 0, 0], atol=1e-15)


# ---- quantized KV round trip --------------------------------------------------

def test_kv_roundtrip_f32_and_ordering(cfg, tensors, tokens, base):
  logits = base[0]
  f32 = ref.forward(cfg, tensors, tokens, kv_roundtrip=("f32", "f32"))
  # The round trip runs in float32: equal to the float64 model up to float32
  # rounding of K and V, not beyond.
  assert _rel(f32, logits) < 1e-5
  errs = {}
  for kind in ("f16", "bf16", "q8_0", "q4_0"):
    errs[kind] = _rel(ref.forward(cfg, tensors, tokens, kv_roundtrip=(kind, kind)), logits)
  assert errs["f16"] < errs["q8_0"] < errs["q4_0"] < 0.5
  assert errs["f16"] < errs["bf16"] < errs["q4_0"]
  assert errs["f16"] > _rel(f32, logits)


def test_kv_roundtrip_acts_on_k_and_v_separately(cfg, tensors, tokens, base):
  logits = base[0]
  kq = ref.forward(cfg, tensors, tokens, kv_roundtrip=("q4_0", "f32"))
  vq = ref.forward(cfg, tensors, tokens, kv_roundtrip=("f32", "q4_0"))
  assert _rel(kq, logits) > 1e-4 and _rel(vq, logits) > 1e-4
  assert _rel(kq, vq) > 1e-4


def test_kv_row_roundtrip_values():
  rng = np.random.default_rng(9)
  x = rng.standard_normal((3, 2, 64))
  np.testing.assert_array_equal(ref.kv_row_roundtrip(x, "f32"),
                                x.astype(np.float32).astype(np.float64))
  np.testing.assert_array_equal(ref.kv_row_roundtrip(x, "f16"),
                                x.astype(np.float16).astype(np.float64))
  # Q8_0 by the formula: per 32-block d = amax/127, q = round(x/d), x' = q * fp16(d).
  y = ref.kv_row_roundtrip(x, "q8_0")
  blk = x.astype(np.float32).reshape(-1, 32)
  d = np.abs(blk).max(-1, keepdims=True) / np.float32(127)
  q = np.clip(np.trunc(blk * (np.float32(1) / d) + np.copysign(0.5, blk)), -127, 127)
  want = (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape)
  np.testing.assert_allclose(y, want, rtol=0, atol=1e-6)
  # Each row is encoded on its own: one row alone gives the same values.
  np.testing.assert_array_equal(ref.kv_row_roundtrip(x[1:2, 1:2], "q4_0"),
                                ref.kv_row_roundtrip(x, "q4_0")[1:2, 1:2])
  with pytest.raises(ValueError, match="multiple of 32"):
    ref.kv_row_roundtrip(np.zeros((1, 1, 48)), "q8_0")


# ---- layer wiring, by hand for tiny sequences -------------------------------------

def _sig(x):
  return 1 / (1 + np.exp(-x))


def test_gated_deltanet_single_token_by_hand(cfg, tensors):
  """S = 1: conv sees only its last tap, the state starts at 0, so o = beta (k.q) v."""
  rng = np.random.default_rng(12)
  h = rng.standard_normal(cfg.hidden_size)
  i, eps = 0, cfg.rms_eps
  W = lambda n: tensors[f"blk.{i}.{n}"].astype(np.float64)
  Hk, Hv, dh = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_head_dim
  pre = (h @ W("attn_qkv.weight").T) * W("ssm_conv1d.weight")[:, -1]
  c = pre * _sig(pre)
  q = c[:Hk * dh].reshape(Hk, dh)
  k = c[Hk * dh:2 * Hk * dh].reshape(Hk, dh)
  v = c[2 * Hk * dh:].reshape(Hv, dh)
  q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps) / np.sqrt(dh)
  k = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
  beta = _sig(h @ W("ssm_beta.weight").T)
  z = (h @ W("attn_gate.weight").T).reshape(Hv, dh)
  o = np.stack([beta[j] * (k[j % Hk] @ q[j % Hk]) * v[j] for j in range(Hv)])
  o = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * W("ssm_norm.weight") * z * _sig(z)
  want = o.reshape(-1) @ W("ssm_out.weight").T
  got = ref.gated_deltanet(cfg, tensors, i, h[None])
  np.testing.assert_allclose(got[0], want, rtol=1e-11, atol=1e-12)


def test_gated_deltanet_two_tokens_by_hand(cfg, tensors):
  """S = 2 through the whole layer: conv taps, softplus decay, delta rule, gate."""
  rng = np.random.default_rng(13)
  h = rng.standard_normal((2, cfg.hidden_size))
  i, eps = 1, cfg.rms_eps
  W = lambda n: tensors[f"blk.{i}.{n}"].astype(np.float64)
  Hk, Hv, dh = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_head_dim
  x = h @ W("attn_qkv.weight").T
  w = W("ssm_conv1d.weight")
  pre = np.stack([x[0] * w[:, -1], x[0] * w[:, -2] + x[1] * w[:, -1]])
  c = pre * _sig(pre)
  q = c[:, :Hk * dh].reshape(2, Hk, dh)
  k = c[:, Hk * dh:2 * Hk * dh].reshape(2, Hk, dh)
  v = c[:, 2 * Hk * dh:].reshape(2, Hv, dh)
  q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps) / np.sqrt(dh)
  k = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
  beta = _sig(h @ W("ssm_beta.weight").T)
  alpha = h @ W("ssm_alpha.weight").T + W("ssm_dt.bias")
  decay = np.exp(np.log1p(np.exp(alpha)) * W("ssm_a"))  # exp(softplus(.) * a)
  o = np.zeros((2, Hv, dh))
  for j in range(Hv):
    k1, k2, q1, q2 = k[0, j % Hk], k[1, j % Hk], q[0, j % Hk], q[1, j % Hk]
    b1, b2, a2 = beta[0, j], beta[1, j], decay[1, j]
    o[0, j] = b1 * (k1 @ q1) * v[0, j]
    d2 = b2 * (v[1, j] - a2 * b1 * (k1 @ k2) * v[0, j])
    o[1, j] = a2 * b1 * (k1 @ q2) * v[0, j] + (k2 @ q2) * d2
  z = (h @ W("attn_gate.weight").T).reshape(2, Hv, dh)
  o = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * W("ssm_norm.weight") * z * _sig(z)
  want = o.reshape(2, -1) @ W("ssm_out.weight").T
  got = ref.gated_deltanet(cfg, tensors, i, h)
  np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
  assert np.max(decay[1]) > 1e-2  # the carried state really contributes


def test_gated_attention_two_tokens_by_hand(cfg, tensors):
  rng = np.random.default_rng(14)
  h = rng.standard_normal((2, cfg.hidden_size))
  i, eps = 3, cfg.rms_eps
  W = lambda n: tensors[f"blk.{i}.{n}"].astype(np.float64)
  Hq, Hkv, D, rd = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_dim
  qg = (h @ W("attn_q.weight").T).reshape(2, Hq, 2 * D)
  q, gate = qg[..., :D], qg[..., D:]
  k = (h @ W("attn_k.weight").T).reshape(2, Hkv, D)
  v = (h @ W("attn_v.weight").T).reshape(2, Hkv, D)
  nrm = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
  q, k = nrm(q, W("attn_q_norm.weight")), nrm(k, W("attn_k_norm.weight"))
  # Position 0 is unrotated; position 1 rotates pair (d, d + rd/2) by theta^(-2d/rd).
  def rot1(x):
    y = x.copy()
    for dd in range(rd // 2):
      a = cfg.rope_theta ** (-2 * dd / rd)
      y[..., dd] = x[..., dd] * np.cos(a) - x[..., dd + rd // 2] * np.sin(a)
      y[..., dd + rd // 2] = x[..., dd + rd // 2] * np.cos(a) + x[..., dd] * np.sin(a)
    return y
  q[1], k[1] = rot1(q[1]), rot1(k[1])
  o = np.zeros((2, Hq, D))
  for hh in range(Hq):
    g = hh // (Hq // Hkv)
    o[0, hh] = v[0, g]
    s = np.array([q[1, hh] @ k[0, g], q[1, hh] @ k[1, g]]) / np.sqrt(D)
    w = np.exp(s - s.max())
    w /= w.sum()
    o[1, hh] = w[0] * v[0, g] + w[1] * v[1, g]
  want = (o * _sig(gate)).reshape(2, -1) @ W("attn_output.weight").T
  got = ref.gated_attention(cfg, tensors, i, h, np.arange(2))
  np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
