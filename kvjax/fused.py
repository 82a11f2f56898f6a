"""Products that read the same input, joined into one matrix: one weight read instead of several.

A decode or verify forward reads every weight once a token; each matrix is a GEMV of its own, and
small ones (the Gated DeltaNet's beta / alpha rows, an attention layer's K and V) run far below
the memory's bandwidth, each a kernel launch. `fuse_projections(model)` stacks the rows of the
matrices a module multiplies by the same input (`FUSED_PRODUCTS`: FFN gate / up; attention q
(+ gate) / k / v; Gated DeltaNet qkv / z / beta / alpha) into one parameter `fused_<first name>`
with its row counts `fused_rows_<first name>`, and the modules' `kvjax.model.products(module, x,
names)` runs one product over it and splits the result. The model is changed in place (the parts
are dropped as each group is joined, so the device never holds both).

Matrices join only when they can be one matrix: the same dtype, or the same block format, row
length, compute dtype and implementation for `QuantizedWeight`s (a Q4_K_M file keeps beta / alpha
in F32 beside Q4_K qkv / z: those join in the next grouping that fits, `FUSED_PRODUCTS`' later
entries). The products are the same sums of the same products, one row of the joined matrix each;
XLA may order a row's sum differently for a matrix of another height, so a joined model's logits
equal an unjoined one's within float rounding, not bit for bit. `load_model` joins them on one
device (`fuse=` to turn it off); a tensor-parallel model keeps them apart (its shards split each
matrix by heads).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.qweights import QuantizedWeight

# module class name -> groupings tried in order; a matrix joins the first grouping that fits
FUSED_PRODUCTS: Dict[str, Tuple[Tuple[str, ...], ...]] = {
    "SwiGLU": (("ffn_gate", "ffn_up"),),
    "GatedAttention": (("attn_q", "attn_k", "attn_v"), ("attn_k", "attn_v")),
    "GatedDeltaNet": (("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"), ("attn_qkv", "attn_gate"),
                      ("ssm_beta", "ssm_alpha")),
}
PREFIX, ROWS = "fused_", "fused_rows_"


def _joined(ws):
  """The matrices `ws` as one (rows stacked), or None where they cannot be one."""
  if all(isinstance(w, QuantizedWeight) for w in ws):
    keys = {(w.fmt, w.k, w.dtype_name, w.impl) for w in ws}
    if len(keys) != 1:
      return None
    cat = np.concatenate if all(isinstance(w.data, np.ndarray) for w in ws) else jnp.concatenate
    return QuantizedWeight(cat([w.data for w in ws]), ws[0].fmt, ws[0].k, ws[0].dtype_name, ws[0].impl)
  if any(isinstance(w, QuantizedWeight) for w in ws):
    return None
  if len({(jnp.dtype(w.dtype), w.ndim, w.shape[1:]) for w in ws}) != 1 or ws[0].ndim != 2:
    return None
  cat = np.concatenate if all(isinstance(w, np.ndarray) for w in ws) else jnp.concatenate
  return cat(list(ws))


def fuse_projections(model) -> int:
  """Join the products of every module of `model` that `FUSED_PRODUCTS` lists (in place) -> the
  number of joined matrices made. A module joined already is left as it is."""
  made = 0
  for module in [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]:
    groupings = FUSED_PRODUCTS.get(type(module).__name__)
    if not groupings or hasattr(module, "fused_groups"):
      continue
    done: List[Tuple[str, ...]] = []
    for group in groupings:
      if any(n in g for g in done for n in group) or not all(hasattr(module, n) for n in group):
        continue
      joined = _joined([getattr(module, n).get_value() for n in group])
      if joined is None:
        continue
      rows = tuple(int(getattr(module, n).get_value().shape[0]) for n in group)
      for n in group:
        delattr(module, n)
      setattr(module, PREFIX + group[0], nnx.Param(joined))
      setattr(module, ROWS + group[0], rows)
      done.append(group)
      made += 1
    module.fused_groups = tuple(done)
  return made
