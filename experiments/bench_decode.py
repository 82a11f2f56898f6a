"""Decode cost of the hybrid target, plain and streamed, at given contexts.

One script, one table. For each context it measures, per decode forward
(one token, greedy, synchronised per token as a real decode loop is; ms a token):

* `resident`  every page on the device (PlainKV: the compute-only cost);
* `streamed`  the fixed resident/ring split `make_kv(arena_mib=)` plans (`kvjax.streaming.plan`:
              the pool is what the measured decode workspace and the staging of in-flight uploads
              leave of `--arena_mib`), and one for each `--pool_pages` (a budget the plan refuses
              prints its refusal);
* `copy`      the streamed run's uploads alone (no compute) -> upload GB/s;

and derives the share of copy time hidden behind compute,
`hidden = (copy + resident - streamed) / copy`, which cannot pass
`resident / copy` when the copies are the longer side, so also the share of
the shorter side that overlaps, `overlap = (copy + resident - streamed) /
min(copy, resident)` (1.0: streamed costs only the longer one), the provider's host time per
forward (`host ms`), the share of deadline samples that missed (`misses`), and
the floor `weight bytes / HBM bandwidth + streamed bytes / 52.6 GB/s`. Before
timing, `--check_steps` greedy decode steps run through both caches from the
same context and their logits are compared bit for bit (`exact`: steps that
matched; a difference stops the run). `--profile` adds the device timeline of
two streamed forwards (copy/kernel overlap as the GPU saw it, `timeline_*.txt`).

Long histories are synthetic (validly encoded random pages; see
`experiments.lib.synthetic`): the cost of attention and copies is that of
real content, without a 128K-token prefill. A short real prefill + decode
checks the plain path end to end first.

`--tensor_parallel=N` shards the model over N devices (`kvjax.parallel`): every
device holds its own KV heads (resident), or streams them through its own
`--arena_mib` arena over its own host link; `GB/s` is then the aggregate of all
devices' uploads, issued together, and `MiB/fwd` the sum over the devices.

  python -m experiments.bench_decode --model=qwen38_27b --contexts=32768,131072 --arena_mib=2240
  python -m experiments.bench_decode --model=tiny --contexts=2048 --arena_mib=1 --page_tokens=64   # CPU smoke
  python -m experiments.bench_decode --model=qwen38_27b --contexts=131072,262144 --arena_mib=2240 \
      --attn_impl=auto --tensor_parallel=2 --out=runs/bench_decode_tp2      # arena per device
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags


def define_flags():
  """The flags, defined when the module runs as a program (see experiments/acceptance.py)."""
  flags.DEFINE_string("model", "qwen38_27b", "preset name")
  flags.DEFINE_string("dtype", "bfloat16", "weight/activation dtype")
  flags.DEFINE_string("weight_type", "", "matrices as random blocks of this format, kept quantized (q8_0, q4_0, "
                      "q4_k, q5_k, q6_k; '': dequantized in --dtype)")
  flags.DEFINE_list("contexts", ["32768", "131072"], "history lengths (tokens)")
  flags.DEFINE_float("arena_mib", 2240.0, "device KV budget for the streamed run (MiB)")
  flags.DEFINE_list("pool_pages", [], "more streamed runs with these KV pools (pages; the smallest that "
                    "runs is layers + the attention partition: copy waves), besides the arena's")
  flags.DEFINE_integer("decode_steps", 8, "timed decode forwards per configuration")
  flags.DEFINE_integer("page_tokens", 256, "tokens per KV page")
  flags.DEFINE_integer("copy_pages", 8, "host copy unit (pages)")
  flags.DEFINE_integer("pipeline_depth", 1, "layers whose copies are queued ahead of the running step")
  flags.DEFINE_integer("prefetch_next", 1, "the next forward's first layers whose blocks are copied "
                       "during this forward's last layer")
  flags.DEFINE_string("attn_impl", "reference", "span attention implementation")
  flags.DEFINE_string("block_pages", "auto", "pages per logical partition (an int) or auto")
  flags.DEFINE_integer("prompt", 256, "real prompt tokens for the end-to-end plain check")
  flags.DEFINE_string("k_type", "q8_0", "K cache type")
  flags.DEFINE_string("v_type", "q4_0", "V cache type")
  flags.DEFINE_string("out", os.environ.get("OUT", "runs/bench_decode"), "output folder")
  flags.DEFINE_float("hbm_gbs", 4800.0, "HBM bandwidth for the floor (GB/s)")
  flags.DEFINE_float("h2d_gbs", 52.6, "host-to-device bandwidth for the floor (GB/s)")
  flags.DEFINE_integer("check_steps", 64, "decode steps compared bit for bit, streamed against resident (0: none)")
  flags.DEFINE_integer("tensor_parallel", 1, "devices the model is sharded over (arena_mib and pool_pages "
                       "are per device)")
  flags.DEFINE_bool("profile", False, "device timeline of two streamed forwards per context (experiments.lib.timeline)")


FLAGS = flags.FLAGS


def _mem():
  import jax
  try:
    s = jax.devices()[0].memory_stats() or {}
    return {"bytes_in_use_gib": s.get("bytes_in_use", 0) / 2**30,
            "peak_bytes_in_use_gib": s.get("peak_bytes_in_use", 0) / 2**30}
  except Exception:
    return {}


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  from kvjax import api, config, engine, generate, kv_build, parallel, weights
  from kvjax.streaming import StreamBudgetError
  from kvjax.model import AttentionOptions
  from experiments.lib import synthetic
  from kvjax_pallas.page_layout import PageLayout

  os.makedirs(FLAGS.out, exist_ok=True)
  log = {"flags": {k: FLAGS[k].value for k in FLAGS if k in (
      "model", "dtype", "contexts", "arena_mib", "decode_steps", "page_tokens", "copy_pages", "attn_impl",
      "block_pages", "k_type", "v_type", "tensor_parallel", "weight_type")}, "device": str(jax.devices()[0]),
      "jax": jax.__version__}
  cfg = config.preset(FLAGS.model)
  tp = FLAGS.tensor_parallel
  parallel.check_tensor_parallel(cfg, tp)
  if FLAGS.weight_type and tp > 1:
    raise app.UsageError("--weight_type (quantized weights) runs on one device: --tensor_parallel=1")
  dtype = jnp.dtype(FLAGS.dtype)
  t0 = time.perf_counter()
  model = engine.build_model(cfg, weights.iter_random_device_tensors(cfg, 0, FLAGS.dtype,
                                                                   weight_type=FLAGS.weight_type or None),
                             dtype=dtype, names=config.gguf_tensor_shapes(cfg))
  jax.block_until_ready(jax.tree.leaves(nnx_state(model)))
  log["build_s"] = time.perf_counter() - t0
  log["mem_after_build"] = _mem()
  weight_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(nnx_state(model)))
  # a decode forward reads every target weight once, one embedding row, none of the MTP head
  mtp_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(nnx_state(model.mtp))) if model.mtp is not None else 0
  embd = model.token_embd[...]
  decode_weight_bytes = weight_bytes - mtp_bytes - embd.nbytes
  log["weight_gib"] = weight_bytes / 2**30
  log["decode_weight_gib"] = decode_weight_bytes / 2**30

  layout = PageLayout(cfg.num_kv_heads, cfg.head_dim, FLAGS.k_type, FLAGS.v_type, FLAGS.page_tokens)
  opts = AttentionOptions(FLAGS.attn_impl, api.parse_block_pages(FLAGS.block_pages))
  if tp > 1:
    runner = parallel.ShardedRunner(model, layout, opts, tp)
    layout = runner.layout          # one device's KV heads
    device_runner = runner.device_runners[0]
    # what one device reads a decode forward: its shard of the target's weights, the replicated head
    decode_weight_bytes = sum(x.size * x.dtype.itemsize for _, leaves in device_runner.groups for x in leaves) + \
        device_runner.output.size * device_runner.output.dtype.itemsize
    log["decode_weight_gib_per_device"] = decode_weight_bytes / 2**30
    del model, embd                 # the shards hold what each device needs
  else:
    runner = device_runner = engine.Runner(model, layout, opts)

  # --- end-to-end plain check: real prefill + decode --------------------------------------------
  prompt = list(np.random.default_rng(0).integers(0, cfg.vocab_size, FLAGS.prompt))
  kv = _cache(runner, lambda d: engine.PlainKV(cfg, layout, FLAGS.prompt + 64))
  seq = generate.SequenceState(runner, kv)
  t = time.perf_counter()
  logits = generate.prefill(seq, prompt, ubatch=min(256, FLAGS.prompt))
  tok = int(jnp.argmax(logits))
  log["prefill_first_call_s"] = time.perf_counter() - t
  t = time.perf_counter()
  tok = int(jnp.argmax(seq.forward([tok])))
  log["decode_first_call_s"] = time.perf_counter() - t
  times = []
  for _ in range(FLAGS.decode_steps):
    t = time.perf_counter()
    tok = int(jnp.argmax(seq.forward([tok])))
    times.append(time.perf_counter() - t)
  log["plain_short_ms"] = 1e3 * float(np.median(times))
  log["mem_plain_short"] = _mem()
  print(json.dumps(log, default=float), flush=True)

  rows = []
  for ctx in [int(c) for c in FLAGS.contexts]:
    max_tokens = ctx + FLAGS.decode_steps + 8
    row = {"context": ctx, "tensor_parallel": tp}
    # resident (compute only)
    pk = _cache(runner, lambda d: engine.PlainKV(cfg, layout, max_tokens))
    _each_part(pk, lambda part: synthetic.fill_plain(part, ctx))
    row["resident_ms"], _ = _time_decode(runner, pk, ctx, FLAGS.decode_steps, cfg)
    print(json.dumps(row, default=float), flush=True)
    # the fixed splits make_kv plans (`plan_kv`): the arena's (the pool is what the measured decode
    # workspace and the staging of in-flight uploads leave), then each pool of pages asked for
    budgets = [dict(arena_mib=FLAGS.arena_mib)] + [dict(pool_pages=int(p)) for p in FLAGS.pool_pages]
    for budget in budgets:
      try:
        plan = kv_build.plan(runner, max_tokens, copy_pages=FLAGS.copy_pages, ubatch=1, **budget)
      except StreamBudgetError as e:   # a budget that cannot run, said as make_kv says it
        print(json.dumps({"context": ctx, **budget, "refused": str(e)}), flush=True)
        continue
      if "arena_mib" in budget:
        log.setdefault("decode_workspace_mib", plan.workspaces.decode_bytes / 2**20)
      rows.append(_streamed_row(dict(row), plan, pk, runner, cfg, layout, ctx, decode_weight_bytes))
    del pk
  log["rows"] = rows
  _report(log, rows)


def _streamed_row(row, plan, pk, runner, cfg, layout, ctx, decode_weight_bytes):
  """One streamed configuration: the fixed split of `plan` (copy waves where a layer's streamed
  pages exceed the ring), checked bit for bit against the resident cache `pk`, timed."""
  from experiments.lib import synthetic
  from kvjax import kv_build
  split, pool_pages = plan.split, plan.pool_pages
  sk = kv_build.build_from_plan(runner, plan)

  def fill(part):
    part.timing_interval = 16     # deadline samples: every 16th forward's first copies timed alone
    part.prefetch_depth = FLAGS.pipeline_depth
    part.prefetch_next = FLAGS.prefetch_next
    synthetic.fill_streamed(part, ctx)
  _each_part(sk, fill)
  if FLAGS.check_steps:
    row["bit_exact_steps"] = _check_bit_exact(runner, pk, sk, ctx, FLAGS.check_steps)
  row["streamed_ms"], per_fwd = _time_decode(runner, sk, ctx, FLAGS.decode_steps, cfg)
  h2d = per_fwd["h2d_bytes"]
  row["streamed_mib_per_forward"] = h2d / 2**20
  row["h2d_calls_per_forward"] = per_fwd["h2d_calls"]
  row["host_ms_per_forward"] = per_fwd["host_ms"]
  for k in ("host_begin_ms", "host_end_ms", "rows_wait_ms", "prefetch_dropped", "tail_uploads", "open_hits"):
    row[k + "_per_forward"] = per_fwd.get(k, 0.0)
  row["prefetch_hits_per_forward"] = per_fwd.get("prefetch_hits", 0.0)
  row["layout_changes"] = per_fwd["layout_changes"] * FLAGS.decode_steps
  row["resident_pages_per_layer"] = split.resident_pages_per_layer[0]
  row["ring_slots"] = split.ring_slots
  row["pool_pages"] = pool_pages
  row["staging_reserve_pages"] = plan.staging_reserve_pages
  row["partition_cap_pages"] = plan.partition_cap_pages
  row["waves_per_forward"] = sk.metrics()["waves_per_forward"]
  samples = sk.counters["deadline_samples"]
  row["deadline_samples"] = samples
  row["readiness_miss_share"] = sk.counters["readiness_misses"] / samples if samples else 0.0
  if FLAGS.profile:
    row.update(_profile_forwards(runner, sk, ctx, cfg))
  row["copy_ms"] = _time_copies(sk, ctx, FLAGS.decode_steps, runner)
  row["upload_gbs"] = h2d / 1e9 / (row["copy_ms"] / 1e3) if row["copy_ms"] > 0 and h2d else 0.0
  hidden = (row["copy_ms"] + row["resident_ms"] - row["streamed_ms"]) / row["copy_ms"] if h2d else 1.0
  row["hidden_share"] = float(min(max(hidden, 0.0), 1.0))
  shorter = min(row["copy_ms"], row["resident_ms"])
  overlap = (row["copy_ms"] + row["resident_ms"] - row["streamed_ms"]) / shorter if h2d and shorter > 0 else 1.0
  row["overlap_share"] = float(min(max(overlap, 0.0), 1.0))
  row["slowdown"] = row["streamed_ms"] / max(row["resident_ms"], row["copy_ms"])
  # per device: its weights from HBM, its uploads over its own link
  row["floor_ms"] = 1e3 * (decode_weight_bytes / (FLAGS.hbm_gbs * 1e9) + h2d / FLAGS.tensor_parallel /
                           (FLAGS.h2d_gbs * 1e9))
  row["mem"] = _mem()
  print(json.dumps(row, default=float), flush=True)
  del sk
  return row


def _report(log, rows):
  with open(os.path.join(FLAGS.out, "bench_decode.json"), "w") as f:
    json.dump(log, f, indent=1, default=float)
  print(json.dumps({k: v for k, v in log.items() if k != "rows"}, default=float))
  print(f"{'tp':>2} {'context':>8} {'resident':>9} {'streamed':>9} {'copy':>7} {'x max':>6} {'hidden':>6} {'overlap':>7} {'GB/s':>6} "
        f"{'MiB/fwd':>8} {'host ms':>7} {'misses':>6} {'exact':>5} {'r/layer':>7} {'ring':>5} {'pool':>5} "
        f"{'waves':>6}")
  for r in rows:
    print(f"{r['tensor_parallel']:>2} {r['context']:>8} {r['resident_ms']:>9.2f} {r['streamed_ms']:>9.2f} {r['copy_ms']:>7.2f} "
          f"{r['slowdown']:>6.3f} {r['hidden_share']:>6.2f} {r['overlap_share']:>7.2f} {r['upload_gbs']:>6.1f} {r['streamed_mib_per_forward']:>8.1f} "
          f"{r['host_ms_per_forward']:>7.2f} {r['readiness_miss_share']:>6.2f} "
          f"{r.get('bit_exact_steps', 0):>5} {r['resident_pages_per_layer']:>7} {r['ring_slots']:>5} "
          f"{r['pool_pages']:>5} {r['waves_per_forward']:>6.1f}")


def _cache(runner, make):
  """make(d) -> one device's KV provider; with a sharded runner, one per device as one provider."""
  from kvjax import parallel
  if not isinstance(runner, parallel.ShardedRunner):
    return make(0)
  return parallel.ShardedKV(runner.mesh, parallel.per_device(runner.mesh, make))


def _each_part(kv, fn):
  """fn(provider) for each device's provider (under its device), or for kv itself."""
  from kvjax import parallel
  if isinstance(kv, parallel.ShardedKV):
    return parallel.per_device(kv.mesh, lambda d: fn(kv.parts[d]))
  return [fn(kv)]


def nnx_state(module):
  from flax import nnx
  return nnx.state(module)


def _time_decode(runner, kv, ctx, steps, cfg):
  import jax.numpy as jnp
  import numpy as np
  from kvjax import generate
  seq = generate.SequenceState(runner, kv)
  seq.pos = ctx
  tok = 1
  tok = int(jnp.argmax(seq.forward([tok])))  # warm-up (compiles, uploads resident pages)
  tok = int(jnp.argmax(seq.forward([tok])))
  before = dict(getattr(kv, "counters", {}))
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    tok = int(jnp.argmax(seq.forward([tok])))
    times.append(time.perf_counter() - t)
  after = getattr(kv, "counters", {})
  per_fwd = {k: (after[k] - before.get(k, 0)) / steps for k in after}
  return 1e3 * float(np.median(times)), per_fwd


def _profile_forwards(runner, kv, ctx, cfg):
  """Two streamed decode forwards under the profiler: the device timeline's overlap numbers, and
  the merged segments written to the output folder."""
  import jax.numpy as jnp
  from experiments.lib import timeline
  from kvjax import generate
  seq = generate.SequenceState(runner, kv)
  seq.pos = int(_each_part(kv, lambda part: part.histories["target"].tokens[0])[0])

  def two():
    tok = 1
    for _ in range(2):
      tok = int(jnp.argmax(seq.forward([tok])))

  events, trace_dir = timeline.profile(two)
  summ = timeline.summarize(events)
  calls = timeline.host_calls(trace_dir)
  summ["host_call_ms"] = sum(ms for _, ms in calls.values()) / 2
  summ["place_ms"] = sum(e.dur_ns for e in events if "dynamic_update_slice" in e.name) / 2e6
  with open(os.path.join(FLAGS.out, f"timeline_{ctx}.txt"), "w") as f:
    f.write(json.dumps(summ, indent=1) + "\n")
    for name, (n, ms) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
      f.write(f"host {ms:9.3f} ms {n:5d} calls  {name}\n")
    f.write(timeline.format_segments(timeline.segments(events), limit=100000) + "\n")
  print(f"timeline {ctx}: " + json.dumps(summ), flush=True)
  print(timeline.format_segments(timeline.segments(events), limit=40), flush=True)
  return {"timeline_" + k: v for k, v in summ.items() if "[" not in k}


def _time_copies(kv, ctx, steps, runner):
  """The streamed uploads of one decode forward without compute: every layer's stage copied to the
  device as a forward issues it (`jax.device_put` of the same host arrays), waited for at the end;
  with a sharded cache every device's uploads, to its own device, issued together."""
  import jax
  import numpy as np
  from kvjax.streaming.staging import to_device as _to_device
  layers = tuple(a for a in runner.attn_index if a is not None)

  def sources_of(part):
    pos = int(part.histories["target"].tokens[0])
    part.begin_forward(pos, 1, layers)
    sources = [x for a in layers for w in range(max(1, len(part._layer_plans[a].waves)))   # copy waves too
               for x in part._stage_sources(a, w)]
    part._stage, part._wave_stage = {}, {}
    return sources

  sources = _each_part(kv, sources_of)
  times = []
  for _ in range(max(steps // 2, 2) + 1):
    t = time.perf_counter()
    out = [y for d, srcs in enumerate(sources)
           for y in _on_part_device(kv, d, lambda: [_to_device(x) for x in srcs])]
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t)
    del out
  return 1e3 * float(np.median(times[1:]))


def _on_part_device(kv, d, fn):
  """fn() under the device of provider d of a sharded cache (or as is)."""
  import jax
  from kvjax import parallel
  if isinstance(kv, parallel.ShardedKV):
    with jax.default_device(kv.mesh.devices.flat[d]):
      return fn()
  return fn()


def _check_bit_exact(runner, plain_kv, streamed_kv, ctx, steps):
  """Greedy decode from the same context through both caches: the logits of every step must be the
  same bits. -> the number of steps compared (raises on the first difference)."""
  import jax.numpy as jnp
  import numpy as np
  from kvjax import generate
  outs = []
  for kv in (plain_kv, streamed_kv):
    seq = generate.SequenceState(runner, kv)
    seq.pos = ctx
    tok, logits = 1, []
    for _ in range(steps):
      lg = np.asarray(seq.forward([tok]))
      logits.append(lg)
      tok = int(jnp.argmax(lg))
    outs.append(logits)
  for i, (a, b) in enumerate(zip(*outs)):
    if not np.array_equal(a, b):
      raise AssertionError(f"context {ctx}: streamed logits differ from resident at decode step {i}")
  return steps


if __name__ == "__main__":
  define_flags()
  app.run(main)
