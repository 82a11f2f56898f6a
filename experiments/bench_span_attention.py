"""GPU benchmark of span attention over Q8_0 K / Q4_0 V pages.

  JAX_PLATFORMS=cuda python -m experiments.bench_span_attention --out_dir=$OUT

For each context and query-token count: the Pallas kernel over an all-resident
contiguous placement and over a resident + ring (scattered) placement, the jnp
reference, XLA einsum attention on contiguous bf16 K/V, and cuDNN
`jax.nn.dot_product_attention` on the same bf16 K/V. Each timing is the
median over rounds of dependent calls (the next query depends on the last
output), per call: `--timing=dispatch` (default) queues `--dispatch_iters`
calls of a jitted step from Python; `--timing=loop` runs `--iters` calls in a
jitted fori_loop, whose while loop adds a host round trip a call
(docs/PERFORMANCE.md).

Effective GB/s counts the KV bytes a call must read once: quantized pages for
the kernel and the reference (1664 B/token/layer at 4x256 Q8_0/Q4_0), bf16 K+V
for XLA and cuDNN (4096 B/token). Imports neither gguf nor ml_collections.
"""

from __future__ import annotations

import csv
import os
import sys
import time

from absl import app, flags
import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
import jax.extend as jex

from kvjax_pallas import ggml_codec
from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import api as span_api
from kvjax_pallas.span_attention import common as span_common
from kvjax_pallas.span_attention import mosaic_decode
from kvjax_pallas.span_attention import mosaic_prefill
from kvjax_pallas.span_attention import reference as ref
from kvjax_pallas.span_attention import triton as kt

FLAGS = flags.FLAGS


def define_flags():
  """The flags, defined when the module runs as a program (see experiments/acceptance.py)."""
  flags.DEFINE_list("contexts", ["8192", "32768", "131072", "163840", "262144"], "history tokens")
  flags.DEFINE_list("rows", ["1", "4", "6", "256"], "query tokens per call")
  flags.DEFINE_integer("kv_heads", 4, "KV heads")
  flags.DEFINE_integer("q_heads", 24, "query heads")
  flags.DEFINE_integer("head_dim", 256, "head dim")
  flags.DEFINE_integer("page_tokens", 256, "tokens per page")
  flags.DEFINE_string("block_pages", "auto", "logical partition (pages) of the kernel split-K: an "
                      "int, or auto (triton.choose_block_pages of the shapes)")
  flags.DEFINE_string("precision", kt.DEFAULT_PRECISION, f"kernel dot precision {kt.PRECISIONS}")
  flags.DEFINE_integer("iters", 10, "dependent calls per timed loop")
  flags.DEFINE_integer("rounds", 5, "timed loops (median)")
  flags.DEFINE_enum("timing", "dispatch", ["loop", "dispatch"], "loop: --iters dependent calls inside "
                    "one jitted fori_loop (XLA's while loop adds a host round trip an iteration); "
                    "dispatch: --dispatch_iters dependent calls of a jitted step dispatched from "
                    "Python (the GPU runs them back to back while the host queues ahead)")
  flags.DEFINE_integer("dispatch_iters", 50, "dependent calls per round with --timing=dispatch")
  flags.DEFINE_float("max_seconds", 300.0, "stop starting new measurements after this")
  flags.DEFINE_bool("sweep", True, "tile sweep at --sweep_contexts x --sweep_rows")
  flags.DEFINE_list("sweep_contexts", ["131072"], "contexts of the tile sweep (the first one is also "
                    "the --profile_config context)")
  flags.DEFINE_list("sweep_rows", ["1"], "query tokens of the tile sweep")
  flags.DEFINE_bool("check", True, "correctness vs the jnp reference at real shapes")
  flags.DEFINE_list("check_precisions", list(kt.PRECISIONS), "precisions checked (1 row)")
  flags.DEFINE_string("compare_module", "", "path of another kernel module (same API) for sweep "
                      "configs with old=1 (version comparisons)")
  flags.DEFINE_list("check_rows", ["1", "6", "256"], "query tokens checked")
  flags.DEFINE_list("sweep_configs", [], "kernel configs of the sweep as k=v;k=v (empty: built-in list)")
  flags.DEFINE_integer("num_stages", 0, "kernel num_stages (0: path default)")
  flags.DEFINE_integer("reference_max_rows", 6, "skip the jnp reference above this many rows")
  flags.DEFINE_string("profile_config", "", "only run the kernel (config k=v;k=v) at the first --sweep_contexts "
                      "for --profile_calls calls (a target for ncu) and exit")
  flags.DEFINE_integer("profile_calls", 5, "calls in --profile_config mode")
  flags.DEFINE_bool("triton", True, "time the Triton kernel (kernel_contiguous / kernel_ring) in "
                    "the main table (false: the Mosaic GPU kernels and the baselines only, fewer "
                    "compiles)")
  flags.DEFINE_bool("mosaic", False, "also time the Mosaic GPU kernels (mosaic_decode: magic "
                    "conversion + wgmma, up to 40 folded rows; mosaic_prefill past that) on "
                    "the contiguous and the ring placement, and check them")
  flags.DEFINE_string("mosaic_block_pages", "auto", "the Mosaic GPU kernels' pages a partition: "
                      "an int or auto (their own choose_block_pages)")
  flags.DEFINE_integer("copy_probe_mib", 2048, "size of the device copy-bandwidth probe (0: skip)")
  flags.DEFINE_bool("interpret", False, "run kernels in interpret mode (CPU smoke test)")
  flags.DEFINE_string("out_dir", os.environ.get("OUT", "/tmp/bench_span"), "CSV / log folder")


HBM_TBPS = 4.8
_T0 = time.time()


def _elapsed():
  return time.time() - _T0


def hoist_closure(fn, q):
  """fn(q) -> (fn_args(q, consts), consts): the arrays `fn` closes over (the pool, the bf16 K / V
  of the baselines) become arguments of the jitted timing step. Closed over, jit embeds them as
  HLO constants: every case compiled with its hundreds of MB inside (slow) and XLA free to fold
  q-independent work at compile time."""
  closed = jax.make_jaxpr(fn)(q)

  def fn_args(x, consts):
    return jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(closed.jaxpr, consts))(x)[0]
  return fn_args, list(closed.consts)


def _time_loop(fn, q, iters, rounds):
  """Median seconds per call of `fn(q) -> o` (same shape), dependent calls (--timing)."""
  if FLAGS.timing == "dispatch":
    return _time_dispatch(fn, q, FLAGS.dispatch_iters, rounds)
  fn_args, consts = hoist_closure(fn, q)

  @jax.jit
  def loop(q0, consts):
    def body(_, q):
      return q + jnp.asarray(1e-30, q.dtype) * fn_args(q, consts).astype(q.dtype)
    return lax.fori_loop(0, iters, body, q0)
  loop(q, consts).block_until_ready()
  ts = []
  for _ in range(rounds):
    t = time.perf_counter()
    loop(q, consts).block_until_ready()
    ts.append((time.perf_counter() - t) / iters)
  return float(np.median(ts))


_STEPS = {}   # jaxpr text -> jitted timing step (see `_dispatch_step`)


def _dispatch_step(fn, q):
  """(jitted step(x, consts), consts) for `fn`, the closed-over arrays hoisted as in
  `hoist_closure`. Cases whose jaxprs differ only in what they close over (a kernel over the
  contiguous and over the ring table) share one jitted step, so one compile (a Mosaic GPU call
  compiles for tens of seconds)."""
  closed = jax.make_jaxpr(fn)(q)
  key = str(closed.jaxpr)
  if key not in _STEPS:
    jaxpr = closed.jaxpr

    def step(x, consts):
      y = jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(jaxpr, consts))(x)[0]
      return x + jnp.asarray(1e-30, x.dtype) * y.astype(x.dtype)
    _STEPS[key] = jax.jit(step)
  return _STEPS[key], list(closed.consts)


def _time_dispatch(fn, q, iters, rounds):
  """Median seconds per call of `iters` dependent calls of a jitted step queued from Python, after
  a warm-up call (compile; none with --interpret: an interpreter's time says nothing of a GPU's, so
  its rounds only show that the path runs, and a warm-up call of an interpreted kernel costs
  seconds)."""
  step, consts = _dispatch_step(fn, q)
  if not FLAGS.interpret:
    step(q, consts).block_until_ready()
  ts = []
  for _ in range(rounds):
    x = q
    t = time.perf_counter()
    for _ in range(iters):
      x = step(x, consts)
    x.block_until_ready()
    ts.append((time.perf_counter() - t) / iters)
  return float(np.median(ts))


def _make_pool(layout, num_pages, num_phys, seed=0, distinct=32):
  """Pool of valid pages: `distinct` encoded random pages tiled over `num_phys`."""
  g, d, pt = layout.num_kv_heads, layout.head_dim, layout.page_tokens
  key = jax.random.PRNGKey(seed)
  kk, kv = jax.random.split(key)
  k = jax.random.normal(kk, (distinct * pt, g, d), jnp.float32)
  v = jax.random.normal(kv, (distinct * pt, g, d), jnp.float32)
  kb = ggml_codec.encode_rows(k, layout.k_type).reshape(distinct, pt * layout.k_row_bytes)
  vb = ggml_codec.encode_rows(v, layout.v_type).reshape(distinct, pt * layout.v_row_bytes)
  pad = jnp.zeros((distinct, layout.v_offset - layout.k_plane_bytes), jnp.uint8)
  tail = jnp.zeros((distinct, layout.page_bytes - layout.v_offset - layout.v_plane_bytes), jnp.uint8)
  pages = jnp.concatenate([kb, pad, vb, tail], axis=1)
  reps = -(-num_phys // distinct)
  pool = jnp.tile(pages, (reps, 1))[:num_phys]
  # decoded contiguous bf16 K/V of the logical history (for the XLA / cuDNN baselines)
  idx = jnp.arange(num_pages) % distinct
  k_tgd = k.reshape(distinct, pt, g, d)[idx].reshape(num_pages * pt, g, d)
  v_tgd = v.reshape(distinct, pt, g, d)[idx].reshape(num_pages * pt, g, d)
  return pool, k_tgd, v_tgd


def _tables(num_pages, num_phys, seed=0):
  contiguous = np.arange(num_pages, dtype=np.int32)
  rng = np.random.default_rng(seed)
  resident = num_pages // 4
  ring = resident + rng.permutation(num_phys - resident)[:num_pages - resident]
  scattered = np.concatenate([np.arange(resident), ring]).astype(np.int32)
  return jnp.asarray(contiguous), jnp.asarray(scattered)


def _xla_attention(q_shd, k_tgd, v_tgd, q_pos_s):
  s, h, d = q_shd.shape
  g = k_tgd.shape[1]
  q = q_shd.astype(jnp.bfloat16).reshape(s, g, h // g, d)
  sc = jnp.einsum("sgrd,tgd->sgrt", q, k_tgd, preferred_element_type=jnp.float32) / np.sqrt(d)
  t = jnp.arange(k_tgd.shape[0])
  sc = jnp.where(t[None, None, None, :] <= q_pos_s[:, None, None, None], sc, -jnp.inf)
  p = jax.nn.softmax(sc, axis=-1).astype(jnp.bfloat16)
  o = jnp.einsum("sgrt,tgd->sgrd", p, v_tgd, preferred_element_type=jnp.float32)
  return o.reshape(s, h, d)


def _cudnn_attention(q_shd, k_tgd, v_tgd):
  o = jax.nn.dot_product_attention(q_shd.astype(jnp.bfloat16)[None], k_tgd[None], v_tgd[None],
                                   implementation="cudnn")
  return o[0].astype(jnp.float32)


def _copy_bandwidth(mib: int):
  """Measured device bandwidth (GB/s): an elementwise uint32 pass (read + write) and a reduction
  (read only) over `mib` MiB, median of 5 after a warm-up; bytes = what each must move."""
  n = mib * 2 ** 20 // 4
  x = jax.random.bits(jax.random.PRNGKey(7), (n,), jnp.uint32)
  out = {}
  for name, fn, nbytes in (("copy", jax.jit(lambda a: a ^ jnp.uint32(1)), 2 * 4 * n),
                           ("read", jax.jit(lambda a: jnp.bitwise_xor.reduce(a)), 4 * n)):
    fn(x).block_until_ready()
    ts = []
    for _ in range(5):
      t = time.perf_counter()
      fn(x).block_until_ready()
      ts.append(time.perf_counter() - t)
    out[name] = nbytes / float(np.median(ts)) / 1e9
  del x
  return out


OPTION_KEYS = ("block_rows", "block_tokens", "num_warps", "num_stages", "decode")  # TritonOptions
FLAG_KEYS = ("old", "u16pool", "mosaic")


def _parse_config(text):
  """"k=v;k=v" -> kernel_fn keyword arguments: precision / path / decode strings, block_pages an
  int or auto, flags 0 / 1 (old, u16pool, mosaic), the rest ints."""
  kw = {}
  for item in filter(None, text.split(";")):
    k, v = item.split("=")
    if k in ("precision", "path", "decode") or (k == "block_pages" and v == "auto"):
      kw[k] = v
    else:
      kw[k] = bool(int(v)) if k in FLAG_KEYS else int(v)
  return kw


def _compare_module():
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("kvjax_compare_kernel", FLAGS.compare_module)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


def _write_csv(results):
  path = os.path.join(FLAGS.out_dir, "bench_span_attention.csv")
  keys = sorted({k for r in results for k in r})
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=keys)
    w.writeheader()
    for r in results:
      w.writerow(r)
  return path


def main(argv):
  del argv
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  dev = jax.devices()[0]
  print(f"jax {jax.__version__} device {dev.device_kind} platform {dev.platform}", flush=True)
  layout = PageLayout(FLAGS.kv_heads, FLAGS.head_dim, "q8_0", "q4_0", FLAGS.page_tokens)
  print(layout.describe(), flush=True)
  h, d = FLAGS.q_heads, FLAGS.head_dim
  bp_flag = FLAGS.block_pages if FLAGS.block_pages == "auto" else int(FLAGS.block_pages)

  def block_pages_of(value, table, rows):
    """The partition size a call uses ("auto" resolved for its table and query rows)."""
    return span_api.resolve_block_pages(value, table.shape[0], rows, h, layout)
  kv_token = layout.token_bytes
  bf16_token = 2 * 2 * FLAGS.kv_heads * d
  rows_list = [int(r) for r in FLAGS.rows]
  contexts = [int(c) for c in FLAGS.contexts]
  results = []
  copy_gbps = {"copy": float("nan"), "read": float("nan")}

  def record(**kw):
    results.append(kw)
    _write_csv(results)
    us = kw.get("us")
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()),
          flush=True)
    return us

  def kernel_fn(pool, table, kv_len, q_pos, **kw):
    interpret = kw.pop("interpret", FLAGS.interpret)
    if kw.pop("mosaic", False):  # the Mosaic GPU kernels: their own partition sizes
      rows = q_pos.shape[0] * (FLAGS.q_heads // layout.num_kv_heads)
      prefill = span_api.uses_mosaic_prefill(layout, rows)
      if FLAGS.mosaic_block_pages == "auto":
        bp = (mosaic_prefill.choose_block_pages(table.shape[0], rows, layout.num_kv_heads,
                                                span_api.num_sms()) if prefill
              else mosaic_decode.choose_block_pages(table.shape[0], span_api.num_sms()))
      else:
        bp = int(FLAGS.mosaic_block_pages)
      bp = kw.pop("block_pages", bp)
      call = (mosaic_prefill.span_attention_mosaic_prefill if prefill
              else mosaic_decode.span_attention_mosaic_decode)
      return lambda q: call(q, pool, table, kv_len, q_pos, layout=layout, block_pages=bp,
                            interpret=interpret)
    bp = block_pages_of(kw.pop("block_pages", bp_flag), table, q_pos.shape[0])
    mod = kt
    if kw.pop("u16pool", False):
      pool = jax.jit(span_common.halfword_view)(pool)
    if kw.pop("old", False):
      mod = _compare_module()
      kw.setdefault("precision", "f16")
    kw.setdefault("precision", FLAGS.precision)
    options = {k: kw.pop(k) for k in OPTION_KEYS if k in kw}
    if FLAGS.num_stages:
      options.setdefault("num_stages", FLAGS.num_stages)
    if options:
      kw["options"] = kt.TritonOptions(**options)
    return lambda q: mod.span_attention_triton(q, pool, table, kv_len, q_pos, layout=layout,
                                               block_pages=bp, interpret=interpret, **kw)

  max_ctx = max(contexts)
  if FLAGS.copy_probe_mib and not FLAGS.profile_config:
    copy_gbps = _copy_bandwidth(FLAGS.copy_probe_mib)
    record(kind="copy_probe", mib=FLAGS.copy_probe_mib, copy_gbps=copy_gbps["copy"],
           read_gbps=copy_gbps["read"])
  if FLAGS.profile_config:
    ctx = int(FLAGS.sweep_contexts[0])
    n_pages = ctx // layout.page_tokens
    pool, _, _ = _make_pool(layout, n_pages, n_pages + 64)
    contiguous, _ = _tables(n_pages, n_pages + 64)
    s = int(rows_list[0])
    q_pos = jnp.arange(ctx - s, ctx, dtype=jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(0), (s, h, d), jnp.float32)
    fn = jax.jit(kernel_fn(pool, contiguous, ctx, q_pos, **_parse_config(FLAGS.profile_config)))
    for _ in range(2):  # compile + warm up outside the profiled range
      q = q + 1e-30 * fn(q)
    q.block_until_ready()
    prof = None
    try:  # ncu --profile-from-start off: profile only the calls below
      import torch  # pylint: disable=import-outside-toplevel
      prof = torch.cuda.profiler
      torch.cuda.init()
    except Exception:  # no torch: ncu profiles from the start
      pass
    if prof is not None:
      prof.start()
    for _ in range(FLAGS.profile_calls):
      q = q + 1e-30 * fn(q)
    q.block_until_ready()
    if prof is not None:
      prof.stop()
    print(f"profiled {FLAGS.profile_config} at {ctx} tokens, {s} rows", flush=True)
    return
  # ---- correctness at real shapes ----
  if FLAGS.check:
    ctx = min(32768, max_ctx)
    n_pages = ctx // layout.page_tokens
    pool, _, _ = _make_pool(layout, n_pages, n_pages + 64, seed=1)
    _, scattered = _tables(n_pages, n_pages + 64, seed=1)
    for s in [int(x) for x in FLAGS.check_rows]:
      q = jax.random.normal(jax.random.PRNGKey(s), (s, h, d), jnp.float32)
      q_pos = jnp.arange(ctx - s, ctx, dtype=jnp.int32)
      o_ref = ref.span_attention_reference(q, pool, scattered, ctx, q_pos, layout=layout,
                                           block_pages=block_pages_of(bp_flag, scattered, s))
      checks = [dict(precision=p) for p in (FLAGS.check_precisions if s == 1 else (FLAGS.precision,))]
      if FLAGS.mosaic and s <= mosaic_prefill.MAX_TOKENS:
        checks += [dict(mosaic=True)]
      for kw in checks:
        try:
          o = kernel_fn(pool, scattered, ctx, q_pos, **kw)(q)
          err = float(jnp.linalg.norm(o - o_ref) / jnp.linalg.norm(o_ref))
          name = kw.get("precision", "mosaic_f16")
          record(kind="check", context=ctx, rows=s, precision=name,
                 rel_err_vs_reference=err, finite=bool(jnp.isfinite(o).all()))
        except Exception as e:  # record and go on
          record(kind="check", context=ctx, rows=s, precision=str(kw), error=str(e)[:300])

  # ---- tile sweep: every config at every (context, rows), each checked against the reference ----
  if FLAGS.sweep:
    configs = [_parse_config(c) for c in FLAGS.sweep_configs] or [
        {}, dict(block_tokens=32), dict(block_tokens=128), dict(num_warps=8),
        dict(block_pages=2), dict(block_pages=8), dict(block_pages=16), dict(precision="f16"),
        dict(precision="tf32")]
    for ctx in [int(c) for c in FLAGS.sweep_contexts]:
      n_pages = ctx // layout.page_tokens
      pool, _, _ = _make_pool(layout, n_pages, n_pages + 64)
      contiguous, _ = _tables(n_pages, n_pages + 64)
      for s in [int(r) for r in FLAGS.sweep_rows]:
        q_pos = jnp.arange(ctx - s, ctx, dtype=jnp.int32)
        q = jax.random.normal(jax.random.PRNGKey(s), (s, h, d), jnp.float32)
        o_ref = ref.span_attention_reference(q, pool, contiguous, ctx, q_pos, layout=layout,
                                             block_pages=block_pages_of(bp_flag, contiguous, s))
        for kw in configs:
          if _elapsed() > FLAGS.max_seconds:
            break
          try:
            fn = kernel_fn(pool, contiguous, ctx, q_pos, **dict(kw))
            err = float(jnp.linalg.norm(fn(q) - o_ref) / jnp.linalg.norm(o_ref))
            t = _time_loop(fn, q, FLAGS.iters, FLAGS.rounds)
            record(kind="sweep", context=ctx, rows=s, config=str(kw) or "default",
                   bp=block_pages_of(kw.get("block_pages", bp_flag), contiguous, s), us=t * 1e6,
                   gbps=ctx * kv_token / t / 1e9, rel_err=err)
          except Exception as e:  # record and go on
            record(kind="sweep", context=ctx, rows=s, config=str(kw), error=str(e)[:300])
        del o_ref
      del pool

  # ---- main table ----
  for ctx in contexts:
    n_pages = ctx // layout.page_tokens
    num_phys = n_pages + n_pages // 8 + 8
    pool, k_tgd, v_tgd = _make_pool(layout, n_pages, num_phys, seed=ctx)
    k_bf, v_bf = k_tgd.astype(jnp.bfloat16), v_tgd.astype(jnp.bfloat16)
    del k_tgd, v_tgd
    contiguous, scattered = _tables(n_pages, num_phys, seed=ctx)
    for s in rows_list:
      if _elapsed() > FLAGS.max_seconds:
        print(f"time budget reached at context {ctx} rows {s}", flush=True)
        break
      q = jax.random.normal(jax.random.PRNGKey(s), (s, h, d), jnp.float32)
      q_pos = jnp.arange(ctx - s, ctx, dtype=jnp.int32)
      row = dict(context=ctx, rows=s, bp=block_pages_of(bp_flag, contiguous, s))
      cases = [("xla_bf16", lambda q: _xla_attention(q, k_bf, v_bf, q_pos), ctx * bf16_token)]
      if FLAGS.triton:
        cases[:0] = [("kernel_contiguous", kernel_fn(pool, contiguous, ctx, q_pos), ctx * kv_token),
                     ("kernel_ring", kernel_fn(pool, scattered, ctx, q_pos), ctx * kv_token)]
      if FLAGS.mosaic and s <= mosaic_prefill.MAX_TOKENS:
        cases.append(("mosaic_contiguous", kernel_fn(pool, contiguous, ctx, q_pos, mosaic=True),
                      ctx * kv_token))
        cases.append(("mosaic_ring", kernel_fn(pool, scattered, ctx, q_pos, mosaic=True),
                      ctx * kv_token))
      if s == 1:
        cases.append(("cudnn_bf16", lambda q: _cudnn_attention(q, k_bf, v_bf), ctx * bf16_token))
      if s <= FLAGS.reference_max_rows:
        cases.append(("reference", lambda q: ref.span_attention_reference(
            q, pool, scattered, ctx, q_pos, layout=layout,
            block_pages=block_pages_of(bp_flag, scattered, s)), ctx * kv_token))
      for name, fn, nbytes in cases:
        try:
          t_case = time.time()
          t = _time_loop(fn, q, FLAGS.iters if s < 256 else 3, FLAGS.rounds)
          row[name + "_us"] = t * 1e6
          row[name + "_gbps"] = nbytes / t / 1e9
          # progress: a run cut by a timeout still shows what it measured and where time went
          print(f"  case {name} ctx={ctx} rows={s}: {t * 1e6:.1f} us ({time.time() - t_case:.0f} s "
                f"with its compile; {_elapsed():.0f} s since start)", flush=True)
        except Exception as e:
          row[name + "_us"] = float("nan")
          print(f"{name} ctx={ctx} rows={s} failed: {str(e)[:300]}", flush=True)
      record(kind="main", **row)
    del pool, k_bf, v_bf

  # ---- outputs ----
  path = _write_csv(results)
  print(f"\nwrote {path}; {_elapsed():.0f}s total")
  print(f"device copy {copy_gbps['copy']:.0f} GB/s (read + write), read-only {copy_gbps['read']:.0f} GB/s; "
        f"%copy = kernel GB/s / copy GB/s, %HBM against {HBM_TBPS} TB/s")
  print(f"{'ctx':>7} {'S':>4} | {'kern us':>8} {'GB/s':>6} {'%HBM':>5} {'%copy':>5} | {'ring us':>8} {'ring/c':>6} | "
        f"{'xla us':>8} {'xla/k':>5} | {'cudnn us':>8} | {'ref us':>8} | {'S/1':>5}")
  # S/1: the kernel time over the 1-row kernel time of the same context in this run
  one_row = {r["context"]: r.get("kernel_contiguous_us", float("nan")) for r in results
             if r.get("kind") == "main" and r["rows"] == 1}
  for r in results:
    if r.get("kind") != "main":
      continue
    kc, kr = r.get("kernel_contiguous_us", float("nan")), r.get("kernel_ring_us", float("nan"))
    gb = r.get("kernel_contiguous_gbps", float("nan"))
    xl = r.get("xla_bf16_us", float("nan"))
    print(f"{r['context']:>7} {r['rows']:>4} | {kc:8.1f} {gb:6.0f} {100 * gb / 1e3 / HBM_TBPS:5.1f} "
          f"{100 * gb / copy_gbps['copy']:5.1f} | "
          f"{kr:8.1f} {kr / kc:6.3f} | {xl:8.1f} {xl / kc:5.2f} | "
          f"{r.get('cudnn_bf16_us', float('nan')):8.1f} | {r.get('reference_us', float('nan')):8.1f} | "
          f"{kc / one_row.get(r['context'], float('nan')):5.2f}")
  if FLAGS.mosaic:   # the Mosaic GPU kernels against the same run's XLA bf16 and their 1-row time
    one2 = {r["context"]: r.get("mosaic_contiguous_us", float("nan")) for r in results
            if r.get("kind") == "main" and r["rows"] == 1}
    print(f"\nmosaic {'ctx':>7} {'S':>4} | {'mosaic us':>9} {'GB/s':>6} | {'ring us':>8} "
          f"{'ring/c':>6} | {'xla/m':>6} | {'triton/m':>9} | {'S/1':>5}")
    for r in results:
      if r.get("kind") != "main" or "mosaic_contiguous_us" not in r:
        continue
      m2, m2r = r["mosaic_contiguous_us"], r.get("mosaic_ring_us", float("nan"))
      print(f"{'':6} {r['context']:>7} {r['rows']:>4} | {m2:9.1f} "
            f"{r.get('mosaic_contiguous_gbps', float('nan')):6.0f} | {m2r:8.1f} {m2r / m2:6.3f} | "
            f"{r.get('xla_bf16_us', float('nan')) / m2:6.2f} | "
            f"{r.get('kernel_contiguous_us', float('nan')) / m2:9.2f} | "
            f"{m2 / one2.get(r['context'], float('nan')):5.2f}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
