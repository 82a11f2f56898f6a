"""The gated delta rule over a forward's few rows (decode and verify): one Pallas call, Triton lowering.

Runs on NVIDIA GPUs, or anywhere with `interpret=True`. A program keeps a [dk, block_v] block of one value
head's state on chip and steps through the S rows in order (a device loop inside the kernel), each row the
token form's arithmetic (`reference.delta_rule_reference`):
  S <- e^(g_t) S;   d = (v_t - S^T k_t) beta_t;   S <- S + k_t d^T;   o_t = S^T q_t
The loop body is the same code whatever S is, so a row's bits do not depend on how many rows come with it:
a one-row decode forward and a verify forward give the same states and outputs row for row (speculative
output stays plain greedy's), and a rollback that replays a verify's rows with the rows past j masked
(g = beta = 0 leave the state as it is) rebuilds the state after row j bit for bit.

Why a kernel: in XLA's form a row is ~3-5 programs (decay, two matrix-vector sums, the update), and S rows
are a device loop of S trips of them, each trip launched by the host; here a layer's rows are one launch.

`capture=True` also writes the state after every row ([S, H, dk, dv]: the "device" rollback's checkpoints).

Shapes: state_hkv [H, dk, dv], q_shk / k_shk [S, H, dk], v_shv [S, H, dv], g_sh / beta_sh [S, H] -> (state_hkv
after the last row, or [S, H, dk, dv] with `capture`; o_shv [S, H, dv]), float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax_pallas.delta_rule import triton as _triton


@dataclasses.dataclass(frozen=True)
class RowsOptions:
  """Static tuning knobs (hashable: part of compiled-step keys)."""
  block_v: int = 32    # value columns of the state a program keeps (a power of two >= 16; at most dv)
  num_warps: int = 4


def check_options(options: RowsOptions) -> None:
  if not isinstance(options, RowsOptions):
    raise ValueError(f"delta_rule_rows: options must be a RowsOptions, got {type(options).__name__}")
  if not isinstance(options.block_v, int) or options.block_v < 16 or options.block_v & (options.block_v - 1):
    raise ValueError(f"delta_rule_rows: block_v is {options.block_v!r}, needs a power of two >= 16 (the Triton tiles)")
  if not isinstance(options.num_warps, int) or options.num_warps < 1:
    raise ValueError(f"delta_rule_rows: num_warps is {options.num_warps!r}, needs an int >= 1")


def row_step(s_kv, q_k, k_k, v_v, g, beta):
  """One row of the delta rule on a program's [dk, block_v] state block -> (state, o [block_v]): the kernels' one
  row arithmetic (this one's and `gdn_rows`'), so their states agree bit for bit."""
  s_kv = jnp.exp(g) * s_kv
  d_v = (v_v - jnp.sum(s_kv * k_k[:, None], axis=0)) * beta
  s_kv = s_kv + k_k[:, None] * d_v[None, :]
  return s_kv, jnp.sum(s_kv * q_k[:, None], axis=0)


def _rows_kernel(n_ref, s0_ref, q_ref, k_ref, v_ref, g_ref, b_ref,   # [1] int32, [H, dk, dv], [S, H, dk] x2,
                                                                    # [S, H, dv], [S, H] x2
                 o_ref, s_ref,                               # -> [S, H, dv], [H, dk, dv] (or [S, H, dk, dv])
                 *, block_v: int, capture: bool):
  hh, vb = pl.program_id(0), pl.program_id(1)
  cols = pl.ds(vb * block_v, block_v)

  def step(t, s_kv):
    s_kv, o_ref[t, hh, cols] = row_step(s_kv, q_ref[t, hh, :], k_ref[t, hh, :], v_ref[t, hh, cols], g_ref[t, hh],
                                        b_ref[t, hh])
    if capture:
      s_ref[t, hh, :, cols] = s_kv
    return s_kv

  s_kv = lax.fori_loop(0, n_ref[0], step, s0_ref[hh, :, cols])
  if not capture:
    s_ref[hh, :, cols] = s_kv


@functools.partial(jax.jit, static_argnames=("capture", "options", "interpret"))
def delta_rule_rows_triton(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, n_rows=None, *, capture: bool = False,
                           options: RowsOptions = RowsOptions(), interpret: bool = False):
  """The S rows in order from `state_hkv` (see the module docstring)."""
  _triton.check_shapes(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, None)
  s, h, dk = q_shk.shape
  dv = v_shv.shape[-1]
  _triton.check_kernel_sizes(dk, dv)
  check_options(options)
  f32 = jnp.float32
  if s == 0:   # no rows: the state as it was
    state = jnp.zeros((0, h, dk, dv), f32) if capture else jnp.asarray(state_hkv, f32)
    return state, jnp.zeros((0, h, dv), f32)
  bv = min(options.block_v, dv)
  state_shape = (s, h, dk, dv) if capture else (h, dk, dv)
  params = None if interpret or _triton._pltriton is None else _triton._pltriton.CompilerParams(
      num_warps=options.num_warps, num_stages=1)
  o, state = pl.pallas_call(
      functools.partial(_rows_kernel, block_v=bv, capture=capture),
      grid=(h, dv // bv),
      out_shape=(jax.ShapeDtypeStruct((s, h, dv), f32), jax.ShapeDtypeStruct(state_shape, f32)),
      compiler_params=params, interpret=interpret, name="kvjax_delta_rule_rows",
  )(jnp.full((1,), s if n_rows is None else n_rows, jnp.int32),
    *(jnp.asarray(x, f32) for x in (state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh)))
  return state, o
