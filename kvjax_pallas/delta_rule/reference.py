"""The gated delta rule, plain jnp: the token-by-token recurrence every kernel here is checked
against (`delta_rule_reference`) and its float64 numpy twin for the tests (`delta_rule_numpy`).

For each value head, with state S [dk, dv], per token t (decay g_t <= 0 in log space, beta_t in
(0, 1), k_t normalised):
  S <- e^(g_t) S
  S <- S + k_t ((v_t - S^T k_t) beta_t)^T
  o_t = S^T q_t
Shapes: state_hkv [H, dk, dv], q_shk / k_shk [S, H, dk], v_shv [S, H, dv], g_sh / beta_sh [S, H].
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def _step(s_hkv, q_hk, k_hk, v_hv, g_h, b_h):
  """One token for every head -> (the state after it, o_hv)."""
  s_hkv = jnp.exp(g_h)[:, None, None] * s_hkv
  d_hv = (v_hv - jnp.einsum("hkv,hk->hv", s_hkv, k_hk, precision=_HI)) * b_h[:, None]
  s_hkv = s_hkv + k_hk[:, :, None] * d_hv[:, None, :]
  return s_hkv, jnp.einsum("hkv,hk->hv", s_hkv, q_hk, precision=_HI)


def _f32(x):
  return jnp.asarray(x, jnp.float32)


def delta_rule_reference(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh):
  """-> (state_hkv after the last token, o_shv [S, H, dv]) in float32, one token a step."""
  return lax.scan(lambda s_hkv, xs: _step(s_hkv, *xs), _f32(state_hkv),
                  tuple(_f32(x) for x in (q_shk, k_shk, v_shv, g_sh, beta_sh)))


def delta_rule_rows_reference(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, n_rows=None, capture: bool = False):
  """`delta_rule_reference` over the first `n_rows` rows (traced; default all: rows past it leave the state and
  output zero rows) -> (the state after row n_rows - 1, or with `capture` the state after every row [S, H, dk,
  dv]; o_shv [S, H, dv])."""
  n = q_shk.shape[0] if n_rows is None else n_rows
  def step(s_hkv, xs):
    i, *row = xs
    new_hkv, o_hv = _step(s_hkv, *row)
    s_hkv = jnp.where(i < n, new_hkv, s_hkv)
    return s_hkv, (jnp.where(i < n, o_hv, 0.0), s_hkv)
  last, (o_shv, states) = lax.scan(step, _f32(state_hkv), (jnp.arange(q_shk.shape[0]),) + tuple(
      _f32(x) for x in (q_shk, k_shk, v_shv, g_sh, beta_sh)))
  return (states if capture else last), o_shv


def delta_rule_numpy(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh):
  """The same recurrence in float64 numpy (the tests' oracle)."""
  s = np.asarray(state_hkv, np.float64).copy()
  q, k, v, g, b = (np.asarray(x, np.float64) for x in (q_shk, k_shk, v_shv, g_sh, beta_sh))
  out = np.zeros(v.shape, np.float64)
  for t in range(q.shape[0]):
    s *= np.exp(g[t])[:, None, None]
    d = (v[t] - np.einsum("hkv,hk->hv", s, k[t])) * b[t][:, None]
    s += k[t][:, :, None] * d[:, None, :]
    out[t] = np.einsum("hkv,hk->hv", s, q[t])
  return s, out


def random_inputs(seed: int, tokens: int, heads: int, head_dim: int, value_dim: int = None):
  """Inputs as a Gated DeltaNet layer makes them: unit-norm keys, queries scaled by
  1/sqrt(head_dim), log decays in (-0.5, 0), beta in (0, 1), a random starting state."""
  dv = head_dim if value_dim is None else value_dim
  r = np.random.default_rng(seed)
  q = r.standard_normal((tokens, heads, head_dim))
  q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(head_dim)
  k = r.standard_normal((tokens, heads, head_dim))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  return tuple(np.asarray(x, np.float32) for x in (
      r.standard_normal((heads, head_dim, dv)), q, k, r.standard_normal((tokens, heads, dv)),
      r.uniform(-0.5, 0.0, (tokens, heads)), r.uniform(0.0, 1.0, (tokens, heads))))
