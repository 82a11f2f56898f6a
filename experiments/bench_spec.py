"""Speculative decoding on a streamed cache: tok/s against realized verify width.

For each context (a synthetic streamed history, `experiments.lib.synthetic`, inside `--arena_mib`):

* `plain`   greedy decoding of `--decode_tokens` tokens, one forward a token;
* `oracle`  the same tokens by speculative decoding with the oracle drafter (plain greedy's tokens,
            each draft kept with probability `--acceptance`, seeded; the first planted rejection
            ends the round) for every `--n_max`: tok/s, rows per verify forward (1 + drafts),
            realized verify width (tokens committed per verify forward, the reference design's
            definition), ms per verify forward. The output must equal
            plain's (checked; a difference stops the run).

With `--oracle_truth=verify` (the default) each `--n_max` first runs `verify-shaped greedy`: greedy
decoding through the verify forward of that width with no drafts, whose tokens the oracle drafts
(bf16 logits depend on a forward's row count; see `--verify_rows`).

Columns: tok/s; rows (rows a verify forward, 1 + drafts); width (the realized verify width:
tokens committed a verify forward); ms/fwd (ms a verify forward; plain: a decode forward); vs plain
(tok/s / plain's); = truth (leading tokens equal to the oracle's truth, of --decode_tokens);
= 1-row (leading tokens equal to one-row greedy decoding); lease MiB/rnd (MTP ring lease uploads a
round, with --oracle_mtp); rollback MiB (host rollback's copies). After the table, each speculative
row's ms a round split by phase. `--out` gets bench_spec.json (every row, with the stats).

Then, at `--width_context`, ms per verify forward for verify widths 1..`--max_width` (what one
more row costs when the history streams). Each timing excludes compilation (a warm-up first); the
programs go to the persistent compilation cache (`kvjax.compile_cache`: `KVJAX_COMPILE_CACHE_DIR`,
else ~/.cache/kvjax/jax), so a later run (another rollback, another width) loads them.
Every oracle row reports the MTP-free costs; MTP lease bytes and rollback bytes come with `stats`.

`--verify_rows=W` runs a numerics check instead, at each context, on the plain cache and on the
streamed one: the logits of one verify forward of W rows (`speculate`'s call) against W one-row
forwards of the same tokens (plain greedy's call) and against W one-valid-row forwards padded to
W rows (a verify whose drafts are all rejected). The tokens are the one-row path's own greedy
continuation. Per row: max abs diff, max diff relative to the row's largest |logit|, whether the
argmax agrees, and the one-row logits' top-1 - top-2 margin (a disagreement within the diff's size
is a near tie, a numerical row-count effect; one far beyond it is a verify-path fault). The plain
and streamed caches' one-row logits must be the same bits.

  python -m experiments.bench_spec --model=qwen38_27b --contexts=32768 --attn_impl=auto --verify_rows=4

  python -m experiments.bench_spec --model=qwen38_27b --contexts=32768,131072,262144 --arena_mib=2240
  python -m experiments.bench_spec --model=tiny --contexts=1024 --arena_mib=2 --page_tokens=64 \\
      --decode_tokens=12 --width_context=1024 --max_width=3    # CPU smoke
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
  flags.DEFINE_list("contexts", ["32768", "131072", "262144"], "history lengths (tokens)")
  flags.DEFINE_float("arena_mib", 2240.0, "device KV arena (MiB): the pool make_kv plans in it (kvjax.streaming.plan)")
  flags.DEFINE_integer("decode_tokens", 64, "generated tokens per run")
  flags.DEFINE_float("acceptance", 0.75, "oracle: probability each draft is kept")
  flags.DEFINE_list("n_max", ["3", "5"], "oracle draft lengths")
  flags.DEFINE_string("rollback", "replay", "recurrent-state rollback: replay, device or host")
  flags.DEFINE_integer("width_context", 131072, "context of the width sweep (0: none)")
  flags.DEFINE_integer("max_width", 6, "width sweep: verify widths 1..max_width")
  flags.DEFINE_integer("width_reps", 5, "width sweep: timed forwards per width")
  flags.DEFINE_integer("page_tokens", 256, "tokens per KV page")
  flags.DEFINE_integer("copy_pages", 8, "host copy unit (pages)")
  flags.DEFINE_string("attn_impl", "reference", "span attention implementation")
  flags.DEFINE_string("block_pages", "auto", "pages per logical partition (an int) or auto")
  flags.DEFINE_integer("seed", 0, "oracle seed")
  flags.DEFINE_enum("oracle_truth", "verify", ["verify", "one_row"],
                    "the greedy tokens the oracle drafts from: 'verify' decodes them through the verify "
                    "forward of each n_max's width with no drafts (its row 'verify-shaped greedy'; bf16 logits "
                    "depend on the forward's row count, so one-row greedy tokens split off near ties), "
                    "'one_row' through plain one-row forwards")
  flags.DEFINE_bool("allow_divergence", False,
                    "record how many leading tokens equal plain greedy instead of stopping at the first "
                    "difference (seen on the H200 at the 27B geometry; docs/DESIGN.md, 'Speculative "
                    "decoding')")
  flags.DEFINE_bool("oracle_mtp", False, "the MTP head catches up and drafts every round beside the oracle "
                    "(under its ring lease; drafts unused): the oracle's acceptance at MTP drafting's cost")
  flags.DEFINE_bool("profile", False, "after each context's first oracle row: the same run once more under "
                    "cProfile (host functions by own time) and the device timeline (experiments.lib.timeline), "
                    "written to --out as profile_<ctx>.txt")
  flags.DEFINE_integer("verify_rows", 0, "> 0: compare a verify forward of this many rows with one-row "
                       "forwards at each context (numerics check; no timing)")
  flags.DEFINE_bool("fuse", True, "join each block's same-input matrices into one product (api.load_model(fuse=))")
  flags.DEFINE_string("weight_type", "", "matrices as random blocks of this format, kept quantized (q8_0, q4_0, "
                      "q4_k, q5_k, q6_k; api.load_model(weight_type=)); empty: --dtype weights")
  flags.DEFINE_string("weights_impl", "auto", "the quantized product with --weight_type: auto (planar on a GPU), xla, "
                      "fused, pallas, pallas_gemv or planar")
  flags.DEFINE_string("out", os.environ.get("OUT", "runs/bench_spec"), "output folder")


FLAGS = flags.FLAGS


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  from kvjax import api, generate, speculative
  from kvjax import checks
  from kvjax import compile_cache
  from experiments.lib import synthetic

  os.makedirs(FLAGS.out, exist_ok=True)
  # programs of an earlier run (another rollback, another width) load from the persistent cache
  print(json.dumps({"compile_cache_dir": compile_cache.enable() or ""}), flush=True)
  try:     # the model as users load it: random weights of the preset's geometry, drawn on the device
    loaded = api.load_model(preset=FLAGS.model, dtype=FLAGS.dtype, page_tokens=FLAGS.page_tokens,
                            attn_impl=FLAGS.attn_impl, block_pages=FLAGS.block_pages, compile_cache=True,
                            fuse=FLAGS.fuse, weight_type=FLAGS.weight_type or None, weights_impl=FLAGS.weights_impl)
  except api.ParameterError as e:
    checks.fail("bench_spec", str(e))
  runner, cfg = loaded.runner, loaded.cfg
  jax.block_until_ready([leaves for _, leaves in runner.groups])
  widest = 1 + max(int(n) for n in FLAGS.n_max)
  # the arena holds the widest verify forward's scratch and the recurrent states its rows capture
  rows = FLAGS.verify_rows or max(widest, FLAGS.max_width if FLAGS.width_context else 1)
  widest_draft = speculative.SpecConfig("oracle", n_max=rows - 1, rollback=FLAGS.rollback) if rows > 1 else None
  log = {"flags": {k: FLAGS[k].value for k in FLAGS if k in (
      "model", "dtype", "contexts", "arena_mib", "decode_tokens", "acceptance", "n_max", "rollback",
      "page_tokens", "copy_pages", "attn_impl", "fuse", "weight_type", "weights_impl")}, "device": str(jax.devices()[0]),
      "jax": jax.__version__, "weights_impl_run": loaded.weights_impl, "planar_product": checks.planar_product("bench_spec")}
  print(json.dumps(log), flush=True)

  def make_kv(ctx):
    """The fixed split `make_kv(arena_mib=)` plans for this context (`plan_kv`: the pool is what the
    widest verify's workspace and states and the staging of in-flight uploads leave of the arena)."""
    max_tokens = ctx + FLAGS.decode_tokens + max(widest, FLAGS.max_width) + 8
    cache = api.make_kv(loaded, max_tokens, arena_mib=FLAGS.arena_mib, copy_pages=FLAGS.copy_pages,
                        spec=widest_draft, exceed_context_length=True)
    plan, ws = cache.plan, cache.plan.workspaces
    log.setdefault("plans", {})[str(ctx)] = {
        "pool_pages": plan.pool_pages, "ring_slots": plan.split.ring_slots,
        "staging_reserve_pages": plan.staging_reserve_pages, "workspace_mib": ws.decode_bytes / 2**20,
        "verify_states_mib": ws.verify_states_bytes / 2**20}
    print(json.dumps({"context": ctx, **log["plans"][str(ctx)]}), flush=True)
    kv = cache.provider
    synthetic.fill_streamed(kv, ctx)
    return kv

  def restart(kv, ctx):
    kv.truncate("target", ctx)
    if cfg.has_mtp:
      kv.truncate("mtp", ctx)
    seq = generate.SequenceState(runner, kv)
    seq.pos = ctx
    return seq

  if FLAGS.verify_rows:
    _verify_rows(runner, lambda n: api.make_kv(loaded, n, exceed_context_length=True).provider, make_kv,
                 restart, log)
    return

  def plain(kv, ctx):
    seq, toks = restart(kv, ctx), [1]
    t = time.perf_counter()
    while len(toks) < FLAGS.decode_tokens:
      toks.append(int(jnp.argmax(seq.forward([toks[-1]]))))
    return toks, (len(toks) - 1) / (time.perf_counter() - t)

  def spec(kv, ctx, n_max, truth, drafter=None):
    draft = speculative.SpecConfig("oracle", n_max=n_max, oracle_acceptance=FLAGS.acceptance,
                                   oracle_seed=FLAGS.seed, rollback=FLAGS.rollback,
                                   oracle_mtp=FLAGS.oracle_mtp and drafter is None)
    # the synthetic MTP history holds ctx rows; the first MTP draft comes from a zero hidden state
    mtp_next = (truth[1], 1.0, jnp.zeros((1, cfg.hidden_size), jnp.dtype(FLAGS.dtype))) \
        if draft.oracle_mtp else None
    t = time.perf_counter()
    toks, stats = speculative.speculate(restart(kv, ctx), truth[0], len(truth), draft, [], ubatch=widest,
                                        drafter=drafter, oracle_tokens=truth, mtp_next=mtp_next)
    return toks, (len(toks) - 1) / (time.perf_counter() - t), stats

  def verify_greedy(kv, ctx, n_max, plain_truth):
    """Greedy decoding through the verify forward of n_max's width with no drafts: the tokens the
    oracle's drafts are checked against (bf16 logits depend on the forward's row count)."""
    spec(kv, ctx, n_max, plain_truth[:4], drafter=lambda history, m: [])     # warm-up
    return spec(kv, ctx, n_max, plain_truth, drafter=lambda history, m: [])

  rows = []
  for ctx in [int(c) for c in FLAGS.contexts]:
    kv = make_kv(ctx)
    plain(kv, ctx)                                    # warm-up (compiles, uploads resident pages)
    truth, tps = plain(kv, ctx)
    rows.append({"context": ctx, "run": "plain", "tok_s": tps, "rows": 1.0, "tokens_per_verify": 1.0,
                 "verify_ms": 1e3 / tps})
    print(json.dumps(rows[-1]), flush=True)
    for n_max in [int(n) for n in FLAGS.n_max]:
      ref = truth
      if FLAGS.oracle_truth == "verify":
        ref, vtps, vst = verify_greedy(kv, ctx, n_max, truth)
        rows.append({"context": ctx, "run": f"verify-shaped greedy n_max={n_max}", "tok_s": vtps, "rows": 1.0,
                     "tokens_per_verify": 1.0, "verify_ms": vst["verify_ms_mean"], "round_ms": vst["round_ms_mean"],
                     "phases": vst["phase_ms_per_round"], "equal_to_one_row": _equal_prefix(ref, truth)})
        print(json.dumps(rows[-1]), flush=True)
      spec(kv, ctx, n_max, ref)                       # warm-up
      toks, tps, st = spec(kv, ctx, n_max, ref)
      same = _equal_prefix(toks, ref)
      if same < len(ref) and not FLAGS.allow_divergence:
        raise AssertionError(f"context {ctx}, n_max {n_max}: speculative output differs from the oracle's "
                             f"{FLAGS.oracle_truth} greedy tokens at token {same} of {len(ref)} "
                             f"(--allow_divergence to measure anyway)")
      rows.append({"context": ctx, "run": f"oracle{'+mtp' if FLAGS.oracle_mtp else ''} P={FLAGS.acceptance} "
                   f"n_max={n_max}", "tok_s": tps, "equal_to_truth": same, "equal_to_one_row": _equal_prefix(toks, truth),
                   "rows": st["verify_rows_mean"], "tokens_per_verify": st["tokens_per_verify"],
                   "verify_ms": st["verify_ms_mean"], "round_ms": st["round_ms_mean"], "phases": st["phase_ms_per_round"],
                   "lease_mib": st.get("mtp_lease_bytes_per_round", 0.0) / 2**20,
                   "rollback_mib": (st["rollback_d2h_bytes"] + st["rollback_h2d_bytes"]) / 2**20, "stats": st})
      print(json.dumps(rows[-1], default=float), flush=True)
      if FLAGS.profile and n_max == int(FLAGS.n_max[0]):
        _profile(lambda: spec(kv, ctx, n_max, ref), ctx)
    del kv
  widths = []
  if FLAGS.width_context:
    ctx = FLAGS.width_context
    kv = make_kv(ctx)
    for w in range(1, FLAGS.max_width + 1):
      times = []
      for _ in range(FLAGS.width_reps + 1):
        seq = restart(kv, ctx)
        t = time.perf_counter()
        out = runner.forward(np.ones((w,), np.int32), ctx, w, seq.rec_states, kv, logits_rows=np.arange(w),
                             chunked=False, capture_states=True)
        np.asarray(out.logits_rv)
        times.append((time.perf_counter() - t) * 1e3)
      widths.append({"width": w, "verify_ms": float(np.median(times[1:]))})
      print(json.dumps(widths[-1]), flush=True)
  log.update(rows=rows, widths=widths)
  # the goals: tok/s >= 0.8 x width x plain ("of w x p"), the round's time outside the verify forward
  # <= 0.1 x the verify forward's ("outside": (round - verify) / verify)
  print(f"{'context':>8} {'run':<34} {'tok/s':>8} {'rows':>6} {'width':>7} {'ms/fwd':>8} {'vs plain':>8} "
        f"{'of w x p':>8} {'outside':>7} {'= truth':>7} {'= 1-row':>7} {'lease MiB/rnd':>13} {'rollback MiB':>12}")
  base = {}
  for r in rows:
    base.setdefault(r["context"], r["tok_s"])
    goals = ("", "")
    if "round_ms" in r:     # a speculative row (plain decoding has no round)
      r["of_width_x_plain"] = r["tok_s"] / (r["tokens_per_verify"] * base[r["context"]])
      r["outside_verify_share"] = (r["round_ms"] - r["verify_ms"]) / r["verify_ms"]
      goals = (f"{r['of_width_x_plain']:.2f}", f"{r['outside_verify_share']:.2f}")
    print(f"{r['context']:>8} {r['run']:<34} {r['tok_s']:>8.2f} {r['rows']:>6.2f} {r['tokens_per_verify']:>7.2f} "
          f"{r['verify_ms']:>8.2f} {r['tok_s'] / base[r['context']]:>8.2f} {goals[0]:>8} "
          f"{goals[1]:>7} {r.get('equal_to_truth', ''):>7} {r.get('equal_to_one_row', ''):>7} "
          f"{r.get('lease_mib', 0.0):>13.2f} {r.get('rollback_mib', 0.0):>12.2f}")
  for r in rows:
    if "phases" in r:
      print(f"{r['context']:>8} {r['run']:<34} ms a round {r['round_ms']:.2f}: " +
            ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))
  if widths:
    print(f"verify width at {FLAGS.width_context}: " + "  ".join(f"{w['width']}: {w['verify_ms']:.2f} ms"
                                                                  for w in widths))
  with open(os.path.join(FLAGS.out, "bench_spec.json"), "w") as f:
    json.dump(log, f, indent=1, default=float)


def _profile(run, ctx):
  """`run()` under cProfile, then under the device profiler: where a round's host time goes."""
  import cProfile
  import io
  import pstats
  from experiments.lib import timeline
  prof = cProfile.Profile()
  prof.enable()
  run()
  prof.disable()
  text = io.StringIO()
  pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
  pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
  events, trace_dir = timeline.profile(run)
  summ = timeline.summarize(events)
  calls = timeline.host_calls(trace_dir)
  from kvjax.speculative import PhaseClock
  phases = timeline.phase_device(events, timeline.phase_windows(trace_dir, PhaseClock.PREFIX))
  with open(os.path.join(FLAGS.out, f"profile_{ctx}.txt"), "w") as f:
    f.write(text.getvalue() + "\n" + json.dumps(summ, indent=1) + "\n")
    f.write("round phases (host wall, device kernels / copies in it): " + json.dumps(phases, indent=1) + "\n")
    for name, (n, ms) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
      f.write(f"host {ms:9.3f} ms {n:5d} calls  {name}\n")
    f.write(timeline.format_segments(timeline.segments(events), limit=100000) + "\n")
  print("\n".join(text.getvalue().splitlines()[:30]), flush=True)
  print(f"timeline {ctx}: " + json.dumps(summ), flush=True)
  from experiments.lib import dispatches
  with dispatches.by_phase() as counts:
    rounds = max(1, run()[2]["verify_forwards"])
  for name, c in counts.items():
    print(f"dispatches {ctx} {name:>13}: " + ", ".join(f"{k} {v / rounds:.1f}" for k, v in c.most_common()) +
          " a round", flush=True)
  if not summ.get("device_events"):
    print(f"timeline {ctx}: no device events (a CPU backend): the phases' wall times only", flush=True)
  for name, d in phases.items():
    print(f"phase {ctx} {name:>13}: {d['n']:4d} x, wall {d['wall_ms'] / d['n']:7.2f} ms, kernels {d['kernel_ms'] / d['n']:7.2f}, "
          f"copies in {d['h2d_ms'] / d['n']:7.2f}, device idle {d['kernel_idle_ms'] / d['n']:7.2f} ms a round", flush=True)


def _verify_rows(runner, make_plain, make_kv, restart, log):
  """`--verify_rows`: verify-forward logits against one-row forwards, per row, plain (`make_plain(n)`:
  `make_kv`'s plain cache of n positions) and streamed."""
  import numpy as np
  from kvjax import engine
  from experiments.lib import synthetic
  w = FLAGS.verify_rows
  results = []
  for ctx in [int(c) for c in FLAGS.contexts]:
    logits = {}
    for cache in ("plain", "streamed"):
      if cache == "plain":
        kv = make_plain(ctx + w + 8)
        synthetic.fill_plain(kv, ctx)
      else:
        kv = make_kv(ctx)
      seq, toks, one = restart(kv, ctx), [1], []
      for i in range(w):                               # plain greedy's forward, its own continuation
        one.append(np.asarray(seq.forward([toks[-1]]), np.float32))
        if i + 1 < w:
          toks.append(int(np.argmax(one[-1])))
      seq = restart(kv, ctx)                           # speculate's verify forward of the same rows
      out = runner.forward(np.asarray(toks, np.int32), ctx, w, seq.rec_states, kv, logits_rows=np.arange(w),
                           chunked=False, capture_states=True)
      verify = np.asarray(out.logits_rv, np.float32)
      seq, padded = restart(kv, ctx), []               # one valid row in the verify's shape (all rejected)
      for t in toks:
        row = np.zeros((w,), np.int32)
        row[0] = t
        out = runner.forward(row, seq.pos, 1, seq.rec_states, kv, logits_rows=np.arange(w), chunked=False,
                             capture_states=True)
        padded.append(np.asarray(out.logits_rv[0], np.float32))
        seq.rec_states, seq.pos = engine.select_row(out.rec_states, 0), seq.pos + 1
      logits[cache] = (np.stack(one), verify, np.stack(padded))
      del kv, seq, out
    for cache, (one, verify, padded) in logits.items():
      for i in range(w):
        top2 = np.sort(one[i])[-2:]
        r = {"context": ctx, "cache": cache, "row": i, "margin": float(top2[1] - top2[0])}
        for name, x in (("verify", verify[i]), ("padded", padded[i])):
          d = np.abs(x - one[i])
          r[f"{name}_max_abs"] = float(d.max())
          r[f"{name}_max_rel"] = float(d.max() / max(float(np.abs(one[i]).max()), 1e-30))
          r[f"{name}_argmax_same"] = bool(np.argmax(x) == np.argmax(one[i]))
        r["one_row_same_bits_as_plain"] = bool(np.array_equal(one[i], logits["plain"][0][i]))
        r["verify_same_bits_as_plain"] = bool(np.array_equal(verify[i], logits["plain"][1][i]))
        results.append(r)
        print(json.dumps(r), flush=True)
  log.update(verify_rows=results)
  with open(os.path.join(FLAGS.out, "verify_rows.json"), "w") as f:
    json.dump(log, f, indent=1, default=float)
  print(f"{'context':>8} {'cache':<8} {'row':>3} {'margin':>9} {'verify abs':>10} {'rel':>9} {'argmax':>6} "
        f"{'padded abs':>10} {'rel':>9} {'argmax':>6} {'1-row=plain':>11} {'verify=plain':>12}")
  for r in results:
    print(f"{r['context']:>8} {r['cache']:<8} {r['row']:>3} {r['margin']:>9.3g} {r['verify_max_abs']:>10.3g} "
          f"{r['verify_max_rel']:>9.2g} {str(r['verify_argmax_same']):>6} {r['padded_max_abs']:>10.3g} "
          f"{r['padded_max_rel']:>9.2g} {str(r['padded_argmax_same']):>6} "
          f"{str(r['one_row_same_bits_as_plain']):>11} {str(r['verify_same_bits_as_plain']):>12}")


def _equal_prefix(a, b) -> int:
  """How many leading tokens of a and b are equal."""
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


if __name__ == "__main__":
  define_flags()
  from kvjax import checks
  app.run(checks.one_line_errors("bench_spec", main), flags_parser=checks.flags_parser(
      "bench_spec", values={"contexts": (int, 1), "n_max": (int, 1), "acceptance": (float, 0, 1),
                            "width_context": (int, 0), "decode_tokens": (int, 1), "arena_mib": (float, 0)}))
