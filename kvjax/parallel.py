"""Tensor-parallel decode: the target and its MTP head sharded over a 1-D device mesh ("tp").

Layout (Megatron-style, one shard per device):

* attention: query heads and KV heads split into N equal runs (device d holds KV heads
  [d G/N, (d+1) G/N) and the query heads that read them); Gated DeltaNet: key heads split the
  same way, with the value heads that read them in GGUF's tiled order (value head j reads key
  head j % Hk, so device d takes value heads r Hk + d Hk/N + i); SwiGLU: FFN columns split;
* every output projection (attention output, Gated DeltaNet output, FFN down) then holds a
  partial sum, all-reduced over the mesh axis by `kvjax.model.block_sum` (`lax.psum`: XLA's
  collective, NCCL on GPUs); norms, embeddings, the output head and the MTP input projection are
  replicated;
* each device's shard is an ordinary model of `local_config(cfg, n)` (a `Qwen38` of 1/N the heads
  and FFN width), so the per-device computation is the single-device code, kernels included:
  the compiled steps are `jax.shard_map` over the mesh of the engine's own step functions;
* KV: each device holds only its own KV heads, in a page layout of G/N heads. `ShardedKV` drives one
  ordinary provider per device (`engine.PlainKV` or `StreamedKV`: its own host history, pool, ring
  and fixed split, built and driven under `jax.default_device`, so its copies go over that device's
  own host link) and presents them to the runner as one provider whose arrays are the devices'
  arrays joined along axis 0 (no copies: `jax.make_array_from_single_device_arrays`).

Device-varying arrays (pools, tables, staged pages, recurrent states, attention intermediates) are
global arrays whose axis 0 is the device axis (`P("tp")`); they are opaque outside the steps.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax import engine
from kvjax.config import ModelConfig
from kvjax.model import AttentionOptions, KVRows, Qwen38, sum_over
from kvjax_pallas.page_layout import PageLayout

AXIS = "tp"
_shard_map = getattr(jax, "shard_map", None)
if _shard_map is None:  # pragma: no cover - older jax
  from jax.experimental.shard_map import shard_map as _exp_shard_map

  def _shard_map(f, *, mesh, in_specs, out_specs, check_vma):
    return _exp_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma)


# ---------------------------------------------------------------------------
# geometry
# ---------------------------------------------------------------------------

def check_tensor_parallel(cfg: ModelConfig, n: int, devices: Optional[int] = None) -> None:
  """`n` devices can share this geometry (and are there); ValueError in one line otherwise."""
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise ValueError(f"tensor_parallel must be an int >= 1, got {n!r}")
  for what, count in (("KV heads (head_count_kv)", cfg.num_kv_heads),
                      ("Gated DeltaNet key heads (ssm.group_count)", cfg.linear_num_key_heads),
                      ("FFN width (feed_forward_length)", cfg.intermediate_size)):
    if count % n:
      raise ValueError(f"tensor_parallel {n} must divide the model's {count} {what}")
  devices = len(jax.devices()) if devices is None else devices
  if n > devices:
    raise ValueError(f"tensor_parallel {n} needs {n} devices, {devices} available")


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
  """The geometry of one device's shard: 1/n of the heads and of the FFN width."""
  return dataclasses.replace(
      cfg, num_attention_heads=cfg.num_attention_heads // n, num_kv_heads=cfg.num_kv_heads // n,
      linear_num_key_heads=cfg.linear_num_key_heads // n,
      linear_num_value_heads=cfg.linear_num_value_heads // n, intermediate_size=cfg.intermediate_size // n)


def local_layout(layout: PageLayout, n: int) -> PageLayout:
  """One device's KV page layout: its KV heads only."""
  return PageLayout(layout.num_kv_heads // n, layout.head_dim, layout.k_type, layout.v_type, layout.page_tokens)


def shard_indices(cfg: ModelConfig, n: int, d: int) -> Dict[str, Tuple[int, np.ndarray]]:
  """Module attribute -> (axis, indices along it) of device d's shard; attributes not listed are
  replicated. Indices follow the orders the modules reshape by (see the module docstring)."""
  D, dk = cfg.head_dim, cfg.linear_head_dim
  hl, gl, kl, fl = (cfg.num_attention_heads // n, cfg.num_kv_heads // n, cfg.linear_num_key_heads // n,
                    cfg.intermediate_size // n)
  Hk, reps = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
  run = lambda lo, k: np.arange(lo, lo + k)
  v_heads = np.array([r * Hk + d * kl + i for r in range(reps) for i in range(kl)])
  v_dims = (v_heads[:, None] * dk + np.arange(dk)[None, :]).reshape(-1)
  conv = np.concatenate([run(d * kl * dk, kl * dk), Hk * dk + run(d * kl * dk, kl * dk), 2 * Hk * dk + v_dims])
  ffn = run(d * fl, fl)
  return {
      "attn_q": (0, run(d * hl * 2 * D, hl * 2 * D)),      # per head: [q (D), gate (D)]
      "attn_k": (0, run(d * gl * D, gl * D)),
      "attn_v": (0, run(d * gl * D, gl * D)),
      "attn_output": (1, run(d * hl * D, hl * D)),
      "attn_qkv": (0, conv), "ssm_conv1d": (0, conv),
      "attn_gate": (0, v_dims), "ssm_out": (1, v_dims),
      "ssm_beta": (0, v_heads), "ssm_alpha": (0, v_heads), "ssm_dt_bias": (0, v_heads), "ssm_a": (0, v_heads),
      "ffn_gate": (0, ffn), "ffn_up": (0, ffn), "ffn_down": (1, ffn),
  }


def _attr(path) -> Optional[str]:
  """The module attribute a state leaf belongs to (the last string key of its path)."""
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  names = [k for k in names if isinstance(k, str) and k != "value"]
  return names[-1] if names else None


def shard_model(model: Qwen38, n: int, devices: Sequence[Any]) -> List[Qwen38]:
  """The n per-device shards of `model`: device d's `Qwen38` of `local_config`, its arrays on
  devices[d] (a replicated parameter is copied to every device)."""
  cfg = model.cfg
  lcfg = local_config(cfg, n)
  mtp = model.mtp
  abstract = nnx.eval_shape(lambda: Qwen38(
      lcfg, mtp_shared_head_norm=mtp is not None and mtp.nextn_shared_head_norm is not None,
      mtp_shared_head_head=mtp is not None and mtp.nextn_shared_head_head is not None))
  local_def, local_state = nnx.split(abstract)
  _, state = nnx.split(model)
  leaves, _ = jax.tree_util.tree_flatten_with_path(state)
  local_leaves, local_tree = jax.tree_util.tree_flatten_with_path(local_state)
  if [p for p, _ in leaves] != [p for p, _ in local_leaves]:
    raise AssertionError("the shard's parameters differ from the model's")  # a module change not mirrored
  shards = []
  for d, dev in enumerate(devices):
    index = shard_indices(cfg, n, d)
    arrays = []
    for (path, arr), (_, want) in zip(leaves, local_leaves):
      spec = index.get(_attr(path))
      local = arr if spec is None else jnp.take(arr, jnp.asarray(spec[1]), axis=spec[0])
      if local.shape != want.shape:
        raise AssertionError(f"shard of {jax.tree_util.keystr(path)}: {local.shape} != {want.shape}")
      arrays.append(jax.device_put(local, dev))
    shards.append(nnx.merge(local_def, jax.tree_util.tree_unflatten(local_tree, arrays)))
  return shards


# ---------------------------------------------------------------------------
# global arrays from per-device arrays, and back
# ---------------------------------------------------------------------------

def join(mesh: Mesh, parts: Sequence[jax.Array], replicated: bool = False) -> jax.Array:
  """Per-device arrays (parts[d] on mesh device d, equal shapes) as one global array, without a
  copy: replicated (each part a full copy) or stacked along axis 0 (`P("tp")`). None stays None."""
  p0 = parts[0]
  if p0 is None:
    return None
  if replicated:
    return jax.make_array_from_single_device_arrays(p0.shape, NamedSharding(mesh, P()), list(parts))
  shape = (len(parts) * p0.shape[0],) + tuple(p0.shape[1:])
  return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, P(AXIS)), list(parts))


def split(mesh: Mesh, arr: jax.Array) -> List[jax.Array]:
  """A `P("tp")` global array -> its per-device arrays in mesh order (no copy)."""
  by_dev = {s.device: s.data for s in arr.addressable_shards}
  return [by_dev[dev] for dev in mesh.devices.flat]


def _join_tree(mesh, trees, replicated_leaves=None):
  """Per-device pytrees (equal structure) -> one pytree of global arrays; leaf i replicated where
  replicated_leaves[i]."""
  flat = [jax.tree_util.tree_flatten(t) for t in trees]
  treedef = flat[0][1]
  out = [join(mesh, [f[0][i] for f in flat], bool(replicated_leaves and replicated_leaves[i]))
         for i in range(len(flat[0][0]))]
  return jax.tree_util.tree_unflatten(treedef, out)


# ---------------------------------------------------------------------------
# the per-device steps
# ---------------------------------------------------------------------------
def _spmd_step(roles: engine.StepRoles):
  """The engine step of `roles` (`engine.STEP_ROLES`; a jitted function whose Python body is run per
  device) as a jitted shard_map over the mesh. Same call signature as the step, plus `mesh`, `wspec`
  (the parameter leaves' specs) and `static` (the step's static keyword arguments as sorted items)."""
  raw = roles.step.__wrapped__
  offset = 1 if roles.graphdef else 0
  spec = {engine.SAME: P(), engine.HEADS: P(AXIS)}

  def run(*args, mesh, wspec, static):
    pre, arrays = args[:offset], args[offset:]

    def body(*a):
      with sum_over(AXIS):
        return raw(*pre, *a, **dict(static))

    in_specs = tuple(wspec if r == engine.PARAMS else spec[r] for r in roles.inputs)
    out_specs = spec[roles.outputs[0]] if len(roles.outputs) == 1 else tuple(spec[r] for r in roles.outputs)
    # check_vma=False: the span-attention loops start from constant carries, which the varying-axis
    # check rejects; the replicated outputs are equal on every device by construction (psum)
    return _shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*arrays)

  return jax.jit(run, static_argnums=tuple(range(offset)), donate_argnums=roles.donate,
                 static_argnames=("mesh", "wspec", "static"))


_STEPS = {name: _spmd_step(roles) for name, roles in engine.STEP_ROLES.items()}


class ShardedRunner(engine.Runner):
  """`engine.Runner` over a 1-D mesh of n devices: the same forward loop, per-device steps.

  `device_runners[d]` is an ordinary `Runner` of device d's shard (its arrays are the ones the
  global arrays are joined from: no extra memory); `cfg` is the whole model's geometry, `layout`
  one device's KV page layout (`local_layout`)."""
  mtp_draft_steps = None     # MTP drafting runs step by step (`speculative.mtp_draft`)

  def __init__(self, model: Qwen38, layout: PageLayout, opts: AttentionOptions, n: int,
               devices: Optional[Sequence[Any]] = None):
    check_tensor_parallel(model.cfg, n)
    devices = list(jax.devices()[:n] if devices is None else devices)
    if layout.num_kv_heads != model.cfg.num_kv_heads:
      raise ValueError(f"layout has {layout.num_kv_heads} KV heads, the model {model.cfg.num_kv_heads}")
    self.mesh = Mesh(np.array(devices), (AXIS,))
    self.tensor_parallel = n
    self.cfg, self.opts = model.cfg, opts
    self.layout = local_layout(layout, n)
    self.device_runners = []
    for dev, shard in zip(devices, shard_model(model, n, devices)):
      with jax.default_device(dev):
        self.device_runners.append(engine.Runner(shard, self.layout, opts))
    r0 = self.device_runners[0]
    self.n_recurrent, self.attn_index, self.mtp_layer = r0.n_recurrent, r0.attn_index, r0.mtp_layer
    self.gdn_form = r0.gdn_form
    self._wspec = {}

    def module(pairs):   # [(structure, leaves) per device] -> (structure, global leaves)
      structure = pairs[0][0]
      rep = self._replicated(structure, pairs[0][1])
      self._wspec[structure] = tuple(P() if r else P(AXIS) for r in rep)
      return structure, _join_tree(self.mesh, [leaves for _, leaves in pairs], rep)

    self.groups = [module([r.groups[g] for r in self.device_runners]) for g in range(len(r0.groups))]
    self.token_embd, self.output_norm, self.output = _join_tree(
        self.mesh, [(r.token_embd, r.output_norm, r.output) for r in self.device_runners], (True, True, True))
    self.mtp = module([r.mtp for r in self.device_runners]) if r0.mtp is not None else None
    for name, step in _STEPS.items():   # the runner's steps (`engine.STEP_ROLES`), each a shard_map
      setattr(self, name, functools.partial(self._call, step))

  def _replicated(self, structure, leaves) -> Tuple[bool, ...]:
    """Which parameter leaves of a module are replicated (every other one is sharded)."""
    state = jax.tree_util.tree_unflatten(structure.treedef, list(leaves))
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    sharded = shard_indices(self.cfg, self.tensor_parallel, 0)
    return tuple(_attr(path) not in sharded for path, _ in flat)

  def _call(self, step, *args, **static):
    wspec = self._wspec[args[0]] if isinstance(args[0], engine.StaticStructure) else ()
    return step(*args, mesh=self.mesh, wspec=wspec, static=tuple(sorted(static.items())))

  def zero_states(self):
    return _join_tree(self.mesh, per_device(self.mesh, lambda d: self.device_runners[d].zero_states()))

  def partition_pages(self, rows: int, max_tokens: int, kv=None) -> int:
    return self.device_runners[0].partition_pages(rows, max_tokens, kv)

  def call_opts(self, rows: int, kv=None, max_tokens=None):
    return self.device_runners[0].call_opts(rows, kv, max_tokens)   # one device's heads and layout


# ---------------------------------------------------------------------------
# the KV of every device as one provider
# ---------------------------------------------------------------------------

def per_device(mesh: Mesh, make):
  """[make(d) for each mesh device d], each called under `jax.default_device` of its device (what
  it allocates or copies lands there)."""
  out = []
  for d, dev in enumerate(mesh.devices.flat):
    with jax.default_device(dev):
      out.append(make(d))
  return out


class ShardedKV:
  """One KV provider per mesh device (each built under `jax.default_device` of its device, holding
  that device's KV heads), driven as one: `layer_kv` joins the devices' pools, tables and staged
  pages into global arrays, `end_layer` splits the step's pool and rows back. The providers run
  the same forward shapes, so their layouts agree (checked)."""

  def __init__(self, mesh: Mesh, parts: Sequence[Any]):
    self.mesh, self.parts = mesh, list(parts)
    self._joined: Dict[Tuple[int, ...], Tuple[tuple, jax.Array]] = {}
    self.max_tokens = self.parts[0].max_tokens
    self.layout = self.parts[0].layout

  def _each(self, method, *args):
    return per_device(self.mesh, lambda d: getattr(self.parts[d], method)(*args))

  def begin_forward(self, pos, n_tokens, cache_layers, wave_pages=1):
    self._each("begin_forward", pos, n_tokens, cache_layers, wave_pages)

  def _join(self, kvs: List[engine.LayerKV]) -> engine.LayerKV:
    k0 = kvs[0]
    shapes = {(k.waves, k.tiles, len(k.stage), tuple(s.shape for s in k.stage), k.table_t.shape,
               None if k.pieces is None else tuple(p.shape for p in k.pieces)) for k in kvs}
    if len(shapes) != 1:
      raise RuntimeError(f"the devices' KV providers laid out one layer differently: {sorted(map(str, shapes))}")
    join_ = functools.partial(join, self.mesh)
    return engine.LayerKV(join_([k.pool_pn for k in kvs]), self._join_kept([k.table_t for k in kvs]),
                          tuple(join_([k.stage[i] for k in kvs]) for i in range(len(k0.stage))),
                          None if k0.pieces is None else tuple(
                              self._join_kept([k.pieces[i] for k in kvs]) for i in range(len(k0.pieces))),
                          k0.waves,
                          k0.tiles)

  def _join_kept(self, parts):
    """`join` of arrays the providers keep across forwards (tables, placement pieces: laid out once
    per forward shape), joined once; the parts are held with the result, so their ids stay valid."""
    key = tuple(id(p) for p in parts)
    hit = self._joined.get(key)
    if hit is None:
      if len(self._joined) >= 512:
        self._joined.clear()
      hit = self._joined[key] = (tuple(parts), join(self.mesh, parts))
    return hit[1]

  def layer_kv(self, cache_layer):
    return self._join(self._each("layer_kv", cache_layer))

  def wave_kv(self, cache_layer, wave):
    return self._join(self._each("wave_kv", cache_layer, wave))

  def end_layer(self, cache_layer, pool_pn, rows):
    pools = split(self.mesh, pool_pn)
    chunks = (rows,) if isinstance(rows, KVRows) else tuple(rows)   # a chunked forward's: one a chunk
    parts = [(split(self.mesh, r.k_sn), split(self.mesh, r.v_sn)) for r in chunks]
    per_device(self.mesh, lambda d: self.parts[d].end_layer(
        cache_layer, pools[d], tuple(KVRows(ks[d], vs[d]) for ks, vs in parts)))

  def end_forward(self):
    self._each("end_forward")

  def truncate(self, cache: str, tokens: int) -> None:
    self._each("truncate", cache, tokens)

  def defer_rows(self, on: bool) -> None:
    self._each("defer_rows", on)

  @property
  def counters(self) -> Dict[str, float]:
    """The providers' counters summed over the devices (streamed providers only)."""
    parts = [p.counters for p in self.parts]
    return {k: sum(c[k] for c in parts) for k in parts[0]}

  def metrics(self) -> Dict[str, Any]:
    """Byte and time counters summed over the devices (what crossed all host links), every other
    counter as device 0's (the devices run the same layout); `per_device_h2d_bytes` lists each."""
    ms = [p.metrics() for p in self.parts]
    out = dict(ms[0])
    for key, value in ms[0].items():
      if isinstance(value, (int, float)) and not isinstance(value, bool) and key.endswith(("_bytes", "_s", "_ms")):
        out[key] = sum(m.get(key, 0) for m in ms)
    out["per_device_h2d_bytes"] = [m.get("h2d_bytes", 0) for m in ms]
    out["tensor_parallel"] = len(self.parts)
    return out
