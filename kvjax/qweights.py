"""Weights kept in their GGUF block format on the device (`load_model(..., weights="quantized")`).

A quantized GGUF's matrices (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K: `kvjax_pallas.quant_matmul.FORMATS`)
stay as ggml stored them, one row of blocks per output row, and are dequantized as they are read:

    w = QuantizedWeight(data_nb, "q4_k", k=5120, dtype_name="bfloat16")   # data [N, row bytes] uint8
    y_sn = linear(x_sk, w)            # x @ dequantize(w).T, f32 accumulation (`kvjax.model.linear`)
    e_se = w[tokens_s]                # embedding rows, dequantized (a gather of their bytes first)

A `QuantizedWeight` is a pytree whose leaf is the bytes (format, row length, compute dtype and
implementation are static), so it sits in an `nnx.Param` like any weight, is split with the model
and passed to the compiled steps as a leaf. The product runs `kvjax_pallas.quant_matmul.quant_matmul`:
"xla" (dequantize, then the same product as a dequantized weight's: bit for bit the logits of a
model dequantized at load) or "pallas" (the kernel that dequantizes in registers). With "planar"
(`kept(..., impl="planar")`) a Q8_0 / Q4_0 / Q4_K / Q6_K matrix is repacked at load into a plane of its
values (`data`) and one of its scales (`scales`, a second leaf) (`kvjax_pallas.quant_matmul.planar`):
on a GPU decode and verify rows (up to 32) run the Pallas GEMV over the planes (float32 weights, a
row's sums the same bits whatever other rows its call has), elsewhere XLA's multiply-and-sum for a
decode row (the product, `$KVJAX_PLANAR_PRODUCT` or the backend's, is read when the weight is made
and kept as a static field, so it is part of the compiled steps' key); prefill rows dequantize the
planes and run the dot, as "xla" does. Other formats keep ggml's rows ("pallas_gemv" on a GPU, else
"xla").

Tensors that stay dequantized: 1-D tensors, `ssm_conv1d` (a convolution, not a product) and any
matrix stored in another type (F32 / F16 / BF16 as they are; other block types are dequantized at
load, with a notice naming them).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterator, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax_pallas.quant_matmul import api as qmm

FORMATS = tuple(qmm.FORMATS)                 # formats kept quantized ("q8_0", "q4_0", "q4_k", ...)
WEIGHTS = ("quantized", "dequantized")       # load_model(weights=)
IMPLEMENTATIONS = qmm.IMPLEMENTATIONS + ("planar",)   # load_model(weights_impl=): "xla", ..., "planar"
# matrices read only through `linear` or an embedding gather (what may stay quantized)
_PRODUCT_LEAVES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                   "ffn_up.weight", "ffn_down.weight", "attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight",
                   "ssm_alpha.weight", "ssm_out.weight", "nextn.eh_proj.weight", "nextn.shared_head_head.weight")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A matrix [N, K] as ggml blocks: `data` [N, row_bytes(fmt, K)] uint8; or, `impl` "planar", as
  planes: `data` the values, `scales` the scales (`kvjax_pallas.quant_matmul.planar.to_planes`)."""
  data: jax.Array
  fmt: str = dataclasses.field(metadata=dict(static=True))
  k: int = dataclasses.field(metadata=dict(static=True))
  dtype_name: str = dataclasses.field(default="float32", metadata=dict(static=True))
  impl: str = dataclasses.field(default="xla", metadata=dict(static=True))
  scales: Optional[jax.Array] = None
  # planar: the product (`qmm.PLANAR_PRODUCTS`), resolved when the weight is made (`kept`), so that it
  # is part of the compiled steps' key (a model loaded under another $KVJAX_PLANAR_PRODUCT traces anew)
  product: str = dataclasses.field(default="auto", metadata=dict(static=True))

  @property
  def shape(self) -> Tuple[int, int]:
    return (int(self.data.shape[0]), self.k)

  @property
  def dtype(self):
    """The compute dtype (what the activations are cast to, what a dequantized row is)."""
    return jnp.dtype(self.dtype_name)

  @property
  def ndim(self) -> int:
    return 2

  @property
  def nbytes(self) -> int:
    return sum(int(a.nbytes) for a in self.arrays())

  def arrays(self) -> tuple:
    """The device arrays: the bytes (or values plane) and, planar, the scales."""
    return (self.data,) if self.scales is None else (self.data, self.scales)

  def __getitem__(self, index):
    if index is Ellipsis:            # `param[...]`, as the model reads every weight
      return self
    if self.scales is not None:
      return qmm.dequantize_planes(self.data[index], self.scales[index], self.fmt, self.k, self.dtype)
    return qmm.dequantize(self.data[index], self.fmt, self.k, self.dtype)

  def dequantize(self):
    if self.scales is not None:
      return qmm.dequantize_planes(self.data, self.scales, self.fmt, self.k, self.dtype)
    return qmm.dequantize(self.data, self.fmt, self.k, self.dtype)

  def makes_input(self, x) -> bool:
    """Whether this weight's product makes x, a `qmm.PrologueInput` (a norm or a gate), inside the kernel that
    quantizes it: the q8 GEMV's, for the rows one call takes."""
    return self.scales is not None and self.product == "pallas_q8" and x.shape[0] <= qmm.Q8_MAX_ROWS and \
        qmm.prologue_enabled()

  def matmul(self, x):
    """x [..., K] @ dequantize(self).T -> [..., N] float32. x may be a `qmm.PrologueInput` [S, K]: made by the
    product's kernel where it can (`makes_input`), else in jnp first."""
    if isinstance(x, qmm.PrologueInput):
      if self.makes_input(x):
        pin = x.cast_to(self.dtype)
        return qmm.planar_q8_gemv_pre(pin.prologue, pin.operands, self.data, self.scales, self.fmt, self.k,
                                      interpret=jax.default_backend() != "gpu")
      x = x.value()
    lead = x.shape[:-1]
    x_sk = x.reshape((-1, self.k)).astype(self.dtype)
    if self.scales is not None:
      return qmm.planar_matmul(x_sk, self.data, self.scales, self.fmt, self.k,
                               implementation=self.product).reshape(lead + (self.shape[0],))
    y = qmm.quant_matmul(x_sk, self.data, self.fmt, self.k, implementation=self.impl,
                         interpret=jax.default_backend() != "gpu")   # the kernel compiles for GPUs
    return y.reshape(lead + (self.shape[0],))


def kept(rows, fmt: str, k: int, dtype_name: str = "float32", impl: str = "xla") -> QuantizedWeight:
  """A matrix kept quantized from its ggml rows (numpy): with `impl` "planar" repacked into planes on
  the device (formats `qmm.PLANAR_FORMATS`; others keep their rows: "pallas_gemv" on a GPU, else "xla")."""
  if impl == "planar":
    if fmt not in qmm.PLANAR_FORMATS:   # the GEMV kernel on a GPU (2026-12-06, H100: 4x "xla" in a 27B decode)
      return QuantizedWeight(rows, fmt, k, dtype_name, "pallas_gemv" if jax.default_backend() == "gpu" else "xla")
    values, scales = qmm.to_planes(rows, fmt, k)
    return QuantizedWeight(values, fmt, k, dtype_name, impl, scales, qmm.resolve_planar_product("auto"))
  return QuantizedWeight(rows, fmt, k, dtype_name, impl)


def request_error(weights: Optional[str], weight_type: Optional[str], preset: Optional[str],
                  tensor_parallel: int) -> Optional[Tuple[str, str]]:
  """`load_model`'s weight arguments that do not go together, or a `KVJAX_PLANAR_PRODUCT` that names
  no product, or a `KVJAX_Q8_PROLOGUE` neither 0 nor 1 (checked whatever the weights: a typo is not left
  for a later run) -> (one-line message, parameter), or None."""
  try:
    qmm.resolve_planar_product("auto")
  except ValueError as e:
    return str(e), qmm.PLANAR_PRODUCT_ENV
  try:
    qmm.prologue_enabled()
  except ValueError as e:
    return str(e), qmm.PROLOGUE_ENV
  if weight_type is not None and preset is None:
    return (f"weight_type {weight_type!r} draws a preset's matrices as random blocks: it needs preset= "
            f"(a GGUF's block types are its own)", "weight_type")
  if weight_type is not None and weight_type not in FORMATS:
    return f"weight_type {weight_type!r}: expected one of {', '.join(FORMATS)}", "weight_type"
  if weight_type is not None and weights == "dequantized":
    return (f"weights 'dequantized' with weight_type {weight_type!r}: the preset's matrices would be drawn "
            f"quantized; give one of them", "weights")
  if weights == "quantized" and preset is not None and weight_type is None:
    return "weights 'quantized' with a preset needs weight_type (the block format to draw)", "weights"
  if (weights == "quantized" or weight_type) and tensor_parallel > 1:
    return (f"weights 'quantized' runs on one device: weights='dequantized' with tensor_parallel "
            f"{tensor_parallel}", "weights")
  return None


def check_rows(shapes, weight_type: Optional[str]) -> None:
  """A one-line ValueError unless every matrix that may stay quantized has rows of whole
  `weight_type` blocks (what drawing a preset's matrices in that format needs)."""
  if weight_type is None:
    return
  b = block_values(weight_type)
  for name, shape in sorted(shapes.items()):
    if keeps_quantized(name) and len(shape) == 2 and shape[1] % b:
      raise ValueError(f"weight_type {weight_type!r}: {name} has rows of {shape[1]} values, not a multiple of "
                       f"its {b}-value block (q8_0 and q4_0 take multiples of 32)")


def resolve_impl(impl: str, backend: str) -> str:
  """`load_model(weights_impl="auto")`: "planar" on a GPU (the fastest 27B decode measured:
  docs/PERFORMANCE.md, "Quantized weights"), "xla" elsewhere (the dequantized model's bits)."""
  return ("planar" if backend == "gpu" else "xla") if impl == "auto" else impl


def block_values(fmt: str) -> int:
  """Values a block of format `fmt` (a one-line ValueError for another name)."""
  if fmt not in FORMATS:
    raise ValueError(f"quantized format {fmt!r}: expected one of {', '.join(FORMATS)}")
  return qmm.FORMATS[fmt].block_values


def is_quantized(w: Any) -> bool:
  return isinstance(w, QuantizedWeight)


def keeps_quantized(name: str) -> bool:
  """Is GGUF tensor `name` one that may stay quantized (a matrix read only by products)?"""
  if name in ("token_embd.weight", "output.weight"):
    return True
  return name.startswith("blk.") and name.split(".", 2)[-1] in _PRODUCT_LEAVES


def ggml_format(type_name: str) -> Optional[str]:
  """GGML type name ("Q4_K") -> a kept format ("q4_k"), or None."""
  fmt = type_name.lower()
  return fmt if fmt in FORMATS else None


def quantized_tensors(gguf_model, dtype=np.float32, impl: str = "xla", dtype_name: str = "float32",
                      notice=None) -> Iterator[Tuple[str, Any]]:
  """A GGUF's tensors, one at a time: the matrices in a kept format as `QuantizedWeight` (their
  stored bytes, numpy), every other tensor dequantized to `dtype` (`GGUFModel.load_tensor`). Block
  types that are dequantized instead of kept are named once through `notice` (default: a line on
  stderr)."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"quantized weight implementation {impl!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
  dequantized = set()
  for name in gguf_model.tensor_names():
    info = gguf_model.tensor_info(name)
    type_name = info.ggml_type.name
    fmt = ggml_format(type_name)
    if fmt is not None and keeps_quantized(name) and len(info.shape) == 2:
      rows = np.asarray(gguf_model.raw_bytes(name)).reshape(info.shape[0], -1)
      yield name, kept(rows, fmt, int(info.shape[1]), dtype_name, impl)
      continue
    if type_name not in ("F32", "F16", "BF16") and len(info.shape) == 2:
      dequantized.add(type_name)
    yield name, gguf_model.load_tensor(name, dtype)
  if dequantized:
    msg = (f"kvjax: {', '.join(sorted(dequantized))} matrices dequantized at load (kept quantized: "
           f"{', '.join(f.upper() for f in FORMATS)})")
    (notice or (lambda m: print(m, file=sys.stderr)))(msg)


# Random blocks: every byte pattern is a valid block, so the quantized values are drawn as random
# bytes and only the f16 scales are set: (byte offset of d, of dmin or None, std of a value per
# unit d, mean of a value per unit dmin offset), so that values have about the std asked for and,
# for the K-quants, a mean near 0 (dmin = offset * d cancels the nibbles' mean on average).
_RANDOM_SCALES = {"q8_0": (0, None, 73.9, 0.0), "q4_0": (0, None, 4.61, 0.0), "q4_k": (0, 2, 240.0, 7.5),
                  "q5_k": (0, 2, 490.0, 15.5), "q6_k": (-2, None, 1365.0, 0.0)}


def random_quantized(fmt: str, n: int, k: int, seed: int = 0, std: Optional[float] = None) -> QuantizedWeight:
  """A random matrix [n, k] in block format `fmt` (numpy bytes; values of about `std`, default
  1 / sqrt(k)): random quantized values with f16 scales that give that spread."""
  block_values(fmt)
  f = qmm.FORMATS[fmt]
  if k % f.block_values:
    raise ValueError(f"{fmt}: rows of {k} values are not a multiple of its {f.block_values}-value block")
  rng = np.random.default_rng(seed)
  nb = k // f.block_values
  blocks = rng.integers(0, 256, (n, nb, f.block_bytes), dtype=np.uint8)
  d_at, dmin_at, unit, offset = _RANDOM_SCALES[fmt]
  d = np.full((n, nb), (1.0 / np.sqrt(k) if std is None else std) / unit, np.float16)
  d_at = d_at % f.block_bytes
  blocks[:, :, d_at:d_at + 2] = d.view(np.uint8).reshape(n, nb, 2)
  if dmin_at is not None:
    dmin = (d.astype(np.float32) * offset).astype(np.float16)
    blocks[:, :, dmin_at:dmin_at + 2] = dmin.view(np.uint8).reshape(n, nb, 2)
  return QuantizedWeight(blocks.reshape(n, nb * f.block_bytes), fmt, k)


def with_dtype(w: QuantizedWeight, dtype_name: str) -> QuantizedWeight:
  """`w` computing in `dtype_name` (the model's), its bytes on the device."""
  return dataclasses.replace(w, data=jnp.asarray(w.data), dtype_name=dtype_name,
                             scales=None if w.scales is None else jnp.asarray(w.scales))


def memory_shapes(shapes, itemsize: int, fmt: Optional[str] = None, impl: str = "xla"):
  """{name: shape} the weight-memory check counts at `itemsize` bytes a value, for weights whose
  kept matrices are quantized: those come as one flat shape of their `fmt` bytes (rows of whole
  blocks; planes for `impl` "planar"), or are left out where the format is not known yet (a
  GGUF's, read later: a lower bound)."""
  out = {n: s for n, s in shapes.items() if not keeps_quantized(n)}
  if fmt is not None:
    f = qmm.FORMATS[fmt]

    def size(n, k):
      if impl == "planar" and fmt in qmm.PLANAR_FORMATS and k % f.block_values == 0:
        return qmm.planes_nbytes(fmt, n, k)
      return n * -(-k // f.block_values) * f.block_bytes
    total = sum(size(*s) for n, s in shapes.items() if keeps_quantized(n))
    out["(quantized matrices)"] = (-(-total // itemsize),)
  return out


def runner_bytes(runner) -> int:
  """Device bytes of an `engine.Runner`'s weights (quantized ones at their stored size; an array
  held twice, as a tied output projection, counted once)."""
  trees = [leaves for _, leaves in runner.groups] + [runner.token_embd, runner.output_norm, runner.output]
  if runner.mtp is not None:
    trees.append(runner.mtp[1])
  leaves = {id(x): x for x in jax.tree_util.tree_leaves(trees)}
  return sum(int(x.nbytes) for x in leaves.values())
