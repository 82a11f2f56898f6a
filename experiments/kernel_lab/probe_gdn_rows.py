"""Probe: the Gated DeltaNet's rows kernel (`kvjax_pallas.delta_rule.rows`) against XLA's token scan.

Question: at the 27B's heads (48 value heads x 128 x 128, float32), does the one-call rows kernel keep
the bits a speculative round relies on once compiled, and what does a call cost against the scan the
model ran before (`kvjax.model.delta_rule_scan`: at S rows a device loop of S trips)? For S in --rows:

  error      the state and outputs against the float64 loop (`reference.delta_rule_numpy`), relative
             to their largest value; the scan's outputs likewise
  alone      rows one call each give the states and outputs of one call over them, bit for bit
  capture    `capture=True`'s last state and outputs equal the plain call's
  by count   the first n rows (`n_rows`) give the state captured after row n - 1 (the replayed rollback)
  us/call    one jitted call at a time, dispatched by the host (--calls of them after a warm call):
             what a layer's delta rule costs inside a decode or verify step, launch included

  python -m experiments.kernel_lab.probe_gdn_rows                    # GPU
  python -m experiments.kernel_lab.probe_gdn_rows --small            # CPU: small heads, interpreted
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import model as kmodel
from kvjax_pallas.delta_rule import reference as ref
from kvjax_pallas.delta_rule import rows as rows_kernel


def _rel(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def _us_per_call(fn, args, calls: int) -> float:
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="1,2,4,8", help="rows a call (comma-separated)")
  parser.add_argument("--calls", type=int, default=200, help="timed calls a variant")
  parser.add_argument("--small", action="store_true", help="4 heads of 32 x 32, interpreted (CPU)")
  args = parser.parse_args(argv)
  heads, d, interpret = (4, 32, True) if args.small else (48, 128, jax.default_backend() != "gpu")
  kernel = jax.jit(lambda *a, n=None, capture=False: rows_kernel.delta_rule_rows_triton(
      *a, n, capture=capture, interpret=interpret), static_argnames=("capture",))
  scan = jax.jit(kmodel.delta_rule_scan)
  print(f"{'S':>3} {'err state':>9} {'err o':>9} {'scan o':>9} {'alone':>6} {'capture':>7} {'by count':>8} "
        f"{'us kernel':>9} {'us scan':>8}")
  for s in (int(x) for x in args.rows.split(",")):
    xs = [jnp.asarray(x) for x in ref.random_inputs(s, s, heads, d, d)]
    want_state, want_o = ref.delta_rule_numpy(*xs)
    state, o = kernel(*xs)
    one_state, outs = xs[0], []
    for t in range(s):
      one_state, o_t = kernel(one_state, *[x[t:t + 1] for x in xs[1:]])
      outs.append(o_t)
    alone = np.array_equal(one_state, state) and np.array_equal(jnp.concatenate(outs), o)
    states, o_cap = kernel(*xs, capture=True)
    captured = np.array_equal(states[-1], state) and np.array_equal(o_cap, o)
    by_count = all(np.array_equal(kernel(*xs, n=jnp.int32(n))[0], states[n - 1]) for n in range(1, s + 1))
    print(f"{s:>3} {_rel(state, want_state):>9.1e} {_rel(o, want_o):>9.1e} {_rel(scan(*xs)[1], want_o):>9.1e} "
          f"{str(alone):>6} {str(captured):>7} {str(by_count):>8} {_us_per_call(kernel, xs, args.calls):>9.1f} "
          f"{_us_per_call(scan, xs, args.calls):>8.1f}", flush=True)


if __name__ == "__main__":
  main()
