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
forward (`host ms`), the share of deadline samples that missed (`misses`), the
host's time to enqueue a forward (`disp r` / `disp s`, resident / streamed: from the call until
every step and the head are dispatched; near the forward's own time when the host, not the device,
sets the pace, or when the device is so far behind that the launch queue fills (about a thousand
launches a stream); `--host_profile` writes where the host's time goes, cProfile of the timed
forwards), and
the floor `weight bytes / HBM bandwidth + streamed bytes / 52.6 GB/s`. Before
timing, `--check_steps` greedy decode steps run through both caches from the
same context and their logits are compared bit for bit (`exact`: steps that
matched; a difference stops the run). `--profile` adds the device timeline of
two streamed forwards (copy/kernel overlap as the GPU saw it, `timeline_*.txt`) and
of two resident ones (`timeline_<context>_resident.txt`, `kernels_<context>_resident.txt`).

Long histories are synthetic (validly encoded random pages; see
`experiments.lib.synthetic`): the cost of attention and copies is that of
real content, without a 128K-token prefill. A short real prefill + decode
checks the plain path end to end first.

`--tensor_parallel=N` shards the model over N devices (`kvjax.parallel`): every
device holds its own KV heads (resident), or streams them through its own
`--arena_mib` arena over its own host link; `GB/s` is then the aggregate of all
devices' uploads, issued together, and `MiB/fwd` the sum over the devices.

  python -m experiments.bench_decode --model=qwen38_27b --contexts=32768,131072 --arena_mib=2240
  python -m experiments.bench_decode --model=tiny --contexts=2048 --arena_mib=2 --page_tokens=64   # CPU smoke
  python -m experiments.bench_decode --model=qwen38_27b --contexts=131072,262144 --arena_mib=2240 \
      --attn_impl=auto --tensor_parallel=2 --out=runs/bench_decode_tp2      # arena per device
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import time

from absl import app, flags


def define_flags():
  """The flags, defined when the module runs as a program (see experiments/acceptance.py)."""
  flags.DEFINE_string("model", "qwen38_27b", "preset name")
  flags.DEFINE_string("dtype", "bfloat16", "weight/activation dtype")
  flags.DEFINE_string("weight_type", "", "matrices as random blocks of this format, kept quantized (q8_0, q4_0, "
                      "q4_k, q5_k, q6_k; '': dequantized in --dtype)")
  flags.DEFINE_string("weights_impl", "auto", "the quantized product with --weight_type: auto (planar on a GPU), xla, fused, pallas, pallas_gemv or planar")
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
  flags.DEFINE_bool("fuse", True, "join each block's same-input matrices into one product (api.load_model(fuse=))")
  flags.DEFINE_float("hbm_gbs", 4800.0, "HBM bandwidth for the floor (GB/s)")
  flags.DEFINE_float("h2d_gbs", 52.6, "host-to-device bandwidth for the floor (GB/s)")
  flags.DEFINE_integer("check_steps", 64, "decode steps compared bit for bit, streamed against resident (0: none)")
  flags.DEFINE_integer("tensor_parallel", 1, "devices the model is sharded over (arena_mib and pool_pages "
                       "are per device)")
  flags.DEFINE_bool("profile", False, "device timeline of two streamed forwards per context and their kernels by "
                    "family and name, and of two resident ones (experiments.lib.timeline)")
  flags.DEFINE_bool("host_profile", False, "the host's Python time in the timed forwards (cProfile), per context "
                    "and cache, written to host_<context>_<resident|streamed_<pool pages>p>.txt")


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
  from kvjax import api, generate, qweights
  from kvjax import checks
  from experiments.lib import synthetic

  os.makedirs(FLAGS.out, exist_ok=True)
  log = {"flags": {k: FLAGS[k].value for k in FLAGS if k in (
      "model", "dtype", "contexts", "arena_mib", "decode_steps", "page_tokens", "copy_pages", "attn_impl", "fuse",
      "block_pages", "k_type", "v_type", "tensor_parallel", "weight_type", "weights_impl")}, "device": str(jax.devices()[0]),
      "jax": jax.__version__, "planar_product": checks.planar_product("bench_decode")}
  tp = FLAGS.tensor_parallel
  t0 = time.perf_counter()
  try:     # the model as users load it: random weights of the preset's geometry, drawn on the device
    loaded = api.load_model(preset=FLAGS.model, dtype=FLAGS.dtype, page_tokens=FLAGS.page_tokens,
                            k_type=FLAGS.k_type, v_type=FLAGS.v_type, attn_impl=FLAGS.attn_impl,
                            block_pages=FLAGS.block_pages, tensor_parallel=tp,
                            weight_type=FLAGS.weight_type or None, weights_impl=FLAGS.weights_impl,
                            compile_cache=False, fuse=FLAGS.fuse)
  except api.ParameterError as e:
    checks.fail("bench_decode", str(e))
  runner, cfg = loaded.runner, loaded.cfg
  device_runner = runner.device_runners[0] if tp > 1 else runner
  jax.block_until_ready([leaves for _, leaves in device_runner.groups])
  log["build_s"] = time.perf_counter() - t0
  log["mem_after_build"] = _mem()
  # a decode forward reads every target weight once, one embedding row, none of the MTP head
  # (with tensor parallelism: one device's shard of the target, the replicated head)
  mtp_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(device_runner.mtp[1])) if device_runner.mtp else 0
  decode_weight_bytes = (qweights.runner_bytes(device_runner) - mtp_bytes
                         - int(device_runner.token_embd.nbytes))
  log["weight_gib"] = (api.weight_bytes(loaded) if tp == 1 else
                       sum(qweights.runner_bytes(d) for d in runner.device_runners)) / 2**30
  log["decode_weight_gib"] = decode_weight_bytes / 2**30
  if tp > 1:
    log["decode_weight_gib_per_device"] = decode_weight_bytes / 2**30

  # --- end-to-end plain check: real prefill + decode --------------------------------------------
  prompt = list(np.random.default_rng(0).integers(0, cfg.vocab_size, FLAGS.prompt))
  kv = api.make_kv(loaded, FLAGS.prompt + 64).provider
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
    # resident (compute only): the plain cache `make_kv` gives without a budget
    pk = api.make_kv(loaded, max_tokens, exceed_context_length=True).provider
    _each_part(pk, lambda part: synthetic.fill_plain(part, ctx))
    row["resident_ms"], per_fwd = _time_decode(runner, pk, ctx, FLAGS.decode_steps, cfg, "resident",
                                               host_profile=FLAGS.host_profile)
    row["resident_dispatch_ms"] = per_fwd["dispatch_ms"]
    if FLAGS.profile:      # the plain cache's kernels beside the streamed ones (`_profile_forwards`)
      row.update({"resident_" + k: v for k, v in _profile_forwards(runner, pk, ctx, cfg, "resident").items()})
    print(json.dumps(row, default=float), flush=True)
    # the fixed splits `make_kv` plans (`plan_kv`) and builds: the arena's (the pool is what the
    # measured decode workspace and the staging of in-flight uploads leave), then each pool asked for
    budgets = [dict(arena_mib=FLAGS.arena_mib)] + [dict(pool_pages=int(p)) for p in FLAGS.pool_pages]
    for budget in budgets:
      try:
        cache = api.make_kv(loaded, max_tokens, copy_pages=FLAGS.copy_pages, ubatch=1,
                            exceed_context_length=True, **budget)
      except api.KVBudgetError as e:   # a budget that cannot run, as make_kv refuses it
        print(json.dumps({"context": ctx, **budget, "refused": str(e)}), flush=True)
        continue
      if "arena_mib" in budget:
        log.setdefault("decode_workspace_mib", cache.plan.workspaces.decode_bytes / 2**20)
      rows.append(_streamed_row(dict(row), cache, pk, runner, cfg, ctx, decode_weight_bytes))
      del cache
    del pk
  log["rows"] = rows
  _report(log, rows)


def _streamed_row(row, cache, pk, runner, cfg, ctx, decode_weight_bytes):
  """One streamed configuration: `make_kv`'s cache `cache`, the fixed split of its plan (copy waves
  where a layer's streamed pages exceed the ring), checked bit for bit against the resident cache
  `pk`, timed."""
  from experiments.lib import synthetic
  plan, sk = cache.plan, cache.provider
  split, pool_pages = plan.split, plan.pool_pages

  def fill(part):
    part.timing_interval = 16     # deadline samples: every 16th forward's first copies timed alone
    part.prefetch_depth = FLAGS.pipeline_depth
    part.prefetch_next = FLAGS.prefetch_next
    synthetic.fill_streamed(part, ctx)
  _each_part(sk, fill)
  if FLAGS.check_steps:
    row["bit_exact_steps"] = _check_bit_exact(runner, pk, sk, ctx, FLAGS.check_steps)
  row["streamed_ms"], per_fwd = _time_decode(runner, sk, ctx, FLAGS.decode_steps, cfg, f"streamed_{pool_pages}p",
                                                host_profile=FLAGS.host_profile)
  h2d = per_fwd["h2d_bytes"]
  row["streamed_mib_per_forward"] = h2d / 2**20
  row["h2d_calls_per_forward"] = per_fwd["h2d_calls"]
  row["host_ms_per_forward"] = per_fwd["host_ms"]
  row["streamed_dispatch_ms"] = per_fwd["dispatch_ms"]
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
  # the plan's own account, made before the cache was built (`KVPlan.decode_cost`)
  row["plan_ring_fills_per_forward"] = plan.decode_cost(ctx).ring_fills
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
        f"{'waves':>6} {'plan':>6} {'disp r':>6} {'disp s':>6}")
  for r in rows:
    streams = r["streamed_mib_per_forward"] > 0      # nothing streamed: no copy to hide ("-")
    hidden, overlap = (f"{r['hidden_share']:.2f}", f"{r['overlap_share']:.2f}") if streams else ("-", "-")
    print(f"{r['tensor_parallel']:>2} {r['context']:>8} {r['resident_ms']:>9.2f} {r['streamed_ms']:>9.2f} {r['copy_ms']:>7.2f} "
          f"{r['slowdown']:>6.3f} {hidden:>6} {overlap:>7} {r['upload_gbs']:>6.1f} {r['streamed_mib_per_forward']:>8.1f} "
          f"{r['host_ms_per_forward']:>7.2f} {r['readiness_miss_share']:>6.2f} "
          f"{r.get('bit_exact_steps', 0):>5} {r['resident_pages_per_layer']:>7} {r['ring_slots']:>5} "
          f"{r['pool_pages']:>5} {r['waves_per_forward']:>6.1f} {r.get('plan_ring_fills_per_forward', 0):>6} "
          f"{r['resident_dispatch_ms']:>6.2f} {r['streamed_dispatch_ms']:>6.2f}")


def _each_part(kv, fn):
  """fn(provider) for each device's provider (under its device), or for kv itself."""
  from kvjax import parallel
  if isinstance(kv, parallel.ShardedKV):
    return parallel.per_device(kv.mesh, lambda d: fn(kv.parts[d]))
  return [fn(kv)]


def _time_decode(runner, kv, ctx, steps, cfg, name="", host_profile=False):
  import jax.numpy as jnp
  import numpy as np
  from kvjax import generate
  seq = generate.SequenceState(runner, kv)
  seq.pos = ctx
  tok = 1
  tok = int(jnp.argmax(seq.forward([tok])))  # warm-up (compiles, uploads resident pages)
  tok = int(jnp.argmax(seq.forward([tok])))
  before = dict(getattr(kv, "counters", {}))
  times, dispatched = [], []
  end_forward = kv.end_forward

  def marked_end_forward():    # the host has dispatched every step of the forward (and its head)
    dispatched.append(time.perf_counter())
    end_forward()
  kv.end_forward = marked_end_forward
  prof = cProfile.Profile() if host_profile else None   # written to host_<ctx>_<name>.txt under --out
  try:
    for _ in range(steps):
      t = time.perf_counter()
      if prof is not None:
        prof.enable()
      tok = int(jnp.argmax(seq.forward([tok])))
      if prof is not None:
        prof.disable()
      times.append(time.perf_counter() - t)
      dispatched[-1] -= t
  finally:
    del kv.end_forward
  if prof is not None:
    with open(os.path.join(FLAGS.out, f"host_{ctx}_{name}.txt"), "w") as f:
      f.write(f"{steps} timed forwards, {name}, context {ctx}\n")
      for order, lines in (("tottime", 30), ("cumulative", 40)):
        pstats.Stats(prof, stream=f).sort_stats(order).print_stats(lines)
  after = getattr(kv, "counters", {})
  per_fwd = {k: (after[k] - before.get(k, 0)) / steps for k in after}
  per_fwd["dispatch_ms"] = 1e3 * float(np.median(dispatched))
  return 1e3 * float(np.median(times)), per_fwd


def _profile_forwards(runner, kv, ctx, cfg, name=""):
  """Two decode forwards under the profiler: the device timeline's overlap numbers, and the merged
  segments written to the output folder (`timeline_<ctx>[_name].txt`, `kernels_<ctx>[_name].txt`);
  streamed (`name` empty), or the plain cache's ("resident"), so the two kernel tables compare."""
  import jax.numpy as jnp
  from experiments.lib import timeline
  from kvjax import generate
  seq = generate.SequenceState(runner, kv)
  seq.pos = ctx if name else int(_each_part(kv, lambda part: part.histories["target"].tokens[0])[0])
  tag = f"{ctx}_{name}" if name else f"{ctx}"

  def two():
    tok = 1
    for _ in range(2):
      tok = int(jnp.argmax(seq.forward([tok])))

  events, trace_dir = timeline.profile(two)
  summ = timeline.summarize(events)
  calls = timeline.host_calls(trace_dir)
  summ["host_call_ms"] = sum(ms for _, ms in calls.values()) / 2
  summ["place_ms"] = sum(e.dur_ns for e in events if "dynamic_update_slice" in e.name) / 2e6
  with open(os.path.join(FLAGS.out, f"timeline_{tag}.txt"), "w") as f:
    f.write(json.dumps(summ, indent=1) + "\n")
    for call, (n, ms) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
      f.write(f"host {ms:9.3f} ms {n:5d} calls  {call}\n")
    f.write(timeline.format_segments(timeline.segments(events), limit=100000) + "\n")
  table = timeline.kernel_table(events, top=25)
  with open(os.path.join(FLAGS.out, f"kernels_{tag}.txt"), "w") as f:
    f.write(timeline.format_kernel_table(table) + "\n")
  print(f"timeline {tag}: " + json.dumps(summ), flush=True)
  print(timeline.format_segments(timeline.segments(events), limit=40), flush=True)
  print(f"kernels of the two {name or 'streamed'} forwards at {ctx}:\n" + timeline.format_kernel_table(table),
        flush=True)
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
               for x in part.stage_sources(a, w)]
    part.stager.clear()
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
  same bits. The resident cache runs the streamed cache's attention partition (a plan's
  `partition_cap_pages` changes the partials' combining order, so the bits are compared at the same
  partition). -> the number of steps compared (raises on the first difference)."""
  import jax.numpy as jnp
  import numpy as np
  from kvjax import generate
  outs = []
  own_cap = getattr(plain_kv, "partition_cap", None)
  plain_kv.partition_cap = getattr(streamed_kv, "partition_cap", None)
  try:
    for kv in (plain_kv, streamed_kv):
      seq = generate.SequenceState(runner, kv)
      seq.pos = ctx
      tok, logits = 1, []
      for _ in range(steps):
        lg = np.asarray(seq.forward([tok]))
        logits.append(lg)
        tok = int(jnp.argmax(lg))
      outs.append(logits)
  finally:
    plain_kv.partition_cap = own_cap
  for i, (a, b) in enumerate(zip(*outs)):
    if not np.array_equal(a, b):
      raise AssertionError(f"context {ctx}: streamed logits differ from resident at decode step {i}")
  return steps


if __name__ == "__main__":
  # the resident comparison cache sits beside the weights and the streamed cache: on an 80 GB card
  # the 27B at 128K needs more than jax's default 75% of the device (2026-12-05, H100)
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  define_flags()
  from kvjax import checks
  app.run(checks.one_line_errors("bench_decode", main), flags_parser=checks.flags_parser(
      "bench_decode", values={"contexts": (int, 1), "pool_pages": (int, 1), "arena_mib": (float, 0),
                              "decode_steps": (int, 1)}))
