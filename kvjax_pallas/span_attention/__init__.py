"""Span attention over paged, quantized KV (reference + Pallas kernels)."""
from kvjax_pallas.span_attention.api import (span_attention, span_attention_partial, init_carry,
                                             finalize, IMPLEMENTATIONS)

__all__ = ["span_attention", "span_attention_partial", "init_carry", "finalize", "IMPLEMENTATIONS"]
