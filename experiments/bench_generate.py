"""The user's path as a benchmark: `kvjax.api` from a cold start to the last decoded token.

For each context N and cache kind, in one process: `api.load_model`, `api.make_kv(model, N +
n_predict + margin, arena_mib=...)`, `api.generate` of an N-token random prompt and `--n_predict`
tokens (a decode that crosses page and copy-unit boundaries), every token timestamped. Reported:

* prefill tok/s with and without the compiling inside it, compile ms and programs by phase
  (prefill, up to the first decoded token, after it), the persistent compilation cache in use;
* ms per decoded token: median, p90, p99, max, and the index of every token above 3x the median;
  Python's full garbage collections during the decode (`gc_full_in_decode`: the token each one
  delayed and its ms; a collection walks every tracked object in one pause);
* uploads by phase (prefill, decode) and the decode's MiB a token;
* with `--compare`, in the same process, bench_decode's page-aligned decode forward at the same
  context (a fixed split of the same budget over a synthetic history: `experiments.bench_decode`)
  and the ratio of the generation's median to it;
* with `--profile_tokens=N`, the device timeline of a second, warmed N-token prefill: kernel time
  by family (GEMMs, attention, fusions, ...) and the top kernels (`experiments.lib.timeline`).

Cache kinds (`--kinds`): `fixed` (the fixed split), `adaptive` (the adaptive policy),
`phased` (adaptive + the phase arena). Compilation: `--compile_cache_dir` (default: a fresh
folder under `--out`, i.e. a cold cache; run the same command again with that folder for a warm
one); `--warmup` compiles ahead (`api.warmup`) and reports it apart.

  python -m experiments.bench_generate --model=qwen38_27b --contexts=32768,131072 --arena_mib=2240 \\
      --attn_impl=auto --n_predict=1024
  python -m experiments.bench_generate --model=tiny --dtype=float32 --contexts=512 --arena_mib=4 \\
      --page_tokens=16 --n_predict=64 --kinds=fixed,phased       # CPU smoke
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import time

from absl import app, flags

KINDS = {"fixed": dict(policy="fixed"), "adaptive": dict(policy="adaptive"),
         "phased": dict(policy="adaptive", phased=True)}


def define_flags():
  """The flags, defined when the module runs as a program (see experiments/acceptance.py)."""
  flags.DEFINE_string("model", "qwen38_27b", "preset name, 'tiny', 'code-tiny' or a GGUF path")
  flags.DEFINE_string("dtype", "bfloat16", "weight/activation dtype")
  flags.DEFINE_string("weight_type", "", "a preset's matrices as random blocks of this format, kept quantized "
                      "(q8_0, q4_0, q4_k, q5_k, q6_k; '': dequantized in --dtype)")
  flags.DEFINE_string("weights_impl", "auto", "the quantized product: auto (planar on a GPU), xla, fused, pallas, pallas_gemv or planar")
  flags.DEFINE_list("contexts", ["32768", "131072"], "prompt lengths (tokens)")
  flags.DEFINE_list("kinds", ["fixed"], "cache kinds: fixed, adaptive, phased")
  flags.DEFINE_integer("n_predict", 1024, "decoded tokens a generation")
  flags.DEFINE_float("arena_mib", 2240.0, "device KV arena (MiB)")
  flags.DEFINE_integer("page_tokens", 256, "tokens per KV page")
  flags.DEFINE_integer("copy_pages", 8, "host copy unit (pages)")
  flags.DEFINE_integer("ubatch", 256, "prefill micro-batch (rows)")
  flags.DEFINE_string("prefill_block", "auto", "prefill block (tokens a forward runs group-major) or auto")
  flags.DEFINE_bool("prefill_only", False, "time the prefill alone (one token decoded, no comparison forward)")
  flags.DEFINE_integer("profile_tokens", 0, "after the cases, a device timeline of a warmed prefill of this many "
                       "tokens on the first kind's cache: kernel time by family and the top kernels (0: none)")
  flags.DEFINE_enum("gdn_impl", "auto", ["auto", "xla", "triton"], "the Gated DeltaNet's prefill form "
                    "(api.load_model(gdn_impl=))")
  flags.DEFINE_bool("fuse", True, "join each block's same-input matrices into one product (api.load_model(fuse=))")
  flags.DEFINE_float("peak_tflops", 989.0, "the device's dense bf16 peak (TFLOP/s) for the prefill's MFU")
  flags.DEFINE_string("attn_impl", "auto", "span attention implementation")
  flags.DEFINE_string("block_pages", "auto", "pages per logical partition (an int) or auto")
  flags.DEFINE_string("compile_cache_dir", "", "persistent compilation cache ('' : a fresh folder under --out; "
                      "'off': none)")
  flags.DEFINE_string("cache_key_log", "", "write jax's persistent-cache key components (each program's "
                      "running hashes) to this file: two processes' logs diffed name what differs")
  flags.DEFINE_bool("warmup", False, "compile ahead (api.warmup) before the timed generation")
  flags.DEFINE_bool("compare", True, "time bench_decode's page-aligned forward at each context too")
  flags.DEFINE_integer("compare_steps", 16, "timed forwards of the comparison")
  flags.DEFINE_string("out", os.environ.get("OUT", "runs/bench_generate"), "output folder")


FLAGS = flags.FLAGS


def token_stats(times_s, first_index: int = 1):
  """Decode ms per token from the commit times of the generated tokens (token i's time is that of
  the forward that produced it): median, p90, p99, max, and the tokens above 3x the median."""
  import numpy as np
  ms = np.diff(np.asarray(times_s, np.float64)) * 1e3
  if ms.size == 0:
    return {"ms": []}
  med = float(np.median(ms))
  slow = [int(i) + first_index for i in np.nonzero(ms > 3 * med)[0]]
  return {"median_ms": med, "p90_ms": float(np.percentile(ms, 90)), "p99_ms": float(np.percentile(ms, 99)),
          "max_ms": float(ms.max()), "over_3x_median": slow, "ms": [float(x) for x in ms]}


@contextlib.contextmanager
def full_collections():
  """The (end time, ms) of each full (generation-2) garbage collection of Python while entered: a
  collection walks every tracked object in one pause (a suspect of single slow decode tokens)."""
  out, start = [], []

  def callback(phase, info):
    if info.get("generation") == 2:
      if phase == "start":
        start[:] = [time.perf_counter()]
      elif start:
        out.append((time.perf_counter(), (time.perf_counter() - start[0]) * 1e3))

  gc.callbacks.append(callback)
  try:
    yield out
  finally:
    gc.callbacks.remove(callback)


def _cache_and_prompt(api, model, ctx: int, n_predict: int, kind: str):
  """A `kind` cache for a ctx-token prompt and n_predict tokens, and the prompt (seeded by ctx)."""
  import numpy as np
  block = FLAGS.prefill_block if FLAGS.prefill_block == "auto" else int(FLAGS.prefill_block)
  kv = api.make_kv(model, ctx + n_predict + 8, arena_mib=FLAGS.arena_mib, copy_pages=FLAGS.copy_pages,
                   ubatch=FLAGS.ubatch, prefill_block=block, **KINDS[kind])
  return kv, [int(t) for t in np.random.default_rng(ctx).integers(0, model.cfg.vocab_size, ctx)]


def run_case(api, model, ctx: int, kind: str):
  """One generation of a ctx-token prompt on a `kind` cache -> the row."""
  n_predict = 1 if FLAGS.prefill_only else FLAGS.n_predict
  t_kv = time.perf_counter()   # the plan's workspaces are measured by compiling the layer step
  kv, prompt = _cache_and_prompt(api, model, ctx, n_predict, kind)
  row = {"context": ctx, "kind": kind, "make_kv_s": time.perf_counter() - t_kv, "pool_pages": kv.info.get("pool_pages"),
         "prefill_block": kv.info.get("prefill_block"),
         "ring_slots": kv.info.get("ring_slots"), "copy_unit_pages": kv.info.get("copy_unit_pages")}
  if FLAGS.warmup:
    row.update({f"warmup_{k}": v for k, v in api.warmup(model, kv, ubatch=FLAGS.ubatch).items()})
  stamps, h2d_at_first = [], []

  def on_token(_tok):
    stamps.append(time.perf_counter())
    if len(stamps) == 1:
      h2d_at_first.append(kv.metrics().get("h2d_bytes", 0))

  t0 = time.perf_counter()
  with full_collections() as collections:
    res = api.generate(model, kv, prompt_tokens=prompt, n_predict=n_predict, ignore_eos=True,
                       ubatch=FLAGS.ubatch, on_token=on_token)
  row["wall_s"] = time.perf_counter() - t0
  # Python's full garbage collections after the first token: (token decoded next, ms) each
  row["gc_full_in_decode"] = [(sum(1 for x in stamps if x < at), round(ms, 1)) for at, ms in collections
                              if stamps and at > stamps[0]]
  m = res.metrics
  prefill_s = m["prompt_ms"] / 1e3
  row.update(prefill_s=prefill_s, prefill_tps=ctx / prefill_s,
             prefill_tps_without_compile=ctx / max(prefill_s - m["prompt_compile_ms"] / 1e3, 1e-9),
             prompt_compile_ms=m["prompt_compile_ms"], decode_compile_ms=m["predicted_compile_ms"],
             prompt_compiles=m["prompt_compiles"], first_token_compiles=m["first_token_compiles"],
             predicted_compiles=m["predicted_compiles"], compile_cache_dir=m.get("compile_cache_dir", ""),
             compile_trace_ms=m["compile_trace_ms"], compile_lower_ms=m["compile_lower_ms"],
             compile_backend_ms=m["compile_backend_ms"], compile_cache_hits=m["compile_cache_hits"],
             executables_loaded=m.get("executables_loaded", 0),
             decode_tps=m["decode_tps"], h2d_prefill_bytes=h2d_at_first[0] if h2d_at_first else 0,
             h2d_decode_bytes=m.get("h2d_bytes", 0) - (h2d_at_first[0] if h2d_at_first else 0),
             waves=m.get("waves", 0), forwards=m.get("forwards", 0),
             compile_by_program=m.get("compile_by_program", {}))
  row["decode_mib_per_token"] = row["h2d_decode_bytes"] / 2**20 / max(1, len(stamps) - 1)
  cfg, lay = model.cfg, model.runner.layout
  row["uploads_over_history"] = row["h2d_prefill_bytes"] / (ctx * lay.token_bytes * cfg.num_attention_layers)
  row["prefill_mfu"] = prefill_flops(model, ctx) / max(prefill_s - m["prompt_compile_ms"] / 1e3, 1e-9) \
      / (FLAGS.peak_tflops * 1e12)
  row.update(token_stats(stamps))
  return row


def prefill_flops(model, n: int) -> float:
  """FLOPs of an n-token prefill: 2 x the parameters a token multiplies (the embedding table is a
  lookup) x n, plus causal attention's QK^T and PV (4 x heads x head_dim x n^2 / 2 a layer)."""
  import jax
  import numpy as np
  from kvjax import qweights
  r, cfg = model.runner, model.cfg
  size = lambda x: int(np.prod(x.shape))   # a kept-quantized matrix counts its values, not its planes' bytes
  leaves = [x for _, g in r.groups for x in jax.tree_util.tree_leaves(g, is_leaf=qweights.is_quantized)]
  params = sum(size(x) for x in leaves) + size(r.output)
  attn = 4 * cfg.num_attention_heads * cfg.head_dim * n * n / 2 * cfg.num_attention_layers
  return 2.0 * params * n + attn


def profile_prefill(api, model, n: int, kind: str):
  """The device timeline of a warmed n-token prefill (one generation compiles, the next is traced)
  -> the row: window and kernel ms, the window's MFU, kernel time by family and the top kernels."""
  from experiments.lib import timeline
  kv, prompt = _cache_and_prompt(api, model, n, 1, kind)

  def run():
    return api.generate(model, kv, prompt_tokens=prompt, n_predict=1, ignore_eos=True, ubatch=FLAGS.ubatch)

  run()
  events, trace_dir = timeline.profile(run, os.path.join(FLAGS.out, f"trace_prefill_{n}"))
  summary, table = timeline.summarize(events), timeline.kernel_table(events)
  window_s = summary.get("window_ms", 0.0) / 1e3
  row = {"profile_tokens": n, "kind": kind, "trace_dir": trace_dir, **summary, "kernels": table,
         "window_mfu": prefill_flops(model, n) / max(window_s, 1e-9) / (FLAGS.peak_tflops * 1e12)}
  if not summary.get("device_events"):
    row["window_mfu"] = None
    print(f"prefill of {n} tokens ({kind}): no device events (a CPU backend): no kernel table")
    return row
  print(f"prefill of {n} tokens ({kind}): window {summary['window_ms']:.1f} ms, kernels "
        f"{summary['kernel_ms']:.1f} ms busy, MFU over the window {row['window_mfu']:.2f}")
  if table["families"]:
    print(timeline.format_kernel_table(table))
  return row


def compare_forward(api, model, ctx: int):
  """bench_decode's warmed, page-aligned streamed forward at `ctx` (a fixed split of the same arena)."""
  from experiments import bench_decode
  from experiments.lib import synthetic
  page = model.layout.page_tokens
  aligned = max(page, ctx // page * page)
  kv = api.make_kv(model, aligned + FLAGS.compare_steps + 8, arena_mib=FLAGS.arena_mib, copy_pages=FLAGS.copy_pages)
  synthetic.fill_streamed(kv.provider, aligned)
  ms, _ = bench_decode._time_decode(model.runner, kv.provider, aligned, FLAGS.compare_steps, model.cfg)
  return ms


def main(argv):
  del argv
  import jax
  from kvjax import api
  from kvjax import checks
  os.makedirs(FLAGS.out, exist_ok=True)
  if FLAGS.cache_key_log:
    handler = logging.FileHandler(FLAGS.cache_key_log, mode="w")
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("jax._src.cache_key", "jax._src.compiler"):   # the components; each program's hit or miss
      logger = logging.getLogger(name)
      logger.setLevel(logging.DEBUG)
      logger.addHandler(handler)
  cache_dir = FLAGS.compile_cache_dir or os.path.join(FLAGS.out, f"jax-cache-{int(time.time())}")
  cache = False if cache_dir.lower() == "off" else cache_dir
  t0 = time.perf_counter()
  preset = FLAGS.model if FLAGS.model not in ("tiny", "code-tiny") and not os.path.exists(FLAGS.model) else None
  if FLAGS.weight_type and preset is None:   # random blocks need a preset's geometry: tiny's, or refuse
    if FLAGS.model != "tiny":
      checks.fail("bench_generate", f"--weight_type={FLAGS.weight_type} draws a preset's matrices; --model="
                  f"{FLAGS.model!r} keeps its own block types (drop --weight_type, or name a preset)")
    preset = "tiny"
  try:
    model = api.load_model(FLAGS.model if preset is None else "tiny", preset=preset, dtype=FLAGS.dtype,
                           page_tokens=FLAGS.page_tokens, attn_impl=FLAGS.attn_impl, block_pages=FLAGS.block_pages,
                           compile_cache=cache, weight_type=(FLAGS.weight_type or None) if preset else None,
                           weights_impl=FLAGS.weights_impl, fuse=FLAGS.fuse,
                           gdn_impl=FLAGS.gdn_impl)
  except api.ParameterError as e:
    checks.fail("bench_generate", str(e))
  log = {"device": str(jax.devices()[0]), "jax": jax.__version__, "load_s": time.perf_counter() - t0,
         "weights": model.weights, "gdn_impl_run": model.gdn_impl, "weight_bytes": api.weight_bytes(model),
         "flags": {k: FLAGS[k].value for k in ("model", "dtype", "weight_type", "weights_impl", "contexts", "kinds", "n_predict", "arena_mib",
                                                "page_tokens", "copy_pages", "ubatch", "attn_impl", "warmup", "fuse", "gdn_impl",
                                                "prefill_block", "prefill_only")},
         "compile_cache_dir": cache_dir if cache else "", "planar_product": checks.planar_product("bench_generate")}
  print(json.dumps(log), flush=True)
  rows, refused = log["rows"], log["refused"] = [], []
  for ctx in [int(c) for c in FLAGS.contexts]:
    ref = compare_forward(api, model, ctx) if FLAGS.compare and not FLAGS.prefill_only else None
    for kind in FLAGS.kinds:
      try:
        row = run_case(api, model, ctx, kind)
      except api.KVBudgetError as e:   # a budget make_kv refuses: a line of its own, the other cases run
        refused.append({"context": ctx, "kind": kind, "refused": str(e)})
        print(json.dumps(refused[-1]), flush=True)
        continue
      if ref is not None:
        row["bench_forward_ms"] = ref
        row["median_over_bench"] = row.get("median_ms", 0.0) / ref
      rows.append(row)
      print(json.dumps({k: v for k, v in row.items() if k != "ms"}, default=float), flush=True)
      save(log)   # every finished case on disk, whatever comes after it
  if FLAGS.profile_tokens:
    log["prefill_profile"] = profile_prefill(api, model, FLAGS.profile_tokens, FLAGS.kinds[0])
  save(log)
  plot(rows)
  report(rows)
  for r in refused:
    print(f"{r['context']:>8} {r['kind']:>8} refused: {r['refused']}")


def save(log):
  with open(os.path.join(FLAGS.out, "bench_generate.json"), "w") as f:
    json.dump(log, f, indent=1, default=float)


def plot(rows):
  """ms per token over the decode, one line per case (bench_generate.png), when matplotlib is there."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  fig, ax = plt.subplots(figsize=(9, 4))
  for r in rows:
    ax.plot(range(1, len(r["ms"]) + 1), r["ms"], lw=0.8, label=f"{r['context']} {r['kind']}")
  ax.set_xlabel("decoded token")
  ax.set_ylabel("ms")
  ax.set_yscale("log")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(FLAGS.out, "bench_generate.png"), dpi=110)


def report(rows):
  print(f"{'context':>8} {'kind':>8} {'kv s':>5} {'prefill s':>9} {'tok/s':>7} {'w/o cmp':>8} {'cmp s':>6} {'progs':>9} "
        f"{'median':>7} {'p99':>7} {'max':>8} {'>3x':>4} {'bench':>6} {'x':>5} {'MiB/tok':>8} {'pre GB':>7} "
        f"{'block':>6} {'up/hist':>7} {'MFU':>5}")
  for r in rows:
    progs = f"{r['prompt_compiles']}/{r['first_token_compiles']}/{r['predicted_compiles']}"
    cmp_s = (r["prompt_compile_ms"] + r["decode_compile_ms"]) / 1e3
    print(f"{r['context']:>8} {r['kind']:>8} {r.get('make_kv_s', 0):>5.1f} {r['prefill_s']:>9.1f} {r['prefill_tps']:>7.0f} "
          f"{r['prefill_tps_without_compile']:>8.0f} {cmp_s:>6.1f} {progs:>9} {r.get('median_ms', 0):>7.2f} "
          f"{r.get('p99_ms', 0):>7.2f} {r.get('max_ms', 0):>8.1f} {len(r.get('over_3x_median', [])):>4} "
          f"{r.get('bench_forward_ms', 0):>6.2f} {r.get('median_over_bench', 0):>5.2f} "
          f"{r['decode_mib_per_token']:>8.1f} {r['h2d_prefill_bytes'] / 1e9:>7.1f} {r['prefill_block'] or 0:>6} "
          f"{r['uploads_over_history']:>7.2f} {r['prefill_mfu']:>5.2f}")


if __name__ == "__main__":
  # the 27B's 53 GiB of bf16 weights beside the arena and XLA's autotuning buffers: on an 80 GB card
  # jax's default 75% of the device ran out at the first forward's output head (2026-12-05, H100)
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  define_flags()
  from kvjax import checks
  app.run(checks.one_line_errors("bench_generate", main), flags_parser=checks.flags_parser(
      "bench_generate", values={"contexts": (int, 1), "kinds": (tuple(KINDS),), "n_predict": (int, 1),
                                "ubatch": (int, 1), "arena_mib": (float, 0)}))
