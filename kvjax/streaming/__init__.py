"""Streamed KV: host-authoritative paged history, resident pages + one shared ring, span plans, and
the memory policy that sizes them (budget arithmetic, the phase arena, the adaptive policy)."""
from kvjax.streaming.budget import (StreamBudgetError, StreamConfig, adaptive_staging_reserve_pages,
                                    fit_adaptive_pool, fit_split, fixed_split, staging_reserve_pages,
                                    stream_config_from_budget)
from kvjax.streaming.host_history import HostHistory
from kvjax.streaming.provider import StreamedKV
from kvjax.streaming.span_plan import Span, SpanPlan, SpanPlanError, make_plan, page_table, validate_plan

__all__ = ["HostHistory", "StreamBudgetError", "StreamConfig", "StreamedKV",
           "adaptive_staging_reserve_pages", "fit_adaptive_pool", "fit_split", "fixed_split",
           "staging_reserve_pages", "stream_config_from_budget", "Span", "SpanPlan", "SpanPlanError",
           "make_plan", "page_table", "validate_plan"]
