"""The gated delta rule (the Gated DeltaNet's recurrence): reference + Pallas kernels.

Modules: `api` (the entry points, `implementation=`: `delta_rule` for a prefill's rows, `delta_rule_rows` for
a decode's or verify's few), `reference` (plain jnp, and a float64 numpy twin for tests), `triton` (the chunked
form's two Pallas calls), `rows` (the one-row-a-step form in one Pallas call), both Triton lowering.
"""
from kvjax_pallas.delta_rule.api import delta_rule, delta_rule_rows, resolve_implementation, IMPLEMENTATIONS
from kvjax_pallas.delta_rule.rows import RowsOptions
from kvjax_pallas.delta_rule.triton import DeltaRuleOptions, PRECISIONS

__all__ = ["delta_rule", "delta_rule_rows", "resolve_implementation", "IMPLEMENTATIONS", "DeltaRuleOptions",
           "RowsOptions", "PRECISIONS"]
