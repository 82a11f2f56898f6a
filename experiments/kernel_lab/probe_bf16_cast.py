"""Probe: does a Pallas Triton kernel round float32 to bfloat16 as XLA does?

Question: compiled for the GPU, the prologue kernel's bfloat16 x (`kvjax_pallas.quant_matmul.prologue`) moved 4.4%
of its int8 values by one against its interpretation (H100, 2026-12-07), far more than a norm's last bit
explains. Each row is a Pallas kernel over the same float32 values (normal draws at many scales and values a
half bfloat16 step from one), compared bit for bit with XLA's `astype(bfloat16)` on the same device:

  astype, stored bf16        the kernel's own conversion, its output a bfloat16 array
  astype, back to f32        the conversion then back to float32 inside the kernel (can the pair be folded away?)
  integer rounding (_cast)   the prologue's conversion by integer operations, round to nearest even

  python -m experiments.kernel_lab.probe_bf16_cast             # GPU (Triton lowering)
  python -m experiments.kernel_lab.probe_bf16_cast --interpret # CPU: every row 0 differing
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kvjax_pallas.quant_matmul import prologue


def _values(n: int) -> np.ndarray:
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 8, n)).astype(np.float32)
  b = x.astype(jnp.bfloat16).astype(np.float32).view(np.int32)
  x[: n // 4] = (b[: n // 4] + 0x8000).view(np.float32)        # exact ties
  return x


def _kernel(form: str):
  def kernel(x_ref, o_ref):
    x = x_ref[...]
    if form == "stored":
      o_ref[...] = x.astype(jnp.bfloat16)
    elif form == "round_trip":
      o_ref[...] = x.astype(jnp.bfloat16).astype(jnp.float32)
    else:
      o_ref[...] = prologue._cast(x, jnp.bfloat16).astype(jnp.float32)   # pylint: disable=protected-access
  return kernel


def run(form: str, x_rc, interpret: bool):
  rows, cols = x_rc.shape
  dtype = jnp.bfloat16 if form == "stored" else jnp.float32
  spec = pl.BlockSpec((8, cols), lambda i: (i, 0))
  return pl.pallas_call(_kernel(form), grid=(rows // 8,), in_specs=[spec], out_specs=spec,
                        out_shape=jax.ShapeDtypeStruct(x_rc.shape, dtype), interpret=interpret)(x_rc)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--n", type=int, default=1 << 20)
  args = ap.parse_args()
  x_rc = jnp.asarray(_values(args.n).reshape(-1, 1024))
  want = np.asarray(x_rc.astype(jnp.bfloat16).astype(jnp.float32)).view(np.int32)
  print(f"backend {jax.default_backend()}, {x_rc.size} values (a quarter exact ties)")
  print(f"{'form':<28} {'differ':>10} {'ties differ':>12} {'others differ':>14}")
  tie = np.zeros(x_rc.size, bool)
  tie[: x_rc.size // 4] = True
  for form, name in (("stored", "astype, stored bf16"), ("round_trip", "astype, back to f32"),
                     ("integer", "integer rounding (_cast)")):
    got = np.asarray(run(form, x_rc, args.interpret).astype(jnp.float32)).view(np.int32).reshape(-1)
    d = got != want.reshape(-1)
    print(f"{name:<28} {d.mean():>10.4%} {d[tie].mean():>12.4%} {d[~tie].mean():>14.4%}")


if __name__ == "__main__":
  main()
