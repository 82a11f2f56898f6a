"""A page-table entry read from GMEM as the dynamic index of a TMA copy (`copy_gmem_to_smem`), and
strided head rows: in the Mosaic GPU interpreter and through the real lowering, on the CPU.

  python -m experiments.kernel_lab.probe_paged_copy
"""
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from experiments.kernel_lab.common import check

P, T, H, W = 6, 256, 4, 136      # K view: [pages, tokens, heads, 136 u16 = 272 B]
BT, NT = 32, 3                   # 3 tiles of 32 tokens
rng = np.random.default_rng(0)
kv = jnp.asarray(rng.integers(0, 65535, (P, T, H, W), dtype=np.uint16))
table = jnp.asarray([4, 1, 5, 0], jnp.int32)

def body(tbl, k, o, smem, bar):
  g = lax.axis_index("g")             # program = logical page index
  page = tbl[g]                        # scalar read from GMEM int32 ref
  for j in range(NT):
    plgpu.copy_gmem_to_smem(k.at[page, pl.ds(j * BT, BT), 1], smem, bar)  # [BT,136] u16, row stride 544
    plgpu.barrier_wait(bar)
    plgpu.copy_smem_to_gmem(smem, o.at[g, pl.ds(j * BT, BT)])
    plgpu.wait_smem_to_gmem(0)

f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((4, NT * BT, W), jnp.uint16),
                 grid=(4,), grid_names=("g",),
                 scratch_types=[plgpu.SMEM((BT, W), jnp.uint16), plgpu.Barrier(num_arrivals=1)])
ref = kv[table][:, :NT * BT, 1]
check("q2 u16 dyn page", f, (table, kv), ref)

# uint8 view: [P, T, H, 272] bytes
kv8 = jax.lax.bitcast_convert_type(kv, jnp.uint8).reshape(P, T, H, 272)
def body8(tbl, k, o, smem, bar):
  g = lax.axis_index("g"); page = tbl[g]
  plgpu.copy_gmem_to_smem(k.at[page, pl.ds(0, BT), 1], smem, bar)
  plgpu.barrier_wait(bar)
  plgpu.copy_smem_to_gmem(smem, o.at[g]); plgpu.wait_smem_to_gmem(0)
f8 = plgpu.kernel(body8, out_type=jax.ShapeDtypeStruct((4, BT, 272), jnp.uint8), grid=(4,), grid_names=("g",),
                  scratch_types=[plgpu.SMEM((BT, 272), jnp.uint8), plgpu.Barrier(num_arrivals=1)])
check("q2 u8 dyn page", f8, (table, kv8), kv8[table][:, :BT, 1])

# flat page buffer [P, 212992] u16 (K block then V block), reshape the GMEM ref in-kernel
flat = jnp.asarray(rng.integers(0, 65535, (P, 256 * 832), dtype=np.uint16))
def bodyr(tbl, pg, o, ok, smem, smv, bar):
  g = lax.axis_index("g"); page = tbl[g]
  kref = pg.at[page, pl.ds(0, 256 * 544)].reshape(256, 4, 136)
  vref = pg.at[page, pl.ds(256 * 544, 256 * 288)].reshape(256, 4, 72)
  plgpu.copy_gmem_to_smem(kref.at[pl.ds(32, BT), 2], smem, bar)
  plgpu.barrier_wait(bar)
  plgpu.copy_gmem_to_smem(vref.at[pl.ds(32, BT), 2], smv, bar)
  plgpu.barrier_wait(bar)
  plgpu.copy_smem_to_gmem(smem, o.at[g]); plgpu.copy_smem_to_gmem(smv, ok.at[g]); plgpu.wait_smem_to_gmem(0)
fr = plgpu.kernel(bodyr, out_type=(jax.ShapeDtypeStruct((4, BT, 136), jnp.uint16), jax.ShapeDtypeStruct((4, BT, 72), jnp.uint16)),
                  grid=(4,), grid_names=("g",),
                  scratch_types=[plgpu.SMEM((BT, 136), jnp.uint16), plgpu.SMEM((BT, 72), jnp.uint16), plgpu.Barrier(num_arrivals=1)])
fp = flat[table]
check("q2 in-kernel GMEM reshape", fr, (table, flat),
      (fp[:, :256*544].reshape(4, 256, 4, 136)[:, 32:64, 2], fp[:, 256*544:].reshape(4, 256, 4, 72)[:, 32:64, 2]))
