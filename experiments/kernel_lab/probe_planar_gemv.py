"""Probe: quantized GEMVs written as XLA fusions over weights repacked into planes at load.

Question: can XLA's own fused reductions read GGUF-quantized weights near the HBM bandwidth, if
the blocks are first repacked into planes (nibbles or int8 values in one array, the per-32
scales in another), with no Pallas kernel at all? Each variant computes x [S, K] @ W[N, K].T
(W = ggml's dequantization) and is timed against the bf16 dot of the same matrix:

  bf16        dense bf16 weights, one dot (the baseline)
  q4k_u8      Q4_K: nibbles u8 [N, K/64, 32] (byte i of a 64-value chunk: value i low, 32 + i
              high), scale and offset f32 [N, K/64, 2] (d * sc, dmin * m: ggml's f32 products);
              y = sum(lo * s0 * x0 + hi * s1 * x1) - sum(o * xsum): one reduction over the bytes
  q4k_u32     the same nibbles read as u32 [N, K/64, 8] (8 nibbles a load)
  q4k_dot     Q4_K: nibbles as uint4 [N, K] in value order, the f32 scales; dequantized to bf16
              and one dot (what XLA makes of an int4 weight-only matmul)
  q4k_row     Q4_K as a byte permutation of ggml's rows (`[nibbles K/2 | packed 6-bit scales 12 a
              block | f16 d, dmin a block]`, the file's bytes exactly): the scales decoded inside
              the product (ggml's f32 d * sc), the reduction of q4k_u8
  q4k_ggml    Q4_K in ggml's own rows (`random_quantized`), decoded by the reference's decoder and
              multiplied and summed (no dot): does XLA fuse the decode into the reduction as is?
  q8_ggml     the same for Q8_0
  q8_u8       Q8_0: int8 values [N, K/32, 32], d f32 [N, K/32]: y = sum_b d * sum_i q x
  q8_dot      Q8_0: int8 values [N, K], dequantized to bf16, one dot

Bytes: the planes as stored (GB/s column) and ggml's block bytes (`ggml GB/s`: the same time
against the file's bytes, what the must-show counts). Times: the calls cycle through copies
worth >= --rotate_mib, `--iters` calls a round, the median of `--rounds`.

  python -m experiments.kernel_lab.probe_planar_gemv                    # GPU, the 27B's shapes
  python -m experiments.kernel_lab.probe_planar_gemv --small            # CPU: correctness only
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags
import numpy as np

FLAGS = flags.FLAGS
SHAPES = {"ffn_gate": (17408, 5120), "ffn_down": (5120, 17408), "attn_qkv": (10240, 5120),
          "attn_q": (12288, 5120), "attn_k": (1024, 5120)}


def define_flags():
  flags.DEFINE_bool("small", False, "small shapes, one round: correctness on the CPU")
  flags.DEFINE_list("shapes", ["ffn_gate", "ffn_down", "attn_qkv"], "matrices (names of SHAPES)")
  flags.DEFINE_list("rows", ["1", "4"], "rows S of x")
  flags.DEFINE_list("variants", ["bf16", "q4k_u8", "q4k_u32", "q4k_row", "q4k_ggml", "q4k_dot", "q8_ggml", "q8_u8", "q8_dot"], "variants")
  flags.DEFINE_integer("iters", 20, "calls a round")
  flags.DEFINE_integer("rounds", 5, "rounds (median)")
  flags.DEFINE_integer("rotate_mib", 512, "weight copies worth at least this many MiB")
  flags.DEFINE_string("out", os.environ.get("OUT", "runs/probe_planar_gemv"), "output folder")


def q4k_planes(rng, n, k):
  """Random Q4_K-like planes: nibbles u8 [N, K/64, 32], scale / offset f32 [N, K/64, 2] built as
  ggml's d * sc and dmin * m (f16 d, 6-bit sc / m)."""
  c = k // 64
  w = rng.integers(0, 256, (n, c, 32), dtype=np.uint8)
  d = rng.uniform(1e-3, 4e-3, (n, k // 256, 1)).astype(np.float16).astype(np.float32)
  dmin = rng.uniform(1e-3, 4e-3, (n, k // 256, 1)).astype(np.float16).astype(np.float32)
  sc = rng.integers(0, 64, (n, k // 256, 8)).astype(np.float32)
  mn = rng.integers(0, 64, (n, k // 256, 8)).astype(np.float32)
  s = (d * sc).reshape(n, c, 2)
  o = (dmin * mn).reshape(n, c, 2)
  return w, s, o


def q4k_dense(w, s, o):
  """-> f32 [N, K] in value order (chunk c: values 64c + i low nibbles, 64c + 32 + i high)."""
  lo, hi = (w & 15).astype(np.float32), (w >> 4).astype(np.float32)
  v = np.stack([lo * s[..., :1] - o[..., :1], hi * s[..., 1:] - o[..., 1:]], axis=2)   # [N, C, 2, 32]
  return v.reshape(w.shape[0], -1)


def _k_scales_np(sb):
  lo, mid, hi = sb[..., 0:4], sb[..., 4:8], sb[..., 8:12]
  sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1).astype(np.float32)
  mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1).astype(np.float32)
  return sc, mn


def make_variant(name, rng, n, k):
  """-> (args a copy, fn(x, *args) -> [S, N] f32, stored bytes, ggml bytes, dense f32 W)."""
  import jax.numpy as jnp
  f32 = jnp.float32
  if name.startswith("q4k") or name == "bf16":
    w, s, o = q4k_planes(rng, n, k)
    dense = q4k_dense(w, s, o)
  else:
    q = rng.integers(-128, 128, (n, k // 32, 32), dtype=np.int8)
    d = rng.uniform(1e-3, 4e-3, (n, k // 32)).astype(np.float16).astype(np.float32)
    dense = (q.astype(np.float32) * d[..., None]).reshape(n, k)
  ggml_q4k, ggml_q8 = n * k // 256 * 144, n * k // 32 * 34

  if name == "bf16":
    args = (jnp.asarray(dense, jnp.bfloat16),)
    fn = lambda x, wd: jnp.einsum("sk,nk->sn", x.astype(jnp.bfloat16), wd, preferred_element_type=f32)
    return args, fn, n * k * 2, n * k * 2, dense
  if name == "q4k_u8":
    args = (jnp.asarray(w), jnp.asarray(s), jnp.asarray(o))

    def fn(x, w, s, o):
      xs = x.astype(f32).reshape(x.shape[0], -1, 2, 32)                    # [S, C, 2, 32]
      lo, hi = (w & 15).astype(f32), (w >> 4).astype(f32)                  # [N, C, 32]
      t = (lo[None] * s[None, ..., 0:1] * xs[:, None, :, 0] + hi[None] * s[None, ..., 1:2] * xs[:, None, :, 1])
      return t.sum((2, 3)) - jnp.einsum("nch,sch->sn", o, xs.sum(-1))
    return args, fn, w.nbytes + s.nbytes + o.nbytes, ggml_q4k, dense
  if name == "q4k_u32":
    w32 = w.view(np.uint32).reshape(n, k // 64, 8)                          # byte 4j + t of the chunk
    args = (jnp.asarray(w32), jnp.asarray(s), jnp.asarray(o))
    shift = (8 * np.arange(4)[:, None] + 4 * np.arange(2)[None, :]).astype(np.uint32)   # [t, h]

    def fn(x, w32, s, o):
      xs = x.astype(f32).reshape(x.shape[0], -1, 2, 8, 4)                 # [S, C, h, j, t]
      xt = jnp.transpose(xs, (0, 1, 3, 4, 2))                              # [S, C, j, t, h]
      nib = ((w32[..., None, None] >> jnp.asarray(shift)) & 15).astype(f32)   # [N, C, j, t, h]
      t = nib[None] * s[None, :, :, None, None, :] * xt[:, None]
      return t.sum((2, 3, 4, 5)) - jnp.einsum("nch,sch->sn", o, xs.sum((-1, -2)))
    return args, fn, w32.nbytes + s.nbytes + o.nbytes, ggml_q4k, dense
  if name == "q4k_row":
    nb = k // 256
    d = rng.uniform(1e-3, 4e-3, (n, nb)).astype(np.float16)
    dmin = rng.uniform(1e-3, 4e-3, (n, nb)).astype(np.float16)
    packed = rng.integers(0, 256, (n, nb, 12), dtype=np.uint8)
    sc, mn = _k_scales_np(packed.astype(np.int32))
    s = (d.astype(np.float32)[..., None] * sc).reshape(n, k // 64, 2)
    o = (dmin.astype(np.float32)[..., None] * mn).reshape(n, k // 64, 2)
    dense = q4k_dense(w, s, o)
    row = np.concatenate([w.reshape(n, -1), packed.reshape(n, -1),
                          np.stack([d, dmin], -1).view(np.uint8).reshape(n, -1)], axis=1)
    args = (jnp.asarray(row),)

    def fn(x, row):
      import jax.lax as lax
      wq = row[:, :k // 2].reshape(n, k // 64, 32)
      pk = row[:, k // 2:k // 2 + 12 * nb].reshape(n, nb, 12).astype(jnp.int32)
      dd = lax.bitcast_convert_type(row[:, k // 2 + 12 * nb:].reshape(n, nb, 2, 2), jnp.float16).astype(f32)
      lo_, mid, hi_ = pk[..., 0:4], pk[..., 4:8], pk[..., 8:12]
      scv = jnp.concatenate([lo_ & 63, (hi_ & 15) | ((lo_ >> 6) << 4)], axis=-1).astype(f32)
      mnv = jnp.concatenate([mid & 63, (hi_ >> 4) | ((mid >> 6) << 4)], axis=-1).astype(f32)
      s = (dd[..., 0:1] * scv).reshape(n, k // 64, 2)
      o = (dd[..., 1:2] * mnv).reshape(n, k // 64, 2)
      xs = x.astype(f32).reshape(x.shape[0], -1, 2, 32)
      lo, hi = (wq & 15).astype(f32), (wq >> 4).astype(f32)
      t = (lo[None] * s[None, ..., 0:1] * xs[:, None, :, 0] + hi[None] * s[None, ..., 1:2] * xs[:, None, :, 1])
      return t.sum((2, 3)) - jnp.einsum("nch,sch->sn", o, xs.sum(-1))
    return args, fn, row.nbytes, ggml_q4k, dense
  if name in ("q4k_ggml", "q8_ggml"):
    from kvjax.qweights import random_quantized
    from kvjax_pallas.quant_matmul import reference as ref
    fmt = "q4_k" if name == "q4k_ggml" else "q8_0"
    data = np.asarray(random_quantized(fmt, n, k, seed=1).data)
    dense = np.asarray(ref.dequantize_jit(jnp.asarray(data), fmt, k))
    args = (jnp.asarray(data),)

    def fn(x, data):
      w = ref.dequantize(data, fmt, k)                                     # f32 [N, K], fused
      return jnp.sum(w[None] * x.astype(f32)[:, None, :], axis=-1)
    return args, fn, data.nbytes, data.nbytes, dense
  if name == "q4k_dot":
    vals = np.stack([w & 15, w >> 4], axis=2).reshape(n, k)                 # value order
    args = (jnp.asarray(vals, jnp.uint4), jnp.asarray(s), jnp.asarray(o))

    def fn(x, v, s, o):
      sv = jnp.repeat(s.reshape(n, -1), 32, axis=1)
      ov = jnp.repeat(o.reshape(n, -1), 32, axis=1)
      wd = (v.astype(f32) * sv - ov).astype(jnp.bfloat16)
      return jnp.einsum("sk,nk->sn", x.astype(jnp.bfloat16), wd, preferred_element_type=f32)
    return args, fn, n * k // 2 + s.nbytes + o.nbytes, ggml_q4k, dense
  if name == "q8_u8":
    args = (jnp.asarray(q), jnp.asarray(d))

    def fn(x, q, d):
      xs = x.astype(f32).reshape(x.shape[0], -1, 32)
      part = (q.astype(f32)[None] * xs[:, None]).sum(-1)                   # [S, N, B]
      return (part * d[None]).sum(-1)
    return args, fn, q.nbytes + d.nbytes, ggml_q8, dense
  if name == "q8_dot":
    args = (jnp.asarray(q.reshape(n, k)), jnp.asarray(d))

    def fn(x, q, d):
      wd = (q.astype(f32) * jnp.repeat(d, 32, axis=1)).astype(jnp.bfloat16)
      return jnp.einsum("sk,nk->sn", x.astype(jnp.bfloat16), wd, preferred_element_type=f32)
    return args, fn, q.nbytes + d.nbytes, ggml_q8, dense
  raise ValueError(f"unknown variant {name!r}")


def time_calls(fn, x, copies, iters, rounds):
  import jax
  jax.block_until_ready(fn(x, *copies[0]))
  ts = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    out = None
    for i in range(iters):
      out = fn(x, *copies[i % len(copies)])
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) / iters)
  return 1e3 * float(np.median(ts))


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  os.makedirs(FLAGS.out, exist_ok=True)
  shapes = {"small": (256, 512)} if FLAGS.small else {s: SHAPES[s] for s in FLAGS.shapes}
  rows = [1, 4] if FLAGS.small else [int(r) for r in FLAGS.rows]
  out = []
  print(f"{'shape':<10} {'S':>3} {'variant':<9} {'ms':>8} {'GB/s':>7} {'ggml GB/s':>9} {'rel err':>8}")
  for sname, (n, k) in shapes.items():
    for v in FLAGS.variants:
      rng = np.random.default_rng(0)
      try:
        args, fn, nbytes, ggml_bytes, dense = make_variant(v, rng, n, k)
      except Exception as e:   # pylint: disable=broad-except
        print(f"{sname:<10} {'-':>3} {v:<9} error: {type(e).__name__}: {str(e)[:120]}")
        continue
      n_copies = 1 if FLAGS.small else max(1, -(-FLAGS.rotate_mib * 2**20 // nbytes))
      copies = [args] + [tuple(jnp.array(a, copy=True) for a in args) for _ in range(n_copies - 1)]
      jfn = jax.jit(fn)
      for s in rows:
        x = jnp.asarray(np.random.default_rng(s).standard_normal((s, k)), jnp.bfloat16)
        try:
          got = np.asarray(jfn(x, *args))
          ms = time_calls(jfn, x, copies, 1 if FLAGS.small else FLAGS.iters, 1 if FLAGS.small else FLAGS.rounds)
        except Exception as e:   # pylint: disable=broad-except
          print(f"{sname:<10} {s:>3} {v:<9} error: {type(e).__name__}: {str(e)[:120]}")
          continue
        ref = np.asarray(x, np.float32) @ dense.T
        err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
        gbs, ggml_gbs = nbytes / ms / 1e6, ggml_bytes / ms / 1e6
        print(f"{sname:<10} {s:>3} {v:<9} {ms:>8.4f} {gbs:>7.0f} {ggml_gbs:>9.0f} {err:>8.1e}", flush=True)
        out.append(dict(shape=sname, n=n, k=k, rows=s, variant=v, ms=ms, bytes=nbytes, ggml_bytes=ggml_bytes,
                        gbs=gbs, ggml_gbs=ggml_gbs, rel_err=err))
      del copies, args
  with open(os.path.join(FLAGS.out, "probe_planar_gemv.json"), "w") as f:
    json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": out}, f, indent=1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
