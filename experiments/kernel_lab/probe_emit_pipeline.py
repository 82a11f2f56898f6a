"""`plgpu.emit_pipeline` over pages named by a page table (`BlockSpec` index map reading the
table): interpreter and lowering, on the CPU.

  python -m experiments.kernel_lab.probe_emit_pipeline
"""
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu
from experiments.kernel_lab.common import check
P, S, D = 6, 64, 128
rng = np.random.default_rng(0)
kv = jnp.asarray(rng.normal(size=(P, S, D)), jnp.float32)
table = jnp.asarray([3, 0, 5, 2], jnp.int32)
def body(tbl, k, o, acc):
  acc[...] = jnp.zeros_like(acc)
  def step(_, k_s):           # k_s: SMEM [S, D] (leading None dim squeezed)
    acc[...] = acc[...] + k_s[...]
  plgpu.emit_pipeline(step, grid=(4,),
      in_specs=[plgpu.BlockSpec((None, S, D), lambda i: (tbl[i], 0, 0))],
      max_concurrent_steps=2)(k)
  o[...] = acc[...]
f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((S, D), jnp.float32),
                 scratch_types=[plgpu.SMEM((S, D), jnp.float32)])
check("emit_pipeline page-table index_map", f, (table, kv), kv[table].sum(0))
