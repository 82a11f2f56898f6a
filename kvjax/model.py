"""Qwen3.8-style hybrid target (Gated DeltaNet + gated attention) and its MTP head, in Flax NNX.

The math is that of docs/reference-design.md ("Model architecture"), in GGUF conventions: every parameter keeps its GGUF
name (dots -> underscores, `.weight` dropped) and GGUF shape (`[out, in]`, applied as `x @ W.T`), norm weights are
stored with the +1 folded in, and Gated DeltaNet value head j reads key head j % Hk.

Structure. Blocks are grouped into `LayerGroup`s: a run of recurrent blocks followed by (at most) one attention block —
3 GDN + 1 attention for the 27B. Every group of the model has the same structure, so one compiled group step serves all
16 groups (compile time does not grow with depth), and a streamed runtime can stage the next group's KV pages between
group steps.

Attention reads and writes KV through the paged pool (`kvjax_pallas.page_layout`): new K/V rows are encoded with the
ggml codec and written into their page first, then span attention runs over the layer's page table. The plain cache is
the same pool with an identity page table."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from kvjax.config import ModelConfig, attention_block_shapes, common_block_shapes, mtp_extra_shapes, \
    recurrent_block_shapes
from kvjax.fused import PREFIX as _FUSED, ROWS as _FUSED_ROWS
from kvjax.gdn_xla import delta_rule_chunked, delta_rule_scan, delta_rule_step
from kvjax.qweights import QuantizedWeight
from kvjax_pallas.quant_matmul.api import Cols, Prologue, PrologueInput
from kvjax_pallas.quant_matmul.prologue import rms_norm   # the model's RMS norm (one formula with the prologue's)
from kvjax_pallas import ggml_codec
from kvjax_pallas.delta_rule import api as delta_rule_api, gdn_rows, triton as delta_rule_triton
from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import api as span_api

_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """Static choices for the attention core (hashable: part of compiled-step keys)."""
  implementation: str = "reference"       # "auto" or one of span_api.IMPLEMENTATIONS
  block_pages: Union[int, str] = "auto"   # pages per logical partition, or "auto" (span_api)
  interpret: bool = False


_SUM_AXIS: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("kvjax_sum_axis", default=None)


@contextlib.contextmanager
def sum_over(axis: str):
  """Trace the modules as one shard of a tensor-parallel model (`kvjax.parallel`): each block's output projections
  (attention, Gated DeltaNet, FFN down) hold this device's partial sum; `block_sum` all-reduces it over `axis`."""
  token = _SUM_AXIS.set(axis)
  try:
    yield
  finally:
    _SUM_AXIS.reset(token)


def block_sum(y):
  """A block's output projection summed over the tensor-parallel axis (none: unchanged)."""
  axis = _SUM_AXIS.get()
  return y if axis is None else lax.psum(y, axis)


def attr_name(leaf: str) -> str:
  """GGUF leaf name -> module attribute: 'ssm_dt.bias' -> 'ssm_dt_bias', 'attn_q.weight' -> 'attn_q'."""
  if leaf.endswith(".weight"):
    leaf = leaf[: -len(".weight")]
  return leaf.replace(".", "_")


def _param(shape, dtype):
  return nnx.Param(jnp.zeros(shape, dtype))


def linear(x, w):
  """x [..., in] @ w[out, in].T -> [..., out] (w's dtype, f32 accumulation). `w` may be a `QuantizedWeight` (ggml
  blocks): "xla" dequantizes it and runs this same product (the bits of a weight dequantized at load), "pallas" a kernel
  that dequantizes as it reads. `x` may be a `PrologueInput` (`normed`, a gate): the q8 GEMV makes it in its kernel."""
  if isinstance(x, PrologueInput) and not (isinstance(w, QuantizedWeight) and w.makes_input(x)):
    x = x.value()
  if isinstance(w, QuantizedWeight):
    if w.impl != "xla":
      return w.matmul(x)
    w = w.dequantize()
  y = jnp.einsum("...i,oi->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32,
                 precision=_HI if w.dtype == jnp.float32 else None)
  return y


def normed(x, w, eps):
  """rms_norm(x, w, eps) as a product's input (`linear`): made by the q8 GEMV's kernel, or `rms_norm` itself."""
  return PrologueInput(Prologue("rms", eps), (x, w))


def products(module, x, names: Sequence[str], cols: Sequence[str] = ()) -> List[jax.Array]:
  """[linear(x, module.<name>) for name in names], with the names that `kvjax.fused.fuse_projections` joined computed as
  one product over their joined matrix, then split; those in `cols` as `Cols` of the joined product (a prologue's
  operands: read in place)."""
  groups = getattr(module, "fused_groups", ())
  out: Dict[str, jax.Array] = {}
  for name in names:
    if name in out:
      continue
    group = next((g for g in groups if name in g), None)
    if group is None:
      out[name] = linear(x, getattr(module, name)[...])
      continue
    y = linear(x, getattr(module, _FUSED + group[0])[...])
    rows = getattr(module, _FUSED_ROWS + group[0])
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).tolist()
    out.update((g, Cols(y, int(st), int(n)) if g in cols else lax.slice_in_dim(y, int(st), int(st + n), axis=-1))
               for g, st, n in zip(group, starts, rows))
  return [out[n] for n in names]


def rope_neox(x_shd, pos_s, rope_dim: int, theta: float):
  """NeoX RoPE over the first `rope_dim` dims (pairs d, d + rope_dim/2); the rest pass through."""
  half = rope_dim // 2
  inv = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / rope_dim)
  ang = pos_s.astype(jnp.float32)[:, None] * inv[None, :]             # [S, half]
  cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
  x1, x2, rest = x_shd[..., :half], x_shd[..., half:rope_dim], x_shd[..., rope_dim:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


# ---------------------------------------------------------------------------
# KV pool access (one mechanism for plain and streamed caches)
# ---------------------------------------------------------------------------

class KVRows(NamedTuple):
  """Encoded K/V rows a forward wrote (what the KV writer publishes to the host)."""
  k_sn: jax.Array  # [S, k_row_bytes] uint8
  v_sn: jax.Array  # [S, v_row_bytes] uint8


def write_kv_rows(pool_pn, table_t, pos, n_valid, rows: KVRows, layout: PageLayout):
  """Scatter rows for positions pos..pos+S-1 into their pages; rows >= n_valid are dropped."""
  s = rows.k_sn.shape[0]
  p_s = pos + jnp.arange(s, dtype=jnp.int32)
  n_pages = pool_pn.shape[0]
  logical = jnp.clip(p_s // layout.page_tokens, 0, table_t.shape[0] - 1)
  page_s = jnp.where(jnp.arange(s) < n_valid, table_t[logical], n_pages)  # OOB -> dropped
  row_s = p_s % layout.page_tokens
  k_off = row_s[:, None] * layout.k_row_bytes + jnp.arange(layout.k_row_bytes)[None, :]
  v_off = layout.v_offset + row_s[:, None] * layout.v_row_bytes + jnp.arange(layout.v_row_bytes)[None, :]
  pool_pn = pool_pn.at[page_s[:, None], k_off].set(rows.k_sn, mode="drop")
  pool_pn = pool_pn.at[page_s[:, None], v_off].set(rows.v_sn, mode="drop")
  return pool_pn


# ---------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------

class SwiGLU(nnx.Module):
  def __init__(self, cfg: ModelConfig, dtype):
    E, F = cfg.hidden_size, cfg.intermediate_size
    self.ffn_gate = _param((F, E), dtype)
    self.ffn_up = _param((F, E), dtype)
    self.ffn_down = _param((E, F), dtype)

  def __call__(self, h_se):
    g, u = products(self, h_se, ("ffn_gate", "ffn_up"), cols=("ffn_gate", "ffn_up"))   # a = silu(g) * u:
    a = PrologueInput(Prologue("swiglu", casts=(jnp.dtype(self.ffn_down[...].dtype).name,)), (g, u))
    return block_sum(linear(a, self.ffn_down[...]))


class GatedAttention(nnx.Module):
  """Gated full attention with partial NeoX RoPE and per-head q/k RMS norms, over paged KV."""

  def __init__(self, cfg: ModelConfig, dtype):
    self.cfg = cfg
    for leaf, shape in attention_block_shapes(cfg).items():
      setattr(self, attr_name(leaf), _param(shape, jnp.float32 if len(shape) == 1 else dtype))

  def project(self, h_se, pos_s):
    """-> q_shd (f32, normed + roped), k_sgd, v_sgd (f32), gate_se (f32 [S, H*D])."""
    cfg = self.cfg
    s = h_se.shape[0]
    H, G, D = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    qg, k_sg, v_sg = products(self, h_se, ("attn_q", "attn_k", "attn_v"))
    qg = qg.reshape(s, H, 2 * D)
    q_shd, gate_shd = qg[..., :D], qg[..., D:]
    k_sgd, v_sgd = k_sg.reshape(s, G, D), v_sg.reshape(s, G, D)
    q_shd = rope_neox(rms_norm(q_shd, self.attn_q_norm[...], cfg.rms_eps), pos_s, cfg.rope_dim, cfg.rope_theta)
    k_sgd = rope_neox(rms_norm(k_sgd, self.attn_k_norm[...], cfg.rms_eps), pos_s, cfg.rope_dim, cfg.rope_theta)
    return q_shd, k_sgd, v_sgd, gate_shd.reshape(s, H * D)

  def begin(self, h_se, pos, layout: PageLayout, rope_offset=0):
    """Rows at cache positions pos..pos+S-1 -> (q_shd, gate_se, encoded K/V rows)."""
    s = h_se.shape[0]
    pos_s = pos + jnp.arange(s, dtype=jnp.int32)
    q_shd, k_sgd, v_sgd, gate_se = self.project(h_se, pos_s + rope_offset)
    rows = KVRows(ggml_codec.encode_rows(k_sgd, layout.k_type), ggml_codec.encode_rows(v_sgd, layout.v_type))
    return q_shd, gate_se, rows

  def end(self, o_shd, gate_se):
    """Attention output o_shd [S, H, D] -> the block's mixer output."""
    cfg = self.cfg
    o_se = o_shd.reshape(o_shd.shape[0], cfg.num_attention_heads * cfg.head_dim) * jax.nn.sigmoid(gate_se)
    return block_sum(linear(o_se.astype(self.attn_output[...].dtype), self.attn_output[...]))

  def causal(self, h_se, pos_s):
    """The rows attend causally to themselves, without a cache (the training form: differentiable, f32 scores and
    softmax). Equals `Block.attend` on an empty cache with f32 K/V pages."""
    cfg = self.cfg
    s = h_se.shape[0]
    G, D = cfg.num_kv_heads, cfg.head_dim
    q_shd, k_sgd, v_sgd, gate_se = self.project(h_se, pos_s)
    q_sgrd = q_shd.reshape(s, G, cfg.q_per_kv, D)         # query head h reads KV head h // r
    sc = jnp.einsum("sgrd,tgd->grst", q_sgrd, k_sgd, precision=_HI) / jnp.sqrt(jnp.float32(D))
    sc = jnp.where(pos_s[:, None] >= pos_s[None, :], sc, -jnp.inf)
    o_shd = jnp.einsum("grst,tgd->sgrd", jax.nn.softmax(sc, axis=-1), v_sgd,
                       precision=_HI).reshape(s, cfg.num_attention_heads, D)
    return self.end(o_shd, gate_se)


def wave_cut(tree):
  """Where `Block.attend` is cut as the copy-wave programs are (`lax.optimization_barrier`; a module attribute so that
  `experiments.kernel_lab.probe_wave_bits` can compare the uncut form)."""
  return lax.optimization_barrier(tree)


def attend_wave(pool_pn, table_t, rows: KVRows, q_shd, carry, pos, n_valid, tile_begin,
                tile_end, layout: PageLayout, opts: AttentionOptions):
  """One copy wave of a layer whose streamed pages exceed the ring (its staged pages already placed): write the new rows
  that fall on logical pages [tile_begin, tile_end) (the wave's table maps only those), fold those pages into the
  attention carry (None before the first wave: the empty carry, as in one call) -> (pool_pn, carry). Waves in logical
  order with boundaries at multiples of the call's partition give the bits of one call."""
  t = jnp.arange(table_t.shape[0], dtype=jnp.int32)
  in_wave = (t >= tile_begin) & (t < tile_end)
  pool_pn = write_kv_rows(pool_pn, jnp.where(in_wave, table_t, pool_pn.shape[0]), pos, n_valid, rows,
                          layout)
  s = q_shd.shape[0]
  pos_s = pos + jnp.arange(s, dtype=jnp.int32)
  carry = span_api.span_attention_partial(
      q_shd, pool_pn, table_t, pos + n_valid, pos_s, carry, tile_begin, tile_end, layout=layout,
      num_q_heads=q_shd.shape[1], block_pages=opts.block_pages, implementation=opts.implementation,
      interpret=opts.interpret)
  return pool_pn, carry


def empty_carry(q_shd, layout: PageLayout):
  """The attention carry before the first page, for the queries `q_shd [S, H, D]`: folding a partition into it is an
  exact no-op (`reference.merge_partials`), so a first copy wave given it runs the program of every later wave, with the
  bits of one call."""
  s, h, d = q_shd.shape
  return span_api.init_carry(layout.num_kv_heads, s * (h // layout.num_kv_heads), d)


class RecurrentState(NamedTuple):
  """State of one Gated DeltaNet layer between calls."""
  conv_kc: jax.Array    # [conv_kernel - 1, conv_dim] float32: last inputs of the causal conv
  delta_hkv: jax.Array  # [Hv, dk, dv] float32: delta-rule state per value head


class ReplayRows(NamedTuple):
  """A verify forward's rows of one Gated DeltaNet layer, what `replay_state` needs to rebuild the state after any of
  them from the state before them (`capture="replay"`): per row tens of KB where the state itself is MBs."""
  qkv_sc: jax.Array     # [S, conv_dim] float32: the causal conv's inputs
  k_shk: jax.Array      # [S, Hv, dk] float32: the delta rule's keys (normalised, tiled, masked)
  v_shv: jax.Array      # [S, Hv, dv] float32
  g_sh: jax.Array       # [S, Hv] float32: log decay
  beta_sh: jax.Array    # [S, Hv] float32


_ROWS_KERNEL = {"fused": "triton"}   # a rows form -> the rows kernel it steps captured rows with


def replay_state(state: RecurrentState, rows: ReplayRows, row, form=("xla", False)) -> RecurrentState:
  """The state after verify row `row` (traced) of a forward that started from `state`: the conv window slid
  past rows 0..row and the delta rule stepped through them by the verify's own arithmetic (`form`, the
  layers' `GatedDeltaNet.rows_form`: "triton" the rows kernel over the first row + 1 rows; "xla" the decode
  step `delta_rule_step` unrolled and masked past `row`, straight-line code rather than a device loop), so
  the result is the captured state's bits."""
  k1 = state.conv_kc.shape[0]
  xpad = jnp.concatenate([state.conv_kc, rows.qkv_sc], axis=0)
  conv = lax.dynamic_slice_in_dim(xpad, row + 1, k1, axis=0)
  if form[0] != "xla":
    s, _ = delta_rule_api.delta_rule_rows(state.delta_hkv, rows.k_shk, rows.k_shk, rows.v_shv, rows.g_sh,
                                          rows.beta_sh, row + 1, implementation=_ROWS_KERNEL.get(form[0], form[0]),
                                          interpret=form[1])
    return RecurrentState(conv, s)
  s = state.delta_hkv
  for i in range(rows.k_shk.shape[0]):
    k_hk = rows.k_shk[i]
    s = jnp.where(i <= row, delta_rule_step(s, k_hk, k_hk, rows.v_shv[i], rows.g_sh[i], rows.beta_sh[i])[0], s)
  return RecurrentState(conv, s)


def zero_recurrent_state(cfg: ModelConfig) -> RecurrentState:
  return RecurrentState(jnp.zeros((cfg.conv_kernel - 1, cfg.conv_dim), jnp.float32),
                        jnp.zeros((cfg.linear_num_value_heads, cfg.linear_head_dim, cfg.linear_head_dim),
                                  jnp.float32))


CHUNK_FORMS = ("xla", "triton")   # the delta rule: XLA's forms (delta_rule_chunked, _scan), the Pallas kernels


def check_chunk_form(cfg: ModelConfig, form: str, backend: str = "cpu", devices: int = 1) -> str:
  """-> the prefill form to run: `form`; for "auto" "triton" on one GPU if the kernels take the heads, else "xla"."""
  d = cfg.linear_head_dim
  if form == "auto":   # (the kernels inside a shard_map: not measured)
    return "triton" if backend == "gpu" and devices == 1 and delta_rule_triton.kernel_sizes_ok(d, d) else "xla"
  if form == "triton":
    try:
      delta_rule_triton.check_kernel_sizes(d, d)
    except ValueError as e:
      raise ValueError(f"gdn_impl 'triton': the model's Gated DeltaNet heads: {e} (gdn_impl 'xla' takes any)") from None
  return form


def set_chunk_form(model: nnx.Module, form: str, interpret: bool = False, rows: Optional[str] = None) -> int:
  """Every Gated DeltaNet of `model` runs its delta rule as `form` ("xla" or "triton": the chunked kernel for a
  prefill's rows and, unless `rows` names another form, the rows kernel for a decode's and verify's; `rows` "fused":
  `kvjax_pallas.delta_rule.gdn_rows`, conv to delta rule in one kernel; `interpret` without a GPU): static
  structure, set before the model is split into steps. -> how many layers it set."""
  for name, f, forms in (("gdn_impl", form, CHUNK_FORMS), ("the rows' form", rows or form, CHUNK_FORMS + ("fused",))):
    if f not in forms:
      raise ValueError(f"{name} {f!r}: expected one of {', '.join(forms)}")
  mixers = [m for _, m in nnx.iter_graph(model) if isinstance(m, GatedDeltaNet)]
  for m in mixers:
    m.chunk_form, m.rows_form = (form, bool(interpret)), (rows or form, bool(interpret))
  return len(mixers)


def rows_form_of(model: nnx.Module) -> Tuple[str, bool]:
  """The (form, interpret) its Gated DeltaNet layers run a decode's and verify's rows in (`set_chunk_form`)."""
  return next((m.rows_form for _, m in nnx.iter_graph(model) if isinstance(m, GatedDeltaNet)), ("xla", False))


class GatedDeltaNet(nnx.Module):
  """Gated DeltaNet mixer: causal conv + gated delta rule + gated RMS norm."""

  def __init__(self, cfg: ModelConfig, dtype):
    self.cfg = cfg
    for leaf, shape in recurrent_block_shapes(cfg).items():
      is_vec = len(shape) == 1 or leaf == "ssm_conv1d.weight"
      setattr(self, attr_name(leaf), _param(shape, jnp.float32 if is_vec else dtype))
    self.chunk_form = self.rows_form = ("xla", False)   # the forms' (implementation, interpret): set_chunk_form

  def __call__(self, h_se, state: RecurrentState, n_valid, chunked: bool, capture: bool = False):
    """`chunked`: WY chunked form (prefill) or token scan (decode / verify). `capture` (scan form only): True returns
    the state after every row, each field with a leading row axis; "replay" returns the rows themselves (`ReplayRows`:
    `replay_state` rebuilds any row's state)."""
    cfg = self.cfg
    s = h_se.shape[0]
    Hk, Hv, dk = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_head_dim
    K = cfg.conv_kernel
    valid_s = jnp.arange(s) < n_valid
    names = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")
    if not chunked and self.rows_form[0] == "fused":   # the rows from the projections, one kernel
      return self._end(*self._fused_rows(*products(self, h_se, names, cols=names), state, n_valid, capture))
    qkv_sc, z_sv, b_sh, a_sh = products(self, h_se, names, cols=("attn_gate",))   # qkv_sc: f32 [S, C]; z_sv: Cols
    beta_sh = jax.nn.sigmoid(b_sh)
    g_sh = jax.nn.softplus(a_sh + self.ssm_dt_bias[...]) * self.ssm_a[...]
    # causal depthwise conv over [previous K-1 inputs; x]
    xpad = jnp.concatenate([state.conv_kc, qkv_sc], axis=0)          # [K-1+S, C]
    w = self.ssm_conv1d[...]                                         # [C, K]
    conv_sc = sum(xpad[j:j + s] * w[:, j] for j in range(K))
    conv_sc = jax.nn.silu(conv_sc)
    if capture == "replay":
      new_conv = None
    elif capture:
      new_conv = jnp.stack([lax.dynamic_slice_in_dim(xpad, i + 1, K - 1, axis=0) for i in range(s)])
    else:
      new_conv = lax.dynamic_slice_in_dim(xpad, n_valid, K - 1, axis=0)
    q, k, v = jnp.split(conv_sc, [Hk * dk, 2 * Hk * dk], axis=-1)
    q = q.reshape(s, Hk, dk)
    k = k.reshape(s, Hk, dk)
    v = v.reshape(s, Hv, dk)
    q = q * lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + cfg.rms_eps) / jnp.sqrt(jnp.float32(dk))
    k = k * lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + cfg.rms_eps)
    # GGUF tiled order: value head j reads key head j % Hk
    reps = Hv // Hk
    q = jnp.tile(q, (1, reps, 1))
    k = jnp.tile(k, (1, reps, 1))
    # padding rows are no-ops for the state
    m = valid_s[:, None].astype(jnp.float32)
    k, v = k * m[..., None], v * m[..., None]
    g_sh, beta_sh = g_sh * m, beta_sh * m
    if chunked:
      if capture:
        raise ValueError("per-row state capture needs the scan form (chunked=False)")
      form, interpret = self.chunk_form
      if form == "xla":
        delta, o_shv = delta_rule_chunked(state.delta_hkv, q, k, v, g_sh, beta_sh)
      else:
        delta, o_shv = delta_rule_api.delta_rule(state.delta_hkv, q, k, v, g_sh, beta_sh, implementation=form,
                                                 interpret=interpret)
    elif self.rows_form[0] == "xla":
      delta, o_shv = delta_rule_scan(state.delta_hkv, q, k, v, g_sh, beta_sh, capture=capture is True)
    else:   # the decode's and verify's rows in one kernel (`kvjax_pallas.delta_rule.rows`)
      delta, o_shv = delta_rule_api.delta_rule_rows(state.delta_hkv, q, k, v, g_sh, beta_sh, capture=capture is True,
                                                    implementation=self.rows_form[0], interpret=self.rows_form[1])
    if capture == "replay":   # the rows, not the states after them (`replay_state`)
      return self._end(o_shv, z_sv, ReplayRows(qkv_sc, k, v, g_sh, beta_sh))
    return self._end(o_shv, z_sv, RecurrentState(new_conv, delta))

  def _fused_rows(self, qkv, z_sv, b, a, state: RecurrentState, n_valid, capture):
    """The rows form "fused": conv, gates, norms and delta rule in one kernel (`kvjax_pallas.delta_rule.gdn_rows`)
    from the projections' columns -> (o_shv, z_sv, RecurrentState, or the rows `ReplayRows` with `capture`)."""
    cfg = self.cfg
    (xq, q0), (xb, b0), (xa, a0) = ((c.array, c.start) if isinstance(c, Cols) else (c, 0) for c in (qkv, b, a))
    d, hv, c = cfg.linear_head_dim, self.ssm_a[...].shape[0], self.ssm_conv1d[...].shape[0]   # a shard's heads
    hd = gdn_rows.GdnHeads((c // d - hv) // 2, hv, d, cfg.conv_kernel, cfg.rms_eps)
    o_shv, delta, conv, *rows = gdn_rows.gdn_rows(
        state.conv_kc, xq, xb, xa, self.ssm_conv1d[...], self.ssm_dt_bias[...], self.ssm_a[...], state.delta_hkv,
        n_valid, hd=hd, starts=(q0, b0, a0), rows=capture == "replay", capture=capture is True,
        interpret=self.rows_form[1])
    if capture == "replay":
      return o_shv, z_sv, ReplayRows(qkv.value() if isinstance(qkv, Cols) else qkv, *rows)
    return o_shv, z_sv, RecurrentState(conv, delta)

  def _end(self, o_shv, z_sv, new):
    """The gated norm rms_norm(o_shv) * silu(z_shv), cast to the product's dtype (made by the q8 GEMV's kernel), the
    output product -> (out, new)."""
    cfg, s = self.cfg, o_shv.shape[0]
    o_sv = PrologueInput(Prologue("gated_rms", cfg.rms_eps, cfg.linear_head_dim,
                                  (jnp.dtype(self.ssm_out[...].dtype).name,)),
                         (o_shv.reshape(s, -1), z_sv, self.ssm_norm[...]))
    return block_sum(linear(o_sv, self.ssm_out[...])), new


class Block(nnx.Module):
  """Pre-norm decoder block: mixer (GDN or gated attention) + SwiGLU, residuals."""

  def __init__(self, cfg: ModelConfig, attention: bool, dtype):
    self.attention = attention
    self.eps = cfg.rms_eps
    self.attn_norm = _param((cfg.hidden_size,), jnp.float32)
    self.post_attention_norm = _param((cfg.hidden_size,), jnp.float32)
    self.mixer = GatedAttention(cfg, dtype) if attention else GatedDeltaNet(cfg, dtype)
    self.ffn = SwiGLU(cfg, dtype)

  def _ffn(self, x):
    return x + self.ffn(normed(x, self.post_attention_norm[...], self.eps)).astype(x.dtype)

  def recurrent(self, x_se, state: RecurrentState, n_valid, chunked: bool, capture: bool = False):
    out, state = self.mixer(normed(x_se, self.attn_norm[...], self.eps), state, n_valid, chunked, capture)
    return self._ffn(x_se + out.astype(x_se.dtype)), state

  def attend(self, x_se, pool_pn, table_t, pos, n_valid, layout, opts, rope_offset=0):
    """Rows at cache positions pos..pos+S-1 (rows >= n_valid are padding) over the paged KV in one span-attention call
    -> (x_se, pool_pn with the rows written, the encoded rows).

    Built from the copy-wave path's pieces (`attend_begin`, the kernel's `partial` entry, `attend_end`) and cut where
    that path's compiled programs are cut, by optimization barriers: XLA then fuses each side alike in both, so one call
    and copy waves give the same bits on the compiled GPU kernels too (without the cuts a waved layer differed by ~1e-5
    on the H200: fusion decides where products are contracted into FMAs)."""
    q_shd, gate_se, rows = self.attend_begin(x_se, pos, layout, rope_offset)
    x_se, q_shd, gate_se, rows = wave_cut((x_se, q_shd, gate_se, rows))
    pool_pn = write_kv_rows(pool_pn, table_t, pos, n_valid, rows, layout)
    pos_s = pos + jnp.arange(q_shd.shape[0], dtype=jnp.int32)
    carry = span_api.span_attention_partial(
        q_shd, pool_pn, table_t, pos + n_valid, pos_s, None, jnp.int32(0), jnp.int32(table_t.shape[0]),
        layout=layout, num_q_heads=q_shd.shape[1], block_pages=opts.block_pages,
        implementation=opts.implementation, interpret=opts.interpret)
    carry = wave_cut(carry)
    return self.attend_end(x_se, span_api.finalize(carry, q_shd.shape[1]), gate_se), pool_pn, rows

  def attend_begin(self, x_se, pos, layout, rope_offset=0):
    """The attention block up to span attention (`GatedAttention.begin`)."""
    return self.mixer.begin(normed(x_se, self.attn_norm[...], self.eps), pos, layout, rope_offset)

  def attend_end(self, x_se, o_shd, gate_se):
    """The attention block after span attention: x_se is the block's input."""
    return self._ffn(x_se + self.mixer.end(o_shd, gate_se).astype(x_se.dtype))

  def attend_causal(self, x_se, pos_s):
    """`attend` in the training form (`GatedAttention.causal`): no cache."""
    out = self.mixer.causal(rms_norm(x_se, self.attn_norm[...], self.eps), pos_s)
    return self._ffn(x_se + out.astype(x_se.dtype))


class LayerGroup(nnx.Module):
  """A run of recurrent blocks followed by at most one attention block."""

  def __init__(self, cfg: ModelConfig, n_recurrent: int, has_attention: bool, dtype):
    self.recurrent = nnx.List([Block(cfg, False, dtype) for _ in range(n_recurrent)])
    self.attention = Block(cfg, True, dtype) if has_attention else None

  def run_recurrent(self, x_se, rec_states, n_valid, chunked, capture=False):
    new_states = []
    for blk, st in zip(self.recurrent, rec_states):
      x_se, st = blk.recurrent(x_se, st, n_valid, chunked, capture)
      new_states.append(st)
    return x_se, tuple(new_states)

  def __call__(self, x_se, rec_states, pool_pn, table_t, pos, n_valid, layout, opts, chunked,
               capture=False):
    x_se, new_states = self.run_recurrent(x_se, rec_states, n_valid, chunked, capture)
    rows = None
    if self.attention is not None:
      x_se, pool_pn, rows = self.attention.attend(x_se, pool_pn, table_t, pos, n_valid, layout, opts)
    return x_se, new_states, pool_pn, rows

  def causal(self, x_se, pos_s):
    """The training form of one sequence from position 0: Gated DeltaNet chunked from the zero state, attention over the
    rows themselves (`Block.attend_causal`); no cache."""
    s = x_se.shape[0]
    for blk in self.recurrent:
      x_se, _ = blk.recurrent(x_se, zero_recurrent_state(blk.mixer.cfg), s, chunked=True)
    if self.attention is not None:
      x_se = self.attention.attend_causal(x_se, pos_s)
    return x_se


class MTPHead(nnx.Module):
  """NextN block: predicts token t+2 from the target's post-norm hidden at t and token t+1."""

  def __init__(self, cfg: ModelConfig, dtype, shared_head_norm: bool = True, shared_head_head: bool = True):
    E = cfg.hidden_size
    self.eps = cfg.rms_eps
    self.nextn_eh_proj = _param((E, 2 * E), dtype)
    self.nextn_enorm = _param((E,), jnp.float32)
    self.nextn_hnorm = _param((E,), jnp.float32)
    self.nextn_shared_head_norm = _param((E,), jnp.float32) if shared_head_norm else None
    self.nextn_shared_head_head = _param((cfg.vocab_size, E), dtype) if shared_head_head else None
    self.block = Block(cfg, True, dtype)

  def __call__(self, hn_se, emb_se, output_norm_e, output_ve, pool_pn, table_t, pos, n_valid, layout,
               opts):
    """Rows (hidden hn_t, embedded token x_{t+1}) at MTP-cache positions pos.. -> (logits_sv f32, hm_se, pool_pn,
    rows). hn_t is the target's post-norm hidden (or, for later draft steps, the MTP's own `hm`). The row's RoPE
    position is its cache position + 1 (llama.cpp's convention: the row for (x_{t+1}, hn_t) sits at position t+1 and
    cache slot t)."""
    u = self.block_input(hn_se, emb_se)
    u, pool_pn, rows = self.block.attend(u, pool_pn, table_t, pos, n_valid, layout, opts, rope_offset=1)
    logits, hm = self.head(u, output_norm_e, output_ve)
    return logits, hm, pool_pn, rows

  def block_input(self, hn_se, emb_se):
    """The attention block's input from (hn_t, embedded x_{t+1})."""
    e = rms_norm(emb_se, self.nextn_enorm[...], self.eps)
    hh = rms_norm(hn_se.astype(e.dtype), self.nextn_hnorm[...], self.eps)
    return linear(jnp.concatenate([e, hh], axis=-1), self.nextn_eh_proj[...]).astype(e.dtype)

  def head(self, u_se, output_norm_e, output_ve):
    """-> (logits_sv f32, hm_se): the shared head (or the target's) on the block's output."""
    norm_w = self.nextn_shared_head_norm[...] if self.nextn_shared_head_norm is not None else output_norm_e
    head_w = self.nextn_shared_head_head[...] if self.nextn_shared_head_head is not None else output_ve
    return output_head(u_se, norm_w, head_w, self.eps)


class Qwen38(nnx.Module):
  """The hybrid target with optional attached MTP head."""

  def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, mtp_shared_head_norm: bool = True,
               mtp_shared_head_head: bool = True):
    self.cfg = cfg
    self.token_embd = _param((cfg.vocab_size, cfg.hidden_size), dtype)
    self.output_norm = _param((cfg.hidden_size,), jnp.float32)
    self.output = None if cfg.tie_embeddings else _param((cfg.vocab_size, cfg.hidden_size), dtype)
    self.groups = nnx.List([LayerGroup(cfg, len(rec), att is not None, dtype)
                            for rec, att in layer_groups(cfg)])
    self.mtp = (MTPHead(cfg, dtype, mtp_shared_head_norm, mtp_shared_head_head) if cfg.has_mtp else None)

  def output_weight(self):
    """The output projection [V, E] (the token embeddings when they are tied)."""
    return self.output[...] if self.output is not None else self.token_embd[...]

  def causal(self, tokens_s):
    """Teacher-forced forward of one sequence from position 0 in the training form (no cache, differentiable) ->
    (logits_sv f32, hn_se: the post-norm hidden of every row)."""
    pos_s = jnp.arange(tokens_s.shape[0], dtype=jnp.int32)
    x_se = self.token_embd[...][tokens_s]
    for group in self.groups:
      x_se = group.causal(x_se, pos_s)
    return output_head(x_se, self.output_norm[...], self.output_weight(), self.cfg.rms_eps)

  def mtp_causal(self, hn_se, next_tokens_s):
    """The MTP head in the training form: row t from hn_t and token t+1 (predicts token t+2), RoPE position t + 1 as in
    `MTPHead.__call__` -> logits_sv f32."""
    pos_s = jnp.arange(hn_se.shape[0], dtype=jnp.int32) + 1
    u_se = self.mtp.block.attend_causal(self.mtp.block_input(hn_se, self.token_embd[...][next_tokens_s]), pos_s)
    return self.mtp.head(u_se, self.output_norm[...], self.output_weight())[0]


def output_head(x_se, output_norm_e, output_ve, eps):
  """Final RMS norm + output projection -> (logits_sv f32, hn_se)."""
  hn = rms_norm(x_se, output_norm_e, eps)
  return linear(hn, output_ve), hn


def layer_groups(cfg: ModelConfig) -> List[Tuple[List[int], Optional[int]]]:
  """Target blocks grouped as ([recurrent block ids], attention block id or None)."""
  groups, run = [], []
  for i in range(cfg.num_layers):
    if cfg.is_attention_layer(i):
      groups.append((run, i))
      run = []
    else:
      run.append(i)
  if run:
    groups.append((run, None))
  return groups


def block_path(cfg: ModelConfig, block: int) -> Tuple[Any, ...]:
  """State path of GGUF block `block` inside `Qwen38`."""
  if cfg.has_mtp and block == cfg.mtp_block:
    return ("mtp", "block")
  for g, (rec, att) in enumerate(layer_groups(cfg)):
    if block == att:
      return ("groups", g, "attention")
    if block in rec:
      return ("groups", g, "recurrent", rec.index(block))
  raise KeyError(f"block {block} out of range (model has {cfg.num_layers} blocks)")


def param_path(cfg: ModelConfig, gguf_name: str) -> Tuple[Any, ...]:
  """GGUF tensor name -> path of its nnx.Param in `nnx.split(Qwen38(cfg))[1]`."""
  if not gguf_name.startswith("blk."):
    return (attr_name(gguf_name),)
  _, b, leaf = gguf_name.split(".", 2)
  base = block_path(cfg, int(b))
  if leaf.startswith("nextn."):
    return ("mtp", attr_name(leaf))
  if leaf in common_block_shapes(cfg):
    sub = ("ffn",) if leaf.startswith("ffn_") else ()
    return base + sub + (attr_name(leaf),)
  return base + ("mixer", attr_name(leaf))


__all__ = ["Qwen38", "LayerGroup", "Block", "GatedAttention", "GatedDeltaNet", "SwiGLU", "MTPHead",
           "RecurrentState", "KVRows", "AttentionOptions", "layer_groups", "param_path",
           "zero_recurrent_state", "delta_rule_scan", "delta_rule_chunked", "write_kv_rows", "rms_norm",
           "rope_neox", "mtp_extra_shapes"]
