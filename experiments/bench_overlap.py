"""Does a host-to-device copy hide behind compute? Each way JAX offers to issue it, measured.

A layer loop like a streamed decode forward: `--layers` layers, each a compiled step of
`--matmuls` bf16 `--dim`^3 matmuls (compute), and each needing `--copy_mib` MiB that come from a
`pinned_host` array (copy). Layer i's step reads its copied bytes (a small reduction), so a copy
must land before its consumer runs. Timed alone (compute only, copies only) and together, per
issuing method:

* `ahead`        `jax.device_put` of layer i+1 issued before layer i's step is dispatched
                 (what the streamed cache intends);
* `after`        layer i's step dispatched first, then the copy of layer i+1;
* `ahead_small`  as `ahead`, plus a small pageable (numpy) upload per layer issued after the big
                 copy and consumed by the step (a page table, a scalar): does it queue behind?
* `small_first`  as `ahead_small`, but every layer's small upload issued before any big copy;
* `all_first`    every copy issued before any step;
* `in_step`      the copy inside the compiled step: step i takes layer i+1's pinned_host array
                 and returns it in device memory (XLA copy-start / copy-done);
* `one_program`  the whole loop as one compiled program that takes every pinned_host array.

`hidden = (copy + compute - together) / copy`: 1.0 means the copies cost nothing beyond the
compute, 0.0 that they were fully serialised. `--profile` adds the device timeline's own
measure of overlap per method (`experiments.lib.timeline`).

  python -m experiments.bench_overlap --layers=16 --copy_mib=91 --matmuls=1      # H200
  python -m experiments.bench_overlap --layers=2 --copy_mib=1 --dim=128 --reps=1  # CPU smoke
"""

from __future__ import annotations

import json
import os

from absl import app, flags


def define_flags():
  """The flags, defined when the module runs as a program (see experiments/acceptance.py)."""
  flags.DEFINE_integer("layers", 16, "layers per forward")
  flags.DEFINE_float("copy_mib", 91.0, "MiB copied per layer")
  flags.DEFINE_integer("matmuls", 1, "bf16 matmuls per layer step")
  flags.DEFINE_integer("dim", 8192, "matmul size")
  flags.DEFINE_integer("reps", 5, "timed repetitions (median)")
  flags.DEFINE_list("methods", ["ahead", "after", "ahead_small", "small_first", "all_first", "in_step",
                                "one_program"], "issuing methods")
  flags.DEFINE_bool("profile", False, "also read the device timeline of one forward per method")
  flags.DEFINE_string("out", os.environ.get("OUT", "runs/bench_overlap"), "output folder")


FLAGS = flags.FLAGS


def main(argv):
  del argv
  import logging
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from experiments.lib import timeline, timing
  from kvjax.streaming.host_history import pinned_available

  os.makedirs(FLAGS.out, exist_ok=True)
  dev = jax.devices()[0]
  pinned = pinned_available()
  on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device") if pinned else dev
  n_layers, nbytes = FLAGS.layers, int(FLAGS.copy_mib * 2**20)
  rng = np.random.default_rng(0)
  host = [rng.integers(0, 255, (nbytes,), dtype=np.uint8) for _ in range(n_layers)]
  if pinned:
    pin_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    srcs = [jax.device_put(h, pin_sh) for h in host]
  else:
    srcs = host
  jax.block_until_ready(srcs)
  w = jnp.asarray(rng.standard_normal((FLAGS.dim, FLAGS.dim)) / FLAGS.dim, jnp.bfloat16)
  a0 = jnp.asarray(rng.standard_normal((FLAGS.dim, FLAGS.dim)), jnp.bfloat16)
  small = [np.arange(1024, dtype=np.int32) + i for i in range(n_layers)]

  def work(a, y, t):
    for _ in range(FLAGS.matmuls):
      a = a @ w
    extra = jnp.sum(y[:4096].astype(jnp.float32))
    if t is not None:
      extra = extra + jnp.sum(t).astype(jnp.float32)
    return a + (extra * 0).astype(a.dtype)

  step = jax.jit(lambda a, y: work(a, y, None))
  step_t = jax.jit(work)

  def put(x):
    return jax.device_put(x, on_dev)

  if pinned:
    @jax.jit
    def step_in(a, y, x_next):
      return work(a, y, None), jax.device_put(x_next, on_dev)

    @jax.jit
    def whole(a, xs):
      for x in xs:
        a = work(a, jax.device_put(x, on_dev), None)
      return a
  else:
    step_in = jax.jit(lambda a, y, x_next: (work(a, y, None), x_next))
    whole = jax.jit(lambda a, xs: _fold(work, a, xs))

  dev_ys = [put(s) for s in srcs]
  jax.block_until_ready(dev_ys)

  def compute_only():
    a = a0
    for i in range(n_layers):
      a = step(a, dev_ys[i])
    return a

  def copies_only():
    return [put(s) for s in srcs]

  def ahead():
    ys = [put(srcs[0])]
    a = a0
    for i in range(n_layers):
      if i + 1 < n_layers:
        ys.append(put(srcs[i + 1]))
      a = step(a, ys[i])
    return a

  def after():
    ys = [put(srcs[0])]
    a = a0
    for i in range(n_layers):
      a = step(a, ys[i])
      if i + 1 < n_layers:
        ys.append(put(srcs[i + 1]))
    return a

  def ahead_small():
    ys = [put(srcs[0])]
    a = a0
    for i in range(n_layers):
      if i + 1 < n_layers:
        ys.append(put(srcs[i + 1]))
      t = jax.device_put(small[i], dev)
      a = step_t(a, ys[i], t)
    return a

  def small_first():
    ts = [jax.device_put(s, dev) for s in small]
    ys = [put(srcs[0])]
    a = a0
    for i in range(n_layers):
      if i + 1 < n_layers:
        ys.append(put(srcs[i + 1]))
      a = step_t(a, ys[i], ts[i])
    return a

  def all_first():
    ys = [put(s) for s in srcs]
    a = a0
    for i in range(n_layers):
      a = step(a, ys[i])
    return a

  def in_step():
    y = put(srcs[0])
    a = a0
    for i in range(n_layers):
      a, y_next = step_in(a, y, srcs[min(i + 1, n_layers - 1)])
      y = y_next
    return a

  def one_program():
    return whole(a0, tuple(srcs))

  methods = dict(ahead=ahead, after=after, ahead_small=ahead_small, small_first=small_first,
                 all_first=all_first, in_step=in_step, one_program=one_program)
  unknown = [m for m in FLAGS.methods if m not in methods]
  if unknown:
    raise app.UsageError(f"--methods: unknown {unknown}; known: {sorted(methods)}")

  def timed(fn):
    return timing.median_ms(fn, FLAGS.reps)

  compute_ms, copy_ms = timed(compute_only), timed(copies_only)
  log = {"device": str(dev), "jax": jax.__version__, "pinned": pinned, "layers": n_layers,
         "copy_mib": FLAGS.copy_mib, "compute_ms": compute_ms, "copy_ms": copy_ms,
         "copy_gbs": n_layers * nbytes / copy_ms / 1e6, "rows": []}
  print(json.dumps({k: v for k, v in log.items() if k != "rows"}), flush=True)
  for name in FLAGS.methods:
    ms = timed(methods[name])
    row = {"method": name, "ms": ms,
           "hidden": (copy_ms + compute_ms - ms) / copy_ms if copy_ms > 0 else 1.0}
    if FLAGS.profile:
      events, _ = timeline.profile(lambda f=methods[name]: jax.block_until_ready(f()))
      summ = timeline.summarize(events)
      row["timeline"] = summ
      row["timeline_hidden"] = summ.get("hidden_share", float("nan"))
    log["rows"].append(row)
    print(json.dumps(row), flush=True)
  with open(os.path.join(FLAGS.out, "bench_overlap.json"), "w") as f:
    json.dump(log, f, indent=1)
  print(f"compute alone {compute_ms:.2f} ms, copies alone {copy_ms:.2f} ms "
        f"({log['copy_gbs']:.1f} GB/s), serial {compute_ms + copy_ms:.2f}, ideal "
        f"{max(compute_ms, copy_ms):.2f}")
  print(f"{'method':<12} {'ms':>8} {'hidden':>7} {'timeline':>8}")
  for r in log["rows"]:
    print(f"{r['method']:<12} {r['ms']:>8.2f} {r['hidden']:>7.2f} {r.get('timeline_hidden', float('nan')):>8.2f}")


def _fold(work, a, xs):
  for x in xs:
    a = work(a, x, None)
  return a


if __name__ == "__main__":
  define_flags()
  app.run(main)
