"""How fast can the Triton span kernel's page reads go by themselves? A read-ceiling probe.

A Pallas (Triton lowering) kernel with the span kernel's grid (KV head, logical partition) and
its page-table walk that only READS each key tile's K and V head rows through the span kernel's
own load (`triton.load_blocks`), then either

  mode "load":   adds the raw halfwords into int32 tile accumulators (wrapping) so no load is
                 dead code, or
  mode "decode": also runs the span kernel's quant decode (`triton.decode_blocks`, the packed
                 PTX on the GPU) and adds the f16 values into f16 tile accumulators,

and writes one number a program. No dots, no softmax, no combine. Its time against the span
kernel's time at the same context splits the kernel into "reading", "decoding" and "the rest".
GB/s counts the page bytes read once (K + V rows of the context, as the span benchmark does).

  python -m experiments.kernel_lab.probe_page_reads --contexts=131072,163840
  python -m experiments.kernel_lab.probe_page_reads --interpret --contexts=2048   # CPU: checks

With --interpret (CPU) the "load" sums (every halfword of a head row once) are checked against
numpy over the same bytes.
"""

from __future__ import annotations

import functools

import numpy as np
from absl import app, flags
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from experiments.kernel_lab import common
from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import common as span_common
from kvjax_pallas.span_attention import triton as kt

FLAGS = flags.FLAGS
common.define_flags(contexts=("131072", "163840"))
flags.DEFINE_list("modes", ["load", "decode"], "load: sum raw halfwords; decode: + quant decode")
flags.DEFINE_integer("block_tokens", 32, "keys a tile")
flags.DEFINE_integer("num_warps", 4, "warps a program")


def _probe_kernel(tab_ref, pool_ref, out_ref, *, layout: PageLayout, block_pages: int,
                  bt: int, mode: str, asm: bool, n_table: int):
  # tab_ref [T] i32 page table; pool_ref [P, page_hw] u16; out_ref [G, parts] (i32 or f32)
  g = pl.program_id(0)
  pp = pl.program_id(1)
  pt, d = layout.page_tokens, layout.head_dim
  kk, vk = layout.k_type, layout.v_type
  planes = [(kk, 0, layout.k_row_bytes // 2, layout.k_head_bytes // 2),
            (vk, layout.v_offset // 2, layout.v_row_bytes // 2, layout.v_head_bytes // 2)]
  t_iota = lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
  page_lo = pp * block_pages
  n_tiles = (jnp.minimum(page_lo + block_pages, n_table) - page_lo) * (pt // bt)

  def tile(i):
    t0 = page_lo * pt + i * bt
    phys = tab_ref[t0 // pt]
    in_page = t0 % pt + t_iota
    out = []
    for kind, base, row_hw, head_hw in planes:
      data, scale = kt.load_blocks(pool_ref, phys, base + in_page * row_hw + g * head_hw, kind, d)
      if mode == "load":
        out.append(data.astype(jnp.int32))
        if scale is not None:
          out.append(scale.astype(jnp.int32))
      else:
        out.append(kt.decode_blocks(data, scale, kind, False, asm))
    return out

  # tile-shaped accumulators, reduced once at the end: per element one add (int32 for the raw
  # halfwords, f16 for the decoded values), no per-tile cross-thread reduction
  shapes = jax.eval_shape(lambda: tile(0))
  init = tuple(jnp.zeros(a.shape, a.dtype) for a in shapes)

  def body(i, accs):
    return tuple(a + x for a, x in zip(accs, tile(i)))

  accs = lax.fori_loop(0, n_tiles, body, init)
  if mode == "load":
    out_ref[g, pp] = sum(jnp.sum(a) for a in accs)
  else:
    out_ref[g, pp] = sum(jnp.sum(a.astype(jnp.float32)) for a in accs)


@functools.partial(jax.jit, static_argnames=("layout", "block_pages", "bt", "mode", "num_warps",
                                             "interpret"))
def probe(pool_u16, table, *, layout, block_pages, bt, mode, num_warps, interpret):
  n_table = table.shape[0]
  parts = -(-n_table // block_pages)
  g = layout.num_kv_heads
  kern = functools.partial(_probe_kernel, layout=layout, block_pages=block_pages, bt=bt,
                           mode=mode, asm=not interpret, n_table=n_table)
  dtype = jnp.int32 if mode == "load" else jnp.float32
  return pl.pallas_call(
      kern, grid=(g, parts), out_shape=jax.ShapeDtypeStruct((g, parts), dtype),
      compiler_params=span_common.triton_params(num_warps, 1, interpret), interpret=interpret,
      name="kvjax_probe_page_reads")(table, pool_u16)


def expected_load_sums(pool_u16: np.ndarray, table: np.ndarray, layout: PageLayout,
                       block_pages: int) -> np.ndarray:
  """numpy: per (KV head, partition) the int32 sum of every halfword of its K and V head rows."""
  pt, g = layout.page_tokens, layout.num_kv_heads
  k_hw, v_hw = layout.k_head_bytes // 2, layout.v_head_bytes // 2
  parts = -(-len(table) // block_pages)
  out = np.zeros((g, parts), np.int64)
  for lp, phys in enumerate(table):
    page = pool_u16[phys].astype(np.int64)
    k = page[:pt * layout.k_row_bytes // 2].reshape(pt, g, k_hw)
    v0 = layout.v_offset // 2
    v = page[v0:v0 + pt * layout.v_row_bytes // 2].reshape(pt, g, v_hw)
    out[:, lp // block_pages] += k.sum(axis=(0, 2)) + v.sum(axis=(0, 2))
  return ((out + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.int32)


def main(argv):
  del argv
  layout = common.layout_from_flags()
  rows = []
  for ctx, n_pages, num_phys, nbytes in common.contexts(layout):
    key = jax.random.PRNGKey(ctx)
    pool = jax.random.bits(key, (num_phys, layout.page_bytes // 2), jnp.uint16)
    table = jnp.asarray(np.random.default_rng(ctx).permutation(num_phys)[:n_pages], jnp.int32)
    for mode in FLAGS.modes:
      fn = functools.partial(probe, pool, table, layout=layout, block_pages=FLAGS.block_pages,
                             bt=FLAGS.block_tokens, mode=mode, num_warps=FLAGS.num_warps,
                             interpret=FLAGS.interpret)
      if FLAGS.interpret and mode == "load":
        want = expected_load_sums(np.asarray(pool), np.asarray(table), layout, FLAGS.block_pages)
        if not np.array_equal(np.asarray(fn()), want):
          raise SystemExit(f"probe sums differ from numpy at {ctx} tokens")
        print(f"check context={ctx}: sums equal numpy's", flush=True)
      common.timed(fn, nbytes, f"probe context={ctx} mode={mode}", (ctx, mode), rows)
  common.print_table(("ctx", "mode"), rows)


if __name__ == "__main__":
  app.run(main)
