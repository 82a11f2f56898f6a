"""Copy waves against one call on the compiled kernels: where do the logits bits part?

A layer streamed in copy waves runs as three compiled programs (before attention, one per wave,
after attention); the same layer in one call is one program. On the CPU both give the same bits;
on the H200 with the Mosaic GPU kernels they differed by ~1e-5 (2026-12-03). This probe runs the GPU
test's setup (256-dim heads, 64-token Q8_0 K / Q4_0 V pages, a 300-token prompt, 1-page
partitions; the plain cache, a 9-page pool that streams without waves, the 4-page minimum pool
whose every layer streams in waves) for each variant of the one-call attention block:

* `uncut`  `Block.attend` with `kvjax.model.wave_cut` the identity: one program that XLA fuses
            as it likes (the runtime before 2026-12-03 evening);
* `cut`    the runtime's `Block.attend`: cut at the wave programs' boundaries by
            `lax.optimization_barrier` ((block input, q, gate, rows) after the projections, the
            un-normalised carry after the kernel), so XLA fuses each side as the wave programs do.

(2026-12-03, H200: uncut 8 of 8 steps of the waved pool differ, max 1.24e-5; cut, none) and
prints, per variant and pool, the greedy tokens' agreement and the largest logits difference
from the plain cache (0.0: the same bits at every step).

  python -m experiments.kernel_lab.probe_wave_bits --impl=auto --steps=8
  python -m experiments.kernel_lab.probe_wave_bits --impl=reference --interpret --steps=2   # CPU
"""

from __future__ import annotations

import json

from absl import app, flags

flags.DEFINE_string("impl", "auto", "span attention implementation")
flags.DEFINE_bool("interpret", False, "Pallas interpret mode")
flags.DEFINE_integer("steps", 8, "generated tokens per run")
flags.DEFINE_list("variants", ["uncut", "cut"], "one-call block variants")
FLAGS = flags.FLAGS


def _runs(impl, interpret, steps):
  import numpy as np
  from kvjax import config, engine, generate, weights
  from kvjax.model import AttentionOptions
  from kvjax.streaming import StreamedKV, fixed_split
  from kvjax_pallas.page_layout import PageLayout
  cfg = config.tiny(head_dim=256, rope_dim=64, num_attention_heads=6, num_kv_heads=2)
  model = engine.build_model(cfg, weights.random_tensors(cfg, 3).items())
  layout = PageLayout(2, 256, "q8_0", "q4_0", page_tokens=64)
  prompt = [int(t) for t in np.random.default_rng(13).integers(0, cfg.vocab_size, 300)]
  runner = engine.Runner(model, layout, AttentionOptions(impl, block_pages=1, interpret=interpret))
  max_tokens = len(prompt) + steps
  out = {}
  for pool in (None, 9, 4):
    kv = engine.PlainKV(cfg, layout, max_tokens) if pool is None else \
        StreamedKV(cfg, layout, max_tokens, fixed_split(pool, 3, max_tokens, layout, copy_pages=2))
    rows = []
    res = generate.generate(runner, kv, prompt, steps, ubatch=64,
                            on_logits=lambda _, l: rows.append(np.asarray(l)))
    out[pool] = (res.tokens, np.stack(rows), getattr(kv, "counters", {}).get("waved_layers", 0))
  return out


def main(argv):
  del argv
  import jax
  import numpy as np
  from kvjax import model as model_mod
  table = []
  cut = model_mod.wave_cut
  for variant in FLAGS.variants:
    model_mod.wave_cut = cut if variant == "cut" else (lambda tree: tree)
    jax.clear_caches()
    out = _runs(FLAGS.impl, FLAGS.interpret, FLAGS.steps)
    plain_tokens, plain_logits, _ = out[None]
    for pool in (9, 4):
      tokens, logits, waved = out[pool]
      diff = np.abs(logits - plain_logits)
      row = {"variant": variant, "pool": pool, "waved_layers": int(waved),
             "tokens_equal": tokens == plain_tokens, "max_abs_diff": float(diff.max()),
             "steps_equal": int(np.sum([np.array_equal(a, b) for a, b in zip(logits, plain_logits)]))}
      table.append(row)
      print(json.dumps(row), flush=True)
  model_mod.wave_cut = cut
  print(f"{'variant':<10} {'pool':>4} {'waved':>6} {'tokens':>6} {'steps =':>7} {'max |diff|':>11}")
  for r in table:
    print(f"{r['variant']:<10} {r['pool']:>4} {r['waved_layers']:>6} {str(r['tokens_equal']):>6} "
          f"{r['steps_equal']:>7} {r['max_abs_diff']:>11.3g}")


if __name__ == "__main__":
  app.run(main)
