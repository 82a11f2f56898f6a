"""The tiny model with random weights, a Q8_0 K / Q4_0 V page layout and its Runner (shared by tests)."""

from kvjax import config, engine, weights
from kvjax_pallas.page_layout import PageLayout


def build_tiny_runner(seed: int, page_tokens: int):
  """-> (cfg, runner, layout) for the tiny model with `weights.random_tensors(cfg, seed)`."""
  cfg = config.tiny()
  model = engine.build_model(cfg, weights.random_tensors(cfg, seed).items())
  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, "q8_0", "q4_0", page_tokens=page_tokens)
  return cfg, engine.Runner(model, layout), layout
