"""TMA read ceiling of the page walk (Pallas Mosaic GPU), and the magic conversions feeding wgmma.

A Mosaic GPU kernel reads a key tile's K and V rows by TMA bulk copies into SMEM; this probe
measures that path alone: `--stages` tiles in flight, one CTA a logical partition of
`--block_pages` pages walking the page table in logical order. Nothing is computed: a tile is
waited for and its slot is refilled with the tile `stages` ahead (docs/DESIGN.md, the Mosaic
GPU decode kernel).

Pallas lowers no reshape of a GMEM ref for a TMA copy ("Non-indexing transforms on GMEM refs are
not implemented"), so the copies move the CONTIGUOUS all-heads span of a tile (the pool viewed as
[P, page_bytes / L, L] lines of `--line_bytes` L, boxes of <= 256 lines). The line width is the
box's inner dimension: narrow lines read much slower (docs/PERFORMANCE.md).

At the end each CTA copies the first max(128, L) bytes of its last tile's K span back to GMEM; the
script checks them against the page bytes (compiled and interpreted), so a copy of the wrong page
or offset fails the run.

`--work` adds consumers of the tiles, `--consumers` warpgroups a CTA (heads round robin), each
checked on the GPU against numpy, bit for bit:
  magic   the magic-number PTX conversion of the ggml quants as they lie
          (`mosaic_common.ggml_k_lhs`, `magic_ptx`): a lane loads 4-byte-aligned words of two
          ggml blocks, realigns the 2-byte-offset one with prmt, converts to f16 WGMMA-layout
          registers (head dims permuted) and feeds wgmma; unscaled.
  step    a decode step without the softmax: the scaled K conversion as the lhs of S^T = K Q^T
          and the scaled, transposed V conversion (`mosaic_common.ggml_vt_lhs`) as the lhs of
          O^T = V^T P^T, both wgmmas.

  python -m experiments.kernel_lab.probe_tma_reads --contexts=131072,262144 --stages=2,3,4 \
      --block_tokens=32,64 --line_bytes=16,128,256
  python -m experiments.kernel_lab.probe_tma_reads --work=magic,step --line_bytes=256 \
      --stages=1,2 --consumers=4,2 --contexts=131072,262144
  python -m experiments.kernel_lab.probe_tma_reads --interpret --contexts=512 --page_tokens=64 \
      --head_dim=64
"""

from __future__ import annotations

import functools
import time

import numpy as np
from absl import app, flags
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from experiments.kernel_lab import common
from kvjax_pallas import ggml_codec
from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import magic_ptx
from kvjax_pallas.span_attention import mosaic_common

FLAGS = flags.FLAGS
# consumers: the wgmma modes' warpgroups a CTA, heads round robin
common.define_flags(stages=("2", "4"), consumers=("1",))
flags.DEFINE_list("block_tokens", ["32", "64"], "keys a tile (all KV heads)")
flags.DEFINE_integer("smem_limit", 227 * 1024, "SMEM a CTA may use (bytes); larger configs skipped")
flags.DEFINE_list("line_bytes", ["16", "128", "256"],
                  "bytes a line of the pool view: the TMA box's inner dimension")
flags.DEFINE_list("work", ["copy"], "copy: TMA only; magic: TMA + the "
                  "magic-number PTX conversion of the ggml quants feeding wgmma (GPU only); "
                  "step: the scaled K and transposed V conversions feeding S^T = K Q^T and "
                  "O^T = V^T P^T (a decode step without the softmax, GPU only)")
flags.DEFINE_integer("magic_n", 16,
                     "magic / step modes: N of the wgmma rhs (the folded query rows)")

BOX = 256         # TMA box limit a dimension
WGMMA_TOKENS = 64  # the magic / step modes' tile: the WGMMA layout's 64 rows
CHECK_BYTES = 128  # at least this many bytes copied back a CTA


def _check_lines(line: int) -> int:
  return max(1, CHECK_BYTES // line)


def _copy_tile(lines_ref, phys, r, dst, bar, k_lines: int, v_lines: int, v_first: int):
  """Start the TMA copies of key tile r of page `phys` (its K span, then its V span, in boxes of
  <= BOX lines) into dst [k_lines + v_lines, L], all arriving on `bar`."""
  for first, n, dst0 in ((r * k_lines, k_lines, 0), (v_first + r * v_lines, v_lines, k_lines)):
    for c0 in range(0, n, BOX):
      c = min(BOX, n - c0)
      plgpu.copy_gmem_to_smem(lines_ref.at[phys, pl.ds(first + c0, c)],
                              dst.at[pl.ds(dst0 + c0, c)], bar)


def _probe_kernel(tab_ref, lines_ref, out_ref, buf, bars, *, block_pages: int, n_table: int,
                  tiles_per_page: int, k_lines: int, v_lines: int, v_first: int, stages: int,
                  check_lines: int):
  # tab_ref [T] i32; lines_ref [P, page_lines, L] u8; out_ref [parts, check_lines, L] u8
  # buf [stages, k_lines + v_lines, L] u8 SMEM; bars: `stages` barriers
  pp = lax.axis_index("p")
  page_lo = pp * block_pages
  n_tiles = (jnp.minimum(page_lo + block_pages, n_table) - page_lo) * tiles_per_page

  def issue(i, slot):
    _copy_tile(lines_ref, tab_ref[page_lo + i // tiles_per_page], i % tiles_per_page,
               buf.at[slot], bars.at[slot], k_lines, v_lines, v_first)

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
  plgpu.copy_smem_to_gmem(buf.at[last, pl.ds(0, check_lines)], out_ref.at[pp])
  plgpu.wait_smem_to_gmem(0)


def _consume_tiles(tab_ref, lines_ref, bufs, bars, frees, consume, carry, *, block_pages: int,
                   tiles_per_page: int, k_lines: int, v_lines: int, v_first: int, stages: int,
                   consumers: int):
  """The wgmma modes' pipeline: TMA copies of a partition's tiles into `stages` slots, each tile
  consumed by every warpgroup (`consume(slot, carry) -> carry`). Every partition has
  block_pages full pages and a multiple of `stages` tiles (checked by the callers), so the slots
  are static: round j consumes tiles j * stages + s in slot s. Warpgroup 0 also issues the
  copies, a slot's refill once every warpgroup has arrived on its "consumed" barrier."""
  wg = lax.axis_index("wg") if consumers > 1 else 0
  page_lo = lax.axis_index("p") * block_pages
  n_tiles = block_pages * tiles_per_page

  def issue(i, slot):
    _copy_tile(lines_ref, tab_ref[page_lo + i // tiles_per_page], i % tiles_per_page,
               bufs[slot], bars[slot], k_lines, v_lines, v_first)

  def by_issuer(fn):
    if consumers == 1:
      fn()
    else:
      pl.when(wg == 0)(fn)

  @by_issuer
  def _():
    for s in range(stages):
      issue(s, s)

  def body(j, carry):
    for s in range(stages):
      i = j * stages + s
      plgpu.barrier_wait(bars[s])
      carry = consume(s, carry)
      if consumers > 1:
        plgpu.barrier_arrive(frees[s])

      def refill(i=i, s=s):
        if consumers > 1:
          plgpu.barrier_wait(frees[s])
        issue(i + stages, s)

      by_issuer(lambda refill=refill, i=i: pl.when(i + stages < n_tiles)(refill))
    return carry

  return lax.fori_loop(0, n_tiles // stages, body, carry)


def _magic_probe_kernel(tab_ref, lines_ref, rhs_ref, out_ref, *scratch, layout: PageLayout,
                        block_pages: int, tiles_per_page: int, k_lines: int, v_lines: int,
                        v_first: int, stages: int, consumers: int):
  # tab_ref [T] i32; lines_ref [P, page_lines, L] u8; rhs_ref [2, D, N] f16 (K's and V's rhs rows
  # in `magic_ptx.ggml_dims` order) -> out_ref [parts, G, 64, N] f32: per head, the float32 sum
  # over the partition's tiles of K . W_K + (V - 8) . W_V (unscaled quants).
  # scratch: `stages` buffers [k_lines + v_lines, L] u8, `stages` TMA barriers, `stages` "slot
  # consumed" barriers, rhs SMEM [2, D, N] f16 (swizzled) and its barrier.
  bufs, bars = scratch[:stages], scratch[stages:2 * stages]
  frees, (rhs_s, rhs_bar) = scratch[2 * stages:3 * stages], scratch[3 * stages:]
  hpw = layout.num_kv_heads // consumers
  wg = lax.axis_index("wg") if consumers > 1 else 0
  pp = lax.axis_index("p")
  line = lines_ref.shape[-1]
  conv = [(mosaic_common.ggml_k_lhs(layout.k_type, layout, 0, consumers, j),
           mosaic_common.ggml_k_lhs(layout.v_type, layout, k_lines * line, consumers, j))
          for j in range(hpw)]

  def tile_mmas(accs, buf):
    for j in range(hpw):
      plgpu.wgmma(accs[j], conv[j][0](buf), rhs_s.at[0])
      plgpu.wgmma(accs[j], conv[j][1](buf), rhs_s.at[1])

  def finish(accs):
    for j in range(hpw):
      out_ref[pp, wg + j * consumers] = accs[j][...]

  _wgmma_tiles(tab_ref, lines_ref, bufs, bars, frees, [(rhs_ref, rhs_s)], rhs_bar, tile_mmas,
               finish, n_accs=hpw, n=rhs_ref.shape[-1], block_pages=block_pages,
               tiles_per_page=tiles_per_page, k_lines=k_lines, v_lines=v_lines, v_first=v_first,
               stages=stages, consumers=consumers)


def _wgmma_tiles(tab_ref, lines_ref, bufs, bars, frees, copies, in_bar, tile_mmas, finish, *,
                 n_accs: int, n: int, **pipeline):
  """The magic / step kernels' frame: copy the rhs operands in (`copies`: (GMEM, SMEM) pairs, on
  in_bar, by warpgroup 0), then `_consume_tiles` with `tile_mmas(accs, buf)` issuing a tile's
  wgmmas into n_accs [64, n] float32 accumulators (waited for before the slot is refilled), then
  `finish(accs)`."""
  def copy_in():
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst, in_bar)

  if pipeline["consumers"] == 1:
    copy_in()
  else:
    pl.when(lax.axis_index("wg") == 0)(copy_in)
  plgpu.barrier_wait(in_bar)

  def run(*accs):
    def consume(s, carry):
      tile_mmas(accs, bufs[s])
      plgpu.wgmma_wait(0)             # the slot's bytes are read
      return carry

    _consume_tiles(tab_ref, lines_ref, bufs, bars, frees, consume, jnp.int32(0), **pipeline)
    finish(accs)

  pl.run_scoped(run, *[plgpu.ACC((WGMMA_TOKENS, n), jnp.float32)] * n_accs)


def _step_probe_kernel(tab_ref, lines_ref, qt_ref, pt_ref, s_ref, o_ref, *scratch,
                       layout: PageLayout, block_pages: int, tiles_per_page: int, k_lines: int,
                       v_lines: int, v_first: int, stages: int, consumers: int):
  # tab_ref [T] i32; lines_ref [P, page_lines, L] u8; qt_ref [D, N] f16 (Q^T, rows in
  # `magic_ptx.ggml_dims` order, every head's); pt_ref [64, N] f16 (a fixed P^T)
  # -> s_ref [parts, G, 64, N] f32 (sum over the partition's tiles of S^T = K Q^T), o_ref
  # [parts, G, D, N] f32 (sum of O^T = V^T P^T, rows in `magic_ptx.vt_dims` order); K and V
  # dequantized (scaled, f16) by the magic conversions. The softmax is left out: a floor.
  # scratch: `stages` buffers, TMA barriers and "consumed" barriers; qt, pt SMEM; a barrier.
  bufs, bars = scratch[:stages], scratch[stages:2 * stages]
  frees, (qt_s, pt_s, in_bar) = scratch[2 * stages:3 * stages], scratch[3 * stages:]
  hpw = layout.num_kv_heads // consumers
  wg = lax.axis_index("wg") if consumers > 1 else 0
  pp = lax.axis_index("p")
  line = lines_ref.shape[-1]

  conv = [(mosaic_common.ggml_k_lhs(layout.k_type, layout, 0, consumers, j, scaled=True),
           mosaic_common.ggml_vt_lhs(layout, k_lines * line, consumers, j)) for j in range(hpw)]

  def tile_mmas(accs, buf):
    for j in range(hpw):
      plgpu.wgmma(accs[5 * j], conv[j][0](buf), qt_s)
      for mb, vt in enumerate(conv[j][1](buf)):
        plgpu.wgmma(accs[5 * j + 1 + mb], vt, pt_s)

  def finish(accs):
    for j in range(hpw):
      h = wg + j * consumers
      s_ref[pp, h] = accs[5 * j][...]
      for mb in range(4):
        o_ref[pp, h, pl.ds(64 * mb, 64)] = accs[5 * j + 1 + mb][...]

  _wgmma_tiles(tab_ref, lines_ref, bufs, bars, frees, [(qt_ref, qt_s), (pt_ref, pt_s)], in_bar,
               tile_mmas, finish, n_accs=5 * hpw, n=qt_ref.shape[-1], block_pages=block_pages,
               tiles_per_page=tiles_per_page, k_lines=k_lines, v_lines=v_lines, v_first=v_first,
               stages=stages, consumers=consumers)


def _wgmma_geometry(lines, table, layout: PageLayout, block_pages: int, stages: int,
                    consumers: int):
  """Checks shared by the wgmma modes; returns (parts, k_lines, v_lines, tiles a page)."""
  line = lines.shape[-1]
  bt = WGMMA_TOKENS
  if not line_fits(layout, bt, line):
    raise ValueError(f"{line}-byte lines do not tile a {bt}-token tile of {layout.describe()}")
  if layout.num_kv_heads % consumers:
    raise ValueError(f"{consumers} consumer warpgroups do not divide {layout.num_kv_heads} heads")
  n_table = table.shape[0]
  tiles_per_page = layout.page_tokens // bt
  if n_table % block_pages or (block_pages * tiles_per_page) % stages:
    raise ValueError(f"the wgmma probes need whole partitions of whole stages: {n_table} pages "
                     f"in partitions of {block_pages}, {block_pages * tiles_per_page} tiles a "
                     f"partition for {stages} stages")
  return (n_table // block_pages, bt * layout.k_row_bytes // line, bt * layout.v_row_bytes // line,
          tiles_per_page)


def _wgmma_mode_call(kernel, lines, table, *, layout: PageLayout, block_pages: int, stages: int,
                     consumers: int, out_type, extra_scratch, **kernel_kw):
  """The pallas call of a wgmma mode (magic, step): the pipeline's geometry checks,
  `stages` tile buffers, TMA barriers and "consumed" barriers, then `extra_scratch`; Lane
  semantics, `consumers` warpgroups. Returns the call, to be applied to (table, lines, ...)."""
  _, k_lines, v_lines, tiles_per_page = _wgmma_geometry(lines, table, layout, block_pages,
                                                        stages, consumers)
  line = lines.shape[-1]
  kern = functools.partial(
      kernel, layout=layout, block_pages=block_pages, tiles_per_page=tiles_per_page,
      k_lines=k_lines, v_lines=v_lines, v_first=layout.v_offset // line, stages=stages,
      consumers=consumers, **kernel_kw)
  kw = dict(num_threads=consumers, thread_name="wg") if consumers > 1 else {}
  return plgpu.kernel(
      kern, out_type=out_type,
      scratch_types=([plgpu.SMEM((k_lines + v_lines, line), jnp.uint8)] * stages
                     + [plgpu.Barrier(num_arrivals=_copies(k_lines) + _copies(v_lines))] * stages
                     + [plgpu.Barrier(num_arrivals=consumers)] * stages + list(extra_scratch)),
      grid=(len(table) // block_pages,), grid_names=("p",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **kw)


def _rhs_smem(shape):
  """SMEM for a wgmma rhs [..., K, N] f16: N * 2-byte swizzled rows (at most 128 bytes)."""
  sw = min(128, 2 * shape[-1])
  return plgpu.SMEM(shape, jnp.float16,
                    transforms=(plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw)))


@functools.partial(jax.jit, static_argnames=("layout", "block_pages", "stages", "consumers"))
def magic_probe(lines, table, rhs, *, layout: PageLayout, block_pages: int, stages: int,
                consumers: int = 1):
  """TMA reads + the magic-number conversion of the ggml pages as they are
  (`mosaic_common.ggml_k_lhs`, PTX through `plgpu.inline_mgpu`: GPU only) feeding wgmma: each warpgroup's heads' K and V quants
  of each 64-token tile, as the lhs against rhs [2, D, N] f16 (rows in `magic_ptx.ggml_dims`
  order), accumulated in float32. The scales are read (they share the words) but not applied.
  lines [P, page_bytes / L, L] u8, table [T] i32 -> [parts, G, 64, N] f32."""
  if (layout.k_type, layout.v_type, layout.head_dim) != ("q8_0", "q4_0", 256):
    raise ValueError(f"the magic probe takes Q8_0 K / Q4_0 V pages of head dim 256, not "
                     f"{layout.describe()}")
  parts = len(table) // block_pages
  call = _wgmma_mode_call(
      _magic_probe_kernel, lines, table, layout=layout, block_pages=block_pages, stages=stages,
      consumers=consumers,
      out_type=jax.ShapeDtypeStruct((parts, layout.num_kv_heads, WGMMA_TOKENS, rhs.shape[-1]),
                                    jnp.float32),
      extra_scratch=[_rhs_smem(rhs.shape), plgpu.Barrier(num_arrivals=1)])
  return call(table, lines, rhs)


def expected_magic_sums(pool: np.ndarray, table: np.ndarray, layout: PageLayout,
                        block_pages: int, w) -> np.ndarray:
  """numpy: [parts, G, 64, N] of `magic_probe`: per head, sum over the partition's tiles of the
  unscaled quants (Q8_0 int8, Q4_0 nibble - 8, by head dim) times W (exact integers)."""
  bt = WGMMA_TOKENS
  parts = len(table) // block_pages
  g, d, pt = layout.num_kv_heads, layout.head_dim, layout.page_tokens
  pages = pool[table]                                               # [T, page_bytes]
  k = pages[:, :layout.k_plane_bytes].reshape(len(table), pt, g, d // 32, 34)
  kq = k[..., 2:].view(np.int8).astype(np.int64).reshape(len(table), pt, g, d)
  v = pages[:, layout.v_offset:layout.v_offset + layout.v_plane_bytes].reshape(
      len(table), pt, g, d // 32, 18)[..., 2:].astype(np.int64)
  vq = np.concatenate([v & 15, v >> 4], axis=-1).reshape(len(table), pt, g, d) - 8
  x = kq @ w[0] + vq @ w[1]                                         # [T, pt, G, N]
  x = x.reshape(parts, block_pages * pt // bt, bt, g, -1).sum(axis=1)
  return x.transpose(0, 2, 1, 3).astype(np.float64)


@functools.partial(jax.jit, static_argnames=("layout", "block_pages", "stages", "consumers"))
def step_probe(lines, table, qt, pt, *, layout: PageLayout, block_pages: int, stages: int,
               consumers: int = 1):
  """TMA reads + the scaled magic conversions of K (as the lhs of S^T = K Q^T) and of V (as the
  transposed lhs of O^T = V^T P^T) + both wgmmas, for every head of every 64-token tile: a decode
  step without the softmax (GPU only). lines [P, page_bytes / L, L] u8, table [T] i32, qt [D, N]
  f16, pt [64, N] f16 -> (S^T sums [parts, G, 64, N], O^T sums [parts, G, D, N]) f32."""
  if (layout.k_type, layout.v_type, layout.head_dim) != ("q8_0", "q4_0", 256):
    raise ValueError(f"the step probe takes Q8_0 K / Q4_0 V pages of head dim 256, not "
                     f"{layout.describe()}")
  parts = len(table) // block_pages
  g, d, n = layout.num_kv_heads, layout.head_dim, qt.shape[-1]
  call = _wgmma_mode_call(
      _step_probe_kernel, lines, table, layout=layout, block_pages=block_pages, stages=stages,
      consumers=consumers,
      out_type=(jax.ShapeDtypeStruct((parts, g, WGMMA_TOKENS, n), jnp.float32),
                jax.ShapeDtypeStruct((parts, g, d, n), jnp.float32)),
      extra_scratch=[_rhs_smem(qt.shape), _rhs_smem(pt.shape), plgpu.Barrier(num_arrivals=2)])
  return call(table, lines, qt, pt)


def step_inputs(head_dim: int, n: int):
  """(W [D, N], P^T [64, N] small integers (int64), qt = W in `magic_ptx.ggml_dims` row order
  and pt, f16) for the step probe's check."""
  w = magic_ptx.check_weights(head_dim, n)[0]
  p = (np.arange(WGMMA_TOKENS)[:, None] * 3 + np.arange(n)) % 4 - 1
  return (w, p.astype(np.int64), w[magic_ptx.ggml_dims("q8_0", head_dim)].astype(np.float16),
          p.astype(np.float16))


def expected_step_sums(pool: np.ndarray, table: np.ndarray, layout: PageLayout,
                       block_pages: int, w, p):
  """numpy: (S^T sums [parts, G, 64, N], O^T sums [parts, G, D, N], rows in
  `magic_ptx.vt_dims` order) of `step_probe`, from `ggml_codec`'s decode (exact on
  `common.exact_pages` pages: every product and sum is a small multiple of 2^-6)."""
  bt = WGMMA_TOKENS
  parts = len(table) // block_pages
  g, d, pt = layout.num_kv_heads, layout.head_dim, layout.page_tokens
  pages = jnp.asarray(pool[table])                                  # [T, page_bytes]
  kr = pages[:, :layout.k_plane_bytes].reshape(len(table) * pt, layout.k_row_bytes)
  vr = pages[:, layout.v_offset:layout.v_offset + layout.v_plane_bytes].reshape(
      len(table) * pt, layout.v_row_bytes)
  k = np.asarray(ggml_codec.decode_rows(kr, layout.k_type, g), np.float64).reshape(
      parts, block_pages * pt // bt, bt, g, d)
  v = np.asarray(ggml_codec.decode_rows(vr, layout.v_type, g), np.float64).reshape(
      parts, block_pages * pt // bt, bt, g, d)
  s = np.einsum("ptrgd,dn->pgrn", k, w.astype(np.float64))
  o = np.einsum("ptrgd,rn->pgdn", v, p.astype(np.float64))[:, :, magic_ptx.vt_dims(d)]
  return s, o


def _copies(n_lines: int) -> int:
  return -(-n_lines // BOX)


def as_lines(pool, line: int):
  """pool [P, page_bytes] -> [P, lines, line]: each page's bytes in lines of `line` bytes, the
  page padded with zeros to whole lines (pages are whole K rows, not always whole lines)."""
  pad = -pool.shape[1] % line
  if pad:
    pool = jnp.pad(pool, ((0, 0), (0, pad)))
  return pool.reshape(pool.shape[0], -1, line)


def line_fits(layout: PageLayout, block_tokens: int, line: int) -> bool:
  """Whether a tile's K and V spans and the V plane's offset are whole lines of `line` bytes."""
  return not (block_tokens * layout.k_row_bytes % line or block_tokens * layout.v_row_bytes % line
              or layout.v_offset % line or line > BOX)


@functools.partial(jax.jit, static_argnames=("layout", "block_pages", "block_tokens", "stages",
                                             "interpret"))
def probe(lines, table, *, layout: PageLayout, block_pages: int, block_tokens: int, stages: int,
          interpret: bool):
  """lines [P, page_bytes / L, L] u8, table [T] i32 -> [parts, check_lines, L] u8 (each CTA's
  check)."""
  line = lines.shape[-1]
  if not line_fits(layout, block_tokens, line):
    raise ValueError(f"{line}-byte lines do not tile a {block_tokens}-token tile of "
                     f"{layout.describe()}")
  n_table = table.shape[0]
  parts = -(-n_table // block_pages)
  k_lines = block_tokens * layout.k_row_bytes // line
  v_lines = block_tokens * layout.v_row_bytes // line
  check_lines = _check_lines(line)
  kern = functools.partial(
      _probe_kernel, block_pages=block_pages, n_table=n_table,
      tiles_per_page=layout.page_tokens // block_tokens, k_lines=k_lines, v_lines=v_lines,
      v_first=layout.v_offset // line, stages=stages, check_lines=check_lines)
  kw = {}
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret import params as _ip  # pylint: disable=g-import-not-at-top
    kw["interpret"] = _ip.InterpretGPUParams()
  call = plgpu.kernel(
      kern,
      out_type=jax.ShapeDtypeStruct((parts, check_lines, line), jnp.uint8),
      scratch_types=[plgpu.SMEM((stages, k_lines + v_lines, line), jnp.uint8),
                     plgpu.Barrier(num_arrivals=_copies(k_lines) + _copies(v_lines),
                                   num_barriers=stages)],
      grid=(parts,), grid_names=("p",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
      **kw)
  return call(table, lines)


def expected(pool: np.ndarray, table: np.ndarray, layout: PageLayout, block_pages: int,
             block_tokens: int, line: int) -> np.ndarray:
  """numpy: the first check_lines lines of each partition's last tile's K span."""
  check = _check_lines(line) * line
  parts = -(-len(table) // block_pages)
  tiles_per_page = layout.page_tokens // block_tokens
  out = np.zeros((parts, check), np.uint8)
  for p in range(parts):
    last_page = min((p + 1) * block_pages, len(table)) - 1
    start = (tiles_per_page - 1) * block_tokens * layout.k_row_bytes
    out[p] = pool[table[last_page], start:start + check]
  return out.reshape(parts, -1, line)


def main(argv):
  del argv
  unknown = set(FLAGS.work) - {"copy", "magic", "step"}
  if unknown:
    raise app.UsageError(f"--work: unknown modes {sorted(unknown)}; choose copy, magic, step")
  layout = common.layout_from_flags()
  rows = []
  for ctx, n_pages, num_phys, nbytes in common.contexts(layout):
    pool_np, table_np = common.exact_pool(ctx, layout, num_phys, n_pages)
    pool = jnp.asarray(pool_np)
    table = jnp.asarray(table_np)
    rand_pool, rand_lines = None, {}
    if "magic" in FLAGS.work:       # full-range quants (garbage scales: the magic mode skips them)
      rand_pool = np.random.default_rng(ctx + 1).integers(0, 256, pool_np.shape, np.uint8)
      rand_lines = {int(b): as_lines(jnp.asarray(rand_pool), int(b)) for b in FLAGS.line_bytes}
    for line in (int(b) for b in FLAGS.line_bytes):
      lines = as_lines(pool, line)
      for work in FLAGS.work:
        if work == "copy":
          variants = [(int(b), int(st), 1) for b in FLAGS.block_tokens
                      for st in FLAGS.stages]
        else:
          variants = [(WGMMA_TOKENS, int(st), int(c)) for st in FLAGS.stages
                      for c in FLAGS.consumers]
        for bt, stages, consumers in variants:
          smem = stages * bt * layout.token_bytes + {
              "magic": 2 * layout.head_dim * FLAGS.magic_n * 2,
              "step": (layout.head_dim + bt) * FLAGS.magic_n * 2}.get(work, 0)
          name = f"{work} line={line} block_tokens={bt} stages={stages} consumers={consumers}"
          if layout.page_tokens % bt or smem > FLAGS.smem_limit or not line_fits(layout, bt, line):
            print(f"skip {name}: SMEM {smem} B > {FLAGS.smem_limit}, {bt} does not divide "
                  f"{layout.page_tokens}, or {line}-byte lines do not tile the tile", flush=True)
            continue
          if work == "copy":
            fn = functools.partial(probe, lines, table, layout=layout,
                                   block_pages=FLAGS.block_pages, block_tokens=bt,
                                   stages=stages, interpret=FLAGS.interpret)
            t = time.perf_counter()
            got = np.asarray(fn())
            checked_s = time.perf_counter() - t
            if not np.array_equal(got, expected(pool_np, table_np, layout, FLAGS.block_pages, bt,
                                                line)):
              raise SystemExit(f"TMA probe copied the wrong bytes at {ctx} tokens, {name}")
          elif work == "step":
            w, p, qt, pt = step_inputs(layout.head_dim, FLAGS.magic_n)
            fn = functools.partial(step_probe, lines, table, jnp.asarray(qt), jnp.asarray(pt),
                                   layout=layout, block_pages=FLAGS.block_pages, stages=stages,
                                   consumers=consumers)
            t = time.perf_counter()
            got = [np.asarray(x) for x in fn()]
            checked_s = time.perf_counter() - t
            want = expected_step_sums(pool_np, table_np, layout, FLAGS.block_pages, w, p)
            if not all(np.array_equal(a, b) for a, b in zip(got, want)):
              print(f"FAILED step check at {ctx} tokens, {name}: "
                    f"{[float(np.mean(a == b)) for a, b in zip(got, want)]} of S / O equal",
                    flush=True)
              continue
            fn = lambda fn=fn: fn()[0]
          elif work == "magic":
            w, rhs = magic_ptx.check_operands("ggml", layout.head_dim, FLAGS.magic_n)
            fn = functools.partial(magic_probe, rand_lines[line], table, jnp.asarray(rhs),
                                   layout=layout, block_pages=FLAGS.block_pages, stages=stages,
                                   consumers=consumers)
            t = time.perf_counter()
            got = np.asarray(fn())
            checked_s = time.perf_counter() - t
            want = expected_magic_sums(rand_pool, table_np, layout, FLAGS.block_pages, w)
            if not np.array_equal(got, want):
              print(f"FAILED magic check at {ctx} tokens, {name}: "
                    f"{float(np.mean(got == want)):.1%} of the sums equal", flush=True)
              continue
          common.timed(fn, nbytes, f"tma context={ctx} {name} smem={smem} checked",
                       (ctx, work, line, bt, stages, consumers, smem), rows, checked_s)
  common.print_table(("ctx", "work", "line", "BT", "stages", "WGs", "SMEM B"), rows)


if __name__ == "__main__":
  app.run(main)
