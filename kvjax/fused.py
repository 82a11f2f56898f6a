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
equal an unjoined one's within float rounding, not bit for bit. A join is made on the device where
the device has a free block for it; where it has not (a model that nearly fills the device, its
free memory in holes the size of the parts), the parts go to the host, are freed on the device,
and the joined matrix is placed into the room they leave; where even that finds no block (the
free memory in holes smaller than the join), the parts go back and the joins stop there, with a
warning: the model runs, its remaining matrices apart. `load_model` joins them on one
device (`fuse=` to turn it off); a tensor-parallel model keeps them apart (its shards split each
matrix by heads).
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import jax
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
SLACK_BYTES = 256 << 20   # free beyond a join on the device: the allocator's rounding, a program's scratch


def _arrays(w) -> tuple:
  return w.arrays() if isinstance(w, QuantizedWeight) else (w,)


def device_room(arrays) -> Optional[int]:
  """The largest block the device holding `arrays` can allocate now: its allocator's largest free
  block, or what its pool may still grow by. None: no device arrays, or the device does not say
  (then joins are made on the device)."""
  held = [a for a in arrays if isinstance(a, jax.Array)]
  if not held:
    return None
  stats = next(iter(held[0].devices())).memory_stats() or {}
  if "largest_free_block_bytes" not in stats:
    return None
  grow = stats["bytes_limit"] - stats["pool_bytes"] if {"bytes_limit", "pool_bytes"} <= set(stats) else 0
  return max(int(stats["largest_free_block_bytes"]), int(grow))


def _through_host(ws) -> Tuple[list, object]:
  """The parts' copies on the host (numpy), the parts freed on the device -> (copies, device)."""
  device = next(iter(_arrays(ws[0])[0].devices()))
  host = jax.device_get(ws)
  for w in ws:
    for a in _arrays(w):
      a.delete()
  return host, device


def _joinable(ws) -> bool:
  """Whether the matrices `ws` can be one: the same dtype, or the same block format, row length,
  compute dtype and implementation for `QuantizedWeight`s."""
  if all(isinstance(w, QuantizedWeight) for w in ws):
    return len({(w.fmt, w.k, w.dtype_name, w.impl, w.product) for w in ws}) == 1
  if any(isinstance(w, QuantizedWeight) for w in ws):
    return False
  return len({(jnp.dtype(w.dtype), w.ndim, w.shape[1:]) for w in ws}) == 1 and ws[0].ndim == 2


def _joined(ws):
  """The matrices `ws` as one (rows stacked), or None where they cannot be one."""
  if not _joinable(ws):
    return None
  parts = [_arrays(w) for w in ws]
  cat = np.concatenate if all(isinstance(a, np.ndarray) for p in parts for a in p) else jnp.concatenate
  joined = [cat(list(same)) for same in zip(*parts)]   # the bytes (values), and the scales of planes
  if isinstance(ws[0], QuantizedWeight):
    return QuantizedWeight(joined[0], ws[0].fmt, ws[0].k, ws[0].dtype_name, ws[0].impl, *joined[1:],
                           product=ws[0].product)
  return joined[0]


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
      parts = [getattr(module, n).get_value() for n in group]
      if not _joinable(parts):
        continue
      rows = tuple(int(w.shape[0]) for w in parts)
      room = device_room([a for w in parts for a in _arrays(w)])
      device = None
      if room is not None and sum(int(w.nbytes) for w in parts) + SLACK_BYTES > room:
        parts, device = _through_host(parts)
      try:
        joined = _joined(parts)
        if device is not None:
          joined = jax.device_put(joined, device)
        jax.block_until_ready(joined)   # the parts go now, not after a queue of joins
      except jax.errors.JaxRuntimeError as e:   # no block for it even in the parts' room: stop joining
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        if device is not None:   # the parts back where they were
          for n, w in zip(group, parts):
            getattr(module, n).set_value(jax.device_put(w, device))
        module.fused_groups = tuple(done)
        warnings.warn(f"kvjax.fused: the device has no free block of {sum(int(w.nbytes) for w in parts) >> 20} "
                      f"MiB for a join; {made} joined, the rest kept apart (fuse=False avoids the attempt)")
        return made
      for n in group:
        delattr(module, n)
      setattr(module, PREFIX + group[0], nnx.Param(joined))
      setattr(module, ROWS + group[0], rows)
      done.append(group)
      made += 1
    module.fused_groups = tuple(done)
  return made
