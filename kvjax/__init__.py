"""kvjax: streamed attention over a host-authoritative, quantized, paged KV cache (JAX/Pallas).

Entry point: `kvjax.api` (load a model, make a plain or streamed KV cache from a budget, generate,
teacher-forced logits); the `kvjax` command (`kvjax.cli`) maps its flags onto it. Underneath:
`kvjax.engine` (build a model, run it against a KV provider), `kvjax.generate` / `kvjax.speculative`
(the decode loops), `kvjax.streaming` (streamed KV, its budget, the adaptive policy and the phase
arena). See docs/DESIGN.md for the layout map.
"""

__version__ = "0.1.0"
