"""Streamed KV: host-authoritative paged history, resident pages + one shared ring, span plans, and
the memory policy that sizes them (the plan of a budget, budget arithmetic, the phase arena, the
adaptive policy). Names load with their module on first use: the arithmetic (`plan`, `budget`,
`policy`) imports no JAX, so `kvjax memory` answers at once."""

import importlib

_EXPORTS = {
    "budget": ("StreamBudgetError", "StreamConfig", "adaptive_staging_reserve_pages", "fit_adaptive_pool",
               "fit_split", "fixed_split", "staging_reserve_pages"),
    "host_history": ("HostHistory",),
    "provider": ("StreamedKV",),
    "span_plan": ("Span", "SpanPlan", "SpanPlanError", "make_plan", "page_table", "validate_plan"),
    "plan": ("KVGeometry", "KVPlan", "Workspaces", "plan_kv"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
  if name not in _WHERE:
    raise AttributeError(f"module 'kvjax.streaming' has no attribute {name!r}")
  value = getattr(importlib.import_module(f"kvjax.streaming.{_WHERE[name]}"), name)
  globals()[name] = value
  return value
