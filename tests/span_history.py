"""Random K/V histories encoded into KV pages, placeable anywhere in a pool (span-attention tests)."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from kvjax_pallas import ggml_codec
from kvjax_pallas.page_layout import PageLayout


class History:
  """Random K/V history encoded into pages, placeable anywhere in a pool."""

  def __init__(self, layout: PageLayout, tokens: int, seed: int, pool_pages: int = 0,
               table_len: int = 0):
    """pool_pages / table_len: every pool this history places has at least that many physical
    pages (random bytes past the placed ones) and every page table that many entries (junk past
    the active pages), so that placements of one history share their shapes (a kernel compiles
    once for them)."""
    rng = np.random.default_rng(seed)
    self.layout, self.tokens = layout, tokens
    self.pool_pages, self.table_len = pool_pages, table_len
    self.num_pages = layout.pages_for(tokens)
    alloc = self.num_pages * layout.page_tokens  # slots past kv_len hold future tokens
    g, d = layout.num_kv_heads, layout.head_dim
    k = rng.standard_normal((alloc, g, d)).astype(np.float32) * 1.5
    v = rng.standard_normal((alloc, g, d)).astype(np.float32)
    self.k_bytes = np.asarray(ggml_codec.encode_rows(jnp.asarray(k), layout.k_type))
    self.v_bytes = np.asarray(ggml_codec.encode_rows(jnp.asarray(v), layout.v_type))
    self.k_tgd = np.asarray(ggml_codec.decode_rows(jnp.asarray(self.k_bytes), layout.k_type, g))
    self.v_tgd = np.asarray(ggml_codec.decode_rows(jnp.asarray(self.v_bytes), layout.v_type, g))
    self.rng = rng

  def pool(self, physical, num_phys: int, table_len: int):
    """Pool of random bytes with logical page i at physical[i]; table padded with junk."""
    lay, pt = self.layout, self.layout.page_tokens
    num_phys, table_len = max(num_phys, self.pool_pages), max(table_len, self.table_len)
    pool = self.rng.integers(0, 256, (num_phys, lay.page_bytes), dtype=np.uint8)
    for i, p in enumerate(physical):
      pool[p, :lay.k_plane_bytes] = self.k_bytes[i * pt:(i + 1) * pt].reshape(-1)
      pool[p, lay.v_offset:lay.v_offset + lay.v_plane_bytes] = self.v_bytes[i * pt:(i + 1) * pt].reshape(-1)
    table = np.full(table_len, 10 ** 6, np.int32)  # entries past the active pages are ignored
    table[:len(physical)] = physical
    return jnp.asarray(pool), jnp.asarray(table)

  def contiguous(self, extra: int = 2):
    return self.pool(np.arange(self.num_pages), self.num_pages + extra, self.num_pages + extra)

  def resident_ring(self, resident: int, ring_base: int, ring_slots: int, wrap: int):
    """First `resident` pages at physical 1..; the rest in a ring that wraps at `wrap`."""
    n = self.num_pages
    ring_slots = max(ring_slots, n - resident + 1)  # real shapes have more pages
    phys = [1 + i for i in range(min(resident, n))]
    phys += [ring_base + (wrap + j) % ring_slots for j in range(n - len(phys))]
    assert len(set(phys)) == n
    return self.pool(np.asarray(phys), ring_base + ring_slots, n + 3)

  def shuffled(self, seed: int):
    """Logical pages at random distinct physical pages of a pool 3 pages larger."""
    n = self.num_pages
    phys = np.random.default_rng(seed).permutation(n + 3)[:n]
    return self.pool(phys, n + 3, n + 3)


def rel_error(a, b) -> float:
  """||a - b|| / ||b|| in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_against_reference(out, hist: History, q, pool, table, q_pos, *, block_pages: int,
                            tol: float):
  """A kernel's output over `hist` (pool / table placement) against the jnp reference on the
  same inputs and the float64 oracle over the decoded history: finite, same shape, relative
  error <= tol against each."""
  # pylint: disable=import-outside-toplevel
  from kvjax_pallas.span_attention import reference as ref
  out = np.asarray(out)
  want = np.asarray(ref.span_attention_reference(q, pool, table, hist.tokens, q_pos,
                                                 layout=hist.layout, block_pages=block_pages))
  assert out.shape == want.shape and np.isfinite(out).all()
  assert rel_error(out, want) <= tol, rel_error(out, want)
  oracle = ref.dense_attention_f64(q, hist.k_tgd, hist.v_tgd, np.asarray(q_pos), hist.tokens)
  assert rel_error(out, oracle) <= tol, rel_error(out, oracle)


# The span-kernel tests' shapes: the 27B attention geometry and a small one for the interpreters.
REAL_SHAPE = dict(kv_heads=4, q_heads=24, head_dim=256, page_tokens=256)
SMALL_SHAPE = dict(kv_heads=2, q_heads=6, head_dim=256, page_tokens=64)


def shape_layout(shape, pair=("q8_0", "q4_0")) -> PageLayout:
  """The PageLayout of a test shape (kv_heads, head_dim, page_tokens) and K/V pair."""
  return PageLayout(shape["kv_heads"], shape["head_dim"], pair[0], pair[1], shape["page_tokens"])


def random_query(seed: int, s: int, h: int, d: int, kv_len: int):
  """(q [s, h, d] float32 normal, q_pos [s]: the last s positions before kv_len)."""
  q = np.random.default_rng(seed).standard_normal((s, h, d)).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(np.arange(kv_len - s, kv_len, dtype=np.int32))


def kernel_placement_and_waves(call, partial, shape, tokens: int, block_pages: int, s_tok: int,
                               interpret: bool, query_seed: int):
  """`check_placement_and_waves` of a kernel's whole call and partial (each taking layout,
  block_pages, interpret; the partial num_q_heads) on a History of `tokens` tokens (seed 11) at a
  test shape, s_tok random query tokens (`random_query(query_seed, ...)`) -> (the output, the
  history, q, q_pos). The three placements share one pool and table shape (the call compiles
  once)."""
  # pylint: disable=import-outside-toplevel
  import functools
  layout, h = shape_layout(shape), shape["q_heads"]
  n = layout.pages_for(tokens)
  hist = History(layout, tokens, seed=11, pool_pages=2 * n + 2, table_len=n + 3)
  q, q_pos = random_query(query_seed, s_tok, h, shape["head_dim"], tokens)
  kw = dict(layout=layout, block_pages=block_pages, interpret=interpret)
  one = check_placement_and_waves(functools.partial(call, **kw),
                                  functools.partial(partial, num_q_heads=h, **kw), hist, q, q_pos)
  return one, hist, q, q_pos


def lowered_at_real_shape(call, s_tok: int, kv_len: int) -> str:
  """The text of call(q, pool, table, kv_len, q_pos, layout=<the 27B layout>, block_pages=2)
  lowered for "cuda" on zero inputs at the 27B attention geometry (REAL_SHAPE; 7 pages, a table
  of 5, s_tok query tokens at positions 1000..)."""
  layout = shape_layout(REAL_SHAPE)
  q = jnp.zeros((s_tok, REAL_SHAPE["q_heads"], REAL_SHAPE["head_dim"]), jnp.float32)
  pool = jnp.zeros((7, layout.page_bytes), jnp.uint8)
  table = jnp.arange(5, dtype=jnp.int32)
  q_pos = jnp.arange(s_tok, dtype=jnp.int32) + 1000

  def f(q, pool, table, kv_len, q_pos):
    return call(q, pool, table, kv_len, q_pos, layout=layout, block_pages=2)

  return jax.jit(f).trace(q, pool, table, jnp.int32(kv_len), q_pos).lower(
      lowering_platforms=("cuda",)).as_text()


def check_placement_and_waves(call, partial, hist: History, q, q_pos):
  """call(q, pool, table, kv_len, q_pos) -> o over three placements of `hist` (contiguous,
  shuffled, resident + ring with wraps) gives the same bits, and so do three waves of
  partial(q, pool, table, kv_len, q_pos, carry, tile_begin, tile_end) over the shuffled one
  (boundaries at multiples of `block_pages`: partial.keywords["block_pages"]). -> the output."""
  # pylint: disable=import-outside-toplevel
  from kvjax_pallas.span_attention import reference as ref
  layout, tokens = hist.layout, hist.tokens
  s_tok, h, d = q.shape
  bp = partial.keywords["block_pages"]
  pool_a, table_a = hist.contiguous()
  pool_b, table_b = hist.shuffled(seed=5)
  pool_c, table_c = hist.resident_ring(resident=1, ring_base=hist.num_pages + 2, ring_slots=3,
                                       wrap=2)
  one = np.asarray(call(q, pool_a, table_a, tokens, q_pos))
  for pool, table in ((pool_b, table_b), (pool_c, table_c)):
    np.testing.assert_array_equal(one, np.asarray(call(q, pool, table, tokens, q_pos)))
  carry = ref.init_carry(layout.num_kv_heads, s_tok * h // layout.num_kv_heads, d)
  for a, b in ((0, bp), (bp, 2 * bp), (2 * bp, table_b.shape[0])):
    carry = partial(q, pool_b, table_b, jnp.int32(tokens), q_pos, carry, jnp.int32(a),
                    jnp.int32(b))
  np.testing.assert_array_equal(one, np.asarray(ref.finalize(carry, h)))
  return one
