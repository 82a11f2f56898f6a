"""Probe: the host's cost of launching, per kernel and per argument buffer.

Question: a decode forward is paced by the host (docs/PERFORMANCE.md); does its time go to the kernels a
step launches or to the buffers a step takes? Each row times one jitted call from the host's side (the
median of --calls calls, each after the previous result is ready), growing one thing:

  xla chain     n elementwise XLA kernels in a row (cut apart by optimization barriers, so n fusions)
  args          one call taking n argument buffers of 4 KiB (one small fusion reads a slice of each)
  args 8MiB     the same with buffers of 8 MiB (does the size matter?)
  pallas chain  n Pallas calls in a row (GPU only: the Triton lowering)

and prints us a unit: the slope against the row's first n.

  python -m experiments.kernel_lab.probe_launch_cost            # GPU
  python -m experiments.kernel_lab.probe_launch_cost --small    # CPU: smaller n, no Pallas rows
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def host_ms(fn, *args, calls: int) -> float:
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(calls):
    jax.block_until_ready(out)
    t = time.perf_counter()
    out = fn(*args)
    times.append(time.perf_counter() - t)
  jax.block_until_ready(out)
  return 1e3 * float(np.median(times))


def xla_chain(n: int):
  def f(x):
    for i in range(n):
      x = lax.optimization_barrier(jnp.sin(x) * 1.0001 + i)
    return x
  return jax.jit(f)


def many_args(n: int):
  return jax.jit(lambda *xs: sum(x[:1].astype(jnp.float32) for x in xs))


def pallas_chain(n: int):
  from jax.experimental import pallas as pl   # pylint: disable=import-outside-toplevel

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + 1.0

  def one(x):
    return pl.pallas_call(kernel, grid=(4,), in_specs=[pl.BlockSpec((1024,), lambda i: (i,))],
                          out_specs=pl.BlockSpec((1024,), lambda i: (i,)),
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

  def f(x):
    for _ in range(n):
      x = one(x)
    return x
  return jax.jit(f)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true", help="CPU: smaller counts, no Pallas rows")
  ap.add_argument("--calls", type=int, default=50)
  args = ap.parse_args(argv)
  counts = (1, 10, 40) if args.small else (1, 25, 100, 200)
  x = jnp.ones((4096,), jnp.float32)
  rows = [("xla chain", n, host_ms(xla_chain(n), x, calls=args.calls)) for n in counts]
  small = [jnp.full((1024,), i, jnp.float32) for i in range(max(counts))]
  rows += [("args", n, host_ms(many_args(n), *small[:n], calls=args.calls)) for n in counts]
  if not args.small:
    big = [jnp.zeros((8 << 20,), jnp.uint8) + i for i in range(100)]
    rows += [("args 8MiB", n, host_ms(many_args(n), *big[:n], calls=args.calls)) for n in (1, 100)]
  if not args.small and jax.default_backend() == "gpu":
    rows += [("pallas chain", n, host_ms(pallas_chain(n), x, calls=args.calls)) for n in (1, 25, 100)]
  print(f"{'what':14s} {'n':>5s} {'host ms':>9s} {'us/unit':>8s}")
  first = {}
  for what, n, ms in rows:
    n0, ms0 = first.setdefault(what, (n, ms))
    per = f"{(ms - ms0) / (n - n0) * 1e3:8.2f}" if n != n0 else f"{'-':>8s}"
    print(f"{what:14s} {n:5d} {ms:9.3f} {per}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
