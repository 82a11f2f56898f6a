"""Input checks shared by `kvjax.api` and its front ends: argument types, sizes against the memory they
would take (before anything is allocated), and `--config.FIELD` overrides against their config file.

Each check raises `kvjax.api.ParameterError` (one line naming the parameter, its value and what is
needed) or, for the command-line helpers, returns that line. This module imports no JAX (the memory
checks call `kvjax.memory_report.available_memory`, which imports it when called), so `kvjax memory`
can use the config checks and still answer at once.
"""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import math
import numbers
import os
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

MIB = 2**20


def _error(message: str, *params: str):
  from kvjax.api import ParameterError  # pylint: disable=import-outside-toplevel  (api imports this module)
  return ParameterError(message, *params)


# ---------------------------------------------------------------------------
# types
# ---------------------------------------------------------------------------

_KINDS = {"int": "an int", "real": "a number", "bool": "a bool", "str": "a str"}


def _is(value: Any, kind: str) -> bool:
  if kind == "bool":
    return isinstance(value, bool)
  if isinstance(value, bool):
    return False
  if kind == "int":
    return isinstance(value, numbers.Integral)
  if kind == "real":
    return isinstance(value, numbers.Real)
  return isinstance(value, str)


def check_types(**checks) -> None:
  """`check_types(n_predict=(2.5, "int"), temperature=(0.0, "real"), prompt=(None, "str?"))`: each
  value of the kind named ("int", "real", "bool", "str", "ids": token ids; "?" lets None through),
  else a ParameterError naming the parameter, the value and the type expected."""
  for name, (value, kind) in checks.items():
    optional = kind.endswith("?")
    kind = kind.rstrip("?")
    if kind == "ids" and value is not None:
      check_token_ids(name, value)
    if (value is None and optional) or kind == "ids" or _is(value, kind):
      continue
    raise _error(f"{name} must be {_KINDS[kind]}{' or None' if optional else ''}, got {value!r} "
                 f"({type(value).__name__})", name)


def check_token_ids(name: str, ids: Any) -> None:
  """`ids` a sequence of int token ids (a list, tuple or 1-D integer array), not text."""
  if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") or not hasattr(ids, "__iter__"):
    raise _error(f"{name} must be a sequence of int token ids, got {_short(ids)} ({type(ids).__name__})"
                 + ("; for text use prompt" if isinstance(ids, str) and name == "prompt_tokens" else ""), name)
  dtype = getattr(ids, "dtype", None)   # a numpy or jax array: 1-D and of an integer dtype
  if getattr(dtype, "kind", "") in ("i", "u") and getattr(ids, "ndim", 1) == 1:
    return
  bad = next((t for t in ids if not _is(t, "int")), None)
  if bad is not None:
    raise _error(f"{name} must be a sequence of int token ids, got the element {bad!r} ({type(bad).__name__})",
                 name)


def _short(value: Any, limit: int = 40) -> str:
  s = repr(value)
  return s if len(s) <= limit else s[:limit] + "..."


# ---------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------

def where_memory(available: Dict[str, Optional[int]]) -> str:
  """Where device buffers live: "device" where the backend reports its memory, else "host" (a CPU)."""
  return "device" if available.get("device") is not None else "host"


def check_memory(param: str, value: Any, need: int, what: str, available: Dict[str, Optional[int]],
                 where: Optional[str] = None) -> None:
  """`need` bytes (for `what`, e.g. "the device pool (N pages of B B)") within the memory available
  `where` ("device" or "host"; default where device buffers live), else a ParameterError naming
  `param` = `value`, the MiB needed and the MiB available. Unknown availability passes."""
  where = where or where_memory(available)
  have = available.get(where)
  if have is not None and need > have:
    shown = f"{value:.12g}" if isinstance(value, float) else f"{value}"
    raise _error(f"{param} {shown}: {what}: {need / MIB:,.1f} MiB of {where} memory needed, "
                 f"{have / MIB:,.1f} MiB available", param)


def _available(available):
  if available is not None:
    return available
  from kvjax.memory_report import available_memory  # pylint: disable=import-outside-toplevel
  return available_memory()


def check_arena_memory(arena_mib: Optional[float], devices: int = 1,
                       available: Optional[Dict[str, Optional[int]]] = None) -> None:
  """An arena of `arena_mib` MiB (one a device) within the device's memory (on a CPU the host's,
  where the `devices` arenas all live)."""
  if arena_mib is None:
    return
  available = _available(available)
  per_host = devices if where_memory(available) == "host" else 1
  need = arena_mib * MIB * per_host
  check_memory("arena_mib", arena_mib, int(min(need, 2**62)), "the arena" if per_host == 1 else
               f"{devices} arenas (one a device)", available)


def check_pool_memory(pool_pages: Optional[int], page_bytes: int, devices: int = 1,
                      available: Optional[Dict[str, Optional[int]]] = None) -> None:
  """A device pool of `pool_pages` pages of `page_bytes` within the device's memory (on a CPU the
  host's)."""
  if pool_pages is None:
    return
  available = _available(available)
  per_host = devices if where_memory(available) == "host" else 1
  check_memory("pool_pages", pool_pages, pool_pages * page_bytes * per_host,
               f"the device pool ({pool_pages} pages of {page_bytes} B{f' on each of {devices} devices' if per_host > 1 else ''})",
               available)


def check_budget_memory(arena_mib: Optional[float], pool_pages: Optional[int], page_bytes: int,
                        devices: int = 1) -> None:
  """`check_arena_memory` and `check_pool_memory` (`kvjax.api.make_kv`, before the cache is built)."""
  available = _available(None)
  check_arena_memory(arena_mib, devices, available)
  check_pool_memory(pool_pages, page_bytes, devices, available)


def budget_error(name: str, value: float, error: Exception) -> str:
  """The message of a budget (`name` = `value`) that cannot hold the cache; an arena too small for
  its layouts (`kvjax.streaming.arena.CapacityError`, with its `needed` bytes) says the least it needs."""
  needed = getattr(error, "needed", None)
  if needed is None:
    return f"{name} {value:.12g}: {error}"
  return f"{name} {value:.12g}: too small: at least {needed / MIB:.3f} MiB needed ({error})"


def weight_bytes(shapes: Iterable[Sequence[int]], itemsize: int) -> int:
  """Bytes of the weights of these tensor shapes in a dtype of `itemsize` bytes."""
  return sum(math.prod(s) for s in shapes) * itemsize


def check_weights_memory(param: str, value: Any, shapes: Iterable[Sequence[int]], dtype_name: str,
                         itemsize: int, devices: int = 1,
                         available: Optional[Dict[str, Optional[int]]] = None, quantized: bool = False) -> None:
  """The model's weights (parameter count x dtype bytes, split over `devices` when the device
  reports its memory) within the memory they are built in, before any is drawn or read."""
  shapes = list(shapes)
  count = sum(math.prod(s) for s in shapes)
  available = _available(available)
  on_device = where_memory(available) == "device"
  need = count * itemsize // (devices if on_device else 1)
  what = (f"{count * itemsize:,} B: quantized matrices at their stored bytes, the rest in {dtype_name}" if quantized
          else f"{count:,} parameters x {itemsize} B {dtype_name}")
  check_memory(param, value, need, f"the weights ({what}"
               f"{f', 1/{devices} a device' if on_device and devices > 1 else ''})", available)


def check_model_fits(cfg, page_tokens: int, param: str, value: Any, shapes: Dict[str, Sequence[int]], dtype,
                     devices: int = 1) -> None:
  """Before a weight is drawn or read: KV pages within the model's context (`check_page_tokens`),
  the weights of `shapes` in `dtype` (a numpy / jax dtype) within memory (`check_weights_memory`)."""
  check_page_tokens(page_tokens, cfg.context_length)
  check_weights_memory(param, value, shapes.values(), dtype.name, dtype.itemsize, devices,
                       quantized="(quantized matrices)" in shapes)


MAX_POSITIONS = 2**31 - 1   # token positions are int32 in the compiled steps


def check_page_tokens(page_tokens: int, context_length: int) -> None:
  """A KV page holds at most the model's context length of tokens (a larger page is never filled)."""
  if page_tokens > context_length:
    raise _error(f"page_tokens {page_tokens} is beyond the model's context length of {context_length} "
                 f"positions: a page holds at most {context_length} tokens", "page_tokens")


# ---------------------------------------------------------------------------
# ml_collections config files and their --config.FIELD overrides (command lines)
# ---------------------------------------------------------------------------

def _config_path(args: Sequence[str], flag: str) -> Optional[str]:
  for i, a in enumerate(args):
    if a.startswith(f"--{flag}="):
      return a[len(flag) + 3:]
    if a == f"--{flag}" and i + 1 < len(args):
      return args[i + 1]
  return None


def _load_config(path: str):
  """`get_config()` of a config file (`file.py:arg` passes arg), as ml_collections' config_flags does."""
  path, _, arg = path.partition(":")
  loader = importlib.machinery.SourceFileLoader("_kvjax_config_check", path)   # any file name, as config_flags
  spec = importlib.util.spec_from_loader(loader.name, loader)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def _fields(node) -> Optional[list]:
  keys = getattr(node, "keys", None)
  return list(keys()) if callable(keys) else None


def config_error(args: Sequence[str], flag: str = "config", example: str = "configs/tiny_stream.py",
                 required: Sequence[str] = ()) -> Optional[str]:
  """The one-line error of a command line's `--config FILE` and `--config.FIELD=value` overrides, or
  None: the flag given twice, a config file that does not exist or cannot be loaded (its
  `get_config()` is run), one without the `required` fields of the command's configs (another
  command's config), or an override naming no field of it (with the closest fields,
  `difflib.get_close_matches`)."""
  given = [a for a in args if a == f"--{flag}" or a.startswith(f"--{flag}=")]
  if len(given) > 1:
    return f"--{flag} given {len(given)} times: give one config file (and --{flag}.FIELD=value overrides)"
  path = _config_path(args, flag)
  if path is None:
    return None
  if not os.path.isfile(path.partition(":")[0]):
    return f"--{flag} {path.partition(':')[0]!r}: no such file (expected e.g. {example})"
  overrides = []
  for a in args:
    name = a.split("=", 1)[0]
    for prefix in (f"--{flag}.", f"--no{flag}."):
      if name.startswith(prefix) and len(name) > len(prefix):
        overrides.append(name[len(prefix):])
  try:
    cfg = _load_config(path)
  except Exception as e:  # pylint: disable=broad-except  (a user's file: any error is reported in one line)
    return f"--{flag} {path!r}: cannot load it: {type(e).__name__}: {e}"
  keys = _fields(cfg)
  if keys is None:
    return f"--{flag} {path!r}: get_config() returned a {type(cfg).__name__}, not a config (expected e.g. {example})"
  missing = [r for r in required if r not in keys]
  if missing:
    return (f"--{flag} {path!r} has no field {', '.join(map(repr, missing[:6]))}{', ...' if len(missing) > 6 else ''}: "
            f"not a config of this command (expected e.g. {example})")
  for dotted in overrides:
    node, seen = cfg, []
    for part in dotted.split("."):
      keys = _fields(node)
      if keys is None:
        break
      if part not in keys:
        where = f"--{flag}.{'.'.join(seen)}" if seen else f"{path}"
        close = difflib.get_close_matches(part, [str(k) for k in keys], n=1)
        hint = (f"did you mean --{flag}.{'.'.join(seen + close)}?" if close
                else f"its fields: {', '.join(sorted(map(str, keys))[:12])}{', ...' if len(keys) > 12 else ''}")
        return f"--{flag}.{dotted}: {where} has no field {part!r}; {hint}"
      seen.append(part)
      node = node[part]
  return None


# ---------------------------------------------------------------------------
# absl programs (the experiments): errors in one line
# ---------------------------------------------------------------------------

def fail(prog: str, message: Any, status: int = 2):
  """Print `PROG: error: MESSAGE` (one line, escaped) on stderr and exit with `status`."""
  import sys  # pylint: disable=import-outside-toplevel
  from kvjax.text import one_line  # pylint: disable=import-outside-toplevel
  print(f"{prog}: error: {one_line(' '.join(str(message).split()))}", file=sys.stderr, flush=True)
  sys.exit(status)


def planar_product(prog: str) -> str:
  """The planar weights' product this process traces (`KVJAX_PLANAR_PRODUCT` resolved), or `fail`."""
  from kvjax_pallas.quant_matmul import api as qmm  # pylint: disable=import-outside-toplevel
  try:
    return qmm.resolve_planar_product("auto")
  except ValueError as e:
    fail(prog, e)


def list_values_error(flag: str, values: Sequence[str], kind: Any = int, least: float = 1,
                      most: Optional[float] = None) -> Optional[str]:
  """The one-line error of a list flag's values, or None: each an integer (`kind` int) or a finite
  number (float) in least..most, or (`kind` a collection of names) one of those names."""
  for v in values:
    if not isinstance(kind, type):
      if v not in kind:
        return f"--{flag} {v!r}: expected one of {', '.join(map(str, kind))}"
      continue
    try:
      x = kind(v)
    except ValueError:
      return f"--{flag} {v!r}: expected {'an integer' if kind is int else 'a number'}"
    if not (x >= least and (most is None or x <= most)) or x != x or x == float("inf"):
      what = "count" if kind is int and least == 1 and most is None else ("integer" if kind is int else "number")
      bounds = f">= {least:g}" if most is None else f"in {least:g}..{most:g}"
      return f"--{flag} {v}: must be {'a positive ' + what if what == 'count' else f'a {what} {bounds}'}"
  return None


def list_values(prog: str, flag: str, values: Sequence[str], kind: Any = int, least: float = 1,
                most: Optional[float] = None) -> list:
  """A list flag's values as `kind` (`list_values_error`'s rules), else one line and exit status 2."""
  bad = list_values_error(flag, values, kind, least, most)
  if bad:
    fail(prog, bad)
  return list(values) if not isinstance(kind, type) else [kind(v) for v in values]


def flags_parser(prog: str, config_flag: Optional[str] = None, example: str = "configs/tiny_stream.py",
                 required: Sequence[str] = (), values: Optional[Dict[str, tuple]] = None):
  """A `flags_parser` for `absl.app.run(main, flags_parser=...)`: a bad flag value, an unknown flag, a
  missing or unloadable config file, another command's config (without the `required` fields), an
  unknown `--config.FIELD`, or a value outside `values` ({flag: (kind, least[, most])}: list and
  number flags, `list_values_error`) is one line `PROG: error: ...` and exit status 2 (absl would
  print its usage text, or a traceback)."""
  def parse(argv):
    from absl import flags  # pylint: disable=import-outside-toplevel
    bad = config_error(argv[1:], config_flag, example, required) if config_flag else None
    if bad is None:
      try:
        rest = flags.FLAGS(argv)
      except flags.Error as e:
        bad = e
      else:
        for name, rule in (values or {}).items():
          given = flags.FLAGS[name].value
          given = [str(v) for v in (given if isinstance(given, (list, tuple)) else [given])]
          bad = bad or list_values_error(name, given, *rule)
        if bad is None:
          return rest
    fail(prog, bad)
  return parse


def one_line_errors(prog: str, main: Callable):
  """`main` for `absl.app.run`: a ValueError it raises (the API's ParameterError, a budget the plan
  refuses, a value out of range) is one line `PROG: error: ...` and exit status 2, no traceback."""
  def run(argv):
    try:
      return main(argv)
    except ValueError as e:
      fail(prog, e)
  return run
