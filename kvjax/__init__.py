"""kvjax: streamed attention over a host-authoritative, quantized, paged KV cache (JAX/Pallas).

Entry points: `kvjax.engine` (build a model, run it against a KV provider), `kvjax.generate`
(the decode loop), `kvjax.streaming` (streamed KV), `kvjax.policy` / `kvjax.arena` (adaptive
split, phase arena), `kvjax.cli` (the `kvjax` command). See docs/DESIGN.md for the layout map.
"""

__version__ = "0.1.0"
