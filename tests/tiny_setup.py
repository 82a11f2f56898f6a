"""The tiny model with random weights, a Q8_0 K / Q4_0 V page layout and its Runner, and greedy
generation that keeps the logits of every step (shared by tests)."""

import numpy as np

from kvjax import config, engine, generate, weights
from kvjax_pallas.page_layout import PageLayout


def build_tiny_runner(seed: int, page_tokens: int, gdn_form: str = "xla"):
  """-> (cfg, runner, layout) for the tiny model with `weights.random_tensors(cfg, seed)`; `gdn_form` "triton":
  its delta rule through the Pallas kernels, interpreted (`model.set_chunk_form`)."""
  from kvjax import model as model_lib
  cfg = config.tiny()
  model = engine.build_model(cfg, weights.random_tensors(cfg, seed).items())
  if gdn_form != "xla":
    model_lib.set_chunk_form(model, gdn_form, interpret=True)
  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, "q8_0", "q4_0", page_tokens=page_tokens)
  return cfg, engine.Runner(model, layout), layout


def generate_logged(runner, kv, prompt, n_predict, **kwargs):
  """`generate.generate` -> (GenerationResult, logits [n_predict, V]: the row each token came from)."""
  rows = []
  res = generate.generate(runner, kv, prompt, n_predict, on_logits=lambda _, l: rows.append(np.asarray(l)),
                          **kwargs)
  return res, np.stack(rows)


def assert_same_logits(got, want, what=""):
  """Every step's logits row the same bits (the claim of streamed vs plain: same compiled code, same
  bytes); the first step that differs is named."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  for i, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_array_equal(a, b, err_msg=f"{what} step {i}: logits differ")
