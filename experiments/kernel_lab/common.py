"""Helpers shared by the kernel lab's scripts (run from the repository root as
`python -m experiments.kernel_lab.NAME`):

* the read-ceiling probes (`probe_page_reads`, `probe_tma_reads`, `probe_packed_decode`): page
  geometry flags, the timing of queued calls, pools of exactly summable pages, the closing table;
* the timing harnesses of the Mosaic GPU kernels (`time_mosaic_decode`, `time_mosaic_prefill`,
  `time_combine`): `time_us`, `synthetic_pool`;
* the Mosaic GPU probes (`probe_decode_tile`, `probe_paged_copy`, ...): `interp`, `lower`,
  `check` (the Mosaic GPU interpreter and the real Pallas -> Mosaic GPU lowering on the CPU).
"""

import sys
import time

import numpy as np
from absl import flags

from kvjax_pallas.page_layout import BLOCK_FORMATS, PageLayout


def define_flags(contexts=("131072", "262144"), stages=None, consumers=None):
  """The probes' shared flags: page geometry (Q8_0 K / Q4_0 V pages), contexts, partition size,
  interpreter and timing; `stages` (tiles in flight) where the probe pipelines. A flag another
  probe already defined in this process (a test importing two probes) is kept as it is."""
  def once(define, name, *args):
    if name not in flags.FLAGS:
      define(name, *args)

  once(flags.DEFINE_integer, "kv_heads", 4, "KV heads")
  once(flags.DEFINE_integer, "head_dim", 256, "head dim")
  once(flags.DEFINE_integer, "page_tokens", 256, "tokens per page")
  once(flags.DEFINE_list, "contexts", list(contexts), "history tokens")
  once(flags.DEFINE_integer, "block_pages", 4, "pages a program / CTA (logical partition)")
  once(flags.DEFINE_bool, "interpret", False, "interpreter (CPU): small contexts, results checked")
  once(flags.DEFINE_integer, "dispatch_iters", 50, "dependent calls a round")
  once(flags.DEFINE_integer, "rounds", 5, "rounds (median)")
  if stages is not None:
    once(flags.DEFINE_list, "stages", list(stages), "tiles in flight a CTA")
  if consumers is not None:
    once(flags.DEFINE_list, "consumers", list(consumers), "consumer warpgroups a CTA")


def layout_from_flags() -> PageLayout:
  f = flags.FLAGS
  return PageLayout(f.kv_heads, f.head_dim, "q8_0", "q4_0", f.page_tokens)


def contexts(layout: PageLayout):
  """Print the run's header; yield (context tokens, pages, physical pages, bytes a call reads)
  of each `--contexts` entry. The pool has 8 pages more than the history, so a random page
  table is a permutation that skips some."""
  import jax  # pylint: disable=import-outside-toplevel
  print(f"jax {jax.__version__} {jax.devices()[0].device_kind}; {layout.describe()}", flush=True)
  for ctx in (int(c) for c in flags.FLAGS.contexts):
    n_pages = ctx // layout.page_tokens
    yield ctx, n_pages, n_pages + 8, ctx * layout.token_bytes


def time_calls(fn, iters: int, rounds: int, warm_up: bool = True) -> float:
  """Median seconds a call of `fn()` (no arguments), `iters` calls queued a round, after one
  warm-up call (compile; warm_up=False: the caller has called `fn` already)."""
  if warm_up:
    fn().block_until_ready()
  ts = []
  for _ in range(rounds):
    t = time.perf_counter()
    outs = [fn() for _ in range(iters)]
    outs[-1].block_until_ready()
    ts.append((time.perf_counter() - t) / iters)
  return float(np.median(ts))


def exact_pool(ctx: int, layout: PageLayout, num_phys: int, n_pages: int):
  """(pool [num_phys, page_bytes] uint8 of `exact_pages`, page table [n_pages] int32: a random
  permutation), numpy, seeded by the context."""
  rng = np.random.default_rng(ctx)
  pool = exact_pages(rng.integers(0, 256, (num_phys, layout.page_bytes), np.uint8), layout, rng)
  return pool, rng.permutation(num_phys)[:n_pages].astype(np.int32)


def timed(fn, nbytes: int, label: str, fields: tuple, rows: list,
          checked_s: float | None = None) -> None:
  """Time `fn()` (`time_calls`: 2 calls in the interpreter), append fields + (us, GB/s) to rows
  and print `label us=... gbps=...`. checked_s: the seconds of the caller's checked call of `fn`,
  which compiled it (no warm-up call); in the interpreter that time is the one reported, with no
  further call (an interpreter's time says nothing of a GPU's: the line shows the path ran)."""
  f = flags.FLAGS
  if f.interpret and checked_s is not None:
    t = checked_s
  else:
    t = time_calls(fn, 2 if f.interpret else f.dispatch_iters, 1 if f.interpret else f.rounds,
                   warm_up=checked_s is None)
  rows.append(tuple(fields) + (t * 1e6, nbytes / t / 1e9))
  print(f"{label} us={t * 1e6:.1f} gbps={nbytes / t / 1e9:.0f}", flush=True)


def print_table(names, rows) -> None:
  """The closing table: the given columns, then us and GB/s."""
  print("\n" + " ".join(f"{n:>7}" for n in names) + f" | {'us':>8} {'GB/s':>6}")
  for r in rows:
    print(" ".join(f"{x:>7}" for x in r[:-2]) + f" | {r[-2]:8.1f} {r[-1]:6.0f}")


def exact_pages(pool: np.ndarray, layout: PageLayout, rng) -> np.ndarray:
  """Page bytes whose decode sums are exact in f16: every block's scale is 2^-6 and every value
  is in [-2, 2] (Q8_0 int8s; Q4_0 nibbles 6..10). A partition's f16 sum of 2048 windows then
  stays a multiple of 2^-6 below 32 in magnitude (far beyond any realistic random walk), so the
  GPU's sums equal numpy's bit for bit whatever the order of the adds or FMA contraction. The
  pool is changed in place and returned."""
  n = layout.page_tokens * layout.num_kv_heads
  scale = np.frombuffer(np.float16(2.0 ** -6).tobytes(), np.uint8)
  for off, kind, row in ((0, layout.k_type, layout.k_row_bytes),
                         (layout.v_offset, layout.v_type, layout.v_row_bytes)):
    per = BLOCK_FORMATS[kind][1]      # bytes a ggml block (f16 scale first)
    span = slice(off, off + layout.page_tokens * row)
    plane = pool[:, span].reshape(len(pool), n, -1, per)
    plane[..., :2] = scale
    if kind == "q8_0":
      plane[..., 2:] = rng.integers(-2, 3, plane[..., 2:].shape).astype(np.int8).view(np.uint8)
    else:
      lo, hi = (rng.integers(6, 11, plane[..., 2:].shape, np.uint8) for _ in range(2))
      plane[..., 2:] = lo | (hi << 4)
    pool[:, span] = plane.reshape(len(pool), -1)
  return pool


# ----------------------------------------------------------------------------- Mosaic GPU timing


def time_us(fn, *args, iters=50):
  """Median microseconds a call of `iters` calls queued from Python (the GPU runs them in order)."""
  import jax  # pylint: disable=import-outside-toplevel
  out = fn(*args)
  jax.block_until_ready(out)
  ts = []
  for _ in range(5):
    t = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t) / iters)
  return float(np.median(ts)) * 1e6


LAYOUT_27B = PageLayout(4, 256, "q8_0", "q4_0", 256)   # the 27B attention geometry's pages


def harness_args(default_variants: str):
  """(contexts, query tokens, variants) of a timing harness: comma lists in argv[1], argv[2] and
  (optional) argv[3]."""
  ints = lambda text: [int(x) for x in text.split(",")]
  variants = sys.argv[3] if len(sys.argv) > 3 else default_variants
  return ints(sys.argv[1]), ints(sys.argv[2]), variants.split(",")


def synthetic_pools(contexts, lay: PageLayout = LAYOUT_27B):
  """Yield (context, pages, pool, contiguous table) of each context (`synthetic_pool`)."""
  for ctx in contexts:
    n_pages = ctx // lay.page_tokens
    yield (ctx, n_pages) + synthetic_pool(lay, n_pages)


def last_queries(ctx: int, s: int, q_heads: int = 24, head_dim: int = 256):
  """(q [s, q_heads, head_dim] f32 normal (seeded by s), q_pos [s]: the last s positions)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  q = jax.random.normal(jax.random.PRNGKey(s), (s, q_heads, head_dim), jnp.float32)
  return q, jnp.arange(ctx - s, ctx, dtype=jnp.int32)


def first_run(call, *args, label: str = ""):
  """(output as numpy, seconds of the first call: trace + compile + run), or None after printing
  `label | failed: <error>` (a variant the shape refuses: the run goes on)."""
  t = time.perf_counter()
  try:
    out = np.asarray(call(*args))
  except Exception as e:  # pylint: disable=broad-except
    print(f"{label} | failed: {str(e)[:400]}", flush=True)
    return None
  return out, time.perf_counter() - t


def synthetic_pool(lay: PageLayout, n_pages: int):
  """(pool [n_pages + 8, page_bytes] u8 of random bytes with finite f16 scales, the contiguous
  table [n_pages]): every scale's high byte below 0x3c (each byte masked with 0x3B)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  pool = jax.random.randint(jax.random.PRNGKey(0), (n_pages + 8, lay.page_bytes), 0, 256,
                            jnp.int32).astype(jnp.uint8)
  return pool & jnp.uint8(0x3B), jnp.arange(n_pages, dtype=jnp.int32)


# ----------------------------------------------------------------------------- Mosaic GPU probes


def interp(f, *args):
  """(f(*args) jitted in the Mosaic GPU interpreter, None) or (None, the error in one line)."""
  # pylint: disable=import-outside-toplevel,g-import-not-at-top
  import jax
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  from jax._src.pallas.mosaic_gpu.interpret import params as ip
  try:
    with ip.force_gpu_interpret_mode(ip.InterpretGPUParams()):
      return jax.jit(f)(*args), None
  except Exception as e:  # pylint: disable=broad-except
    ipc.reset_gpu_interpret_mode_state()
    return None, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def lower(f, *args):
  """"LOWER OK", or "LOWER FAIL" and the error: the real Pallas -> Mosaic GPU lowering (Python
  side) for CUDA, no GPU needed."""
  import jax  # pylint: disable=import-outside-toplevel
  try:
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    return "LOWER OK"
  except Exception as e:  # pylint: disable=broad-except
    msg = " | ".join(l for l in str(e).splitlines() if l.strip())
    return f"LOWER FAIL {type(e).__name__}: " + msg[:600]


def check(name, f, args, ref=None):
  """Prints `[name] INTERP OK [match / MISMATCH against ref]` (or the failure) and `[name]
  LOWER ...`; returns the interpreter's output."""
  import jax  # pylint: disable=import-outside-toplevel
  out, err = interp(f, *args)
  if err:
    print(f"[{name}] INTERP FAIL {err}")
  else:
    same = lambda a, b: np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                    atol=1e-2)
    ok = "" if ref is None else ("match" if all(same(a, b) for a, b in zip(
        jax.tree.leaves(out), jax.tree.leaves(ref))) else "MISMATCH")
    print(f"[{name}] INTERP OK {ok}")
  print(f"[{name}] {lower(f, *args)}")
  return out
