"""Compile time of a decode / verify forward with each span-attention kernel inside the model's
group step: a model with the 27B attention geometry (24 query heads, 4 KV heads of 256, Q8_0 K /
Q4_0 V pages of 256 tokens; the rest of the model tiny, so the attention kernel is what the
compile adds), a plain cache of `prompt` tokens.

  python3 -m experiments.kernel_lab.compile_time 1,4 triton,mosaic [prompt]

Prints, per (rows, implementation): the first forward (trace + compile + run) and the second
(run only) in seconds. Each implementation gets a fresh Runner, so nothing is shared.
"""
import copy
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from kvjax import config, engine, weights
from kvjax.model import AttentionOptions
from kvjax_pallas.page_layout import PageLayout


def main():
  rows_list = [int(x) for x in sys.argv[1].split(",")]
  impls = sys.argv[2].split(",")
  prompt = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
  cfg = config.tiny(head_dim=256, rope_dim=64, num_attention_heads=24, num_kv_heads=4)
  model = engine.build_model(cfg, weights.random_tensors(cfg, 3).items())
  layout = PageLayout(4, 256, "q8_0", "q4_0", 256)
  kv = engine.PlainKV(cfg, layout, max_tokens=prompt + 256)
  toks = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt + 8).astype(np.int32)
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}; {cfg.num_layers} layers, "
        f"{cfg.num_attention_layers} attention; prompt {prompt}", flush=True)
  print(f"{'rows':>4} {'impl':>8} | {'first s':>8} {'second s':>9}", flush=True)
  for rows in rows_list:
    for impl in impls:
      runner = engine.Runner(model, layout, AttentionOptions(impl))
      states = runner.zero_states()
      times = []
      for _ in range(2):
        k = copy.copy(kv)
        k.pool_pn = jnp.copy(kv.pool_pn)
        t = time.perf_counter()
        out = runner.forward(toks[prompt:prompt + rows], prompt, rows, states, k)
        jax.block_until_ready(out.logits_rv)
        times.append(time.perf_counter() - t)
      print(f"{rows:>4} {impl:>8} | {times[0]:8.2f} {times[1]:9.3f}", flush=True)


if __name__ == "__main__":
  main()
