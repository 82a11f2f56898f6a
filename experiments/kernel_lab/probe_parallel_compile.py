"""Kernel-study probe: do a generation's layer-step programs compile faster side by side in threads?

A cold 27B generation spends most of its compile time in XLA's backend, one program after another
(docs/PERFORMANCE.md, "The user's path": 30.4 of 37.5 s on the H200). This lowers 2 x N distinct
`_group_step` programs of one 27B layer group (row counts 1..N, two page-table sizes, `--impl`
attention; abstract arguments, no weights), then compiles the first N one after another and the
other N in N threads (the persistent cache off), and prints both wall times and the lowering time.
An AOT `.lower(args).compile()` with the arguments a later call passes is the program that call
runs (checked on the CPU), so a warm-up could compile a generation's programs this way.

  python -m experiments.kernel_lab.probe_parallel_compile --n=4 --impl=auto        # GPU
  python -m experiments.kernel_lab.probe_parallel_compile --n=2 --tiny            # CPU smoke
"""

import argparse
import concurrent.futures
import time

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax import config, engine
from kvjax.model import AttentionOptions, Qwen38, zero_recurrent_state
from kvjax_pallas.page_layout import PageLayout


def lowered_steps(cfg, impl: str, n: int, contexts):
  """The lowered `_group_step` of the first layer group for rows 1..n at each context."""
  abstract = nnx.eval_shape(lambda: Qwen38(cfg, jnp.bfloat16))
  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, "q8_0", "q4_0", page_tokens=256)
  gd, gs = engine.split_static(abstract.groups[0])
  gs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in gs]
  st = jax.eval_shape(lambda: tuple(zero_recurrent_state(cfg) for _ in range(cfg.full_attention_interval - 1)))
  s = jax.ShapeDtypeStruct
  out = []
  for context in contexts:
    for rows in range(1, n + 1):
      out.append(engine._group_step.trace(   # pylint: disable=protected-access
          gd, gs, s((rows, cfg.hidden_size), jnp.bfloat16), st, s((64, layout.page_bytes), jnp.uint8),
          s((layout.pages_for(context),), jnp.int32), s((), jnp.int32), s((), jnp.int32), layout=layout,
          opts=AttentionOptions(implementation=impl), chunked=False, capture=False).lower())
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--n", type=int, default=4, help="programs a set (and threads)")
  ap.add_argument("--impl", default="auto", help="span attention implementation")
  ap.add_argument("--tiny", action="store_true", help="the tiny geometry (CPU smoke)")
  a = ap.parse_args()
  jax.config.update("jax_compilation_cache_dir", None)
  cfg = config.tiny() if a.tiny else config.qwen38_27b(num_layers=4)
  t0 = time.perf_counter()
  steps = lowered_steps(cfg, "reference" if a.tiny else a.impl, a.n, (32768, 65536) if not a.tiny else (512, 1024))
  t_lower = time.perf_counter() - t0
  serial, threaded = steps[:a.n], steps[a.n:]
  t0 = time.perf_counter()
  for lowered in serial:
    lowered.compile()
  t_serial = time.perf_counter() - t0
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(a.n) as pool:
    list(pool.map(lambda lowered: lowered.compile(), threaded))
  t_threads = time.perf_counter() - t0
  print(f"{jax.devices()[0].device_kind}: {2 * a.n} programs lowered in {t_lower:.1f} s; "
        f"{a.n} compiled one after another {t_serial:.1f} s, {a.n} in {a.n} threads {t_threads:.1f} s "
        f"({t_serial / max(t_threads, 1e-9):.2f}x)", flush=True)


if __name__ == "__main__":
  main()
