"""TMA read ceiling of the page walk (Pallas Mosaic GPU): the first measurement of a v2 kernel.

The Triton read probe (`probe_page_reads.py`, session 7) showed that the span kernel's own loads
plus its decode stop at 1.9-2.3 TB/s, below the 2.5 TB/s goal before any attention math. This
probe asks the same question of the path a Mosaic GPU v2 kernel would take (docs/DESIGN.md,
"Span attention v2"): TMA bulk copies of a key tile's K and V rows into SMEM, `--stages` tiles
in flight, one CTA a logical partition of `--block_pages` pages walking the page table in
logical order. Nothing is computed: a tile is waited for and its slot is refilled with the
tile `stages` ahead.

Pallas lowers no reshape of a GMEM ref for a TMA copy ("Non-indexing transforms on GMEM refs are
not implemented"), so a single head's [tokens, 272 B] rows (token stride 1088 B) cannot be one
box. The copies therefore move the CONTIGUOUS all-heads span of a tile (the pool viewed as
[P, page_bytes / 16, 16] lines, boxes of <= 256 lines), as Mosaic v1 does; a v2 kernel would use
all heads of the span in one CTA.

At the end each CTA copies the first 128 bytes of its last tile's K span back to GMEM; the script
checks them against the page bytes (compiled and interpreted), so a copy of the wrong page or
offset fails the run.

  python experiments/probe_tma_reads.py --contexts=131072,262144 --stages=2,3,4 --block_tokens=32,64
  python experiments/probe_tma_reads.py --interpret --contexts=512 --page_tokens=64 --head_dim=64
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from kvjax_pallas.page_layout import PageLayout  # noqa: E402

import probe_common  # noqa: E402  (experiments/, the script's folder)
from probe_common import time_calls  # noqa: E402

FLAGS = flags.FLAGS
probe_common.define_flags()
flags.DEFINE_list("contexts", ["131072", "262144"], "history tokens")
flags.DEFINE_list("stages", ["2", "4"], "tiles in flight a CTA")
flags.DEFINE_list("block_tokens", ["32", "64"], "keys a tile (all KV heads)")
flags.DEFINE_integer("block_pages", 4, "pages a CTA (logical partition)")
flags.DEFINE_integer("smem_limit", 227 * 1024, "SMEM a CTA may use (bytes); larger configs skipped")
flags.DEFINE_bool("interpret", False, "Mosaic GPU interpreter (CPU): small contexts")

LINE = 16         # bytes a line of the pool view (the TMA granule)
BOX = 256         # TMA box limit a dimension
CHECK_LINES = 8   # 128 bytes copied back a CTA


def _probe_kernel(tab_ref, lines_ref, out_ref, buf, bars, *, block_pages: int, n_table: int,
                  tiles_per_page: int, k_lines: int, v_lines: int, v_first: int, stages: int):
  # tab_ref [T] i32; lines_ref [P, page_lines, 16] u8; out_ref [parts, 8, 16] u8
  # buf [stages, k_lines + v_lines, 16] u8 SMEM; bars: `stages` barriers
  pp = lax.axis_index("p")
  page_lo = pp * block_pages
  n_tiles = (jnp.minimum(page_lo + block_pages, n_table) - page_lo) * tiles_per_page

  def issue(i, slot):
    phys = tab_ref[page_lo + i // tiles_per_page]
    r = i % tiles_per_page
    for first, n, dst0 in ((r * k_lines, k_lines, 0), (v_first + r * v_lines, v_lines, k_lines)):
      for c0 in range(0, n, BOX):
        c = min(BOX, n - c0)
        plgpu.copy_gmem_to_smem(lines_ref.at[phys, pl.ds(first + c0, c)],
                                buf.at[slot, pl.ds(dst0 + c0, c)], bars.at[slot])

  for s in range(stages):
    pl.when(s < n_tiles)(functools.partial(issue, s, s))

  def body(i, carry):
    slot = i % stages
    plgpu.barrier_wait(bars.at[slot])
    pl.when(i + stages < n_tiles)(lambda: issue(i + stages, slot))
    return carry

  lax.fori_loop(0, n_tiles, body, jnp.int32(0))
  last = (n_tiles - 1) % stages
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(buf.at[last, pl.ds(0, CHECK_LINES)], out_ref.at[pp])
  plgpu.wait_smem_to_gmem(0)


def _copies(n_lines: int) -> int:
  return -(-n_lines // BOX)


@functools.partial(jax.jit, static_argnames=("layout", "block_pages", "block_tokens", "stages",
                                             "interpret"))
def probe(lines, table, *, layout: PageLayout, block_pages: int, block_tokens: int, stages: int,
          interpret: bool):
  """lines [P, page_bytes / 16, 16] u8, table [T] i32 -> [parts, 8, 16] u8 (each CTA's check)."""
  n_table = table.shape[0]
  parts = -(-n_table // block_pages)
  k_lines = block_tokens * layout.k_row_bytes // LINE
  v_lines = block_tokens * layout.v_row_bytes // LINE
  kern = functools.partial(
      _probe_kernel, block_pages=block_pages, n_table=n_table,
      tiles_per_page=layout.page_tokens // block_tokens, k_lines=k_lines, v_lines=v_lines,
      v_first=layout.v_offset // LINE, stages=stages)
  kw = {}
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret import params as _ip  # pylint: disable=g-import-not-at-top
    kw["interpret"] = _ip.InterpretGPUParams()
  call = plgpu.kernel(
      kern,
      out_type=jax.ShapeDtypeStruct((parts, CHECK_LINES, LINE), jnp.uint8),
      scratch_types=[plgpu.SMEM((stages, k_lines + v_lines, LINE), jnp.uint8),
                     plgpu.Barrier(num_arrivals=_copies(k_lines) + _copies(v_lines),
                                   num_barriers=stages)],
      grid=(parts,), grid_names=("p",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **kw)
  return call(table, lines)


def expected(pool: np.ndarray, table: np.ndarray, layout: PageLayout, block_pages: int,
             block_tokens: int) -> np.ndarray:
  """numpy: the first 128 bytes of each partition's last tile's K span."""
  parts = -(-len(table) // block_pages)
  tiles_per_page = layout.page_tokens // block_tokens
  out = np.zeros((parts, CHECK_LINES * LINE), np.uint8)
  for p in range(parts):
    last_page = min((p + 1) * block_pages, len(table)) - 1
    start = (tiles_per_page - 1) * block_tokens * layout.k_row_bytes
    out[p] = pool[table[last_page], start:start + CHECK_LINES * LINE]
  return out.reshape(parts, CHECK_LINES, LINE)


def main(argv):
  del argv
  layout = probe_common.layout_from_flags()
  if layout.k_row_bytes % LINE or layout.v_row_bytes % LINE or layout.v_offset % LINE:
    raise SystemExit(f"rows and the V offset must be multiples of {LINE} bytes: {layout.describe()}")
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}; {layout.describe()}", flush=True)
  rows = []
  for ctx in (int(c) for c in FLAGS.contexts):
    n_pages = ctx // layout.page_tokens
    num_phys = n_pages + 8
    pool = jax.random.bits(jax.random.PRNGKey(ctx), (num_phys, layout.page_bytes), jnp.uint8)
    lines = pool.reshape(num_phys, layout.page_bytes // LINE, LINE)
    table_np = np.random.default_rng(ctx).permutation(num_phys)[:n_pages].astype(np.int32)
    table = jnp.asarray(table_np)
    nbytes = ctx * layout.token_bytes
    pool_np = None
    for bt in (int(b) for b in FLAGS.block_tokens):
      for stages in (int(s) for s in FLAGS.stages):
        smem = stages * bt * layout.token_bytes
        if layout.page_tokens % bt or smem > FLAGS.smem_limit:
          print(f"skip block_tokens={bt} stages={stages}: SMEM {smem} B > {FLAGS.smem_limit} "
                f"or {bt} does not divide {layout.page_tokens}", flush=True)
          continue
        fn = functools.partial(probe, lines, table, layout=layout, block_pages=FLAGS.block_pages,
                               block_tokens=bt, stages=stages, interpret=FLAGS.interpret)
        if pool_np is None:
          pool_np = np.asarray(pool)
        got = np.asarray(fn())
        if not np.array_equal(got, expected(pool_np, table_np, layout, FLAGS.block_pages, bt)):
          raise SystemExit(f"TMA probe copied the wrong bytes at {ctx} tokens, block_tokens={bt}, "
                           f"stages={stages}")
        iters = 2 if FLAGS.interpret else FLAGS.dispatch_iters
        t = time_calls(fn, iters, 1 if FLAGS.interpret else FLAGS.rounds)
        rows.append((ctx, bt, stages, smem, t * 1e6, nbytes / t / 1e9))
        print(f"tma context={ctx} block_tokens={bt} stages={stages} smem={smem} checked "
              f"us={t * 1e6:.1f} gbps={nbytes / t / 1e9:.0f}", flush=True)
  print(f"\n{'ctx':>7} {'BT':>4} {'stages':>6} {'SMEM B':>8} | {'us':>8} {'GB/s':>6}")
  for ctx, bt, stages, smem, us, gbps in rows:
    print(f"{ctx:>7} {bt:>4} {stages:>6} {smem:>8} | {us:8.1f} {gbps:6.0f}")


if __name__ == "__main__":
  app.run(main)
