"""The tiny built-in model: config, deterministic weights, its own GGUF, and the model-source
resolver (`"tiny"`, `"tiny:SEED"` or a GGUF path) behind `kvjax.api.load_model`."""

from __future__ import annotations

import os
from typing import Dict, Iterator, Optional, Tuple

import numpy as np

from kvjax import config as config_lib
from kvjax import gguf_io, tokenizer as tok_lib
from kvjax import weights as weights_lib
from kvjax.config import ModelConfig


def tiny_config(**overrides) -> ModelConfig:
  """`kvjax.config.tiny()` (vocab = the tiny tokenizer's 384 tokens)."""
  return config_lib.tiny(**overrides)


def tiny_tensors(seed: int = 0) -> Dict[str, np.ndarray]:
  """Deterministic random float32 weights in GGUF naming and shapes."""
  return weights_lib.random_tensors(config_lib.tiny(), seed)


def write_tiny_gguf(path, seed: int = 0, weight_type: str = "f32") -> str:
  """Write the tiny model (weights of `seed`, its own tokenizer) as a `qwen35` GGUF."""
  return gguf_io.write_gguf(path, tiny_config(), tiny_tensors(seed),
                            tok_lib.tiny_tokenizer_spec(), weight_type=weight_type,
                            name=f"kvjax-tiny-seed{seed}")


MODELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
BUILTIN_GGUF = {"code-tiny": "code-tiny.gguf"}


def builtin_path(name: str) -> str:
  """The packaged GGUF of a built-in trained model (`BUILTIN_GGUF`)."""
  return os.path.join(MODELS_DIR, BUILTIN_GGUF[name])


def is_builtin(spec: str) -> bool:
  return spec == "tiny" or spec.startswith("tiny:") or spec in BUILTIN_GGUF


def not_found(spec: str, preset_arg: bool = False) -> str:
  """The message for a model source that is neither a file nor a built-in model, with the closest
  built-in name or preset when one is near (a preset is random weights at a real geometry).
  `preset_arg`: the caller takes presets as its own argument (`api.load_model(preset=)`)."""
  import difflib  # pylint: disable=import-outside-toplevel
  names = ["tiny", "tiny:SEED", *sorted(BUILTIN_GGUF)]
  presets = sorted(p for p in config_lib.PRESETS if p not in names)
  if preset_arg and spec in presets:
    return f"source {spec!r} is a preset, not a file: load_model(preset={spec!r})"
  close = difflib.get_close_matches(spec.lower(), names + presets, n=1, cutoff=0.6)
  hint = "" if not close else f"; did you mean {'the preset ' if close[0] in presets else ''}{close[0]!r}?"
  return f"source {spec!r}: no such file (expected a .gguf path, {', '.join(map(repr, names))} or a preset: " \
         f"{', '.join(presets)}){hint}"


def load_model_source(spec: str, seed: int = 0, dtype=np.float32, weights: str = "dequantized",
                      weights_impl: str = "xla"
                      ) -> Tuple[ModelConfig, Iterator[Tuple[str, np.ndarray]], Optional[tok_lib.Tokenizer]]:
  """Resolve a model source ('tiny', 'tiny:SEED', 'code-tiny' or a GGUF path) -> `(config, tensor
  iterator, tokenizer)`.

  "tiny" (or "tiny:SEED") is the built-in random model; "code-tiny" the packaged trained GGUF;
  anything else is a GGUF path, opened and validated (`GGUFError` on a bad file) and read one
  tensor at a time by the iterator; its tokenizer is None when the file has no token list. With
  `weights="quantized"` a GGUF's matrices in a kept block format come as `QuantizedWeight`s
  (`kvjax.qweights`, product implementation `weights_impl`); the random tiny model has none.
  """
  if spec in BUILTIN_GGUF:
    spec = builtin_path(spec)
  if spec == "tiny" or spec.startswith("tiny:"):
    if spec.startswith("tiny:"):
      try:
        seed = int(spec[5:])
      except ValueError:
        raise ValueError(f"source {spec!r}: expected 'tiny' or 'tiny:SEED' with an integer seed") from None
    cfg = tiny_config()
    it = weights_lib.iter_random_tensors(cfg, seed, dtype=dtype)
    return cfg, it, tok_lib.tiny_tokenizer()
  if not os.path.exists(spec):
    raise FileNotFoundError(not_found(spec))
  model = gguf_io.read_gguf(spec)
  if weights == "quantized":
    from kvjax import qweights
    return model.config, qweights.quantized_tensors(model, dtype, weights_impl), model.tokenizer
  return model.config, model.iter_tensors(dtype), model.tokenizer
