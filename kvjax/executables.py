"""Compiled steps kept on disk, so that a second process neither traces, lowers nor compiles them.

JAX's persistent compilation cache (`kvjax.compile_cache`) saves the backend compile, but its key is
the lowered program: a process must still trace and lower every step before it can look one up, and
for the 27B layer steps (the span-attention kernels' Mosaic GPU lowering runs in Python) that was
~9 s of a warm start (docs/log/performance-log.md, R1204a-3). A `StoredStep` wraps a jitted step:
the first call of each argument signature looks for the compiled executable under a key made
without tracing (the step's name, its static arguments' text, the arguments' shapes and dtypes,
and `compile_cache.memo_key`'s jax / jaxlib versions, device and kvjax source hash, with XLA's
flags and jax's tracing configuration); found, it is loaded (`serialize_executable`); not found,
the step is lowered and compiled as jit would and written there. Later calls of the signature call
the executable directly.

`StoredStep.prepare` makes a signature ready ahead of its call, from shapes: loaded, or lowered on
the caller's thread and compiled on `workers()` threads side by side (`kvjax.warmup.prepare`: a
generation's programs as its prefill starts), in `stage`s so that the programs needed first
compile first; the call waits for its own.

Only while `compile_cache` is on (in its `executables/` folder); `KVJAX_STORE_EXECUTABLES=0` turns
the store off alone (plain jit calls, for comparisons). Loaded executables are not compilations:
`CompileClock` counts none for them (`LOADED_EVENT` instead); a prepared one counts at its first
call, its wait as compile time (`WAIT_EVENT`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import importlib
import inspect
import os
import pickle
import re
import threading
import time
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import compile_cache

ENV = "KVJAX_STORE_EXECUTABLES"
THREADS_ENV = "KVJAX_COMPILE_THREADS"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_STEPS: "weakref.WeakSet[StoredStep]" = weakref.WeakSet()
LOADED_EVENT = "/kvjax/executables/loaded"   # recorded (jax.monitoring) per executable loaded
WAIT_EVENT = "/kvjax/executables/wait_duration"   # seconds a call waited for a prepared step
# loaded / compiled / written / unstorable executables; unprepared: calls of a signature nothing prepared
STATS = {"loaded": 0, "compiled": 0, "written": 0, "unstorable": 0, "unprepared": 0, "from_jax_cache": 0,
         "mismatched": 0}


def directory() -> Optional[str]:
  """The folder executables are kept in, or None (cache off, or `KVJAX_STORE_EXECUTABLES=0`)."""
  cache = compile_cache.current()
  if cache is None or os.environ.get(ENV, "1").strip().lower() in compile_cache.OFF:
    return None
  return os.path.join(cache, "executables")


def clear_loaded() -> None:
  """Forget the executables loaded or compiled in this process (as `jax.clear_caches` does jit's)."""
  for step in list(_STEPS):
    step._loaded.clear()
    step._param_sigs.clear()


def _leaf_sig(a) -> Tuple:
  """An argument's shape, dtype and weak type (the same for an array and its `ShapeDtypeStruct`, so
  that a step prepared from shapes is found by the call with arrays), and whether it is traced."""
  try:
    return (a.shape, a.dtype, bool(getattr(a, "weak_type", False)), isinstance(a, jax.core.Tracer))
  except AttributeError:       # a Python scalar: traced weakly typed, by its type
    return (type(a),)


def _traced(sig: Tuple) -> bool:
  return len(sig) == 4 and sig[3]


def _text(value) -> str:
  """A static argument as text without object addresses (a key must be the same in two processes)."""
  graphdef, treedef = getattr(value, "graphdef", None), getattr(value, "treedef", None)
  if graphdef is not None and treedef is not None:     # engine.StaticStructure
    value = (graphdef, treedef)
  return _ADDRESS.sub("", repr(value))


# environment variables read while a step is traced (they decide its program, so they are part of
# a stored executable's key): XLA's flags, the planar weights' product
# (`kvjax_pallas.quant_matmul.planar.PRODUCT_ENV`; read when a step is first traced in a process),
# whether the q8 product makes its x (`kvjax_pallas.quant_matmul.prologue.PROLOGUE_ENV`)
TRACE_ENV = ("XLA_FLAGS", "KVJAX_PLANAR_PRODUCT", "KVJAX_Q8_PROLOGUE")


def _trace_env() -> Tuple[str, ...]:
  return tuple(os.environ.get(name, "") for name in TRACE_ENV)


def _context() -> str:
  """What else decides a compiled program: the environment read while tracing (`TRACE_ENV`) and
  jax's tracing configuration."""
  try:
    from jax._src import config as jax_config
    trace = repr(jax_config.trace_context())
  except (ImportError, AttributeError):   # pragma: no cover - a jax without it: the x64 switch at least
    trace = repr(jax.config.jax_enable_x64)
  return "\n".join(_trace_env() + (_ADDRESS.sub("", trace),))


def int32_arg(a):
  """An int32 argument of a step call: a device array as it is (no wait for the device), anything
  else (token ids, positions) as a numpy array, moved to the device by the call itself rather than
  by a dispatch of its own (a `jnp.int32(pos)` cost ~0.4 ms of host time on an H100 machine, ~1.3
  ms of a decode forward's ~15: 2026-12-06). Its signature is jnp.int32's: the same executable."""
  if isinstance(a, jax.Array):
    return a if a.dtype == jnp.int32 else a.astype(jnp.int32)
  return np.asarray(a, np.int32)


def jit(fn=None, *, static_argnames=(), donate_argnames=(), params: Optional[str] = None, name: Optional[str] = None):
  """`jax.jit` with the executables stored (module docstring), as a decorator:

      @executables.jit(static_argnames=("eps",), params="state")
      def step(state, x, *, eps): ...

  `params`: the argument holding the step's parameter leaves (a tuple the caller keeps), whose
  signature is worked out once per tuple rather than at every call; `name` (default: the function's)
  names its stored executables, so that one function jitted twice (other donations) keeps two."""
  def wrap(f):
    return StoredStep(f, name or f.__name__.lstrip("_"), tuple(static_argnames), tuple(donate_argnames), params)
  return wrap if fn is None else wrap(fn)


class StoredStep:
  """`jax.jit(fn, ...)` (`self.jitted`) with its executables stored (module docstring); called as
  the jitted function is; `lower` is its `lower`."""

  def __init__(self, fn, name: str, static_argnames=(), donate_argnames=(), params: Optional[str] = None):
    self.jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames)
    self.name = name
    names = list(inspect.signature(fn).parameters)
    static = set(static_argnames)
    self._static_pos = frozenset(i for i, n in enumerate(names) if n in static)
    self._static_names = frozenset(static)
    dynamic = [n for n in names if n not in static]
    self._params_at = dynamic.index(params) if params in dynamic else None
    self._loaded: Dict[Any, Any] = {}
    self._param_sigs: Dict[int, Tuple] = {}
    self.__doc__, self.__wrapped__ = fn.__doc__, fn
    _STEPS.add(self)

  def lower(self, *args, **kwargs):
    return self.jitted.lower(*args, **kwargs)

  def __call__(self, *args, **kwargs):
    if directory() is None or any(k not in self._static_names for k in kwargs):
      return self.jitted(*args, **kwargs)
    dyn = [a for i, a in enumerate(args) if i not in self._static_pos]
    key = self._key(args, kwargs, dyn)
    compiled = self._loaded.get(key)
    if compiled is None:
      STATS["unprepared"] += 1
      compiled = self._loaded[key] = False if self._is_traced(key) else self._load_or_compile(args, kwargs, dyn)
    elif isinstance(compiled, concurrent.futures.Future):   # prepared: compiling on another thread
      compiled = self._loaded[key] = _wait(compiled, self.name)
    if compiled is False:        # called inside a trace: jit's own path
      return self.jitted(*args, **kwargs)
    return compiled(*dyn)

  def prepare(self, *args, **kwargs):
    """Make ready the executable a call with these arguments (arrays or `jax.ShapeDtypeStruct`s)
    will run, without running it: loaded from the store, else lowered here and compiled on a
    worker thread (`workers()` at a time; the call waits for it) -> the outputs' shapes
    (`ShapeDtypeStruct`s, for preparing the step they feed), or None with the store off."""
    if directory() is None:
      return None
    dyn = [a for i, a in enumerate(args) if i not in self._static_pos]
    key = self._key(args, kwargs, dyn)
    have = self._loaded.get(key)
    if have is None:
      path, disk_key = self._path(args, kwargs, dyn)
      have = _load(path, disk_key, dyn)
      if have is not None:
        _count_loaded()
      else:
        lowered = self.jitted.lower(*args, **kwargs)
        have = _pool().submit(self._compile_and_write, lowered, path, disk_key, _STAGE["after"])
        have.out_info = lowered.out_info
        _STAGE["futures"].append(have)
      self._loaded[key] = have
    if have is False:
      return None
    info = have.out_info
    return jax.tree_util.tree_map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=getattr(o, "sharding", None)),
                                  info)

  def _key(self, args, kwargs, dyn) -> Tuple:
    """This process's key of a call: its static arguments, the default device (a tensor-parallel
    cache drives one provider per device under `jax.default_device`; kvjax commits arrays there,
    `engine.on_device`) and the dynamic arguments' signature (the last element: `_is_traced`)."""
    statics = tuple(a for i, a in enumerate(args) if i in self._static_pos)
    return (len(args), statics, tuple(sorted(kwargs.items())), jax.config.jax_default_device,
            self._signature(dyn))

  @staticmethod
  def _is_traced(key) -> bool:
    psig, _, sigs = key[-1]
    return any(map(_traced, sigs)) or (psig is not None and any(map(_traced, psig[1])))

  def _cache_size(self) -> int:
    """Executables this step holds in this process (jit's and those called directly)."""
    return self.jitted._cache_size() + sum(1 for c in self._loaded.values() if c is not False)

  def __getattr__(self, name):   # trace, eval_shape, _cache_size, ...: the jitted function's
    return getattr(self.jitted, name)

  def _signature(self, dyn) -> Tuple:
    """The dynamic arguments' structure, shapes and dtypes; the parameter tuple's once per tuple."""
    rest = dyn
    psig = None
    if self._params_at is not None and self._params_at < len(dyn):
      p = dyn[self._params_at]
      rest = dyn[:self._params_at] + dyn[self._params_at + 1:]
      psig = self._param_sigs.get(id(p))
      if psig is None or psig[0]() is not _first(p):   # a new tuple (or another at a freed address)
        sig = tuple(_leaf_sig(a) for a in jax.tree_util.tree_leaves(p))
        first = _first(p)
        ref = weakref.ref(first) if first is not None else (lambda: None)
        psig = self._param_sigs[id(p)] = (ref, jax.tree_util.tree_structure(p), sig)
      psig = psig[1:]
    leaves, tree = jax.tree_util.tree_flatten(rest)
    return psig, tree, tuple(_leaf_sig(a) for a in leaves)

  def description(self, args, kwargs, dyn) -> str:
    """The text the stored executable's key is made of (module docstring)."""
    statics = [_text(a) for i, a in enumerate(args) if i in self._static_pos]
    statics += [f"{k}={_text(v)}" for k, v in sorted(kwargs.items())]
    leaves, tree = jax.tree_util.tree_flatten(dyn)
    sigs = [repr(_leaf_sig(a)[:3]) for a in leaves]
    return "\n".join([self.name, *statics, str(tree), *sigs, _context()])

  def _path(self, args, kwargs, dyn) -> Tuple[str, str]:
    key = compile_cache.memo_key("executable", self.description(args, kwargs, dyn))
    return os.path.join(directory(), f"{self.name}-{key}.pkl"), key

  def _load_or_compile(self, args, kwargs, dyn):
    path, key = self._path(args, kwargs, dyn)
    compiled = _load(path, key, dyn)
    if compiled is not None:
      _count_loaded()
      return compiled
    return self._compile_and_write(self.jitted.lower(*args, **kwargs), path, key)

  @staticmethod
  def _compile_and_write(lowered, path: str, key: str, after=()):
    concurrent.futures.wait(after)   # an earlier stage's programs first (`stage`)
    before = getattr(_THREAD, "hits", 0)
    compiled = lowered.compile()
    STATS["compiled"] += 1
    if getattr(_THREAD, "hits", 0) > before and jax.devices()[0].platform == "cpu":
      # jax's persistent cache gave it: serialized again, a CPU executable lost its code ("Function
      # ... not found" where loaded; a GPU one ran: checked on an H100, jax 0.11.2)
      STATS["from_jax_cache"] += 1
    else:
      _write(path, key, compiled)
    return compiled


_THREAD = threading.local()   # per thread: jax's persistent-cache hits of the compiles it ran


def _count_hit(event: str, **_) -> None:
  if event == "/jax/compilation_cache/cache_hits":   # recorded on the thread that compiles
    _THREAD.hits = getattr(_THREAD, "hits", 0) + 1


jax.monitoring.register_event_listener(_count_hit)


def _count_loaded() -> None:
  STATS["loaded"] += 1
  jax.monitoring.record_event(LOADED_EVENT)


_STAGE = {"after": (), "futures": []}   # the stage being prepared (`stage`)


@contextlib.contextmanager
def stage(after: Sequence[concurrent.futures.Future] = ()):
  """Steps prepared inside compile once the `after` futures (an earlier stage's) are done, so that
  the programs needed first do not share the worker threads with those needed later (a layer step
  compiled beside seven others took 3x its time alone). -> the list of futures this stage starts.

      with executables.stage() as prefill: ...            # prepare the prefill's steps
      with executables.stage(after=prefill): ...          # then the decode's
  """
  outer = dict(_STAGE)
  _STAGE.update(after=tuple(after), futures=[])
  try:
    yield _STAGE["futures"]
  finally:
    _STAGE.update(outer)


def workers() -> int:
  """Threads compiling prepared steps: XLA's backend compile runs outside Python's lock (4 layer
  steps of the 27B compiled 3.0x faster in 4 threads than one after another on an H200 host:
  `experiments/kernel_lab/probe_parallel_compile.py`); half the machine's cores, at most 8, or
  `KVJAX_COMPILE_THREADS`."""
  env = os.environ.get(THREADS_ENV, "").strip()
  return max(1, int(env)) if env.isdigit() else max(1, min(8, (os.cpu_count() or 2) // 2))


DONATE_ENV = "KVJAX_DONATE_STATES"


def donate_states() -> bool:
  """Whether a sequence's forwards give their recurrent states' and hidden rows' buffers to the
  group steps (`Runner.forward(donate=True)`: `SequenceState.forward` and the warmup of its
  programs); `KVJAX_DONATE_STATES=0` turns it off (for comparisons)."""
  return os.environ.get(DONATE_ENV, "1").strip().lower() not in compile_cache.OFF


GDN_ROWS_ENV = "KVJAX_GDN_ROWS"


def gdn_rows_form() -> Optional[str]:
  """The delta rule's form for a decode's and verify's rows when `KVJAX_GDN_ROWS` names one ("xla", "triton", "fused":
  for comparisons), else None (gdn_impl's form). A one-line ValueError naming the variable for any other value."""
  value = os.environ.get(GDN_ROWS_ENV, "").strip().lower()
  if value not in ("", "xla", "triton", "fused"):
    raise ValueError(f"{GDN_ROWS_ENV}={value!r}: expected xla, triton or fused (or unset: gdn_impl's form)")
  return value or None


def check_gdn_rows_form(cfg) -> None:
  """`gdn_rows_form()` checked against the model's heads (the kernel's sizes) before anything is placed."""
  from kvjax_pallas.delta_rule import triton as delta_rule_triton   # pylint: disable=import-outside-toplevel
  if gdn_rows_form() in ("triton", "fused"):
    try:
      delta_rule_triton.check_kernel_sizes(cfg.linear_head_dim, cfg.linear_head_dim)
    except ValueError as e:
      raise ValueError(f"{GDN_ROWS_ENV}={gdn_rows_form()}: the model's Gated DeltaNet heads: {e}") from None


def ahead() -> bool:
  """Whether steps are prepared ahead of their calls (`kvjax.warmup.prepare`): with the store on,
  on a machine of 4 cores or more (on 2, a compile beside the run slowed a CPU generation 2x)."""
  return directory() is not None and workers() >= 2


def _pool() -> concurrent.futures.ThreadPoolExecutor:
  return _pool_of(workers())


@functools.lru_cache(maxsize=None)
def _pool_of(n: int) -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="kvjax-compile")


def _wait(future, name: str):
  """A prepared step's executable; the seconds the caller waited for it are reported to jax's
  monitoring as `WAIT_EVENT` (compile time on the caller's clock: `kvjax.generate.CompileClock`)."""
  t0 = time.perf_counter()
  compiled = future.result()
  jax.monitoring.record_event_duration_secs(WAIT_EVENT, time.perf_counter() - t0, fun_name=name)
  return compiled


def _first(params):
  leaves = jax.tree_util.tree_leaves(params[:1] if isinstance(params, tuple) else params)
  return leaves[0] if leaves else None


@functools.lru_cache(maxsize=1)
def _runtime_ready() -> None:
  """What jax sets up as it lowers and a loaded executable may call: the CPU's LAPACK kernels (the
  chunked Gated DeltaNet's triangular solve) are bound to their library when first lowered; an
  executable loaded before that crashed calling them."""
  try:
    from jax._src.lax import linalg
    linalg.initialize_lapack()
  except (ImportError, AttributeError):   # pragma: no cover - a jax that binds them otherwise
    pass
  if jax.devices()[0].platform == "gpu":   # the Mosaic GPU kernels' runtime target, registered on import
    try:
      importlib.import_module("jax.experimental.mosaic.gpu")
    except ImportError:   # pragma: no cover
      pass


def _takes(compiled, dyn) -> bool:
  """Whether `compiled` takes arguments of `dyn`'s shapes and dtypes (a Python scalar: its shape)."""
  want = jax.tree_util.tree_leaves(dyn)
  have = jax.tree_util.tree_leaves(compiled.args_info)
  return len(want) == len(have) and all(
      tuple(np.shape(a)) == tuple(i.shape) and (not hasattr(a, "dtype") or str(a.dtype) == str(i.dtype))
      for a, i in zip(want, have))


def _load(path: str, key: str, dyn=None):
  """The executable stored at `path` under `key`, or None (absent, unreadable, of another key, or
  taking other shapes than the arguments `dyn`: a key that collided is compiled again)."""
  if not os.path.exists(path):
    return None
  _runtime_ready()
  try:
    from jax.experimental import serialize_executable
    with open(path, "rb") as f:
      entry = pickle.load(f)
    if entry.get("key") != key:
      return None
    compiled = serialize_executable.deserialize_and_load(entry["payload"], entry["in_tree"], entry["out_tree"])
    if dyn is not None and not _takes(compiled, dyn):
      STATS["mismatched"] += 1
      return None
    return compiled
  except Exception:   # noqa: BLE001 - a damaged or foreign entry: compiled again (and rewritten)
    return None


def _storable(compiled) -> bool:
  """Whether an executable can be loaded in another process: not one calling back into this
  process's Python (host callbacks, as Pallas's interpret mode makes; jax's persistent cache does
  not keep those either: their addresses are compiled in, and loading one elsewhere crashed)."""
  unloaded = getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)
  return unloaded is not None and not getattr(unloaded, "host_callbacks", None) \
      and not getattr(unloaded, "keepalive", None)


def _write(path: str, key: str, compiled) -> None:
  if not _storable(compiled):
    STATS["unstorable"] += 1
    return
  try:
    from jax.experimental import serialize_executable
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    blob = pickle.dumps({"key": key, "payload": payload, "in_tree": in_tree, "out_tree": out_tree})
  except Exception:   # noqa: BLE001 - a program the backend cannot serialize: this process's only
    STATS["unstorable"] += 1
    return
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
      f.write(blob)
    os.replace(tmp, path)
    STATS["written"] += 1
  except OSError:   # a read-only cache: kept in this process
    pass
