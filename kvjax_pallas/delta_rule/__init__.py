"""The gated delta rule (the Gated DeltaNet's recurrence) over a prefill's rows: reference + Pallas
kernel.

Modules: `api` (the entry point, `implementation=`), `reference` (plain jnp, and a float64 numpy
twin for tests), `triton` (the chunked form's two Pallas calls, Triton lowering).
"""
from kvjax_pallas.delta_rule.api import delta_rule, resolve_implementation, IMPLEMENTATIONS
from kvjax_pallas.delta_rule.triton import DeltaRuleOptions, PRECISIONS

__all__ = ["delta_rule", "resolve_implementation", "IMPLEMENTATIONS", "DeltaRuleOptions", "PRECISIONS"]
