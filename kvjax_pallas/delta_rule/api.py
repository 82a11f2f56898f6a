"""The gated delta rule: `implementation=` picks the jnp reference or a Pallas kernel. `delta_rule` takes a
prefill's rows (the chunked form), `delta_rule_rows` a decode's or verify's few (one row a step).

implementations:
  "reference"  the token-by-token recurrence in plain jnp (`reference.py`): the oracle
  "triton"     the chunked form as two Pallas calls a layer, Triton lowering (`triton.py`); runs
               on NVIDIA GPUs, or anywhere with `interpret=True`
  "auto"       "triton" on an NVIDIA GPU, "reference" elsewhere

Kernel-only keyword arguments (ignored by "reference"): `options` (`triton.DeltaRuleOptions`:
chunk, value block, warps, each kernel's precision) and `precision` (a `triton.PRECISIONS` name for
both kernels).

No gradient: the kernels are forward-only (training runs the model's XLA form).

Shapes: state_hkv [H, dk, dv], q_shk / k_shk [S, H, dk], v_shv [S, H, dv], g_sh / beta_sh [S, H]
-> (state_hkv after the last row, o_shv [S, H, dv]), float32.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from kvjax_pallas.delta_rule import reference as _ref
from kvjax_pallas.delta_rule import rows as _rows
from kvjax_pallas.delta_rule import triton as _triton

IMPLEMENTATIONS = ("reference", "triton")


_NAMES = ("state", "q", "k", "v", "g", "beta")


def _as_array(name: str, x):
  """Nested lists and numbers as an array (float32), or a one-line ValueError naming the operand."""
  try:
    return np.asarray(x, np.float32)
  except (TypeError, ValueError):
    raise ValueError(f"delta_rule: {name} must be an array (numpy or jax), got {type(x).__name__}") from None


def resolve_implementation(implementation: str) -> str:
  """"auto" -> "triton" on an NVIDIA GPU, else "reference"; other names are checked."""
  if implementation == "auto":
    return "triton" if jax.default_backend() == "gpu" else "reference"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"delta_rule: implementation {implementation!r}, needs auto or one of {IMPLEMENTATIONS}")
  return implementation


def delta_rule(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, *, implementation: str = "reference",
               options: Optional[_triton.DeltaRuleOptions] = None,
               precision: Optional[str] = None, interpret: bool = False):
  """The gated delta rule over S rows from `state_hkv` (see the module docstring)."""
  impl = resolve_implementation(implementation)
  if options is not None and not isinstance(options, _triton.DeltaRuleOptions):
    raise ValueError(f"delta_rule: options must be a DeltaRuleOptions, got {type(options).__name__}")
  state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh = (x if hasattr(x, "shape") else _as_array(name, x) for name, x in
                                                   zip(_NAMES, (state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh)))
  if impl == "reference":
    _triton.check_shapes(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, None)
    return _ref.delta_rule_reference(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh)
  return _triton.delta_rule_chunked_triton(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh,
                                           options=options or _triton.DeltaRuleOptions(),
                                           precision=precision, interpret=interpret)


def delta_rule_rows(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, n_rows=None, *, implementation: str = "reference",
                    capture: bool = False, options: Optional[_rows.RowsOptions] = None, interpret: bool = False):
  """The gated delta rule one row a step over the first `n_rows` rows (traced int32; default all) -> (the state
  after them, or with `capture` the state after every row [S, H, dk, dv]; o_shv [S, H, dv]), float32.
  "triton": `rows.delta_rule_rows_triton` (one call; `options` a `rows.RowsOptions`); "reference": the scan in
  jnp (`reference.delta_rule_rows_reference`). Rows past `n_rows` leave the state as it is; their output rows
  are zero ("reference") or left unwritten ("triton")."""
  impl = resolve_implementation(implementation)
  state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh = (x if hasattr(x, "shape") else _as_array(name, x) for name, x in
                                                   zip(_NAMES, (state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh)))
  if impl == "reference":
    _triton.check_shapes(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, None)
    return _ref.delta_rule_rows_reference(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, n_rows, capture)
  return _rows.delta_rule_rows_triton(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, n_rows, capture=capture,
                                      options=options or _rows.RowsOptions(), interpret=interpret)
