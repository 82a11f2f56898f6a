"""Matrix products with weights in GGUF block formats (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K), dequantized
as they are read.

Modules: `api` (the entry point and the registry of implementations), `formats` (block sizes,
row sizes, argument checks), `reference` (plain jnp: dequantize, dequantize-then-dot) and
`kernel` (the Pallas kernel that decodes weight tiles in registers), `gemv` (its form for a few
rows of x: no dot, split over K), `planar` (Q8_0 / Q4_0 / Q4_K repacked into planes at load) and
`planar_gemv` (the Pallas GEMV over the planes, a GPU's product for decode and verify rows).
"""
from kvjax_pallas.quant_matmul.api import (quant_matmul, dequantize, FORMATS, IMPLEMENTATIONS,
                                           GemvConfig, QuantMatmulConfig)

__all__ = ["quant_matmul", "dequantize", "FORMATS", "IMPLEMENTATIONS", "GemvConfig", "QuantMatmulConfig"]
