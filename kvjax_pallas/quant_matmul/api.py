"""Matmul with GGUF-quantized weights: `implementation=` picks dequantize-then-dot or the kernel.

The implementations are a registry (`IMPLEMENTATIONS`, in `_REGISTRY`), each a function
(x_sk, w_nb, fmt, k, *, config, interpret) -> [S, N] float32:

  "xla"     `reference.quant_matmul_reference`: dequantize the whole matrix in jnp, then one dot
            (XLA fuses what it can). The default, until the kernel is measured on a GPU.
  "fused"   `reference.quant_matvec_fused`: for up to 16 rows the decode fused into one
            multiply-and-sum (XLA reads the stored bytes once); more rows as "xla".
  "pallas"  `kernel.quant_matmul_pallas`: the weight tiles decoded inside a Pallas kernel
            (Triton lowering), or anywhere with `interpret=True`.
  "pallas_gemv"  for one row (decode) `gemv.quant_gemv_pallas`: the planes meet x without a
            dot, split over K; more rows go to the "pallas" kernel, unless `config` is a
            `GemvConfig` (then the GEMV takes up to 16 rows). On the H200 (2026-12-05) the GEMV
            was the faster Q4_K product at one row and 1.3-5x slower than the kernel at four.

Kernel-only keyword arguments (checked, then ignored by "xla"):
  config     a `QuantMatmulConfig` (the matmul kernel's tiles) or, for "pallas_gemv", a
             `GemvConfig` (the GEMV's tiles, for up to 16 rows); None: the defaults of the call.
  interpret  run the Pallas kernel in the interpreter (CPU).

Shapes: x_sk [S, K] float32 or bfloat16 (they meet the weights in bfloat16 for bfloat16 x, else
in float32), w_nb uint8 [N, row_bytes(fmt, K)] (or its uint16 halfword view), out [S, N]
float32. Formats: `FORMATS` (q8_0, q4_0, q4_k, q5_k, q6_k; ggml's block layouts).
Imports nothing from `kvjax`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax

from kvjax_pallas.quant_matmul import formats as _formats
from kvjax_pallas.quant_matmul import gemv as _gemv
from kvjax_pallas.quant_matmul import kernel as _kernel
from kvjax_pallas.quant_matmul import planar as _planar
from kvjax_pallas.quant_matmul import planar_gemv as _planar_gemv
from kvjax_pallas.quant_matmul import prologue as _prologue
from kvjax_pallas.quant_matmul import reference as _ref

FORMATS = _formats.FORMATS
FORMAT_NAMES = _formats.FORMAT_NAMES
QuantMatmulConfig = _kernel.QuantMatmulConfig
GemvConfig = _gemv.GemvConfig
dequantize = _ref.dequantize
row_bytes = _formats.row_bytes
# weights repacked into planes at load (not ggml rows, so not in the registry): `planar`
PLANAR_FORMATS = _planar.PLANAR_FORMATS
to_planes = _planar.to_planes
dequantize_planes = _planar.dequantize_planes
planar_matmul = _planar.planar_matmul
PLANAR_PRODUCTS = _planar.PRODUCTS
PLANAR_PRODUCT_ENV = _planar.PRODUCT_ENV
resolve_planar_product = _planar.resolve_product
PlanarGemvConfig = _planar_gemv.PlanarGemvConfig
planes_nbytes = _planar.planes_nbytes
# x made by the q8 GEMV's quantizing kernel from the arrays it comes from (a norm, a gate): `prologue`
Prologue = _prologue.Prologue
PrologueInput = _prologue.PrologueInput
Cols = _prologue.Cols
planar_q8_gemv_pre = _prologue.planar_q8_gemv_pre
Q8_MAX_ROWS = _prologue.Q8_MAX_ROWS
PROLOGUE_ENV = _prologue.PROLOGUE_ENV
prologue_enabled = _prologue.prologue_enabled


@dataclasses.dataclass(frozen=True)
class Implementation:
  """An entry of the registry: matmul(x_sk, w_nb, fmt, k, *, config, interpret) -> [S, N] f32."""
  name: str
  matmul: Callable[..., jax.Array]
  kernel: bool        # takes `config` and `interpret`


def _xla(x_sk, w_nb, fmt, k, *, config, interpret):
  del config, interpret
  return _ref.quant_matmul_reference(x_sk, w_nb, fmt, k)


def _fused(x_sk, w_nb, fmt, k, *, config, interpret):
  del config, interpret
  return _ref.quant_matvec_fused(x_sk, w_nb, fmt, k)


def _pallas(x_sk, w_nb, fmt, k, *, config, interpret):
  return _kernel.quant_matmul_pallas(x_sk, w_nb, fmt, k, config=config, interpret=interpret)


GEMV_ROUTED_ROWS = 1   # "pallas_gemv" without a GemvConfig: the GEMV up to this many rows


def _pallas_gemv(x_sk, w_nb, fmt, k, *, config, interpret):
  gemv_rows = {GemvConfig: _gemv.GEMV_MAX_ROWS, type(None): GEMV_ROUTED_ROWS}.get(type(config), 0)
  if x_sk.shape[0] <= gemv_rows:
    return _gemv.quant_gemv_pallas(x_sk, w_nb, fmt, k, config=config, interpret=interpret)
  return _pallas(x_sk, w_nb, fmt, k, config=config if isinstance(config, QuantMatmulConfig) else None,
                 interpret=interpret)


_REGISTRY = {impl.name: impl for impl in (
    Implementation("xla", _xla, kernel=False),
    Implementation("fused", _fused, kernel=False),
    Implementation("pallas", _pallas, kernel=True),
    Implementation("pallas_gemv", _pallas_gemv, kernel=True),
)}
IMPLEMENTATIONS = tuple(_REGISTRY)
DEFAULT_IMPLEMENTATION = "xla"


def get_implementation(name: str) -> Implementation:
  """The registry's entry `name` (one of IMPLEMENTATIONS)."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown quant-matmul implementation {name!r}; choose one of "
                     f"{IMPLEMENTATIONS}")
  return _REGISTRY[name]


def quant_matmul(x_sk, w_nb, fmt: str, k: int, *, implementation: str = DEFAULT_IMPLEMENTATION,
                 config: Optional[QuantMatmulConfig] = None, interpret: bool = False):
  """x [S, K] @ dequantize(w_nb, fmt, k)[N, K].T -> [S, N] float32."""
  impl = get_implementation(implementation)
  _formats.check_k(fmt, k)
  _formats.check_weight(w_nb, fmt, k)
  _formats.check_x(x_sk, k)
  if isinstance(config, GemvConfig):
    _gemv.check_config(config)
  elif config is not None:
    _kernel.check_config(config)
  return impl.matmul(x_sk, w_nb, fmt, k, config=config, interpret=interpret)
