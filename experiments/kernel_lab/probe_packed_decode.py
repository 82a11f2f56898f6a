"""Decode ceiling of a REPACKED device page format (Pallas Mosaic GPU): a measurement for the
decision in docs/DESIGN.md ("The decode gap, measured"), not a kernel of the package.

Each page's K quants as an int8 [heads, tokens, dims] plane, its V nibbles as a byte [heads,
tokens, dims / 2] plane (byte j of block b: value j low, value 16 + j high, as in ggml), and the
f16 scales as [heads, tokens, blocks] planes; 1664 bytes a token, as the ggml page. TMA copies
[64 tokens, dims] tiles straight into swizzled SMEM tiles. Variants (`--variant`):

  sum    one warpgroup loads a tile and converts it to f16 (`astype`, Warpgroup semantics) and
         adds it into f16 sums (Mosaic converts int8 -> f16 with one I2F a value).
  wgmma  `--consumers` warpgroups, each its own heads and pipeline, convert int8 -> bf16 with
         Mosaic's PRMT upcast and feed the tiles to wgmma as the lhs (ones as the rhs, float32
         sums); V's nibbles as two lhs tiles (16 (m - 8) and n).
  magic  the same with the PTX magic-number conversion (`magic_ptx`, through inline_mgpu; GPU
         only) against a permuted weight rhs (`magic_ptx.packed_dims`).

The scale multiplies are not done here (the scale planes are read and summed). Every check is
exact: f16 sums on `common.exact_pages` pages (sum), integer sums in float32 on full-range
quants (wgmma, magic), so the GPU's sums are compared with numpy bit for bit. The same magic
conversion on the ggml pages as they are (`probe_tma_reads --work=magic`) measured about as
fast as this format (docs/PERFORMANCE.md), so the page format stays ggml's (docs/DESIGN.md).

  python -m experiments.kernel_lab.probe_packed_decode --contexts=131072,262144 --stages=1,2 \
      --consumers=2,4
  python -m experiments.kernel_lab.probe_packed_decode --interpret --variant=sum,wgmma \
      --contexts=512 --page_tokens=128 --head_dim=64 --kv_heads=2 --block_pages=2 --consumers=1,2
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
from kvjax_pallas.page_layout import PageLayout
from kvjax_pallas.span_attention import magic_ptx

FLAGS = flags.FLAGS
common.define_flags(stages=("1", "2"), consumers=("1", "2", "4"))
flags.DEFINE_list("variant", ["sum", "wgmma", "magic"], "sum: one warpgroup converts int8 -> f16 "
                  "and adds into f16 sums; wgmma: `--consumers` warpgroups "
                  "convert int8 -> bf16 (Mosaic's upcast) and feed wgmma (ones as the rhs, "
                  "float32 sums); magic: the same with the PTX magic-number conversion "
                  "(`_magic_lhs`, GPU only) against a permuted weight rhs")
flags.DEFINE_integer("wgmma_n", 16, "wgmma / magic variants: N of the rhs (the folded query rows)")

TILE = 64        # tokens a tile: the WGMMA layout's 64 rows
FOLD = 64        # columns of the f16 sums (a tile's columns are added 64 at a time)
BLOCK = 32       # values a ggml block


def repack(pool: np.ndarray, layout: PageLayout):
  """ggml Q8_0 K / Q4_0 V pages [P, page_bytes] -> the packed planes (numpy): kq int8
  [P, G, T, D], vq uint8 [P, G, T, D / 2], ks / vs f16 [P, G, T, D / 32]."""
  if (layout.k_type, layout.v_type) != ("q8_0", "q4_0"):
    raise ValueError(f"the packed probe takes Q8_0 K / Q4_0 V pages, not {layout.describe()}")
  p, g, t, d = len(pool), layout.num_kv_heads, layout.page_tokens, layout.head_dim
  nb = d // BLOCK
  k = pool[:, :layout.k_plane_bytes].reshape(p, t, g, nb, 34)
  v = pool[:, layout.v_offset:layout.v_offset + layout.v_plane_bytes].reshape(p, t, g, nb, 18)
  kq = np.ascontiguousarray(k[..., 2:].view(np.int8).reshape(p, t, g, d).transpose(0, 2, 1, 3))
  vq = np.ascontiguousarray(v[..., 2:].reshape(p, t, g, d // 2).transpose(0, 2, 1, 3))
  ks, vs = (np.ascontiguousarray(x[..., :2]).view(np.float16)[..., 0].transpose(0, 2, 1, 3).copy()
            for x in (k, v))
  return kq, vq, ks, vs


def _packed_kernel(tab_ref, kq_ref, vq_ref, ks_ref, vs_ref, ok_ref, ov_ref, os_ref, *scratch,
                   heads: int, block_pages: int, tiles_per_page: int, stages: int):
  # tab [T] i32; kq [P, G, pt, D] i8; vq [P, G, pt, D/2] u8; ks, vs [P, G, pt, D/32] f16
  # -> ok [parts, 64, Fk] f16, ov [parts, 64, Fv] f16, os [parts, 64, D/32] f16 (the sums)
  # scratch: per stage K [G, 64, D] i8, V [G, 64, D/2] u8, K / V scales [G, 64, D/32] f16 and a
  # barrier; then the three sums' SMEM. Every partition has block_pages full pages and a multiple
  # of `stages` tiles (checked by the caller), so the slots are static.
  kb, vb = scratch[:stages], scratch[stages:2 * stages]
  ksb, vsb = scratch[2 * stages:3 * stages], scratch[3 * stages:4 * stages]
  bars = scratch[4 * stages:5 * stages]
  ok_s, ov_s, os_s = scratch[5 * stages:]
  pp = lax.axis_index("p")
  n_tiles = block_pages * tiles_per_page

  def issue(i, s):
    phys = tab_ref[pp * block_pages + i // tiles_per_page]
    rows = pl.ds((i % tiles_per_page) * TILE, TILE)
    for h in range(heads):
      for src, dst in ((kq_ref, kb[s]), (vq_ref, vb[s]), (ks_ref, ksb[s]), (vs_ref, vsb[s])):
        plgpu.copy_gmem_to_smem(src.at[phys, h, rows], dst.at[h], bars[s])

  for s in range(stages):
    issue(s, s)

  def fold(acc, x):
    for c in range(0, x.shape[1], acc.shape[1]):
      acc = acc + x[:, c:c + acc.shape[1]]
    return acc

  def body(j, sums):
    sk, sv, ss = sums
    for s in range(stages):
      i = j * stages + s
      plgpu.barrier_wait(bars[s])
      for h in range(heads):
        sk = fold(sk, kb[s][h].astype(jnp.float16))
        v = vb[s][h]                  # 8-bit values allow bitwise ops only: mask, then convert
        lo = (v & jnp.uint8(0x0F)).astype(jnp.float16) - jnp.float16(8)
        hi = (v & jnp.uint8(0xF0)).astype(jnp.float16) * jnp.float16(1 / 16) - jnp.float16(8)
        sv = fold(sv, lo + hi)
        ss = ss + ksb[s][h] + vsb[s][h]
      pl.when(i + stages < n_tiles)(functools.partial(issue, i + stages, s))
    return sk, sv, ss

  init = tuple(jnp.zeros(ref.shape, jnp.float16) for ref in (ok_s, ov_s, os_s))
  sums = lax.fori_loop(0, n_tiles // stages, body, init)
  for ref, x in zip((ok_s, ov_s, os_s), sums):
    ref[...] = x
  plgpu.commit_smem()
  for ref, out in ((ok_s, ok_ref), (ov_s, ov_ref), (os_s, os_ref)):
    plgpu.copy_smem_to_gmem(ref, out.at[pp])
  plgpu.wait_smem_to_gmem(0)


def _wgmma_kernel(tab_ref, kq_ref, vq_ref, ks_ref, vs_ref, rhs_ref, okv_ref, os_ref,
                  kb, vb, ksb, vsb, rhs_s, bars, rhs_bar, *lhs_s,
                  heads: int, consumers: int, block_pages: int, tiles_per_page: int,
                  stages: int, convert: str):
  # tab [T] i32; kq [P, G, pt, D] i8; vq [P, G, pt, D/2] i8 (the nibble bytes); ks, vs
  # [P, G, pt, D/32] f16; rhs [2, D, N] (K's, V's) -> okv [parts, G, 64, N] f32 (the wgmma
  # sums of the K values and the V nibbles, one accumulator a head), os [parts, G, 64, D/32] f16
  # (the scale sums).
  # Scratch, per consumer warpgroup w (heads w, w + consumers, ...: hpw of them): kb [stages, C,
  # hpw, 64, D] i8, vb [stages, C, hpw, 64, D/2] i8, ksb / vsb [stages, C, hpw, 64, D/32] f16,
  # bars [stages x C] (its own copies), rhs_s [2, D, N] + rhs_bar.
  # convert "mosaic": Mosaic's int8 -> bf16 upcast (`astype`), V's low and high nibbles as two
  # [64, D/2] lhs tiles against rhs rows [0, D/2) and [D/2, D); "magic": `_magic_lhs` (f16, the
  # head dims permuted as `magic_ptx.packed_dims`, which the rhs rows must follow).
  # [C, hpw, 64, D/32] f16. Every warpgroup runs its own pipeline over its own heads.
  # lhs_s (interpreter only: its wgmma takes no register lhs) [C, 64, D] bf16 stages the lhs.
  hpw = heads // consumers
  wg = lax.axis_index("wg") if consumers > 1 else 0
  pp = lax.axis_index("p")
  n_tiles = block_pages * tiles_per_page
  d = kq_ref.shape[-1]

  def lhs(x):
    if not lhs_s:
      return x
    dst = lhs_s[0].at[wg, :, pl.ds(0, x.shape[1])]
    dst[...] = x
    return dst

  pl.when(wg == 0)(lambda: plgpu.copy_gmem_to_smem(rhs_ref, rhs_s, rhs_bar))

  def issue(i, s):
    phys = tab_ref[pp * block_pages + i // tiles_per_page]
    rows = pl.ds((i % tiles_per_page) * TILE, TILE)
    for j in range(hpw):
      h = wg + j * consumers
      for src, dst in ((kq_ref, kb), (vq_ref, vb), (ks_ref, ksb), (vs_ref, vsb)):
        plgpu.copy_gmem_to_smem(src.at[phys, h, rows], dst.at[s, wg, j],
                                bars.at[s * consumers + wg])

  for s in range(stages):
    issue(s, s)
  plgpu.barrier_wait(rhs_bar)
  if convert == "magic":
    tf = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
    conv_k, conv_v = _magic_lhs("q8_0", d, tf), _magic_lhs("q4_0", d // 2, tf)

  def run(*accs):

    def body(jj, ss):
      for s in range(stages):
        i = jj * stages + s
        plgpu.barrier_wait(bars.at[s * consumers + wg])
        for j in range(hpw):
          if convert == "magic":
            plgpu.wgmma(accs[j], conv_k(kb.at[s, wg, j]), rhs_s.at[0])
            plgpu.wgmma(accs[j], conv_v(vb.at[s, wg, j]), rhs_s.at[1])
          else:
            k = kb[s, wg, j].astype(jnp.bfloat16)               # signed int8 -> bf16, exact
            plgpu.wgmma(accs[j], lhs(k), rhs_s.at[0])
            v = vb[s, wg, j]                                    # low nibble n, high nibble m
            lo = (v & jnp.int8(0x0F)).astype(jnp.bfloat16)       # n
            hi = ((v & jnp.int8(-16)) ^ jnp.int8(-128)).astype(jnp.bfloat16)   # 16 (m - 8)
            plgpu.wgmma(accs[j], lhs(lo), rhs_s.at[1, pl.ds(0, d // 2)])
            plgpu.wgmma(accs[j], lhs(hi), rhs_s.at[1, pl.ds(d // 2, d // 2)])
          ss = ss[:j] + (ss[j] + ksb[s, wg, j] + vsb[s, wg, j],) + ss[j + 1:]
        plgpu.wgmma_wait(0)        # the slot's int8 tiles are read: refill it
        pl.when(i + stages < n_tiles)(functools.partial(issue, i + stages, s))
      return ss

    nb = d // BLOCK
    init = tuple(jnp.zeros((TILE, nb), jnp.float16) for _ in range(hpw))
    ss = lax.fori_loop(0, n_tiles // stages, body, init)
    for j in range(hpw):        # straight from registers to GMEM (no SMEM left at 2 stages)
      h = wg + j * consumers
      okv_ref[pp, h] = accs[j][...]
      os_ref[pp, h] = ss[j]

  n = rhs_ref.shape[2]
  pl.run_scoped(run, *[plgpu.ACC((TILE, n), jnp.float32)] * hpw)


def smem_bytes(heads: int, head_dim: int, stages: int) -> int:
  """SMEM a CTA: `stages` tiles of every head's planes plus the three sums."""
  tile = heads * TILE * (head_dim + head_dim // 2 + 2 * 2 * (head_dim // BLOCK))
  sums = TILE * 2 * (min(FOLD, head_dim) + min(FOLD, head_dim // 2) + head_dim // BLOCK)
  return stages * tile + sums


@functools.partial(jax.jit, static_argnames=("block_pages", "stages", "interpret"))
def packed_probe(kq, vq, ks, vs, table, *, block_pages: int, stages: int, interpret: bool):
  """kq [P, G, pt, D] i8, vq [P, G, pt, D/2] u8, ks / vs [P, G, pt, D/32] f16, table [T] i32 ->
  (K sums [parts, 64, min(64, D)], V sums [parts, 64, min(64, D/2)], scale sums [parts, 64,
  D/32]) f16."""
  _, g, pt, d = kq.shape
  n_table = table.shape[0]
  tiles_per_page = pt // TILE
  if pt % TILE or n_table % block_pages or (block_pages * tiles_per_page) % stages:
    raise ValueError(f"the packed probe needs {TILE}-token tiles in whole partitions of whole "
                     f"stages: {pt}-token pages, {n_table} pages in partitions of {block_pages}, "
                     f"{stages} stages")
  parts = n_table // block_pages
  fk, fv, nb = min(FOLD, d), min(FOLD, d // 2), d // BLOCK
  k_tf = v_tf = ()
  kw = {}
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret import params as _ip  # pylint: disable=C0415
    kw["interpret"] = _ip.InterpretGPUParams()
  else:     # 128-byte swizzled tiles, as the wgmma operands of the mixed-type matmul example
    k_tf = v_tf = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
  kern = functools.partial(_packed_kernel, heads=g, block_pages=block_pages,
                           tiles_per_page=tiles_per_page, stages=stages)
  call = plgpu.kernel(
      kern,
      out_type=tuple(jax.ShapeDtypeStruct((parts, TILE, w), jnp.float16) for w in (fk, fv, nb)),
      scratch_types=([plgpu.SMEM((g, TILE, d), jnp.int8, transforms=k_tf)] * stages
                     + [plgpu.SMEM((g, TILE, d // 2), jnp.uint8, transforms=v_tf)] * stages
                     + [plgpu.SMEM((g, TILE, nb), jnp.float16)] * (2 * stages)
                     + [plgpu.Barrier(num_arrivals=4 * g)] * stages
                     + [plgpu.SMEM((TILE, w), jnp.float16) for w in (fk, fv, nb)]),
      grid=(parts,), grid_names=("p",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **kw)
  return call(table, kq, vq, ks, vs)


def _magic_lhs(kind: str, cols: int, transforms):
  """SMEM int8 tile [64, cols] (swizzled) -> f16 [64, 256] in the WGMMA layout, the head dims in
  `magic_ptx.packed_dims` order: a 32-bit load of Mosaic's WGMMA_LAYOUT_8BIT gives a lane 4
  consecutive bytes of a row, and each such register becomes 2 (Q8_0) or 4 (Q4_0) f16x2
  registers of the lane, with no data moved between lanes."""
  import jax.experimental.mosaic.gpu as mgpu                 # pylint: disable=C0415
  from jax.experimental.mosaic.gpu import fragmented_array as fa  # pylint: disable=C0415
  per = magic_ptx.REGS_PER_WORD[kind]
  width = cols * per // 2                     # values: Q8_0 cols, Q4_0 2 cols

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms),),
                     return_type=plgpu.ShapeDtypeStruct((TILE, width), jnp.float16,
                                                        plgpu.Layout.WGMMA))
  def conv(ctx, ref):
    del ctx
    x = mgpu.FragmentedArray.load_tiled(ref, swizzle=128, is_signed=True,
                                        layout=fa.WGMMA_LAYOUT_8BIT)
    regs = np.empty(fa.WGMMA_LAYOUT.registers_shape((TILE, width)), dtype=object)
    for idx, reg in np.ndenumerate(x.registers):   # idx: (0, 16-byte group, 0, 0, row half, ...)
      for r, out in enumerate(magic_ptx.convert_word(kind, reg)):
        regs[(0, idx[1] * per + r) + idx[2:]] = out
    return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return conv


def wgmma_smem_bytes(heads: int, head_dim: int, stages: int, n: int) -> int:
  """SMEM a CTA of the wgmma / magic variants: `stages` tiles of every head's planes and the two
  rhs operands (the sums go from registers straight to GMEM)."""
  tile = heads * TILE * (head_dim + head_dim // 2 + 2 * 2 * (head_dim // BLOCK))
  return stages * tile + 2 * head_dim * n * 2


@functools.partial(jax.jit, static_argnames=("block_pages", "stages", "consumers", "interpret",
                                             "convert"))
def packed_wgmma_probe(kq, vq, ks, vs, table, rhs, *, block_pages: int, stages: int,
                       consumers: int, interpret: bool, convert: str = "mosaic"):
  """The conversion as a kernel would use it: each consumer warpgroup converts its heads' int8
  tiles to bf16 in registers (Mosaic's PRMT upcast for signed int8) and feeds them to wgmma as
  the lhs against rhs [2, D, N] (K's, V's; bf16) in SMEM, accumulating in float32 (exact for
  small integers). convert="magic": the PTX conversion of `_magic_lhs` instead (f16 rhs whose
  rows follow `magic_ptx.packed_dims`; GPU only: the interpreter runs no inline Mosaic GPU code).
  kq [P, G, pt, D] i8, vq [P, G, pt, D/2] i8, ks / vs [P, G, pt, D/32] f16, table [T] i32 ->
  (K + V sums [parts, G, 64, N] f32, scale sums [parts, G, 64, D/32] f16)."""
  _, g, pt, d = kq.shape
  n = rhs.shape[2]
  if convert not in ("mosaic", "magic") or (convert == "magic" and interpret):
    raise ValueError(f"convert={convert!r}: 'mosaic', or 'magic' on the GPU")
  n_table = table.shape[0]
  tiles_per_page = pt // TILE
  if pt % TILE or n_table % block_pages or (block_pages * tiles_per_page) % stages or g % consumers:
    raise ValueError(f"the packed wgmma probe needs {TILE}-token tiles in whole partitions of "
                     f"whole stages and heads shared evenly: {pt}-token pages, {n_table} pages in "
                     f"partitions of {block_pages}, {stages} stages, {g} heads, {consumers} "
                     f"warpgroups")
  parts = n_table // block_pages
  hpw, nb = g // consumers, d // BLOCK
  kw = {}
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret import params as _ip  # pylint: disable=C0415
    kw["interpret"] = _ip.InterpretGPUParams()
  tf = lambda sw: (plgpu.TilingTransform((8, sw)), plgpu.SwizzleTransform(sw))  # int8: sw cols
  rhs_sw = min(128, 2 * n)
  kern = functools.partial(_wgmma_kernel, heads=g, consumers=consumers, block_pages=block_pages,
                           tiles_per_page=tiles_per_page, stages=stages, convert=convert)
  if consumers > 1:
    kw.update(num_threads=consumers, thread_name="wg")
  call = plgpu.kernel(
      kern,
      out_type=(jax.ShapeDtypeStruct((parts, g, TILE, n), jnp.float32),
                jax.ShapeDtypeStruct((parts, g, TILE, nb), jnp.float16)),
      scratch_types=[
          plgpu.SMEM((stages, consumers, hpw, TILE, d), jnp.int8,
                     transforms=() if interpret else tf(128)),
          plgpu.SMEM((stages, consumers, hpw, TILE, d // 2), jnp.int8,
                     transforms=() if interpret else tf(128)),
          plgpu.SMEM((stages, consumers, hpw, TILE, nb), jnp.float16),
          plgpu.SMEM((stages, consumers, hpw, TILE, nb), jnp.float16),
          plgpu.SMEM((2, d, n), rhs.dtype, transforms=() if interpret else (
              plgpu.TilingTransform((8, rhs_sw // 2)), plgpu.SwizzleTransform(rhs_sw))),
          plgpu.Barrier(num_arrivals=4 * hpw, num_barriers=stages * consumers),
          plgpu.Barrier(num_arrivals=1)]
      + ([plgpu.SMEM((consumers, TILE, d), jnp.bfloat16)] if interpret else []),
      grid=(parts,), grid_names=("p",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **kw)
  return call(table, kq, vq, ks, vs, rhs)


def expected_wgmma_sums(kq, vq, ks, vs, table, block_pages: int, n: int):
  """numpy: the two sums of `packed_wgmma_probe` (exact: integers in float32, exact f16 scale
  sums on `exact_pages` pages)."""
  _, g, pt, d = kq.shape
  parts = len(table) // block_pages
  pages = table.reshape(parts, block_pages)
  v = vq[pages].astype(np.int64) & 0xFF
  vals = (v & 15) + 16 * ((v >> 4) - 8)
  x = sum(x.reshape(parts, block_pages, g, pt // TILE, TILE, -1).sum(axis=(1, 3, 5))
          for x in (kq[pages].astype(np.int64), vals))                           # [parts, G, 64]
  out = [np.repeat(x[..., None], n, axis=-1).astype(np.float64)]
  s = ks[pages].astype(np.float64) + vs[pages].astype(np.float64)
  out.append(s.reshape(parts, block_pages, g, pt // TILE, TILE, -1).sum(axis=(1, 3)))
  return out


def expected_magic_sums(kq, vq, ks, vs, table, block_pages: int, w):
  """numpy: the sums of `packed_wgmma_probe(convert="magic")` with rhs from `magic_ptx.check_operands("packed", ...)`: K . W_K +
  (V - 8) . W_V by head dim (exact integers), and the scale sums."""
  _, g, pt, d = kq.shape
  parts = len(table) // block_pages
  pages = table.reshape(parts, block_pages)
  vb = vq[pages].astype(np.int64) & 0xFF                      # [parts, bp, G, pt, D/2]
  blocks = vb.reshape(*vb.shape[:-1], d // BLOCK, BLOCK // 2)
  vvals = np.concatenate([blocks & 15, blocks >> 4], axis=-1).reshape(*vb.shape[:-1], d) - 8
  x = kq[pages].astype(np.int64) @ w[0] + vvals @ w[1]      # [parts, bp, G, pt, N]
  x = x.reshape(parts, block_pages, g, pt // TILE, TILE, -1).sum(axis=(1, 3))
  s = ks[pages].astype(np.float64) + vs[pages].astype(np.float64)
  return [x.astype(np.float64),
          s.reshape(parts, block_pages, g, pt // TILE, TILE, -1).sum(axis=(1, 3))]


def expected_sums(kq, vq, ks, vs, table, block_pages: int):
  """numpy: the three sums of `packed_probe` (exact on `exact_pages` pages, so in float64)."""
  _, g, pt, d = kq.shape
  parts = len(table) // block_pages
  pages = table.reshape(parts, block_pages)
  fk, fv = min(FOLD, d), min(FOLD, d // 2)
  v = vq[pages].astype(np.float64)
  vals = (np.mod(v, 16) - 8) + (np.floor(v / 16) - 8)
  out = []
  for x, w in ((kq[pages].astype(np.float64), fk), (vals, fv)):
    # [parts, tiles x heads, 64, folds, w]
    x = x.reshape(parts, block_pages * g * (pt // TILE), TILE, -1, w)
    out.append(x.sum(axis=(1, 3)))
  s = (ks[pages].astype(np.float64) + vs[pages].astype(np.float64))
  out.append(s.reshape(parts, block_pages * g * (pt // TILE), TILE, -1).sum(axis=1))
  return out


def main(argv):
  del argv
  layout = common.layout_from_flags()
  rows = []
  for ctx, _, num_phys, nbytes in common.contexts(layout):
    pool, table_np = common.exact_pool(ctx, layout, num_phys, ctx // layout.page_tokens)
    planes = repack(pool, layout)
    del pool
    dev = [jnp.asarray(x) for x in planes] + [jnp.asarray(table_np)]
    # full-range quants for the wgmma variants (their float32 sums stay exact integers)
    rng = np.random.default_rng(ctx)
    kq_full = rng.integers(-128, 128, planes[0].shape, dtype=np.int8)
    vq_full = rng.integers(-128, 128, planes[1].shape, dtype=np.int8)
    full = (kq_full, vq_full, planes[2], planes[3])
    for variant in FLAGS.variant:
      if variant == "magic" and FLAGS.interpret:
        print("skip magic: GPU only (the interpreter runs no inline Mosaic GPU code)", flush=True)
        continue
      if variant in ("wgmma", "magic"):
        if variant == "wgmma":
          want = expected_wgmma_sums(*full, table_np, FLAGS.block_pages, FLAGS.wgmma_n)
          rhs = jnp.ones((2, layout.head_dim, FLAGS.wgmma_n), jnp.bfloat16)
        else:
          w, rhs_np = magic_ptx.check_operands("packed", layout.head_dim, FLAGS.wgmma_n)
          want = expected_magic_sums(*full, table_np, FLAGS.block_pages, w)
          rhs = jnp.asarray(rhs_np)
        wdev = [jnp.asarray(kq_full), jnp.asarray(vq_full), dev[2], dev[3], dev[4], rhs]
        configs = [(st, int(c)) for st in (int(s) for s in FLAGS.stages) for c in FLAGS.consumers]
      elif variant == "sum":
        want = expected_sums(*planes, table_np, FLAGS.block_pages)
        configs = [(st, 1) for st in (int(s) for s in FLAGS.stages)]
      else:
        raise ValueError(f"unknown --variant {variant!r}: sum, wgmma or magic")
      for stages, consumers in configs:
        if variant in ("wgmma", "magic"):
          smem = wgmma_smem_bytes(layout.num_kv_heads, layout.head_dim, stages, FLAGS.wgmma_n)
          fn = functools.partial(packed_wgmma_probe, *wdev, block_pages=FLAGS.block_pages,
                                 stages=stages, consumers=consumers, interpret=FLAGS.interpret,
                                 convert="magic" if variant == "magic" else "mosaic")
        else:
          smem = smem_bytes(layout.num_kv_heads, layout.head_dim, stages)
          fn = functools.partial(packed_probe, *dev, block_pages=FLAGS.block_pages, stages=stages,
                                 interpret=FLAGS.interpret)
        name = f"{variant} context={ctx} stages={stages} WGs={consumers}"
        try:
          t = time.perf_counter()
          got = [np.asarray(x).astype(np.float64) for x in fn()]
          checked_s = time.perf_counter() - t
        except Exception as e:  # pylint: disable=broad-except  (report it, go on to the next one)
          print(f"FAILED to build or run the packed probe {name} (SMEM {smem} B): "
                f"{type(e).__name__}: {str(e)[:400]}", flush=True)
          continue
        if not all(np.array_equal(a, b) for a, b in zip(got, want)):
          print(f"FAILED packed decode check {name}: "
                f"{[float(np.mean(a == b)) for a, b in zip(got, want)]} of the sums equal",
                flush=True)
          continue
        common.timed(lambda fn=fn: fn()[0], nbytes, f"packed {name} smem={smem} checked",
                     (variant, ctx, stages, consumers, smem), rows, checked_s)
  common.print_table(("variant", "ctx", "stages", "WGs", "SMEM B"), rows)


if __name__ == "__main__":
  app.run(main)
