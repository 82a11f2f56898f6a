"""Decode ceiling of a REPACKED device page format (Pallas Mosaic GPU): a measurement for the
user's decision in docs/DESIGN.md ("Proposal for the decode gap"), not a kernel of the package.

Session 8 measured that the ggml block layout, decoded from SMEM as both lowerings can express it,
stops at 2.1-2.2 TB/s (`probe_tma_reads.py --work=decode`, S8-5), while TMA reads the pages at
4.0-4.3 TB/s (S8-2). This probe asks what the same bytes cost in a kernel-friendly format: each
page's K quants as an int8 [heads, tokens, dims] plane, its V nibbles as a uint8 [heads, tokens,
dims / 2] plane (byte j of block b: value j low, value 16 + j high, as in ggml), and the f16
scales as [heads, tokens, blocks] planes; 1664 bytes a token, as the ggml page. TMA copies a
[64 tokens, dims] int8 tile straight into a swizzled SMEM tile, and the warpgroup loads it and
converts it to f16 the way Pallas's `hopper_mixed_type_matmul_mgpu` example does (Warpgroup
semantics: `ref[...]`, `.astype`), with no 2-byte windows. The consumer adds every tile's values
into f16 sums (64-column folds) and adds the scales into a third sum; the scale multiplies
themselves are not done (K's can move onto 8 row-scaled accumulators of the QK^T dot; V's would
cost one f16x2 multiply a pair). On `probe_common.exact_pages` pages every sum is exact, so the
GPU's sums are checked against numpy bit for bit.

  python experiments/probe_packed_decode.py --contexts=131072,262144 --stages=1,2
  python experiments/probe_packed_decode.py --interpret --contexts=512 --page_tokens=128 \
      --head_dim=64 --kv_heads=2 --block_pages=2
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

FLAGS = flags.FLAGS
probe_common.define_flags(stages=("1", "2"))

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
  layout = probe_common.layout_from_flags()
  rows = []
  for ctx, _, num_phys, nbytes in probe_common.contexts(layout):
    pool, table_np = probe_common.exact_pool(ctx, layout, num_phys, ctx // layout.page_tokens)
    planes = repack(pool, layout)
    del pool
    want = expected_sums(*planes, table_np, FLAGS.block_pages)
    dev = [jnp.asarray(x) for x in planes] + [jnp.asarray(table_np)]
    for stages in (int(s) for s in FLAGS.stages):
      smem = smem_bytes(layout.num_kv_heads, layout.head_dim, stages)
      fn = functools.partial(packed_probe, *dev, block_pages=FLAGS.block_pages, stages=stages,
                             interpret=FLAGS.interpret)
      try:
        got = [np.asarray(x).astype(np.float64) for x in fn()]
      except Exception as e:  # pylint: disable=broad-except  (report it, go on to the next one)
        print(f"FAILED to build or run the packed probe at {ctx} tokens, stages={stages} "
              f"(SMEM {smem} B): {type(e).__name__}: {str(e)[:400]}", flush=True)
        continue
      if not all(np.array_equal(a, b) for a, b in zip(got, want)):
        print(f"FAILED packed decode check at {ctx} tokens, stages={stages}: "
              f"{[float(np.mean(a == b)) for a, b in zip(got, want)]} of the sums equal",
              flush=True)
        continue
      probe_common.timed(lambda fn=fn: fn()[0], nbytes,
                         f"packed context={ctx} stages={stages} smem={smem} checked",
                         (ctx, stages, smem), rows)
  probe_common.print_table(("ctx", "stages", "SMEM B"), rows)


if __name__ == "__main__":
  app.run(main)
