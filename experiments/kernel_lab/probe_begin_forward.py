"""Host time of `StreamedKV.begin_forward` at the 27B geometry (no model, no GPU needed).

A verify forward of `--rows` rows at each context over a synthetic history in a pool of
`--pool_pages`, timed `--reps` times as a plain decode loop calls it, again with a truncation
before each call (a speculative round's rollback), and with its layout built again each call (what
a page boundary costs). Prints ms per call.

  python -m experiments.kernel_lab.probe_begin_forward --contexts=32768,131072
"""

from __future__ import annotations

import time

from absl import app, flags


def define_flags():
  flags.DEFINE_list("contexts", ["32768", "131072"], "history lengths (tokens)")
  flags.DEFINE_integer("pool_pages", 5479, "device pool (pages; 5,479 = the 2,240 MiB arena's)")
  flags.DEFINE_integer("rows", 6, "rows of the forward")
  flags.DEFINE_integer("reps", 8, "timed calls per variant")


def main(argv):
  del argv
  import numpy as np
  from kvjax import config
  from kvjax.streaming import StreamedKV, fixed_split
  from kvjax_pallas.page_layout import PageLayout
  from experiments.lib import synthetic
  FLAGS = flags.FLAGS
  cfg = config.preset("qwen38_27b")
  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, "q8_0", "q4_0", 256)
  layers = tuple(range(cfg.num_attention_layers))
  print(f"{'context':>8} {'variant':<24} {'median ms':>9} {'max ms':>7}")
  for ctx in [int(c) for c in FLAGS.contexts]:
    max_tokens = ctx + 64
    kv = StreamedKV(cfg, layout, max_tokens,
                    fixed_split(FLAGS.pool_pages, cfg.num_attention_layers + 1, max_tokens, layout, 32))
    synthetic.fill_streamed(kv, ctx)
    kv.begin_forward(ctx, FLAGS.rows, layers)        # the first call mirrors the pinned blocks
    for variant, how in (("begin_forward", ""), ("truncate + begin_forward", "truncate"),
                         ("lay out + begin_forward", "layout")):
      ts = []
      for _ in range(FLAGS.reps):
        if how == "truncate":
          kv.truncate("target", ctx)
        elif how == "layout":      # a new key: the layout built again (a page boundary, a new phase)
          kv._layouts.clear()      # pylint: disable=protected-access
          kv._shape_key = None     # pylint: disable=protected-access
        t = time.perf_counter()
        kv.begin_forward(ctx, FLAGS.rows, layers)
        ts.append((time.perf_counter() - t) * 1e3)
      print(f"{ctx:>8} {variant:<24} {np.median(ts):>9.2f} {max(ts):>7.2f}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
