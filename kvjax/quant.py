"""Public ggml codec API: `encode` / `decode` along the last axis.

Thin wrappers over `kvjax_pallas.ggml_codec` (the one definition shared by the
KV writer and the attention kernels). Kinds: "q8_0", "q4_0" (32-value blocks
of 34 / 18 bytes), "f32", "f16", "bf16" (little-endian scalars).

    blocks_u8 = encode(x_f32[..., n], "q8_0")     # [..., n // 32 * 34] uint8
    x_f32     = decode(blocks_u8, "q8_0")          # [..., n] float32

Bytes are identical to ggml's C reference quantizers (`quantize_row_q8_0_ref`,
`quantize_row_q4_0_ref`) and to `gguf.quants.quantize`; see
`kvjax_pallas/ggml_codec.py` for the rounding rules.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvjax_pallas import ggml_codec
from kvjax_pallas.page_layout import BLOCK_FORMATS, QK, row_bytes

KINDS = tuple(BLOCK_FORMATS)

# Map to the GGML type names used by the `gguf` package (GGMLQuantizationType).
GGML_TYPE_NAMES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "f32": "F32", "f16": "F16", "bf16": "BF16"}


def encode(x, kind: str):
  """Encode the last axis of `x` (any float array, length a multiple of the
  block size) as ggml `kind` -> uint8 `[..., row_bytes(kind, n)]`. Jit-able."""
  return ggml_codec.encode(jnp.asarray(x), kind)


def decode(blocks, kind: str, dtype=jnp.float32):
  """Decode uint8 ggml `kind` bytes along the last axis -> `[..., n]` of `dtype`."""
  return ggml_codec.decode(jnp.asarray(blocks), kind, dtype)


def nbytes(kind: str, n_values: int) -> int:
  """Bytes of `n_values` consecutive values stored as `kind`."""
  return row_bytes(kind, n_values)


encode_jit = ggml_codec.encode_jit
decode_jit = ggml_codec.decode_jit

__all__ = ["KINDS", "QK", "GGML_TYPE_NAMES", "encode", "decode", "nbytes",
           "encode_jit", "decode_jit"]
