"""Deterministic random weights in GGUF naming (for tiny built-in models and the
27B-geometry benchmarks).

`random_tensors(cfg, seed)` returns `{gguf_name: np.ndarray}` with the shapes of
`config.gguf_tensor_shapes(cfg)`, scaled so that activations stay O(1) through
the depth of the network (norm weights near 1 as GGUF stores them, i.e. with
Hugging Face's +1 already folded in; `ssm_a = -exp(A_log) < 0`).
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import numpy as np

from kvjax.config import ModelConfig, gguf_tensor_shapes


def _init_one(name: str, shape: Tuple[int, ...], rng: np.random.Generator, dtype) -> np.ndarray:
  leaf = name.split(".", 2)[-1] if name.startswith("blk.") else name
  if leaf.endswith("norm.weight") and not leaf.startswith("ssm_norm"):
    x = 1.0 + 0.1 * rng.standard_normal(shape)
  elif leaf == "ssm_norm.weight":
    x = 1.0 + 0.1 * rng.standard_normal(shape)
  elif leaf == "ssm_a":
    x = -np.exp(rng.uniform(np.log(1.0), np.log(16.0), shape))
  elif leaf == "ssm_dt.bias":
    x = rng.uniform(-2.0, 1.0, shape)
  elif leaf == "ssm_conv1d.weight":
    x = rng.standard_normal(shape) / np.sqrt(shape[-1])
  elif name == "token_embd.weight" or leaf == "nextn.embed_tokens.weight":
    x = rng.standard_normal(shape)
  elif len(shape) == 2:
    x = rng.standard_normal(shape) / np.sqrt(shape[1])
  else:
    x = 0.1 * rng.standard_normal(shape)
  return np.asarray(x, dtype=dtype)


def iter_random_tensors(cfg: ModelConfig, seed: int = 0, dtype=np.float32,
                        include_optional: bool = True) -> Iterator[Tuple[str, np.ndarray]]:
  """Yield `(gguf_name, array)` one tensor at a time (each from its own seed)."""
  for k, (name, shape) in enumerate(sorted(gguf_tensor_shapes(cfg, include_optional).items())):
    rng = np.random.default_rng([seed, k])
    yield name, _init_one(name, shape, rng, dtype)


def random_tensors(cfg: ModelConfig, seed: int = 0, dtype=np.float32,
                   include_optional: bool = True) -> Dict[str, np.ndarray]:
  return dict(iter_random_tensors(cfg, seed, dtype, include_optional))


def iter_random_device_tensors(cfg: ModelConfig, seed: int = 0, dtype="bfloat16",
                               include_optional: bool = True,
                               weight_type: Optional[str] = None,
                               weights_impl: str = "xla") -> Iterator[Tuple[str, "object"]]:
  """Like `iter_random_tensors`, but drawn on the default device with jax.random (for the
  27B geometry, where numpy generation of 54 GB would dominate the run). `weight_type` (a block
  format of `kvjax.qweights.FORMATS`): the matrices that may stay quantized come as random blocks
  of that format (`qweights.random_quantized`, host bytes), as a quantized GGUF's would, their
  product `weights_impl` (`kvjax.qweights.IMPLEMENTATIONS`)."""
  import jax
  import jax.numpy as jnp
  from kvjax import qweights
  key = jax.random.PRNGKey(seed)
  block = None if weight_type is None else qweights.block_values(weight_type)
  for k, (name, shape) in enumerate(sorted(gguf_tensor_shapes(cfg, include_optional).items())):
    if block is not None and qweights.keeps_quantized(name) and len(shape) == 2 and shape[1] % block == 0:
      w = qweights.random_quantized(weight_type, shape[0], shape[1], seed=seed * 1_000_003 + k)
      yield name, qweights.kept(w.data, weight_type, shape[1], impl=weights_impl)
      continue
    kk = jax.random.fold_in(key, k)
    leaf = name.split(".", 2)[-1] if name.startswith("blk.") else name
    if leaf.endswith("norm.weight"):
      x = 1.0 + 0.1 * jax.random.normal(kk, shape, jnp.float32)
    elif leaf == "ssm_a":
      x = -jnp.exp(jax.random.uniform(kk, shape, jnp.float32, 0.0, float(np.log(16.0))))
    elif leaf == "ssm_dt.bias":
      x = jax.random.uniform(kk, shape, jnp.float32, -2.0, 1.0)
    elif leaf == "ssm_conv1d.weight":
      x = jax.random.normal(kk, shape, jnp.float32) / np.sqrt(shape[-1])
    elif name == "token_embd.weight" or leaf == "nextn.embed_tokens.weight":
      x = jax.random.normal(kk, shape, jnp.dtype(dtype))
    elif len(shape) == 2:
      x = (jax.random.normal(kk, shape, jnp.dtype(dtype)) * (1.0 / np.sqrt(shape[1]))).astype(dtype)
    else:
      x = 0.1 * jax.random.normal(kk, shape, jnp.float32)
    yield name, x
