"""Matmul with GGUF-quantized weights: effective bandwidth of each implementation, per format.

  JAX_PLATFORMS=cuda python -m experiments.bench_gemv --out=$OUT/bench_gemv.json     # GPU
  python -m experiments.bench_gemv --small                                            # CPU smoke

For every weight shape of the 27B geometry (`kvjax.config.qwen38_27b`: the attention layers' q
(+ gate), k, v and output projections, the recurrent layers' qkv and gate projections, the FFN's
gate / up and down), every format (q8_0, q4_0, q4_k, q5_k, q6_k), rows S (1, 4: decode and
verify; 256: a prefill chunk) and implementation of `kvjax_pallas.quant_matmul.api` ("xla":
dequantize then dot; "pallas": the kernel; "pallas_gemv": its GEMV for S <= 16 (no dot, split
over K); "planar": the blocks repacked into planes once, `api.planar_matmul` (the product
`KVJAX_PLANAR_PRODUCT` resolves to; "planar_pallas", "planar_dot", "planar_xla": the GEMV's sums, its
tensor-core dots, XLA's reduction, named); plus "bf16", a plain
bf16 x bf16 dot of dense weights as the baseline): the median time a call, effective GB/s and TFLOP/s.

Bytes counted: what a call must read once, the weight matrix as stored (N x row_bytes; the planes for "planar"; N x K x 2
for "bf16") and x (S x K x 2, bf16); the [S, N] output is not counted. Times: one program calls
the product on each of several copies of the weights (at least 8, and worth at least
`--rotate_mib` MiB, so a matrix is not read from L2: the H200's is 50 MB; at most 8 GiB of
copies), so what is timed is the GPU's work, not the host's dispatch of each call (a call of a
50 MB matrix takes ~20 us, about what dispatching a jitted call costs); per round that program
is queued for at least `--iters` calls, then one wait; the median of `--rounds` rounds, divided
by the calls. Each case also checks the implementation
against "xla" (max |diff| / max |xla|, column `check`); a case that fails to compile becomes a
row with its error. The "pallas" weights are passed as their uint16 halfword view, made once
(the kernel reads halfwords); "xla" gets the uint8 bytes.

--small: a few small shapes, S in {1, 4} (or --rows), the kernel interpreted: a quick check that the
program runs (CPU). Imports kvjax only for the geometry.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time

from absl import app, flags

FLAGS = flags.FLAGS

MIN_COPIES = 8          # weight copies (calls in one timed program), within COPIES_BYTES
COPIES_BYTES = 8 << 30
PLANAR_IMPLS = ("planar", "planar_pallas", "planar_dot", "planar_q8", "planar_xla")
SMALL_SHAPES = (("ffn_up.weight", 512, 512), ("ffn_down.weight", 256, 1024))


def define_flags():
  """The flags, defined when the module runs as a program (see experiments/acceptance.py)."""
  flags.DEFINE_bool("small", False, "CPU smoke test: small shapes, S 1 and 4 (or --rows), one round")
  flags.DEFINE_list("formats", ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k"], "weight formats")
  flags.DEFINE_list("rows", ["1", "4", "256"], "rows S of x")
  flags.DEFINE_list("implementations", ["xla", "fused", "pallas", "pallas_gemv", "bf16"],
                    "xla, fused, pallas, pallas_gemv, planar (planes, its formats only: the model's "
                    "product), planar_pallas / planar_dot / planar_q8 / planar_xla (the planes' products named), bf16 (baseline)")
  flags.DEFINE_list("shapes", [], "tensor names to keep (default: all), e.g. ffn_up.weight")
  flags.DEFINE_integer("iters", 20, "calls a round")
  flags.DEFINE_integer("rounds", 5, "timed rounds (median)")
  flags.DEFINE_integer("rotate_mib", 256, "cycle the calls through weight copies of at least this "
                       "many MiB (0: one copy)")
  flags.DEFINE_string("interpret", "auto", "run the kernel interpreted: true, false, auto (when the "
                      "backend is not a GPU)")
  flags.DEFINE_list("tiles", [], "pallas tile configs to compare, each block_s:block_n:block_k:warps:stages "
                    "(e.g. 16:64:512:4:3); each a row of impl 'pallas' with its tiles (default: the "
                    "kernel's default_config)")
  flags.DEFINE_list("gemv_tiles", [], "pallas_gemv tile configs to compare, each "
                    "block_n:block_k:split_k:warps:stages (e.g. 32:512:8:4:3); each a row of impl "
                    "'pallas_gemv' with its tiles (default: gemv.DEFAULT_CONFIG)")
  flags.DEFINE_list("planar_tiles", [], "planar_pallas tile configs to compare, each "
                    "block_n:block_groups:split_k:min_programs:sum_each_step:grouped:warps:stages:dot:prefetch:x_blocks (e.g. 32:8:0:512:1:0:4:3:1; a prefix: the rest as the class defaults); each a row "
                    "of impls 'planar_pallas' and 'planar_q8' (q8: dot 0 only; default: each kernel's DEFAULT_CONFIG)")
  flags.DEFINE_float("max_seconds", 1200.0, "stop starting new cases after this")
  flags.DEFINE_string("out", "", "JSON file for the rows (empty: none)")


def geometry_shapes():
  """[(tensor name, N, K)] of the 27B preset's projection weights (one row a distinct shape)."""
  from kvjax import config as config_lib
  cfg = config_lib.qwen38_27b()
  shapes = {}
  for table in (config_lib.attention_block_shapes(cfg), config_lib.recurrent_block_shapes(cfg),
                config_lib.common_block_shapes(cfg)):
    shapes.update(table)
  keep = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
          "attn_qkv.weight", "attn_gate.weight", "ffn_gate.weight", "ffn_up.weight",
          "ffn_down.weight")
  out, seen = [], set()
  for name in keep:
    n, k = shapes[name]
    if (n, k) not in seen:
      seen.add((n, k))
      out.append((name, n, k))
  return out


def _random_weights(np, fmt: str, n: int, k: int, seed: int):
  """uint8 [n, row_bytes]: random bytes (any pattern is a valid block) with sane f16 scales."""
  from kvjax_pallas.quant_matmul import formats
  f = formats.FORMATS[fmt]
  nb = k // f.block_values
  rng = np.random.default_rng(seed)
  w = rng.integers(0, 256, (n, nb, f.block_bytes), dtype=np.uint8)
  for off in {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}.get(fmt, (0,)):
    d = (rng.standard_normal((n, nb)) * 0.02).astype(np.float16)
    w[..., off:off + 2] = d.view(np.uint8).reshape(n, nb, 2)
  return w.reshape(n, nb * f.block_bytes)


def _time_calls(jax, fn, xs, ws, iters: int, rounds: int) -> float:
  """Median seconds a call of fn(x, w): one program makes a call on each weight copy of `ws` (so
  the host's dispatch of a call is not what is timed); per round that program is queued enough
  times for `iters` calls, then one wait."""
  many = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
  jax.block_until_ready(many(xs, ws))
  reps = max(1, -(-iters // len(ws)))
  per = []
  for _ in range(rounds):
    t = time.perf_counter()
    outs = [many(xs, ws) for _ in range(reps)]
    jax.block_until_ready(outs)
    per.append((time.perf_counter() - t) / (reps * len(ws)))
  per.sort()
  return per[len(per) // 2]


def _parse_config(text: str, flag: str, cls, check=None):
  """'a:b:c' (the first int fields of `cls`, in order; the rest its defaults) -> a `cls`, checked by
  `check` if given."""
  names = [f.name for f in dataclasses.fields(cls)]
  parts = text.split(":")
  if len(parts) > len(names) or not all(p.isdigit() for p in parts):
    raise ValueError(f"--{flag} entry {text!r}: want {':'.join(names)}, up to {len(names)} integers >= 0 (the "
                     f"rest: defaults), got {len(parts)} fields")
  try:
    cfg = cls(*(int(p) for p in parts))
    return check(cfg) if check else cfg
  except ValueError as e:
    raise ValueError(f"--{flag} entry {text!r}: {e}") from None


def parse_tiles(text: str):
  """'bs:bn:bk:warps:stages' -> a QuantMatmulConfig."""
  from kvjax_pallas.quant_matmul import api
  return _parse_config(text, "tiles", api.QuantMatmulConfig)


def parse_gemv_tiles(text: str):
  """'bn:bk:split:warps:stages' -> a GemvConfig (checked)."""
  from kvjax_pallas.quant_matmul import gemv
  return _parse_config(text, "gemv_tiles", gemv.GemvConfig, gemv.check_config)


def parse_planar_tiles(text: str):
  """'bn:groups:split:min_programs:sum_each_step:grouped:warps:stages:dot:prefetch:x_blocks' (or a
  prefix) -> a PlanarGemvConfig (checked)."""
  from kvjax_pallas.quant_matmul import planar_gemv
  return _parse_config(text, "planar_tiles", planar_gemv.PlanarGemvConfig, planar_gemv.check_config)


def gemv_default():
  from kvjax_pallas.quant_matmul import gemv
  return gemv.DEFAULT_CONFIG


def run_case(jax, jnp, np, api, name, n, k, fmt, s, impl, interpret, copies_for, w_u8, ref_out,
             x, config=None, tiles=""):
  """One row of the table (a dict); the implementation's output is checked against ref_out."""
  from kvjax_pallas.quant_matmul import formats, reference
  row = dict(shape=name, n=n, k=k, fmt="dense" if impl == "bf16" else fmt, s=s, impl=impl)
  if tiles:
    row["tiles"] = tiles
  if impl == "bf16":
    w = jnp.asarray(np.random.default_rng(1).standard_normal((n, k)), jnp.bfloat16)
    w_bytes = n * k * 2
    fn = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                                  preferred_element_type=jnp.float32))
  elif impl.startswith("planar"):   # the planes made once (at load in a model); bytes: the planes'
    if fmt not in api.PLANAR_FORMATS:
      return dict(row, error=f"not a planar format (planar: {', '.join(api.PLANAR_FORMATS)})")
    w = tuple(jnp.asarray(a) for a in api.to_planes(np.asarray(w_u8), fmt, k))
    w_bytes = api.planes_nbytes(fmt, n, k)
    product = {"planar": "auto", "planar_pallas": "pallas", "planar_dot": "pallas_dot", "planar_q8": "pallas_q8",
               "planar_xla": "xla"}[impl]
    fn = jax.jit(lambda x, w: api.planar_matmul(x, w[0], w[1], fmt, k, implementation=product, config=config,
                                                interpret=interpret))
  else:
    w = reference.halfword_view(w_u8) if impl.startswith("pallas") else w_u8
    w_bytes = formats.row_bytes(fmt, k) * n
    fn = jax.jit(lambda x, w: api.quant_matmul(x, w, fmt, k, implementation=impl, config=config,
                                               interpret=interpret))
  ws = [w] + [jax.tree.map(lambda a: a + 0, w) for _ in range(copies_for(w_bytes) - 1)]   # new buffers
  try:
    out = np.asarray(fn(x, w))
    if impl != "bf16":
      row["check"] = float(np.max(np.abs(out - ref_out)) / max(np.max(np.abs(ref_out)), 1e-30))
    sec = _time_calls(jax, fn, x, ws, FLAGS.iters, FLAGS.rounds)
  except Exception as e:  # pylint: disable=broad-except  (a case that does not compile: a row)
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return row
  nbytes = w_bytes + s * k * 2
  row.update(ms=sec * 1e3, bytes=nbytes, gbps=nbytes / sec / 1e9,
             tflops=2.0 * s * n * k / sec / 1e12, copies=len(ws))
  return row


def _fmt_row(r) -> str:
  if "error" in r:
    return (f"{r['shape']:>18} {r['n']:>6} {r['k']:>6} {r['fmt']:>5} {r['s']:>4} {r['impl']:>13}"
            f"  ERROR {r['error']}")
  check = f"{r['check']:.1e}" if "check" in r else "-"
  return (f"{r['shape']:>18} {r['n']:>6} {r['k']:>6} {r['fmt']:>5} {r['s']:>4} {r['impl']:>13} "
          f"{r['ms']:>9.4f} {r['gbps']:>8.1f} {r['tflops']:>7.2f} {check:>8} {r.get('tiles', '')}")


def main(argv):
  del argv
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)   # its TPU backend probe
  import jax
  import jax.numpy as jnp
  import numpy as np
  from kvjax_pallas.quant_matmul import api, formats, reference

  t0 = time.time()
  backend = jax.default_backend()
  interpret = {"true": True, "false": False, "auto": backend != "gpu"}[FLAGS.interpret.lower()]
  if FLAGS.small:
    rows = [int(r) for r in FLAGS.rows] if FLAGS["rows"].present else [1, 4]
    shapes, rounds_note = list(SMALL_SHAPES), "small"
    FLAGS.iters, FLAGS.rounds, FLAGS.rotate_mib = 2, 1, 0
  else:
    shapes, rows, rounds_note = geometry_shapes(), [int(r) for r in FLAGS.rows], "geometry"
  if FLAGS.shapes:
    shapes = [sh for sh in shapes if sh[0] in FLAGS.shapes]
  for fmt in FLAGS.formats:
    formats.get_format(fmt)
  for impl in FLAGS.implementations:
    if impl not in PLANAR_IMPLS + ("bf16",):
      api.get_implementation(impl)
  tile_configs = {"pallas": [(t, parse_tiles(t)) for t in FLAGS.tiles] or [("", None)],
                  # the GEMV itself at every S <= 16 (without a GemvConfig "pallas_gemv" takes one row)
                  "pallas_gemv": [(t, parse_gemv_tiles(t)) for t in FLAGS.gemv_tiles] or [("", gemv_default())],
                  "planar_pallas": [(t, parse_planar_tiles(t)) for t in FLAGS.planar_tiles] or [("", None)]}
  tile_configs["planar_q8"] = [(t, c) for t, c in tile_configs["planar_pallas"] if c is None or not c.dot] or [("", None)]

  planar_product = api.resolve_planar_product("auto")      # a bad KVJAX_PLANAR_PRODUCT: one line, before any case
  if FLAGS.planar_tiles and not {"planar_pallas", "planar_q8"} & set(FLAGS.implementations):
    print("note: --planar_tiles applies to implementations planar_pallas and planar_q8 only (neither given)", flush=True)
  no_planes = [f for f in FLAGS.formats if f not in api.PLANAR_FORMATS]
  if no_planes and any(i in PLANAR_IMPLS for i in FLAGS.implementations):
    print(f"note: {', '.join(no_planes)} not repacked into planes: no planar rows for them "
          f"(planar formats: {', '.join(api.PLANAR_FORMATS)})", flush=True)

  def copies_for(nbytes: int) -> int:
    if not FLAGS.rotate_mib:
      return 1
    want = max(MIN_COPIES, math.ceil(FLAGS.rotate_mib * 2**20 / nbytes))   # >= MIN_COPIES calls a program
    return max(1, min(64, want, COPIES_BYTES // nbytes))

  print(f"backend {backend} ({jax.devices()[0].device_kind}), kernel interpret={interpret}, "
        f"{rounds_note} shapes, iters {FLAGS.iters} x rounds {FLAGS.rounds}", flush=True)
  print(f"{'shape':>18} {'N':>6} {'K':>6} {'fmt':>5} {'S':>4} {'impl':>13} {'ms':>9} {'GB/s':>8} "
        f"{'TFLOP/s':>7} {'check':>8} tiles", flush=True)
  table = []
  stopped = False
  for name, n, k in shapes:
    for fmt in FLAGS.formats:
      w_u8 = jnp.asarray(_random_weights(np, fmt, n, k, seed=n + k))
      for s in rows:
        x = jnp.asarray(np.random.default_rng(s).standard_normal((s, k)), jnp.bfloat16)
        ref_out = np.asarray(reference.quant_matmul_reference(x, w_u8, fmt, k))
        for impl in FLAGS.implementations:
          if (impl == "bf16" and fmt != FLAGS.formats[0]) or (impl in PLANAR_IMPLS and fmt not in api.PLANAR_FORMATS):
            continue          # the dense baseline once a shape and S; planes of their formats only
          if time.time() - t0 > FLAGS.max_seconds:
            stopped = True
            break
          for tiles, config in tile_configs.get(impl, [("", None)]):
            row = run_case(jax, jnp, np, api, name, n, k, fmt, s, impl, interpret, copies_for,
                           w_u8, ref_out, x, config, tiles)
            table.append(row)
            print(_fmt_row(row), flush=True)
  if stopped:
    print(f"stopped after --max_seconds={FLAGS.max_seconds}", flush=True)
  if FLAGS.out:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w") as f:
      json.dump(dict(backend=backend, device=jax.devices()[0].device_kind, interpret=interpret,
                     small=FLAGS.small, iters=FLAGS.iters, rounds=FLAGS.rounds,
                     rotate_mib=FLAGS.rotate_mib, planar_product=planar_product, stopped=stopped, rows=table),
                f, indent=1)
    print(f"wrote {FLAGS.out}", flush=True)
  errors = [r for r in table if "error" in r]
  print(f"{len(table)} cases, {len(errors)} errors, {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
  define_flags()
  from kvjax import checks
  from kvjax_pallas import quant_matmul
  app.run(checks.one_line_errors("bench_gemv", main), flags_parser=checks.flags_parser(
      "bench_gemv", values={"formats": (tuple(quant_matmul.FORMATS),),
                            "implementations": (tuple(quant_matmul.IMPLEMENTATIONS) + PLANAR_IMPLS + ("bf16",),),
                            "rows": (int, 1)}))
