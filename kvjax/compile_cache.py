"""JAX's persistent compilation cache, on by default for kvjax's API and command line.

A generation compiles a fixed set of programs (`kvjax.warmup`); with this cache a second process
loads them from disk instead of compiling them again. The directory:

* `KVJAX_COMPILE_CACHE_DIR` when set ("off" or "0" turns the cache off), else
* `$XDG_CACHE_HOME/kvjax/jax` (`~/.cache/kvjax/jax`).

Entries are keyed by JAX on the program, the jax / jaxlib versions, XLA flags and the devices, so
one directory serves every model and version. Every program is cached, however short its compile
(`jax_persistent_cache_min_compile_time_secs` 0): a decode compiles many small ones. JAX is imported
when a function is called (the command line's `memory` runs without it).

`remembered` keeps small values measured from compiled programs (an arena's workspace bytes, from
XLA's memory analysis) in a `measured/` folder beside the programs, so that a second process sizes a
cache without compiling the step it measures. Their key names the jax / jaxlib versions, the
device, a hash of kvjax's own source and the caller's description of the program.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
from typing import Any, Callable, Dict, Optional, Union

ENV = "KVJAX_COMPILE_CACHE_DIR"
OFF = ("off", "0", "false", "no", "none")


def default_dir() -> Optional[str]:
  """The directory `enable()` uses without an argument, or None when `KVJAX_COMPILE_CACHE_DIR`
  turns the cache off."""
  env = os.environ.get(ENV)
  if env is not None:
    return None if env.strip().lower() in OFF or not env.strip() else os.path.expanduser(env)
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "kvjax", "jax")


def enable(path: Union[str, bool, None] = None) -> Optional[str]:
  """Turn the persistent cache on at `path` (None or True: `default_dir()`; False: off) -> the
  directory in use, or None when off. Programs compiled before the call are not written."""
  if path is False:
    return disable()
  directory = default_dir() if path in (None, True) else os.path.expanduser(str(path))
  if directory is None:
    return disable()
  global _CURRENT
  if active() == directory:
    _CURRENT = directory
    return directory
  try:
    os.makedirs(directory, exist_ok=True)
    if not os.access(directory, os.W_OK | os.X_OK):
      raise PermissionError(13, "not writable")
  except OSError as e:
    source = f" (${ENV})" if path in (None, True) else ""
    raise ValueError(f"compile cache folder {directory!r}{source}: not a writable folder ({e.strerror or e}); "
                     f"give a writable folder, or 'off' for no persistent cache") from None
  import jax
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  _reset()
  _CURRENT = directory
  return directory


def disable() -> None:
  """Turn the persistent cache off (programs compile in this process only)."""
  global _CURRENT
  _CURRENT = None
  if active() is not None:
    import jax
    jax.config.update("jax_compilation_cache_dir", None)
    _reset()
  return None


_CURRENT: Optional[str] = None   # the directory `enable` set (read on every stored step's call)


def current() -> Optional[str]:
  """The directory kvjax turned the cache on at (`enable`), or None: what `kvjax.executables`
  stores in, without asking jax's configuration (a call on the decode's hot path)."""
  return _CURRENT


def active() -> Optional[str]:
  """The directory of the persistent cache in use, or None."""
  import jax
  return jax.config.jax_compilation_cache_dir or None


def _reset() -> None:
  """Make JAX take the new directory (the cache object is made once, at the first compile)."""
  try:
    from jax._src import compilation_cache
  except ImportError:   # pragma: no cover - a jax without it reads the config anew
    return
  logger = logging.getLogger(compilation_cache.__name__)
  level = logger.level
  logger.setLevel(max(level, logging.WARNING))   # its "Resetting cache at ..." line, at every start
  try:
    compilation_cache.reset_cache()
  except AttributeError:   # pragma: no cover
    pass
  finally:
    logger.setLevel(level)


_MEMO: Dict[str, Any] = {}     # this process's remembered values, by key


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
  """A hash of kvjax's and kvjax_pallas's Python source: a remembered measurement is of this code."""
  h = hashlib.sha256()
  root = pathlib.Path(__file__).resolve().parent.parent
  for pkg in ("kvjax", "kvjax_pallas"):
    for f in sorted((root / pkg).rglob("*.py")):
      h.update(str(f.relative_to(root)).encode())
      h.update(f.read_bytes())
  return h.hexdigest()[:20]


def memo_key(kind: str, description: str) -> str:
  """The key of a value `kind` measured of the program `description` names, on this jax and device."""
  import jax
  import jaxlib
  dev = jax.devices()[0]
  text = "\n".join((kind, jax.__version__, getattr(jaxlib, "__version__", "?"), dev.platform,
                    str(getattr(dev, "device_kind", "")), source_hash(), description))
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def remembered(kind: str, description: str, measure: Callable[[], Any]) -> Any:
  """`measure()` (a JSON value), or what it gave before for the same `kind` and `description` on
  this jax, device and source: in this process, else from the persistent cache's `measured/` folder
  (when the cache is on). A new value is written there; an unreadable entry is measured again."""
  key = memo_key(kind, description)
  if key in _MEMO:
    return _MEMO[key]
  directory = active()
  path = os.path.join(directory, "measured", f"{kind}-{key}.json") if directory else None
  if path and os.path.exists(path):
    try:
      with open(path) as f:
        entry = json.load(f)
      if entry.get("key") == key:
        _MEMO[key] = entry["value"]
        return entry["value"]
    except (OSError, ValueError, KeyError, AttributeError):
      pass
  value = measure()
  _MEMO[key] = value
  if path:
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      tmp = f"{path}.{os.getpid()}.tmp"
      with open(tmp, "w") as f:
        json.dump({"key": key, "kind": kind, "value": value}, f)
      os.replace(tmp, path)
    except OSError:   # a read-only cache: the value is still this process's
      pass
  return value
