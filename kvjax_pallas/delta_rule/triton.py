"""The chunked gated delta rule (the Gated DeltaNet's prefill): Pallas kernels, Triton lowering.

Runs on NVIDIA GPUs, or anywhere with `interpret=True`. Same algebra as the model's XLA form
(`kvjax.gdn_xla.delta_rule_chunked`): within a chunk of C tokens with cumulative log decay gamma_t
and chunk-start state S0 [dk, dv],
  T  = (I + diag(beta) M)^-1,  M[t, i] = e^(gamma_t - gamma_i) k_t.k_i (i < t)   unit lower-triangular
  W  = T diag(beta e^gamma) K       U = T diag(beta) V                           none uses S0
  D  = U - W S0
  O  = diag(e^gamma) Q S0 + P D,    P[t, i] = e^(gamma_t - gamma_i) q_t.k_i (i <= t)
  S1 = e^gamma_C S0 + (diag(e^(gamma_C - gamma)) K)^T D

Two calls a layer:
  `_prep_kernel`  grid (chunks, heads): every chunk at once. gamma (a cumulative sum), T by
                  forward substitution (C steps on a [C, C] tile: row i of T is final once the
                  columns before it are folded in; or 16-row diagonal blocks at once, then the
                  blocks below by products), then W, U and P. Writes gamma [S, H],
                  W [S, H, dk], U [S, H, dv], P [chunks, H, C, C].
  `_scan_kernel`  grid (heads, value blocks): a [dk, block_v] block of the state stays on chip
                  while the program walks the chunks in order (the value columns of the delta rule
                  are independent given K), three products and one update a chunk. With
                  `DeltaRuleOptions.split_output` (the default) two calls instead: `_state_kernel` (the serial
                  part, D and the update: two products a chunk; writes D and each chunk's starting
                  state) and `_output_kernel` (grid chunks x heads x value blocks: O at once).

The XLA form runs the same chunks as a device loop of about fifteen small programs a chunk (a
triangular solve among them); here the chunk-parallel work is one call and the loop one program.

A precision (`PRECISIONS`, one a kernel: `DeltaRuleOptions`) says how the float32 products meet
the GPU (the interpreter computes float32 at HIGHEST whatever it says):
  "tf32x3"  TF32 tensor cores, three products a dot (head x head + the two cross terms):
            float32-class results (the scan's default)
  "bf16x6"  bf16 tensor cores, six products a dot (float32-class; the prep's default)
  "ieee"    float32 FMAs (exact float32, slowest)
  "tf32"    one TF32 product (~1e-3 relative: a study knob, not the model's accuracy)

Tuning knobs: `DeltaRuleOptions` (chunk, value block, warps, pipeline stages, precisions, T's
substitution).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # jax 0.10 / 0.11: the Triton backend's compiler parameters (deprecated in jax 0.11)
  from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover
  _pltriton = None

PRECISIONS = ("tf32x3", "bf16x6", "ieee", "tf32")
_PRESETS = {"tf32x3": "TF32_TF32_F32_X3", "bf16x6": "BF16_BF16_F32_X6", "ieee": "F32_F32_F32",
            "tf32": "TF32_TF32_F32"}


@dataclasses.dataclass(frozen=True)
class DeltaRuleOptions:
  """Static tuning knobs of the two kernels (hashable: part of compiled-step keys). Defaults: the
  fastest measured on an H100 at the 27B's heads (docs/PERFORMANCE.md, 'Gated DeltaNet')."""
  chunk: int = 64                 # tokens a chunk (a power of two, >= 16)
  block_v: int = 32               # value columns a scan program keeps of the state (a power of two
                                  # >= 16; at most the value head size)
  num_warps: int = 4              # a scan program's
  num_stages: int = 1             # the scan's software pipelining of its chunk loads
  scan_precision: str = "tf32x3"  # `PRECISIONS`
  prep_num_warps: int = 4
  prep_precision: str = "bf16x6"
  split_output: bool = True       # the scan as a serial call of two products a chunk (D and each
                                  # chunk's starting state) and a chunk-parallel call for O
  sub_block: int = 16             # T's forward substitution: 0 one row a step over the chunk; B (a
                                  # power of two dividing the chunk): B steps over the diagonal BxB
                                  # blocks at once (a product a step), then the blocks below by products


def _pow2(x: int) -> bool:
  return x >= 16 and x & (x - 1) == 0


def kernel_sizes_ok(dk: int, dv: int) -> bool:
  return _pow2(dk) and _pow2(dv)


def check_kernel_sizes(dk: int, dv: int) -> None:
  """A ValueError unless the kernels take heads of these sizes (each a power of two >= 16)."""
  for name, n in (("head_dim (dk)", dk), ("value head_dim (dv)", dv)):
    if not _pow2(n):
      raise ValueError(f"delta_rule: {name} is {n}, needs a power of two >= 16 (the Triton dots)")


def check_shapes(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, options: Optional[DeltaRuleOptions]) -> None:
  """One-line ValueErrors for operands that do not agree, and (with `options`) for those the
  kernels cannot take and options they cannot run, before anything runs."""
  arrays = dict(state=state_hkv, q=q_shk, k=k_shk, v=v_shv, g=g_sh, beta=beta_sh)
  for name, x in arrays.items():
    if not hasattr(x, "shape") or not hasattr(x, "ndim"):
      raise ValueError(f"delta_rule: {name} must be an array (numpy or jax), got {type(x).__name__}")
  if q_shk.ndim != 3:
    raise ValueError(f"delta_rule: q must be [S, H, dk], got shape {tuple(q_shk.shape)}")
  s, h, dk = q_shk.shape
  dv = v_shv.shape[-1]
  want = {"k": (k_shk.shape, (s, h, dk)), "v": (v_shv.shape, (s, h, dv)), "g": (g_sh.shape, (s, h)),
          "beta": (beta_sh.shape, (s, h)), "state": (state_hkv.shape, (h, dk, dv))}
  for name, (got, need) in want.items():
    if tuple(got) != need:
      raise ValueError(f"delta_rule: {name} has shape {tuple(got)}, needs {need} (q is {(s, h, dk)})")
  if options is None:
    return
  if not isinstance(options, DeltaRuleOptions):
    raise ValueError(f"delta_rule: options must be a DeltaRuleOptions, got {type(options).__name__}")
  for f in dataclasses.fields(options):
    value = getattr(options, f.name)
    if f.type in ("int", int) and (not isinstance(value, int) or isinstance(value, bool)):
      raise ValueError(f"delta_rule: options.{f.name} must be an int, got {value!r}")
  check_kernel_sizes(dk, dv)
  if not _pow2(options.chunk):
    raise ValueError(f"delta_rule: chunk is {options.chunk}, needs a power of two >= 16 (the Triton dots)")
  if not _pow2(options.block_v):
    raise ValueError(f"delta_rule: block_v is {options.block_v}, needs a power of two >= 16 (the Triton dots)")
  if options.sub_block and (not _pow2(options.sub_block) or options.chunk % options.sub_block):
    raise ValueError(f"delta_rule: sub_block {options.sub_block}, needs 0 or a power of two >= 16 dividing the "
                     f"chunk {options.chunk}")
  for name in ("num_warps", "num_stages", "prep_num_warps"):
    if getattr(options, name) < 1:
      raise ValueError(f"delta_rule: options.{name} is {getattr(options, name)}, needs >= 1")


def _precision(precision: str, interpret: bool):
  """A `PRECISIONS` name -> the dots' precision (HIGHEST in the interpreter)."""
  if precision not in PRECISIONS:
    raise ValueError(f"delta_rule: precision {precision!r}, needs one of {PRECISIONS}")
  if interpret:
    return lax.Precision.HIGHEST
  return getattr(lax.DotAlgorithmPreset, _PRESETS[precision])


def _dot(a, b, prec, trans_a: bool = False, trans_b: bool = False):
  """[M, K] . [K, N] -> [M, N] float32 (a given as [K, M] with trans_a, b as [N, K] with trans_b)."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _last(x_c, chunk: int):
  """x_c [C] -> its last element as a scalar (a masked sum: no element indexing in the lowering)."""
  return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, (chunk,), 0) == chunk - 1, x_c, 0.0))


def _unit_lower_inverse(m_cc, ti, tj, chunk: int, sub_block: int, prec):
  """(I + M)^-1 for M [C, C] strictly lower triangular (float32)."""
  eye = jnp.where(ti == tj, 1.0, 0.0).astype(jnp.float32)
  if not sub_block:
    return _row_substitution(m_cc, ti, tj, chunk)
  same = (ti // sub_block) == (tj // sub_block)
  diag_cc, below_cc = jnp.where(same, m_cc, 0.0), jnp.where(same, 0.0, m_cc)

  def substitute_blocks(i, t_cc):     # column i of every diagonal block at once
    rows = jnp.where(ti % sub_block == i, t_cc, 0.0)              # the final rows j, j % B == i
    return t_cc - _dot(jnp.where(tj % sub_block == i, diag_cc, 0.0), rows, prec)
  tb_cc = lax.fori_loop(0, sub_block, substitute_blocks, eye)     # (I + diag blocks)^-1
  x_cc = _dot(tb_cc, below_cc, prec)                              # nilpotent: X^(C/B) = 0
  y_cc = eye
  for _ in range(chunk // sub_block - 1):                         # (I + X)^-1 = I - X (I - X (...))
    y_cc = eye - _dot(x_cc, y_cc, prec)
  return _dot(y_cc, tb_cc, prec)


def _prep_kernel(q_ref, k_ref, v_ref, g_ref, b_ref,           # [S, H, dk] x2, [S, H, dv], [S, H] x2
                 gam_ref, w_ref, u_ref, p_ref,                 # [S, H], [S, H, dk], [S, H, dv], [n, H, C, C]
                 *, chunk: int, sub_block: int, prec):
  ci, hh = pl.program_id(0), pl.program_id(1)
  rows = pl.ds(ci * chunk, chunk)
  q_ck, k_ck, v_cv = q_ref[rows, hh, :], k_ref[rows, hh, :], v_ref[rows, hh, :]
  g_c, b_c = g_ref[rows, hh], b_ref[rows, hh]
  ti = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
  tj = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
  strict, incl = tj < ti, tj <= ti
  gam_c = jnp.sum(jnp.where(incl, g_c[None, :], 0.0), axis=1)      # cumulative log decay
  diff_cc = gam_c[:, None] - gam_c[None, :]
  kk_cc = _dot(k_ck, k_ck, prec, trans_b=True)
  m_cc = jnp.where(strict, b_c[:, None] * kk_cc * jnp.exp(jnp.where(strict, diff_cc, 0.0)), 0.0)

  t_cc = _unit_lower_inverse(m_cc, ti, tj, chunk, sub_block, prec)

  eg_c = jnp.exp(gam_c)
  gam_ref[rows, hh] = gam_c
  w_ref[rows, hh, :] = _dot(t_cc, (b_c * eg_c)[:, None] * k_ck, prec)
  u_ref[rows, hh, :] = _dot(t_cc, b_c[:, None] * v_cv, prec)
  qk_cc = _dot(q_ck, k_ck, prec, trans_b=True)
  p_ref[ci, hh, :, :] = jnp.where(incl, qk_cc * jnp.exp(jnp.where(incl, diff_cc, 0.0)), 0.0)


def _row_substitution(m_bb, ti, tj, rows: int):
  """(I + M)^-1 for M [B, B] strictly lower triangular, one row a step (row i of T is final once
  the columns before it are folded in)."""
  def substitute(i, t_bb):
    row = jnp.sum(jnp.where(ti == i, t_bb, 0.0), axis=0)         # T[i, :]
    col = jnp.sum(jnp.where(tj == i, m_bb, 0.0), axis=1)         # M[:, i] (zero for rows <= i)
    return t_bb - col[:, None] * row[None, :]
  return lax.fori_loop(0, rows, substitute, jnp.where(ti == tj, 1.0, 0.0).astype(jnp.float32))


def _scan_kernel(s0_ref, q_ref, k_ref, gam_ref, w_ref, u_ref, p_ref,  # [H, dk, dv], [S, H, dk] x2, [S, H],
                                                                        # [S, H, dk], [S, H, dv], [n, H, C, C]
                 o_ref, s1_ref,                                         # -> [S, H, dv], [H, dk, dv]
                 *, chunk: int, chunks: int, block_v: int, prec):
  hh, vb = pl.program_id(0), pl.program_id(1)
  cols = pl.ds(vb * block_v, block_v)

  def step(ci, s_kv):
    rows = pl.ds(ci * chunk, chunk)
    q_ck, k_ck, w_ck = q_ref[rows, hh, :], k_ref[rows, hh, :], w_ref[rows, hh, :]
    u_cv, gam_c, p_cc = u_ref[rows, hh, cols], gam_ref[rows, hh], p_ref[ci, hh, :, :]
    d_cv = u_cv - _dot(w_ck, s_kv, prec)
    o_ref[rows, hh, cols] = jnp.exp(gam_c)[:, None] * _dot(q_ck, s_kv, prec) + _dot(p_cc, d_cv, prec)
    return _next_state(s_kv, k_ck, gam_c, d_cv, chunk, prec)

  s1_ref[hh, :, cols] = lax.fori_loop(0, chunks, step, s0_ref[hh, :, cols])


def _next_state(s_kv, k_ck, gam_c, d_cv, chunk: int, prec):
  """S1 = e^gamma_C S0 + (diag(e^(gamma_C - gamma)) K)^T D."""
  g_end = _last(gam_c, chunk)
  k_tail = k_ck * jnp.exp(g_end - gam_c)[:, None]
  return jnp.exp(g_end) * s_kv + _dot(k_tail, d_cv, prec, trans_a=True)


def _state_kernel(s0_ref, k_ref, gam_ref, w_ref, u_ref,               # [H, dk, dv], [S, H, dk], [S, H],
                                                                        # [S, H, dk], [S, H, dv]
                  d_ref, sc_ref, s1_ref,                                # -> [S, H, dv], [n, H, dk, dv], [H, dk, dv]
                  *, chunk: int, chunks: int, block_v: int, prec):
  """`split_output`'s serial half: D and each chunk's starting state, two products a chunk."""
  hh, vb = pl.program_id(0), pl.program_id(1)
  cols = pl.ds(vb * block_v, block_v)

  def step(ci, s_kv):
    rows = pl.ds(ci * chunk, chunk)
    sc_ref[ci, hh, :, cols] = s_kv
    d_cv = u_ref[rows, hh, cols] - _dot(w_ref[rows, hh, :], s_kv, prec)
    d_ref[rows, hh, cols] = d_cv
    return _next_state(s_kv, k_ref[rows, hh, :], gam_ref[rows, hh], d_cv, chunk, prec)

  s1_ref[hh, :, cols] = lax.fori_loop(0, chunks, step, s0_ref[hh, :, cols])


def _output_kernel(q_ref, gam_ref, p_ref, d_ref, sc_ref,   # [S, H, dk], [S, H], [n, H, C, C], [S, H, dv], [n, H, dk, dv]
                   o_ref,                                   # -> [S, H, dv]
                   *, chunk: int, block_v: int, prec):
  """`split_output`'s parallel half: O = diag(e^gamma) Q S_chunk + P D, every chunk at once."""
  ci, hh, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, cols = pl.ds(ci * chunk, chunk), pl.ds(vb * block_v, block_v)
  o_ref[rows, hh, cols] = (jnp.exp(gam_ref[rows, hh])[:, None] * _dot(q_ref[rows, hh, :], sc_ref[ci, hh, :, cols], prec)
                           + _dot(p_ref[ci, hh, :, :], d_ref[rows, hh, cols], prec))


def _params(num_warps: int, num_stages: int, interpret: bool):
  if interpret or _pltriton is None:
    return None
  return _pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _padded(options: DeltaRuleOptions, *xs):
  s = xs[0].shape[0]
  pad = -(-s // options.chunk) * options.chunk - s
  return [jnp.pad(jnp.asarray(x, jnp.float32), [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in xs]


def prep_call(q, k, v, g, b, *, options: DeltaRuleOptions, prec, interpret: bool):
  """The chunk-parallel call over padded rows (a multiple of the chunk) -> (gamma [S, H],
  W [S, H, dk], U [S, H, dv], P [chunks, H, C, C])."""
  s, h, dk = q.shape
  dv, c, f32 = v.shape[-1], options.chunk, jnp.float32
  n = s // c
  return pl.pallas_call(
      functools.partial(_prep_kernel, chunk=c, sub_block=options.sub_block, prec=prec),
      grid=(n, h),
      out_shape=(jax.ShapeDtypeStruct((s, h), f32), jax.ShapeDtypeStruct((s, h, dk), f32),
                 jax.ShapeDtypeStruct((s, h, dv), f32), jax.ShapeDtypeStruct((n, h, c, c), f32)),
      compiler_params=_params(options.prep_num_warps, 1, interpret),
      interpret=interpret, name="kvjax_delta_rule_prep",
  )(q, k, v, g, b)


def scan_call(state_hkv, q, k, gam, w, u, p, *, options: DeltaRuleOptions, prec, interpret: bool):
  """The chunks in order from `state_hkv` over padded rows -> (o [S, H, dv], state_hkv): one call, or
  with `options.split_output` the serial state call and the chunk-parallel output call."""
  s, h, dk = q.shape
  dv, c, f32, bv = u.shape[-1], options.chunk, jnp.float32, options.block_v
  params = _params(options.num_warps, options.num_stages, interpret)
  if not options.split_output:
    return pl.pallas_call(
        functools.partial(_scan_kernel, chunk=c, chunks=s // c, block_v=bv, prec=prec),
        grid=(h, dv // bv),
        out_shape=(jax.ShapeDtypeStruct((s, h, dv), f32), jax.ShapeDtypeStruct((h, dk, dv), f32)),
        compiler_params=params, interpret=interpret, name="kvjax_delta_rule_scan",
    )(jnp.asarray(state_hkv, f32), q, k, gam, w, u, p)
  d, starts, state = pl.pallas_call(
      functools.partial(_state_kernel, chunk=c, chunks=s // c, block_v=bv, prec=prec),
      grid=(h, dv // bv),
      out_shape=(jax.ShapeDtypeStruct((s, h, dv), f32), jax.ShapeDtypeStruct((s // c, h, dk, dv), f32),
                 jax.ShapeDtypeStruct((h, dk, dv), f32)),
      compiler_params=params, interpret=interpret, name="kvjax_delta_rule_state",
  )(jnp.asarray(state_hkv, f32), k, gam, w, u)
  o = pl.pallas_call(
      functools.partial(_output_kernel, chunk=c, block_v=bv, prec=prec),
      grid=(s // c, h, dv // bv),
      out_shape=jax.ShapeDtypeStruct((s, h, dv), f32),
      compiler_params=_params(options.prep_num_warps, 1, interpret), interpret=interpret,
      name="kvjax_delta_rule_output",
  )(q, gam, p, d, starts)
  return o, state


@functools.partial(jax.jit, static_argnames=("options", "precision", "interpret"))
def delta_rule_chunked_triton(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, *,
                              options: DeltaRuleOptions = DeltaRuleOptions(),
                              precision: Optional[str] = None, interpret: bool = False):
  """-> (state_hkv after the last token, o_shv [S, H, dv]), float32. `precision` (a `PRECISIONS`
  name) overrides both kernels' (`options.prep_precision`, `options.scan_precision`). Tokens past a
  multiple of the chunk are padded with k = v = g = beta = 0 (they leave the state unchanged)."""
  check_shapes(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, options)
  if q_shk.shape[0] == 0:   # no rows: the state as it was
    return jnp.asarray(state_hkv, jnp.float32), jnp.zeros(v_shv.shape, jnp.float32)
  options = dataclasses.replace(options, block_v=min(options.block_v, v_shv.shape[-1]))
  prep_prec = _precision(precision or options.prep_precision, interpret)
  scan_prec = _precision(precision or options.scan_precision, interpret)
  q, k, v, g, b = _padded(options, q_shk, k_shk, v_shv, g_sh, beta_sh)
  gam, w, u, p = prep_call(q, k, v, g, b, options=options, prec=prep_prec, interpret=interpret)
  o, state = scan_call(state_hkv, q, k, gam, w, u, p, options=options, prec=scan_prec, interpret=interpret)
  return state, o[:q_shk.shape[0]]
