"""Independent float64 numpy reference of the Qwen3.8 hybrid target and MTP head.

Written directly from `qwen38-architecture.md` (the exact model math), NOT from
`kvjax.model`: it is the oracle the JAX model's logits are checked against.
Everything is float64 and deliberately plain (loops over tokens for the
Gated DeltaNet recurrence). Only `kvjax.config` (geometry, GGUF tensor names)
is imported from kvjax.

Conventions (GGUF): a matrix `W` is `[out, in]` and applied as `x @ W.T`;
norm weights already include Hugging Face's +1 (`ssm_norm` is plain in both);
Gated DeltaNet value head j reads key head `j % Hk` (tiled order).

Public API:
  forward(cfg, tensors, tokens, kv_roundtrip=None, return_hidden=False)
  mtp_logits(cfg, tensors, tokens, kv_roundtrip=None)
and the building blocks used by the tests: `rms`, `rope`, `kv_row_roundtrip`,
`causal_conv_silu`, `gated_delta_rule`, `gated_attention`, `gated_deltanet`.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import gguf
import numpy as np

from kvjax.config import ModelConfig, gguf_tensor_shapes

KV_KINDS = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "f32": gguf.GGMLQuantizationType.F32,
}
_BLOCKED_KINDS = ("q8_0", "q4_0")  # 32-value blocks along head_dim

Tensors = Dict[str, np.ndarray]


# ---- elementwise helpers ---------------------------------------------------

def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _silu(x):
  return x * _sigmoid(x)


def _softplus(x):
  # log(1 + exp(x)), stable for large |x|.
  return np.logaddexp(0.0, x)


def rms(x, w, eps):
  """RMS norm over the last axis: `x / sqrt(mean(x^2) + eps) * w`."""
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def l2norm(x, eps):
  """`x / sqrt(sum(x^2) + eps)` over the last axis (eps inside the sqrt)."""
  return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def rope(x_shd, positions_s, rope_dim, theta):
  """NeoX partial RoPE.

  x_shd: `[S, H, D]`; positions_s: `[S]` ints. Dims `d` and `d + rope_dim/2`
  (d < rope_dim/2) rotate together by `pos * theta^(-2d/rope_dim)`;
  dims >= rope_dim pass through unchanged.
  """
  half = rope_dim // 2
  inv_freq = theta ** (-(2.0 * np.arange(half)) / rope_dim)          # [half]
  ang_sd = np.asarray(positions_s, np.float64)[:, None] * inv_freq[None, :]
  cos = np.cos(ang_sd)[:, None, :]
  sin = np.sin(ang_sd)[:, None, :]
  x1 = x_shd[..., :half]
  x2 = x_shd[..., half:rope_dim]
  out = x_shd.copy()
  out[..., :half] = x1 * cos - x2 * sin
  out[..., half:rope_dim] = x2 * cos + x1 * sin
  return out


def kv_row_roundtrip(x_shd, kind):
  """Quantize then dequantize K or V rows with the `gguf` package, in float32.

  x_shd: `[S, Hkv, D]` float64; every `[D]` row (one token, one head) is
  encoded independently (ggml blocks of 32 run along D). Returns float64.
  """
  if kind not in KV_KINDS:
    raise ValueError(f"unknown KV cache kind {kind!r}; known: {sorted(KV_KINDS)}")
  d = x_shd.shape[-1]
  if kind in _BLOCKED_KINDS and d % 32:
    raise ValueError(f"KV kind {kind} needs head_dim a multiple of 32, got {d}")
  qtype = KV_KINDS[kind]
  rows = np.ascontiguousarray(x_shd.reshape(-1, d).astype(np.float32))
  back = gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype)
  return np.asarray(back, np.float32).reshape(x_shd.shape).astype(np.float64)


# ---- tensor access -----------------------------------------------------------

def _get(tensors: Tensors, name: str) -> np.ndarray:
  if name not in tensors:
    raise KeyError(f"reference model: tensor {name!r} is missing")
  return np.asarray(tensors[name], np.float64)


def _opt(tensors: Tensors, *names: str) -> np.ndarray:
  """The first of `names` present in `tensors` (fallback chain)."""
  for n in names:
    if n in tensors:
      return np.asarray(tensors[n], np.float64)
  raise KeyError(f"reference model: none of {names} is present")


def _check_inputs(cfg: ModelConfig, tensors: Tensors, tokens, need_mtp: bool):
  tokens = np.asarray(tokens)
  if tokens.ndim != 1 or tokens.shape[0] < 1:
    raise ValueError(f"tokens must be a non-empty 1-D array, got shape {tokens.shape}")
  if not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
  if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
    raise ValueError(f"token ids must be in [0, {cfg.vocab_size}), got range "
                     f"[{tokens.min()}, {tokens.max()}]")
  if need_mtp and not cfg.has_mtp:
    raise ValueError("config has no MTP block (mtp_layers=0)")
  for name, shape in gguf_tensor_shapes(cfg, include_optional=False).items():
    if name.startswith(f"blk.{cfg.mtp_block}.") and cfg.has_mtp and not need_mtp:
      continue
    if name not in tensors:
      raise KeyError(f"reference model: tensor {name!r} is missing")
    if tuple(np.shape(tensors[name])) != tuple(shape):
      raise ValueError(f"tensor {name!r} has shape {np.shape(tensors[name])}, "
                       f"expected {shape}")
  return tokens.astype(np.int64)


# ---- blocks ------------------------------------------------------------------

def swiglu(tensors: Tensors, i: int, h_se):
  p = f"blk.{i}."
  gate = h_se @ _get(tensors, p + "ffn_gate.weight").T
  up = h_se @ _get(tensors, p + "ffn_up.weight").T
  return (_silu(gate) * up) @ _get(tensors, p + "ffn_down.weight").T


def gated_attention(cfg: ModelConfig, tensors: Tensors, i: int, h_se, positions_s,
                    kv_roundtrip: Optional[Tuple[str, str]] = None):
  """Gated full attention of block i over the rows of `h_se` (causal)."""
  p = f"blk.{i}."
  S = h_se.shape[0]
  Hq, Hkv, D = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
  eps = cfg.rms_eps
  qg_shd = (h_se @ _get(tensors, p + "attn_q.weight").T).reshape(S, Hq, 2 * D)
  q_shd, gate_shd = qg_shd[..., :D], qg_shd[..., D:]
  k_sgd = (h_se @ _get(tensors, p + "attn_k.weight").T).reshape(S, Hkv, D)
  v_sgd = (h_se @ _get(tensors, p + "attn_v.weight").T).reshape(S, Hkv, D)
  q_shd = rope(rms(q_shd, _get(tensors, p + "attn_q_norm.weight"), eps),
               positions_s, cfg.rope_dim, cfg.rope_theta)
  k_sgd = rope(rms(k_sgd, _get(tensors, p + "attn_k_norm.weight"), eps),
               positions_s, cfg.rope_dim, cfg.rope_theta)
  if kv_roundtrip is not None:
    k_kind, v_kind = kv_roundtrip
    k_sgd = kv_row_roundtrip(k_sgd, k_kind)
    v_sgd = kv_row_roundtrip(v_sgd, v_kind)
  causal = np.tril(np.ones((S, S), bool))
  o_shd = np.zeros((S, Hq, D))
  for h in range(Hq):
    g = h // cfg.q_per_kv
    scores = (q_shd[:, h, :] @ k_sgd[:, g, :].T) / np.sqrt(D)
    scores = np.where(causal, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    w = np.exp(scores)
    w = w / w.sum(axis=-1, keepdims=True)
    o_shd[:, h, :] = w @ v_sgd[:, g, :]
  o_se = o_shd.reshape(S, Hq * D) * _sigmoid(gate_shd.reshape(S, Hq * D))
  return o_se @ _get(tensors, p + "attn_output.weight").T


def causal_conv_silu(x_sc, w_ck):
  """Depthwise causal conv (no bias, zero left padding) followed by silu.

  `c[t, ch] = sum_j xpad[t + j, ch] * w[ch, j]`, `xpad = [K-1 zeros; x]`.
  """
  S, C = x_sc.shape
  K = w_ck.shape[1]
  xpad = np.concatenate([np.zeros((K - 1, C)), x_sc], axis=0)
  c = np.zeros((S, C))
  for t in range(S):
    for j in range(K):
      c[t] += xpad[t + j] * w_ck[:, j]
  return _silu(c)


def gated_delta_rule(q_skd, k_skd, v_svd, g_sv, beta_sv):
  """The per-token gated delta rule from a zero state.

  q, k: `[S, Hk, dk]` (already normalized), v: `[S, Hv, dv]`, g, beta `[S, Hv]`.
  Value head j reads key head `j % Hk`. Returns o `[S, Hv, dv]`.
  """
  S, Hk, dk = q_skd.shape
  _, Hv, dv = v_svd.shape
  o = np.zeros((S, Hv, dv))
  for j in range(Hv):
    kh = j % Hk
    state = np.zeros((dk, dv))
    for t in range(S):
      state = np.exp(g_sv[t, j]) * state
      d = (v_svd[t, j] - state.T @ k_skd[t, kh]) * beta_sv[t, j]
      state = state + np.outer(k_skd[t, kh], d)
      o[t, j] = state.T @ q_skd[t, kh]
  return o


def gated_deltanet(cfg: ModelConfig, tensors: Tensors, i: int, h_se):
  """Gated DeltaNet mixer of block i."""
  p = f"blk.{i}."
  S = h_se.shape[0]
  Hk, Hv, dh = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_head_dim
  eps = cfg.rms_eps
  qkv_sc = h_se @ _get(tensors, p + "attn_qkv.weight").T
  z_svd = (h_se @ _get(tensors, p + "attn_gate.weight").T).reshape(S, Hv, dh)
  beta_sv = _sigmoid(h_se @ _get(tensors, p + "ssm_beta.weight").T)
  g_sv = (_softplus(h_se @ _get(tensors, p + "ssm_alpha.weight").T
                    + _get(tensors, p + "ssm_dt.bias"))
          * _get(tensors, p + "ssm_a"))
  c_sc = causal_conv_silu(qkv_sc, _get(tensors, p + "ssm_conv1d.weight"))
  kd = cfg.linear_key_dim
  q_skd = c_sc[:, :kd].reshape(S, Hk, dh)
  k_skd = c_sc[:, kd:2 * kd].reshape(S, Hk, dh)
  v_svd = c_sc[:, 2 * kd:].reshape(S, Hv, dh)
  q_skd = l2norm(q_skd, eps) / np.sqrt(dh)
  k_skd = l2norm(k_skd, eps)
  o_svd = gated_delta_rule(q_skd, k_skd, v_svd, g_sv, beta_sv)
  o_svd = rms(o_svd, _get(tensors, p + "ssm_norm.weight"), eps) * _silu(z_svd)
  return o_svd.reshape(S, Hv * dh) @ _get(tensors, p + "ssm_out.weight").T


def decoder_block(cfg: ModelConfig, tensors: Tensors, i: int, x_se, positions_s,
                  kv_roundtrip=None):
  p = f"blk.{i}."
  eps = cfg.rms_eps
  h = rms(x_se, _get(tensors, p + "attn_norm.weight"), eps)
  if cfg.is_attention_layer(i):
    x_se = x_se + gated_attention(cfg, tensors, i, h, positions_s, kv_roundtrip)
  else:
    x_se = x_se + gated_deltanet(cfg, tensors, i, h)
  h = rms(x_se, _get(tensors, p + "post_attention_norm.weight"), eps)
  return x_se + swiglu(tensors, i, h)


# ---- public entry points -----------------------------------------------------

def forward(cfg: ModelConfig, tensors: Tensors, tokens, kv_roundtrip=None,
            return_hidden: bool = False):
  """Target forward from position 0.

  tokens: `[S]` ints. Returns logits `[S, V]` float64, and with
  `return_hidden` also `hn [S, E]`, the hidden after `output_norm`.
  `kv_roundtrip=(k_kind, v_kind)` passes attention K (after norm + rope) and
  V through a gguf quantize/dequantize per row before attention.
  """
  tokens = _check_inputs(cfg, tensors, tokens, need_mtp=False)
  S = tokens.shape[0]
  positions = np.arange(S)
  x = _get(tensors, "token_embd.weight")[tokens]
  for i in range(cfg.num_layers):
    x = decoder_block(cfg, tensors, i, x, positions, kv_roundtrip)
  hn = rms(x, _get(tensors, "output_norm.weight"), cfg.rms_eps)
  logits = hn @ _opt(tensors, "output.weight", "token_embd.weight").T
  return (logits, hn) if return_hidden else logits


def mtp_logits(cfg: ModelConfig, tensors: Tensors, tokens, kv_roundtrip=None):
  """Teacher-forced MTP logits `[S-1, V]`: row t predicts token t+2.

  Row t combines the target's post-norm hidden hn_t with the embedding of
  token t+1, runs the NextN block (`blk.{num_layers}`, own causal attention
  over the MTP rows, RoPE position t+1) and the shared head.
  """
  tokens = _check_inputs(cfg, tensors, tokens, need_mtp=True)
  S = tokens.shape[0]
  if S < 2:
    raise ValueError(f"mtp_logits needs at least 2 tokens, got {S}")
  _, hn = forward(cfg, tensors, tokens, kv_roundtrip=kv_roundtrip, return_hidden=True)
  eps = cfg.rms_eps
  b = cfg.mtp_block
  p = f"blk.{b}."
  embd = _opt(tensors, p + "nextn.embed_tokens.weight", "token_embd.weight")
  e = rms(embd[tokens[1:]], _get(tensors, p + "nextn.enorm.weight"), eps)
  hh = rms(hn[:-1], _get(tensors, p + "nextn.hnorm.weight"), eps)
  u = np.concatenate([e, hh], axis=-1) @ _get(tensors, p + "nextn.eh_proj.weight").T
  u = decoder_block(cfg, tensors, b, u, np.arange(1, S), kv_roundtrip)
  hm = rms(u, _opt(tensors, p + "nextn.shared_head_norm.weight", "output_norm.weight"), eps)
  head = _opt(tensors, p + "nextn.shared_head_head.weight", "output.weight",
              "token_embd.weight")
  return hm @ head.T
