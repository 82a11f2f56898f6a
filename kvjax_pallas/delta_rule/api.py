"""The gated delta rule over a prefill's rows: `implementation=` picks the jnp reference or the
Pallas kernel.

implementations:
  "reference"  the token-by-token recurrence in plain jnp (`reference.py`): the oracle
  "triton"     the chunked form as two Pallas calls a layer, Triton lowering (`triton.py`); runs
               on NVIDIA GPUs, or anywhere with `interpret=True`
  "auto"       "triton" on an NVIDIA GPU, "reference" elsewhere

Kernel-only keyword arguments (ignored by "reference"): `options` (`triton.DeltaRuleOptions`:
chunk, value block, warps, each kernel's precision) and `precision` (a `triton.PRECISIONS` name for
both kernels).

Shapes: state_hkv [H, dk, dv], q_shk / k_shk [S, H, dk], v_shv [S, H, dv], g_sh / beta_sh [S, H]
-> (state_hkv after the last row, o_shv [S, H, dv]), float32.
"""

from __future__ import annotations

from typing import Optional

import jax

from kvjax_pallas.delta_rule import reference as _ref
from kvjax_pallas.delta_rule import triton as _triton

IMPLEMENTATIONS = ("reference", "triton")


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
  if impl == "reference":
    _triton.check_shapes(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh, None)
    return _ref.delta_rule_reference(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh)
  return _triton.delta_rule_chunked_triton(state_hkv, q_shk, k_shk, v_shv, g_sh, beta_sh,
                                           options=options or _triton.DeltaRuleOptions(),
                                           precision=precision, interpret=interpret)
