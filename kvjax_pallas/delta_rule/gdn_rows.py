"""A Gated DeltaNet layer's few rows (decode, verify) from its projections in one Pallas call: the causal
conv, silu, the q / k L2 norms, the gates and the gated delta rule (Triton lowering; `interpret=True`
anywhere).

A decode forward is paced by the host's launches; in XLA's form the steps between the layer's input
projection and the delta rule (the conv over [window; rows], silu, two L2 norms, the tiling of key heads
over value heads, the padding mask, beta = sigmoid(b), g = softplus(a + dt_bias) * A, the new conv window)
are several kernels a layer. Here a program (value head h, a block of `block_v` value columns) computes
what it needs of them itself, row by row inside the rows kernel's loop (`rows.py`, whose row step it
shares): the conv and norms of its key head h % Hk's q and k (dk channels), of its value columns, and
h's gates; rows at and past `n_valid` are padding (k = v = g = beta = 0 leave the state as it is). The
programs with h < Hk and the first value block also write their key head's q / k channels of the new
conv window, every program its value columns'. Each row's arithmetic is the same code whatever the
rows' count, so a decode row and the same row among verify rows agree bit for bit.

The projections come as columns of the joined input product's output (`starts`: where the conv's
channels, beta's and alpha's columns begin in `qkv`, `b`, `a`, which may be one array), read in place.
`rows=True` also returns each row's delta-rule inputs (k [S, H, dk] tiled and masked, v [S, H, dv],
g, beta [S, H]): what a replayed rollback steps through again with the rows kernel (`rows.py`).

`gdn_rows_reference` is the same in plain jnp (the model's XLA formulas).

Shapes: conv_kc [K-1, C] (C = 2 Hk dk + H dv), qkv [S, >= q0 + C], b / a [S, >= start + H], conv_w_ck
[C, K], dt_bias_h / a_h [H], state_hkv [H, dk, dv] -> (o_shv [S, H, dv], state_hkv, conv_kc), float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax_pallas.delta_rule import rows as _rows
from kvjax_pallas.delta_rule import triton as _triton


@dataclasses.dataclass(frozen=True)
class GdnHeads:
  """The layer's sizes (static)."""
  key_heads: int
  value_heads: int
  head_dim: int          # dk = dv
  conv_kernel: int
  eps: float

  @property
  def conv_dim(self) -> int:
    return (2 * self.key_heads + self.value_heads) * self.head_dim


def _softplus(x):
  return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _gdn_kernel(n_ref, cs_ref, qkv_ref, b_ref, a_ref, w_ref, dtb_ref, ah_ref, s0_ref,   # [2] int32 (rows, valid)
                o_ref, s_ref, cso_ref, *row_refs, hd: GdnHeads, starts: Tuple[int, int, int], block_v: int,
                capture: bool):
  hh, vb = pl.program_id(0), pl.program_id(1)
  dk, k_taps, hk = hd.head_dim, hd.conv_kernel, hd.key_heads
  q0, b0, a0 = starts
  kh = hh % hk                                          # GGUF tiled order: value head j reads key head j % Hk
  chans = ((kh * dk, dk), ((hk + kh) * dk, dk), (2 * hk * dk + hh * dk + vb * block_v, block_v))   # q, k, v
  taps = [[w_ref[pl.ds(c, n), j] for j in range(k_taps)] for c, n in chans]
  n_valid = n_ref[1]

  def window_row(idx, c, n):
    """Row idx of [conv window; rows] for channels c..c+n (idx traced)."""
    from_state = idx < k_taps - 1
    old = cs_ref[jnp.minimum(idx, k_taps - 2), pl.ds(c, n)]
    new = qkv_ref[jnp.maximum(idx - (k_taps - 1), 0), pl.ds(q0 + c, n)]
    return jnp.where(from_state, old, new)

  def conv(t, i):
    c, n = chans[i]
    acc = window_row(t, c, n) * taps[i][0]
    for j in range(1, k_taps):
      acc = acc + window_row(t + j, c, n) * taps[i][j]
    return jax.nn.silu(acc)

  cols = pl.ds(vb * block_v, block_v)

  def step(t, s_kv):
    q, k, v = conv(t, 0), conv(t, 1), conv(t, 2)
    q = q * lax.rsqrt(jnp.sum(q * q) + hd.eps) / math.sqrt(dk)
    k = k * lax.rsqrt(jnp.sum(k * k) + hd.eps)
    valid = t < n_valid
    beta = jnp.where(valid, jax.nn.sigmoid(b_ref[t, b0 + hh]), 0.0)
    g = jnp.where(valid, _softplus(a_ref[t, a0 + hh] + dtb_ref[hh]) * ah_ref[hh], 0.0)
    k, v = jnp.where(valid, k, 0.0), jnp.where(valid, v, 0.0)
    s_kv, o_v = _rows.row_step(s_kv, q, k, v, g, beta)
    o_ref[t, hh, cols] = o_v
    if capture:                        # the state and conv window after this row
      s_ref[t, hh, :, cols] = s_kv
      write_window(t + 1, lambda r, c, n, x: cso_ref.__setitem__((t, r, pl.ds(c, n)), x))
    if row_refs:
      k_out, v_out, g_out, b_out = row_refs
      k_out[t, hh, :] = k              # every value block writes the same numbers
      v_out[t, hh, cols] = v
      g_out[t, hh] = g
      b_out[t, hh] = beta
    return s_kv

  def write_window(first, put):
    """The conv window starting at row `first` of [window; rows]: this program's value columns, and its key head's
    q / k channels where it is the head's first program (h < Hk, the first value block)."""
    def chans_window(i):
      c, n = chans[i]
      for r in range(k_taps - 1):
        put(r, c, n, window_row(first + r, c, n))
    chans_window(2)

    @pl.when((hh < hk) & (vb == 0))
    def _():
      chans_window(0)
      chans_window(1)

  s_kv = lax.fori_loop(0, n_ref[0], step, s0_ref[hh, :, cols])
  if not capture:
    s_ref[hh, :, cols] = s_kv
    write_window(n_valid, lambda r, c, n, x: cso_ref.__setitem__((r, pl.ds(c, n)), x))


def check(hd: GdnHeads, conv_kc, qkv, b, a, conv_w_ck, dt_bias_h, a_h, state_hkv, starts) -> int:
  """One-line ValueErrors for operands that do not agree with `hd` and `starts` -> S."""
  c, h, d = hd.conv_dim, hd.value_heads, hd.head_dim
  _triton.check_kernel_sizes(d, d)
  if hd.value_heads % hd.key_heads:
    raise ValueError(f"gdn_rows: value heads {h} must be a multiple of key heads {hd.key_heads}")
  s = qkv.shape[0]
  want = {"conv_kc": (conv_kc.shape, (hd.conv_kernel - 1, c)), "conv_w": (conv_w_ck.shape, (c, hd.conv_kernel)),
          "dt_bias": (dt_bias_h.shape, (h,)), "a": (a_h.shape, (h,)), "state": (state_hkv.shape, (h, d, d))}
  for name, (got, need) in want.items():
    if tuple(got) != need:
      raise ValueError(f"gdn_rows: {name} must be {need}, got {tuple(got)}")
  for name, x, st, n in (("qkv", qkv, starts[0], c), ("b", b, starts[1], h), ("a", a, starts[2], h)):
    if x.ndim != 2 or x.shape[0] != s or st < 0 or st + n > x.shape[1]:
      raise ValueError(f"gdn_rows: {name} must be [{s}, >= {st + n}] (columns {st}..{st + n}), got {tuple(x.shape)}")
  return s


def gdn_rows(conv_kc, qkv, b, a, conv_w_ck, dt_bias_h, a_h, state_hkv, n_valid, n_rows=None, *, hd: GdnHeads,
             starts: Tuple[int, int, int] = (0, 0, 0), rows: bool = False, capture: bool = False,
             options: _rows.RowsOptions = _rows.RowsOptions(), interpret: bool = False):
  """The layer's rows from its projections (module docstring). `n_rows`: the loop's trip count (default S: a
  replay passes j + 1); `n_valid`: rows at and past it are padding. -> (o_shv, state_hkv, conv_kc) and, with
  `rows`, (k_shk, v_shv, g_sh, beta_sh). `capture`: the state and conv window after every row instead
  ([S, H, dk, dv], [S, K-1, C]: the window after row t is rows t + 1 .. t + K - 1 of [window; rows], padding rows'
  inputs included, as the model's XLA form captures them)."""
  check(hd, conv_kc, qkv, b, a, conv_w_ck, dt_bias_h, a_h, state_hkv, starts)
  _rows.check_options(options)
  return _call(conv_kc, qkv, b, a, conv_w_ck, dt_bias_h, a_h, state_hkv, n_valid, n_rows, hd=hd, starts=tuple(starts),
               rows=rows, capture=capture, options=options, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("hd", "starts", "rows", "capture", "options", "interpret"))
def _call(conv_kc, qkv, b, a, conv_w_ck, dt_bias_h, a_h, state_hkv, n_valid, n_rows, *, hd, starts, rows, capture,
          options, interpret):
  s = qkv.shape[0]
  h, d, f32 = hd.value_heads, hd.head_dim, jnp.float32
  bv = min(options.block_v, d)
  lead = (s,) if capture else ()
  out = [jax.ShapeDtypeStruct((s, h, d), f32), jax.ShapeDtypeStruct(lead + (h, d, d), f32),
         jax.ShapeDtypeStruct(lead + tuple(conv_kc.shape), f32)]
  if rows:
    out += [jax.ShapeDtypeStruct((s, h, d), f32), jax.ShapeDtypeStruct((s, h, d), f32),
            jax.ShapeDtypeStruct((s, h), f32), jax.ShapeDtypeStruct((s, h), f32)]
  params = None if interpret or _triton._pltriton is None else _triton._pltriton.CompilerParams(
      num_warps=options.num_warps, num_stages=1)
  counts = jnp.stack([jnp.asarray(s if n_rows is None else n_rows, jnp.int32), jnp.asarray(n_valid, jnp.int32)])
  res = pl.pallas_call(
      functools.partial(_gdn_kernel, hd=hd, starts=starts, block_v=bv, capture=capture),
      grid=(h, d // bv), out_shape=tuple(out), compiler_params=params, interpret=interpret, name="kvjax_gdn_rows",
  )(counts, *(jnp.asarray(x, f32) for x in (conv_kc, qkv, b, a, conv_w_ck, dt_bias_h, a_h, state_hkv)))
  return tuple(res)


def gdn_rows_reference(conv_kc, qkv, b, a, conv_w_ck, dt_bias_h, a_h, state_hkv, n_valid, *, hd: GdnHeads,
                       starts: Tuple[int, int, int] = (0, 0, 0)):
  """`gdn_rows` in plain jnp (float32, the model's XLA formulas; the delta rule by `reference`'s token step)."""
  from kvjax_pallas.delta_rule import reference as _ref   # pylint: disable=import-outside-toplevel
  s, c, h, hk, d = qkv.shape[0], hd.conv_dim, hd.value_heads, hd.key_heads, hd.head_dim
  x = qkv[:, starts[0]:starts[0] + c]
  xpad = jnp.concatenate([conv_kc, x], axis=0)
  conv = jax.nn.silu(sum(xpad[j:j + s] * conv_w_ck[:, j] for j in range(hd.conv_kernel)))
  q, k, v = (conv[:, :hk * d].reshape(s, hk, d), conv[:, hk * d:2 * hk * d].reshape(s, hk, d),
             conv[:, 2 * hk * d:].reshape(s, h, d))
  q = q * lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + hd.eps) / jnp.sqrt(jnp.float32(d))
  k = k * lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + hd.eps)
  q, k = jnp.tile(q, (1, h // hk, 1)), jnp.tile(k, (1, h // hk, 1))
  m = (jnp.arange(s) < n_valid).astype(jnp.float32)
  beta = jax.nn.sigmoid(b[:, starts[1]:starts[1] + h]) * m[:, None]
  g = jax.nn.softplus(a[:, starts[2]:starts[2] + h] + dt_bias_h) * a_h * m[:, None]
  k, v = k * m[:, None, None], v * m[:, None, None]
  state, o = _ref.delta_rule_reference(state_hkv, q, k, v, g, beta)
  return o, state, lax.dynamic_slice_in_dim(xpad, n_valid, hd.conv_kernel - 1, axis=0)
