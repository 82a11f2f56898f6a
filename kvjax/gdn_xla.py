"""The gated delta rule in XLA: a token's step, the token scan (decode and verify rows on the CPU; comparisons) and the
chunked WY form (prefill), the forms the Gated DeltaNet runs where no kernel does (`kvjax.model.GatedDeltaNet`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

GDN_CHUNK = 64
_HI = lax.Precision.HIGHEST


def delta_rule_step(state_hkv, q_hk, k_hk, v_hv, g_h, beta_h):
  """One token of the gated delta rule for every value head (inputs already tiled to Hv)."""
  s = jnp.exp(g_h)[:, None, None] * state_hkv
  d_hv = (v_hv - jnp.einsum("hkv,hk->hv", s, k_hk, precision=_HI)) * beta_h[:, None]
  s = s + k_hk[:, :, None] * d_hv[:, None, :]
  o_hv = jnp.einsum("hkv,hk->hv", s, q_hk, precision=_HI)
  return s, o_hv


def delta_rule_scan(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, capture: bool = False):
  """Token-by-token gated delta rule (the decode form). With `capture`, the returned state has a leading row axis:
  the state after each row (speculative verification keeps the one after the last accepted row)."""
  def body(s, xs):
    s, o = delta_rule_step(s, *xs)
    return s, ((o, s) if capture else o)
  state_hkv, ys = lax.scan(body, state_hkv, (q_shk, k_shk, v_shv, g_sh, beta_sh))
  if capture:
    o_shv, states_shkv = ys
    return states_shkv, o_shv
  return state_hkv, ys


def delta_rule_chunked(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, chunk: int = GDN_CHUNK):
  """Chunked (WY-form) gated delta rule, algebraically identical to `delta_rule_scan`.

  Within a chunk with cumulative log-decay gamma_t and chunk-start state S0:
    (I + diag(beta) M) D = diag(beta) (V - diag(e^gamma) K S0),  M[t,i] = e^(gamma_t-gamma_i) k_t.k_i (i < t)
    O  = diag(e^gamma) Q S0 + (Q K^T * e^(gamma_t-gamma_i) [i <= t]) D
    S1 = e^gamma_C S0 + K^T diag(e^(gamma_C - gamma)) D
  Padding tokens (k = v = beta = g = 0) leave the state unchanged.
  """
  s = q_shk.shape[0]
  c = min(chunk, s)
  n = -(-s // c)
  pad = n * c - s

  def prep(x):
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(n, c, *x.shape[1:]).swapaxes(1, 2)  # [n, H, c, ...]

  qs, ks, vs = prep(q_shk), prep(k_shk), prep(v_shv)
  gs, bs = prep(g_sh), prep(beta_sh)  # [n, H, c]
  tri_strict = jnp.tril(jnp.ones((c, c), bool), -1)
  tri_incl = jnp.tril(jnp.ones((c, c), bool))

  def body(s0_hkv, xs):
    q, k, v, g, b = xs                         # q/k [H, c, dk], v [H, c, dv], g/b [H, c]
    gam = jnp.cumsum(g, axis=-1)               # [H, c]
    diff = gam[:, :, None] - gam[:, None, :]   # gamma_t - gamma_i
    decay_strict = jnp.where(tri_strict, jnp.exp(jnp.where(tri_strict, diff, 0.0)), 0.0)
    decay_incl = jnp.where(tri_incl, jnp.exp(jnp.where(tri_incl, diff, 0.0)), 0.0)
    kk = jnp.einsum("htk,hik->hti", k, k, precision=_HI)
    a = jnp.eye(c)[None] + b[:, :, None] * kk * decay_strict
    eg = jnp.exp(gam)
    rhs = b[:, :, None] * (v - eg[:, :, None] * jnp.einsum("htk,hkv->htv", k, s0_hkv, precision=_HI))
    d = jax.scipy.linalg.solve_triangular(a, rhs, lower=True, unit_diagonal=True)
    qk = jnp.einsum("htk,hik->hti", q, k, precision=_HI) * decay_incl
    o = eg[:, :, None] * jnp.einsum("htk,hkv->htv", q, s0_hkv, precision=_HI) + \
        jnp.einsum("hti,hiv->htv", qk, d, precision=_HI)
    tail = jnp.exp(gam[:, -1:] - gam)          # e^(gamma_C - gamma_i)
    s1 = jnp.exp(gam[:, -1])[:, None, None] * s0_hkv + jnp.einsum("hik,hi,hiv->hkv", k, tail, d,
                                                                  precision=_HI)
    return s1, o

  state_hkv, o = lax.scan(body, state_hkv, (qs, ks, vs, gs, bs))  # o [n, H, c, dv]
  o_shv = o.swapaxes(1, 2).reshape(n * c, o.shape[1], o.shape[-1])[:s]
  return state_hkv, o_shv

