"""The forward runner: one compiled step per layer group, KV through a provider.

`Runner` splits the NNX model once (`nnx.split`) and calls plain `jax.jit` steps on `(graphdef, state, ...)`:
`embed` (tokens -> x), `group` (one LayerGroup: 3 GDN blocks + 1 attention block for the 27B; all groups
share one compiled executable per (rows, chunked) shape), `head` (final norm + output projection on
selected rows), `mtp` (the attached MTP block, its own KV cache layer).

KV is reached through a `KVProvider`: before each attention layer the runner asks it for `(pool_pn, table_t)`
(the pool holding that layer's pages and the layer's logical -> physical page table), and hands back the
updated pool and the encoded rows written. The plain cache (`PlainKV`) is an all-resident pool with identity
tables; the streamed cache (`kvjax.streaming`) stages resident pages and ring slots behind the same three
calls. Both run the same compiled attention code, which is what makes bit-exact comparison possible.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, Iterable, NamedTuple, Optional, Protocol, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import executables
from kvjax.config import MTP_OPTIONAL, ModelConfig, gguf_tensor_shapes
from kvjax.qweights import QuantizedWeight, with_dtype
from kvjax.model import AttentionOptions, KVRows, Qwen38, attend_wave, rows_form_of, empty_carry, layer_groups, \
    output_head, param_path, rms_norm, zero_recurrent_state
from kvjax.streaming.placement import place_pages
from kvjax_pallas.span_attention import api as span_api
from kvjax_pallas.page_layout import PageLayout


# --- building a model from GGUF-named tensors (tensor by tensor) ---

def _set_path(state, name, path, value):
  node = state
  try:
    for p in path[:-1]:
      node = node[p]
    var = node[path[-1]]
  except (KeyError, IndexError, TypeError):
    raise ValueError(f"tensor {name!r} is not a parameter of this model") from None
  cur = var.get_value()
  if tuple(cur.shape) != tuple(value.shape):
    raise ValueError(f"tensor {name!r}: expected shape {tuple(cur.shape)}, found {tuple(value.shape)}")
  if isinstance(value, QuantizedWeight):   # kept in its ggml blocks, computing in the model's dtype
    var.set_value(with_dtype(value, jnp.dtype(cur.dtype).name))
  else:
    var.set_value(jnp.asarray(value, dtype=cur.dtype))


def build_model(cfg: ModelConfig, tensors: Iterable[Tuple[str, np.ndarray]], dtype=jnp.float32,
                names: Optional[Iterable[str]] = None) -> Qwen38:
  """Qwen38 from `(gguf_name, array)` pairs, placing one tensor at a time (no full f32 copy).

  Optional MTP shared-head tensors are used when present. `names` (all tensor
  names, if known up front) decides which optional parameters exist; otherwise
  the iterable is materialised into a list of names first.
  """
  tensors = list(tensors) if names is None else tensors
  names = set(names) if names is not None else {n for n, _ in tensors}
  if cfg.tie_embeddings != ("output.weight" not in names):
    cfg = dataclasses.replace(cfg, tie_embeddings="output.weight" not in names)
  mb = cfg.mtp_block
  abstract = nnx.eval_shape(lambda: Qwen38(
      cfg, dtype, mtp_shared_head_norm=f"blk.{mb}.nextn.shared_head_norm.weight" in names,
      mtp_shared_head_head=f"blk.{mb}.nextn.shared_head_head.weight" in names))
  graphdef, state = nnx.split(abstract)
  filled = set()
  for name, arr in tensors:
    if name.endswith("nextn.embed_tokens.weight"):
      continue  # llama.cpp ignores the NextN copy of the embeddings; so do we
    try:
      path = param_path(cfg, name)
    except (KeyError, ValueError):
      raise ValueError(f"tensor {name!r} is not a parameter of this model") from None
    _set_path(state, name, path, arr)
    filled.add(name)
  optional = {f"blk.{mb}.{leaf}" for leaf in MTP_OPTIONAL}
  missing = sorted(n for n in gguf_tensor_shapes(cfg) if n not in filled and n not in optional
                   and n != f"blk.{mb}.nextn.embed_tokens.weight")
  if missing:
    raise ValueError(f"tensors not provided: {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                     f"({len(missing)} of {len(gguf_tensor_shapes(cfg))})")
  return nnx.merge(graphdef, state)


def model_tensors(model: Qwen38) -> Dict[str, np.ndarray]:
  """Inverse of `build_model`: GGUF name -> numpy array."""
  from kvjax.config import gguf_tensor_shapes
  cfg = model.cfg
  _, state = nnx.split(model)
  out = {}
  for name in gguf_tensor_shapes(cfg):
    node = state
    try:
      for p in param_path(cfg, name):
        node = node[p]
    except (KeyError, IndexError, TypeError):
      continue
    value = node.get_value()
    out[name] = np.asarray(value.dequantize() if isinstance(value, QuantizedWeight) else value)
  return out


# --- KV providers ---

class LayerKV(NamedTuple):
  """What one attention layer's compiled step takes from a KV provider: the pool, the layer's page
  table, and staged pages the runner places into the pool before the step (`Runner.place`)."""
  pool_pn: jax.Array                    # [P, page_bytes] uint8 (donated to the step)
  table_t: jax.Array                    # [table pages] int32: logical page -> pool page
  stage: Tuple[jax.Array, ...] = ()     # [n_i, page_bytes] uint8 device arrays
  pieces: Optional[Tuple[jax.Array, ...]] = None   # per staged array [k, 3] int32: (base, lo, hi) per run
  waves: int = 1                        # > 1: the layer's pages come in copy waves (`wave_kv`)
  tiles: Tuple[int, int] = (0, 0)       # a wave's logical pages [lo, hi) (waves > 1 only)


class KVProvider(Protocol):
  """`begin_forward(..., wave_pages)`: the attention call's logical partition in pages; a provider
  that streams a layer in copy waves puts every wave boundary on a multiple of it (then waves give
  the bits of one call). `wave_kv(a, w)` (only when `layer_kv(a).waves > 1`) gives wave w >= 1.
  `lease_mtp(end_tokens)` holds device pages for the MTP layer's history up to `end_tokens` until
  `release_lease()` (-> bytes loaded). `defer_rows(on)`: rows published at `truncate`, not at the
  forward's end; `end_layer(rows=None)`: rows not to publish."""
  def begin_forward(self, pos: int, n_tokens: int, cache_layers: Tuple[int, ...], wave_pages: int = 1) -> None: ...
  def layer_kv(self, cache_layer: int) -> LayerKV: ...
  def wave_kv(self, cache_layer: int, wave: int) -> LayerKV: ...
  def end_layer(self, cache_layer: int, pool_pn: jax.Array, rows: KVRows) -> None: ...
  def end_forward(self) -> None: ...
  def truncate(self, cache: str, tokens: int) -> None: ...
  def lease_mtp(self, end_tokens: int) -> int: ...
  def release_lease(self) -> None: ...
  def defer_rows(self, on: bool) -> None: ...


def cache_layers_of(cfg: ModelConfig) -> Tuple[int, ...]:
  """Logical KV cache layers: target attention layers 0..L-1, then the MTP layer L."""
  return tuple(range(cfg.num_attention_layers + (1 if cfg.has_mtp else 0)))


class PlainKV:
  """The stock cache: every page resident, layer l's pages contiguous (identity page tables)."""

  def __init__(self, cfg: ModelConfig, layout: PageLayout, max_tokens: int):
    self.layout = layout
    self.n_layers = len(cache_layers_of(cfg))
    self.pages_per_layer = layout.pages_for(max_tokens)
    self.max_tokens = self.pages_per_layer * layout.page_tokens
    self.pool_pn = on_device(jnp.zeros((self.n_layers * self.pages_per_layer, layout.page_bytes), jnp.uint8))
    self.tables_lt = on_device(jnp.arange(self.n_layers * self.pages_per_layer, dtype=jnp.int32).reshape(
        self.n_layers, self.pages_per_layer))
    # one device array a layer, made once: indexing `tables_lt` in `layer_kv` ran an eager slice for every layer
    self._table_of = tuple(self.tables_lt[a] for a in range(self.n_layers))
    self.h2d_bytes = 0
    self.d2h_bytes = 0

  def begin_forward(self, pos, n_tokens, cache_layers, wave_pages=1):
    if pos + n_tokens > self.max_tokens:
      raise ValueError(f"context full: {pos + n_tokens} tokens needed, cache holds {self.max_tokens} "
                       f"({pos + n_tokens - self.max_tokens} more; raise --ctx-size)")

  def layer_kv(self, cache_layer):
    return LayerKV(self.pool_pn, self._table_of[cache_layer])

  def wave_kv(self, cache_layer, wave):
    raise RuntimeError("the plain cache attends every layer in one call (no copy waves)")

  def end_layer(self, cache_layer, pool_pn, rows):
    self.pool_pn = pool_pn

  def end_forward(self):
    pass

  def truncate(self, cache: str, tokens: int) -> None:
    """Forget rows >= tokens of "target" or "mtp": rows past a forward's kv_len are never read."""
    if cache not in ("target", "mtp"):
      raise ValueError(f"unknown logical cache {cache!r}; caches: target, mtp")

  def lease_mtp(self, end_tokens: int) -> int:
    """Every page is resident: nothing to lease or load (`StreamedKV.lease_mtp`)."""
    del end_tokens
    return 0

  def release_lease(self) -> None:
    pass

  def defer_rows(self, on: bool) -> None:   # the pool is the cache: no rows to publish
    pass

  def layer_bytes(self, cache_layer: int, n_tokens: int) -> np.ndarray:
    """Host copy of the first pages of one layer (for byte-level comparisons)."""
    pages = self.layout.pages_for(n_tokens)
    first = cache_layer * self.pages_per_layer
    return np.asarray(self.pool_pn[first:first + pages])

  def metrics(self):
    return {"h2d_bytes": 0, "d2h_bytes": 0}


# --- compiled steps ---

class StaticStructure:
  """A hashable, cheaply hashed stand-in for an NNX graphdef + state treedef (a static jit argument).

  Hashing an NNX GraphDef (and flattening an nnx.State) walks the whole structure in Python on every
  call, a cost paid 16 times a 27B decode forward (docs/log/performance-log.md, "Provider overhead
  without streaming"). The hash is computed once here; the state travels as a flat tuple of arrays.
  """
  __slots__ = ("graphdef", "treedef", "_hash")

  def __init__(self, graphdef, treedef):
    self.graphdef, self.treedef = graphdef, treedef
    self._hash = hash((graphdef, treedef))

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return self is other or (isinstance(other, StaticStructure) and self._hash == other._hash
                             and self.graphdef == other.graphdef and self.treedef == other.treedef)


def split_static(module):
  """-> (StaticStructure, tuple of state leaves): the module in the form the compiled steps take."""
  graphdef, state = nnx.split(module)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  return StaticStructure(graphdef, treedef), tuple(leaves)


def intern_structures(pairs):
  """[(StaticStructure, leaves)] with equal structures replaced by one object: the compiled steps'
  cache then matches a group's key by identity instead of comparing graphdefs (a deep walk, once per
  group of every forward otherwise)."""
  seen = {}
  return [(seen.setdefault(s, s), leaves) for s, leaves in pairs]


def on_device(tree):
  """The arrays of `tree` committed to the default device (no copy when they are already there).

  jit caches an executable per argument placement as well as per shape: a committed array (the
  output of a step that took one, a staged page, a restored checkpoint) and an uncommitted one of the
  same shape lower separately, so a run that mixed them compiled each group step twice
  (docs/log/performance-log.md, "Facts moved out of the code"). The runner's parameters, zero
  states and the caches' pools are committed, so every step output is."""
  return jax.device_put(tree, default_device())


def zeros_on_device(shape, dtype):
  """Zeros committed to the device, put there from the host: each new shape of `jnp.zeros` compiles a
  broadcast program (120-180 ms each on a GPU, 7-10 shapes in a streamed cold start's inert runs). For the
  small and mid-sized arguments of inert runs; a pool stays `jnp.zeros`."""
  return on_device(np.zeros(shape, dtype))


def default_device():
  """The device new arrays go to: `jax.default_device`'s when one is set (a tensor-parallel cache builds and
  drives one provider per device under it: `kvjax.parallel`), else the first device."""
  dev = jax.config.jax_default_device
  return dev if isinstance(dev, jax.Device) else jax.devices()[0]


def merge_static(structure: StaticStructure, leaves):
  return nnx.merge(structure.graphdef, jax.tree_util.tree_unflatten(structure.treedef, list(leaves)))


@executables.jit(donate_argnames=("pool_pn",))
def place_staged(pool_pn, rows_rn, pieces_k3):
  """Staged pages into the pool before a layer's step: `rows_rn [c, page_bytes]` (one staged array),
  `pieces_k3[k] = (base, lo, hi)` its contiguous destination runs (`kvjax.streaming.placement.place_rows`). Apart
  from the layer steps, so that their compiled shapes do not follow the staged arrays: one program
  per staged shape, and the stage's shapes come from a fixed set (`StreamedKV`)."""
  return place_pages(pool_pn, (rows_rn,), pieces_k3[None])


def _layer_group(graphdef, state, x_se, rec_states, pool_pn, table_t, pos, n_valid, *, layout, opts, chunked,
                 capture=False):
  """One LayerGroup. `graphdef` is a `StaticStructure`, `state` its flat leaves."""
  group = merge_static(graphdef, state)
  return group(x_se, rec_states, pool_pn, table_t, pos, n_valid, layout, opts, chunked, capture)


_GROUP_STATIC = ("graphdef", "layout", "opts", "chunked", "capture")
_group_step = executables.jit(_layer_group, name="group_step", static_argnames=_GROUP_STATIC,
                              donate_argnames=("pool_pn",), params="state")
# the same step, its outputs in x_se's and the states' buffers (`Runner.forward(donate=True)`)
_donating_group_step = executables.jit(_layer_group, name="donating_group_step", static_argnames=_GROUP_STATIC,
                                       donate_argnames=("pool_pn", "x_se", "rec_states"), params="state")


@executables.jit(static_argnames=("graphdef", "layout", "chunked", "capture"), params="state")
def _group_attn_begin(graphdef, state, x_se, rec_states, pos, n_valid, *, layout, chunked, capture=False):
  """A group whose attention runs in copy waves (`_wave_step`), up to span attention:
  -> (x_se after the recurrent blocks, states, q_shd, gate_se, rows, the empty carry the first wave
  folds into: every wave then runs one program)."""
  group = merge_static(graphdef, state)
  x_se, states = group.run_recurrent(x_se, rec_states, n_valid, chunked, capture)
  q_shd, gate_se, rows = group.attention.attend_begin(x_se, pos, layout)
  return x_se, states, q_shd, gate_se, rows, empty_carry(q_shd, layout)


@executables.jit(static_argnames=("graphdef",), params="state")
def _group_attn_end(graphdef, state, x_se, carry, gate_se):
  """The rest of the group after its last wave: the carry normalised, gate, output, FFN."""
  block = merge_static(graphdef, state).attention
  o_shd = span_api.finalize(carry, block.mixer.cfg.num_attention_heads)
  return block.attend_end(x_se, o_shd, gate_se)


@executables.jit(static_argnames=("layout", "opts"), donate_argnames=("pool_pn",))
def _wave_step(pool_pn, table_t, rows, q_shd, carry, pos, n_valid, tile_begin, tile_end, *, layout, opts):
  return attend_wave(pool_pn, table_t, rows, q_shd, carry, pos, n_valid, tile_begin, tile_end, layout, opts)


@executables.jit
def _embed_step(token_embd_ve, tokens_s):
  return token_embd_ve[tokens_s]


@executables.jit(static_argnames=("eps",))
def _head_step(output_norm_e, output_ve, x_se, rows_r, *, eps):
  """-> (logits of the selected rows [R, V] f32, post-norm hidden of every row [S, E])."""
  logits, _ = output_head(x_se[rows_r], output_norm_e, output_ve, eps)
  return logits, rms_norm(x_se, output_norm_e, eps)


@executables.jit(static_argnames=("eps",))
def _norm_step(output_norm_e, x_se, *, eps):
  """The post-norm hidden of every row [S, E] (`_head_step`'s, without logits)."""
  return rms_norm(x_se, output_norm_e, eps)


@executables.jit(static_argnames=("graphdef", "layout", "opts"), donate_argnames=("pool_pn",), params="state")
def _mtp_step(graphdef, state, token_embd_ve, output_norm_e, output_ve, hn_se, next_tokens_s, pool_pn,
              table_t, pos, n_valid, *, layout, opts):
  mtp = merge_static(graphdef, state)
  return mtp(hn_se, token_embd_ve[next_tokens_s], output_norm_e, output_ve, pool_pn, table_t, pos, n_valid,
             layout, opts)


@executables.jit(static_argnames=("graphdef", "layout", "opts", "steps"), donate_argnames=("pool_pn",), params="state")
def _mtp_draft_steps(graphdef, state, token_embd_ve, output_norm_e, output_ve, hm_1e, d, p, p_min, pool_pn,
                     table_t, pos, limit, *, layout, opts, steps):
  """MTP drafting as one program: from the candidate `d` (top-1 probability `p`) proposed by the MTP hidden
  `hm_1e`, up to `steps` draft steps, step i feeding (its hidden, its candidate) at MTP position pos + i,
  while i < `limit` and every candidate so far reached `p_min`. -> (candidates [steps + 1] int32 and their
  top-1 probabilities [steps + 1] f32, `d` / `p` first (-1 / -1.0 where not reached), pool_pn, the rows of
  every step `KVRows [steps, ...]` (zero where not run)). The loop always takes `steps` trips, a trip past the
  stop masked (its row not written: n_valid 0): a loop whose condition is a device value is read by the host
  every trip, which waited there for the device to finish the verify before it."""
  mtp = merge_static(graphdef, state)
  kb, vb = layout.k_row_bytes, layout.v_row_bytes
  cand_d = jnp.full((steps + 1,), -1, jnp.int32).at[0].set(d)
  cand_p = jnp.full((steps + 1,), -1.0, jnp.float32).at[0].set(p)
  rows0 = KVRows(jnp.zeros((steps, kb), jnp.uint8), jnp.zeros((steps, vb), jnp.uint8))

  def step(i, c):
    run, hm, d, p, pool, cand_d, cand_p, rows = c
    run = run & (i < limit) & (p >= p_min)
    logits, hm, pool, r = mtp(hm, token_embd_ve[d[None]], output_norm_e, output_ve, pool, table_t, pos + i,
                              run.astype(jnp.int32), layout, opts)
    probs = jax.nn.softmax(logits[0].astype(jnp.float32))
    d = jnp.argmax(probs).astype(jnp.int32)
    p = probs[d]
    rows = KVRows(rows.k_sn.at[i].set(jnp.where(run, r.k_sn[0], 0)), rows.v_sn.at[i].set(jnp.where(run, r.v_sn[0], 0)))
    return (run, hm, d, p, pool, cand_d.at[i + 1].set(jnp.where(run, d, -1)),
            cand_p.at[i + 1].set(jnp.where(run, p, -1.0)), rows)

  c = jax.lax.fori_loop(0, steps, step, (jnp.bool_(True), hm_1e, jnp.asarray(d, jnp.int32),
                                         jnp.asarray(p, jnp.float32), pool_pn, cand_d, cand_p, rows0))
  return c[5], c[6], c[4], c[7]


@executables.jit(static_argnames=("graphdef", "layout"), params="state")
def _mtp_attn_begin(graphdef, state, token_embd_ve, hn_se, next_tokens_s, pos, *, layout):
  """The MTP head up to span attention (copy waves): -> (u_se, q_shd, gate_se, rows, empty carry)."""
  mtp = merge_static(graphdef, state)
  u = mtp.block_input(hn_se, token_embd_ve[next_tokens_s])
  q_shd, gate_se, rows = mtp.block.attend_begin(u, pos, layout, rope_offset=1)
  return u, q_shd, gate_se, rows, empty_carry(q_shd, layout)


@executables.jit(static_argnames=("graphdef",), params="state")
def _mtp_attn_end(graphdef, state, output_norm_e, output_ve, u_se, carry, gate_se):
  mtp = merge_static(graphdef, state)
  o_shd = span_api.finalize(carry, mtp.block.mixer.cfg.num_attention_heads)
  return mtp.head(mtp.block.attend_end(u_se, o_shd, gate_se), output_norm_e, output_ve)


# How each step's arguments and results divide over devices sharding the KV heads (`kvjax.parallel` builds a
# shard_map a step from this table): PARAMS the parameter leaves (a spec each), SAME the same array on every
# device, HEADS split by KV head along axis 0 (pools, tables, states, queries).
PARAMS, SAME, HEADS = "params", "same", "heads"


class StepRoles(NamedTuple):
  step: Callable                 # a jitted engine step (its Python body runs per device)
  inputs: Tuple[str, ...]        # the roles of its array arguments, after the static graphdef
  outputs: Tuple[str, ...]
  graphdef: bool                 # whether its first argument is the module's static structure
  donate: Tuple[int, ...] = ()   # argument positions donated (the pool)


STEP_ROLES: Dict[str, StepRoles] = {
    "place_step": StepRoles(place_staged, (HEADS, HEADS, HEADS), (HEADS,), False, (0,)),
    "group_step": StepRoles(_group_step, (PARAMS, SAME, HEADS, HEADS, HEADS, SAME, SAME), (SAME, HEADS, HEADS, HEADS),
                            True, (4,)),
    "donating_group_step": StepRoles(_donating_group_step, (PARAMS, SAME, HEADS, HEADS, HEADS, SAME, SAME),
                                     (SAME, HEADS, HEADS, HEADS), True, (2, 3, 4)),
    "group_attn_begin": StepRoles(_group_attn_begin, (PARAMS, SAME, HEADS, SAME, SAME),
                                  (SAME, HEADS, HEADS, HEADS, HEADS, HEADS), True),
    "group_attn_end": StepRoles(_group_attn_end, (PARAMS, SAME, HEADS, HEADS), (SAME,), True),
    "wave_step": StepRoles(_wave_step, (HEADS,) * 5 + (SAME,) * 4, (HEADS, HEADS), False, (0,)),
    "mtp_step": StepRoles(_mtp_step, (PARAMS,) + (SAME,) * 5 + (HEADS, HEADS, SAME, SAME), (SAME, SAME, HEADS, HEADS),
                          True, (7,)),
    "mtp_attn_begin": StepRoles(_mtp_attn_begin, (PARAMS,) + (SAME,) * 4, (SAME, HEADS, HEADS, HEADS, HEADS), True),
    "mtp_attn_end": StepRoles(_mtp_attn_end, (PARAMS, SAME, SAME, SAME, HEADS, HEADS), (SAME, SAME), True),
}


def select_row(captured_states, row: int):
  """Recurrent states captured per row (`capture_states=True`) -> the states after `row` (one compiled call
  for the whole tree, the row a traced index: no compile per row)."""
  return _select_row(captured_states, executables.int32_arg(row))


@executables.jit
def _select_row(captured_states, row):
  return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, row, keepdims=False), captured_states)


class ForwardOut(NamedTuple):
  logits_rv: jax.Array   # [R, V] float32 for the requested rows
  hn_se: jax.Array       # [S, E] post-final-norm hidden of every row (of the last chunk: `chunk_rows`)
  rec_states: tuple      # per group, per recurrent block
  hn_chunks: tuple = ()  # [chunk_rows, E] post-final-norm hidden of each chunk holding a valid row


class Runner:
  """Runs the split model group by group against a KV provider. The compiled steps are class attributes, so a
  runner over a device mesh (`kvjax.parallel.ShardedRunner`) drives the same loop with its per-device steps."""
  place_step = staticmethod(place_staged)
  group_step = staticmethod(_group_step)
  donating_group_step = staticmethod(_donating_group_step)
  group_attn_begin = staticmethod(_group_attn_begin)
  group_attn_end = staticmethod(_group_attn_end)
  wave_step = staticmethod(_wave_step)
  mtp_step = staticmethod(_mtp_step)
  mtp_attn_begin = staticmethod(_mtp_attn_begin)
  mtp_attn_end = staticmethod(_mtp_attn_end)
  mtp_draft_steps = staticmethod(_mtp_draft_steps)    # None: a runner drafts step by step

  def __init__(self, model: Qwen38, layout: PageLayout, opts: AttentionOptions = AttentionOptions()):
    self.cfg, self.layout, self.opts = model.cfg, layout, opts
    self.gdn_form = rows_form_of(model)   # the rows' delta rule (form, interpret): a rollback replays by it
    self.groups = [(structure, on_device(leaves))
                   for structure, leaves in intern_structures([split_static(g) for g in model.groups])]
    self.n_recurrent = [len(g.recurrent) for g in model.groups]
    self.attn_index = []  # cache layer of each group's attention block (or None)
    a = 0
    for _, att in layer_groups(self.cfg):
      self.attn_index.append(a if att is not None else None)
      a += att is not None
    self.token_embd, self.output_norm, self.output = on_device(
        (model.token_embd[...], model.output_norm[...], model.output_weight()))
    if model.mtp is not None:
      mtp_structure, mtp_leaves = split_static(model.mtp)
      self.mtp = (mtp_structure, on_device(mtp_leaves))
    else:
      self.mtp = None
    self.mtp_layer = self.cfg.num_attention_layers if self.cfg.has_mtp else None

  def zero_states(self):
    return on_device(tuple(tuple(zero_recurrent_state(self.cfg) for _ in range(n)) for n in self.n_recurrent))

  def step_for(self, donate: bool, capture):
    """The group step a forward runs: the donating one when `donate` and no states are captured."""
    return self.donating_group_step if donate and not capture else self.group_step

  def forward(self, tokens_s, pos: int, n_valid: int, rec_states, kv: KVProvider,
              logits_rows: Optional[np.ndarray] = None, chunked: Optional[bool] = None, capture_states: bool = False,
              on_group_states: Optional[Callable[[int, tuple], tuple]] = None, chunk_rows: Optional[int] = None,
              with_hidden: bool = True, donate: bool = False) -> ForwardOut:
    """One forward of S rows (rows >= n_valid are padding) at positions pos..

    `chunked` (default: S > 1) picks the Gated DeltaNet form; `capture_states` (scan form) returns
    recurrent states with a leading row axis: the state after each row (see `select_row`).
    `on_group_states(group, states)`, when given, receives each group's new states as soon as its
    step is dispatched and returns what the forward keeps for that group (host-staged rollback
    moves captured checkpoints off the device group by group: `kvjax.speculative.HostRollback`).

    `chunk_rows` (a divisor of S): the forward runs group-major over chunks of that many rows: each
    layer group steps through the chunks in order (the programs and bits of forwards of
    `chunk_rows` rows one after another) while the provider holds the layer's pages once for all
    of them, so a streamed layer's history is uploaded once a forward rather than once a chunk (the
    prefill's block: `kvjax.generate.prefill`). `hn_se` is then the last chunk's and `hn_chunks`
    every valid chunk's (without `with_hidden`, only those of chunks holding a row of `logits_rows`).

    `donate` (no `capture_states`; the caller keeps no reference to `rec_states`): the group steps
    write hidden rows and states into their inputs' buffers (`_donating_group_step`).
    """
    s = int(tokens_s.shape[0])
    c = s if chunk_rows is None else int(chunk_rows)
    if c < 1 or s % c:
      raise ValueError(f"chunk_rows {c} does not divide the forward's {s} rows")
    chunked = (c > 1) if chunked is None else chunked
    if capture_states and (chunked or c < s):
      raise ValueError("capture_states needs the scan form in one chunk: pass chunked=False")
    opts = self.call_opts(c, kv)
    kv.begin_forward(pos, n_valid, tuple(a for a in self.attn_index if a is not None),
                     wave_pages=self.partition_pages(c, kv.max_tokens, kv))
    m = 1 if c == s else max(1, -(-n_valid // c))   # chunks that hold a valid row
    if c == s:
      xs = [_embed_step(self.token_embd, executables.int32_arg(tokens_s))]
    else:                                        # sliced on the host: no program per slice
      toks = np.asarray(tokens_s, np.int32)
      xs = [_embed_step(self.token_embd, np.array(toks[j * c:(j + 1) * c])) for j in range(m)]
    at = [(executables.int32_arg(pos + j * c), executables.int32_arg(min(c, n_valid - j * c))) for j in range(m)]
    new_states = []
    for g, ((gdef, gstate), st, a) in enumerate(zip(self.groups, rec_states, self.attn_index)):
      lkv = kv.layer_kv(a) if a is not None else LayerKV(None, None)
      rows = []
      if lkv.waves > 1:     # the layer's streamed pages exceed the ring: attention in copy waves
        begun = []
        for j in range(m):
          x_in, st, q, gate, r, empty = self.group_attn_begin(gdef, gstate, xs[j], st, *at[j], layout=self.layout,
                                                              chunked=chunked, capture=capture_states)
          begun.append((x_in, q, gate, empty))
          rows.append(r)
        pool_pn, carries = self._waves(kv, a, lkv, [(q, r, e) for (_, q, _, e), r in zip(begun, rows)], at, opts)
        xs = [self.group_attn_end(gdef, gstate, x_in, carry, gate)
              for (x_in, _, gate, _), carry in zip(begun, carries)]
      else:
        pool_pn = self.place(lkv)
        step = self.step_for(donate, capture_states)
        for j in range(m):
          xs[j], st, pool_pn, r = step(gdef, gstate, xs[j], st, pool_pn, lkv.table_t, *at[j], layout=self.layout,
                                       opts=opts, chunked=chunked, capture=capture_states)
          rows.append(r)
      if a is not None:
        kv.end_layer(a, pool_pn, rows[0] if m == 1 else tuple(rows))
      new_states.append(on_group_states(g, st) if on_group_states is not None else st)
    logits, hn = self._heads(xs, c, n_valid, logits_rows, with_hidden)   # dispatched before the provider waits
    kv.end_forward()
    return ForwardOut(logits, hn[-1], tuple(new_states), tuple(hn))

  def _heads(self, xs, c: int, n_valid: int, logits_rows, with_hidden: bool):
    """The output head over a forward's chunks: -> (logits of `logits_rows` (default: every valid
    row; indices into the forward's rows) [R, V], post-norm hidden [c, E] of each chunk (of those
    with a requested row only, without `with_hidden`))."""
    rows = np.arange(n_valid) if logits_rows is None else np.asarray(logits_rows)
    if len(xs) == 1:
      logits, hn = self.head(xs[0], rows)
      return logits, [hn]
    logits, hn = [], []
    for j, x in enumerate(xs):
      mine = rows[(rows >= j * c) & (rows < (j + 1) * c)] - j * c
      if len(mine):
        lg, h = self.head(x, mine)
        logits.append(lg)
        hn.append(h)
      elif with_hidden:
        hn.append(_norm_step(self.output_norm, x, eps=self.cfg.rms_eps))
    return (logits[0] if len(logits) == 1 else jnp.concatenate(logits, axis=0)), hn

  def _waves(self, kv: KVProvider, a: int, lkv: LayerKV, chunks, at, opts: AttentionOptions):
    """Attention of cache layer a in copy waves: each wave's pages through the ring, placed once,
    then every chunk's `(q_shd, rows, empty carry)` at its `(pos, n_valid)` attends them, each
    chunk's carry folded in logical order -> (pool_pn, carry of each chunk)."""
    pool_pn, carries = lkv.pool_pn, [empty for _, _, empty in chunks]
    int32 = executables.int32_arg
    for w in range(lkv.waves):
      wkv = lkv if w == 0 else kv.wave_kv(a, w)._replace(pool_pn=pool_pn)
      lo, hi = wkv.tiles
      pool_pn = self.place(wkv)
      for j, ((q_shd, rows, _), (pos, n_valid)) in enumerate(zip(chunks, at)):
        pool_pn, carries[j] = self.wave_step(pool_pn, wkv.table_t, rows, q_shd, carries[j], pos, n_valid,
                                             int32(lo), int32(hi), layout=self.layout, opts=opts)
    return pool_pn, carries

  def run_inert(self, pool_pn, table_t, rows: int, chunked: bool, capture: bool = False, kv=None):
    """A forward's programs of `rows` rows run once with inert arguments (no valid row: nothing
    written or attended; their first run, loading or compiling, before the phase's) -> the pool."""
    x, zero = zeros_on_device((rows, self.cfg.hidden_size), self.token_embd.dtype), jnp.int32(0)
    _embed_step(self.token_embd, np.zeros((rows,), np.int32))   # as a forward passes its ids
    states = self.zero_states()
    step = self.step_for(executables.donate_states(), capture)   # as `SequenceState.forward` runs them
    donate = step is self.donating_group_step
    for g, gdef, gstate, a in self.distinct_groups():
      out = step(gdef, gstate, zeros_on_device(x.shape, x.dtype) if donate else x, states[g],
                 pool_pn if a is not None else None, table_t if a is not None else None, zero, zero,
                 layout=self.layout, opts=self.call_opts(rows, kv), chunked=chunked, capture=capture)
      pool_pn = out[2] if a is not None else pool_pn
    self.head(x, np.zeros((1,), np.int32))
    return pool_pn

  def place(self, lkv: LayerKV):
    """The pool with the layer's staged pages placed (one `place_step` call a staged array)."""
    pool_pn = lkv.pool_pn
    for rows_rn, pieces_k3 in zip(lkv.stage, lkv.pieces or ()):
      pool_pn = self.place_step(pool_pn, rows_rn, pieces_k3)
    return pool_pn

  def partition_pages(self, rows: int, max_tokens: int, kv=None) -> int:
    """The logical partition (pages) of this runner's attention call for `rows` query rows over a
    table of `max_tokens` tokens (at most `kv`'s cap): copy waves split a layer at multiples of it."""
    return _partition_pages(self.call_opts(rows, kv, max_tokens), self.layout, self.cfg.num_attention_heads,
                            int(rows), self.layout.pages_for(int(max_tokens)))

  def call_opts(self, rows: int, kv=None, max_tokens: Optional[int] = None) -> AttentionOptions:
    """The attention options of a call of `rows` rows on cache `kv`: the runner's, with the partition
    capped at the cache's `partition_cap` (`KVPlan.partition_cap_pages`) where theirs is larger."""
    cap = getattr(kv, "partition_cap", None)
    if cap is None:
      return self.opts
    pages = self.layout.pages_for(int(kv.max_tokens if max_tokens is None else max_tokens))
    own = _partition_pages(self.opts, self.layout, self.cfg.num_attention_heads, int(rows), pages)
    return self.opts if own <= cap else dataclasses.replace(self.opts, block_pages=int(cap))

  def head(self, x_se, rows):
    return _head_step(self.output_norm, self.output, x_se, executables.int32_arg(rows),
                      eps=self.cfg.rms_eps)

  def distinct_groups(self):
    """[(group index, structure, leaves, cache layer or None)], one group a compiled program."""
    out = {}
    for g, ((gdef, gstate), a) in enumerate(zip(self.groups, self.attn_index)):
      out.setdefault((gdef, a is None), (g, gdef, gstate, a))
    return list(out.values())

  def prepare_ends(self, tokens_s, x_se, rows_r) -> None:
    """Prepare (`kvjax.warmup.prepare`, shapes) the embedding of `tokens_s`, the output head of
    `x_se`'s `rows_r` rows (`head`) and its norm alone (`_heads`)."""
    _embed_step.prepare(self.token_embd, tokens_s)
    _head_step.prepare(self.output_norm, self.output, x_se, rows_r, eps=self.cfg.rms_eps)
    _norm_step.prepare(self.output_norm, x_se, eps=self.cfg.rms_eps)

  def mtp_forward(self, hn_se, next_tokens_s, pos: int, n_valid: int, kv: KVProvider):
    """MTP rows at MTP-cache positions pos.. (RoPE position = cache position + 1)."""
    if self.mtp_layer is None:
      raise ValueError("this model has no MTP head (nextn_predict_layers = 0)")
    opts = self.call_opts(hn_se.shape[0], kv)
    kv.begin_forward(pos, n_valid, (self.mtp_layer,),
                     wave_pages=self.partition_pages(hn_se.shape[0], kv.max_tokens, kv))
    lkv = kv.layer_kv(self.mtp_layer)
    gdef, gstate = self.mtp
    next_s, pos_a, nv_a = (executables.int32_arg(v) for v in (next_tokens_s, pos, n_valid))
    if lkv.waves > 1:
      u, q, gate, rows, empty = self.mtp_attn_begin(gdef, gstate, self.token_embd, hn_se, next_s, pos_a,
                                                    layout=self.layout)
      pool_pn, (carry,) = self._waves(kv, self.mtp_layer, lkv, [(q, rows, empty)], [(pos_a, nv_a)], opts)
      logits, hm = self.mtp_attn_end(gdef, gstate, self.output_norm, self.output, u, carry, gate)
    else:
      logits, hm, pool_pn, rows = self.mtp_step(gdef, gstate, self.token_embd, self.output_norm, self.output,
                                            hn_se, next_s, self.place(lkv), lkv.table_t, pos_a, nv_a,
                                            layout=self.layout, opts=opts)
    kv.end_layer(self.mtp_layer, pool_pn, rows)
    kv.end_forward()
    return logits, hm


  def mtp_draft(self, hm_1e, d, p, pos, steps: int, limit, p_min: float, kv: KVProvider, span=None):
    """Up to `limit` <= `steps` MTP draft steps as one forward of the MTP layer (`_mtp_draft_steps`:
    `steps` fixes the program, `limit` and `p_min` mask it) at MTP positions pos.. -> (candidates,
    probabilities) as device arrays [steps + 1]. `pos` and `limit` may be device scalars, `span` =
    (first position, rows) laid out to hold every position the steps take. The layer attends in one
    call (plain cache, or MTP ring lease); its rows are not published (catch-ups write them again)."""
    first, n = (pos, max(1, min(steps, limit))) if span is None else span
    kv.begin_forward(first, n, (self.mtp_layer,), wave_pages=self.partition_pages(1, kv.max_tokens, kv))
    lkv = kv.layer_kv(self.mtp_layer)
    if lkv.waves > 1:
      raise RuntimeError("mtp_draft: the MTP layer streams in copy waves (draft step by step)")
    gdef, gstate = self.mtp
    cand_d, cand_p, pool_pn, _ = self.mtp_draft_steps(
        gdef, gstate, self.token_embd, self.output_norm, self.output, hm_1e, d, p, jnp.float32(p_min),
        self.place(lkv), lkv.table_t, executables.int32_arg(pos), executables.int32_arg(limit),
        layout=self.layout, opts=self.call_opts(1, kv), steps=steps)
    kv.end_layer(self.mtp_layer, pool_pn, None)
    kv.end_forward()
    return cand_d, cand_p


@functools.lru_cache(maxsize=64)
def _partition_pages(opts: AttentionOptions, layout: PageLayout, num_q_heads: int, rows: int,
                     table_pages: int) -> int:
  impl = span_api.resolve_implementation(opts.implementation, layout=layout,
                                         q_shape=(rows, num_q_heads, layout.head_dim))
  return span_api.resolve_block_pages(opts.block_pages, table_pages, rows, num_q_heads, layout, None, impl)


def recurrent_state_bytes(runner: "Runner") -> Tuple[int, int]:
  """Bytes of one row's recurrent states: (every group's, the largest group's)."""
  per_group = [sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(g))
               for g in jax.eval_shape(runner.zero_states)]
  return sum(per_group), max(per_group, default=0)
