"""Span attention over paged, quantized KV (reference + Pallas kernels).

Modules: `api` (the entry points and the registry of implementations), `reference` (plain jnp),
`triton` (the Pallas Triton kernel), `mosaic_decode` and `mosaic_prefill` (the Pallas Mosaic GPU
kernels), and their shared pieces: `combine` (the in-order fold of a kernel's partitions),
`common` (argument checks, pool views, the whole-span call), `partitions` (block_pages="auto"),
`mosaic_common` (the Mosaic GPU layout contract, pool views and magic conversions) and
`magic_ptx` (the conversions' PTX).
"""
from kvjax_pallas.span_attention.api import (span_attention, span_attention_partial, init_carry,
                                             finalize, IMPLEMENTATIONS)
from kvjax_pallas.span_attention.common import pages_from_kv

__all__ = ["span_attention", "span_attention_partial", "init_carry", "finalize", "IMPLEMENTATIONS", "pages_from_kv"]
