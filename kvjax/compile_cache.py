"""JAX's persistent compilation cache, on by default for kvjax's API and command line.

A generation compiles a fixed set of programs (`kvjax.warmup`); with this cache a second process
loads them from disk instead of compiling them again. The directory:

* `KVJAX_COMPILE_CACHE_DIR` when set ("off" or "0" turns the cache off), else
* `$XDG_CACHE_HOME/kvjax/jax` (`~/.cache/kvjax/jax`).

Entries are keyed by JAX on the program, the jax / jaxlib versions, XLA flags and the devices, so
one directory serves every model and version. Every program is cached, however short its compile
(`jax_persistent_cache_min_compile_time_secs` 0): a decode compiles many small ones. JAX is imported
when a function is called (the command line's `memory` runs without it).
"""

from __future__ import annotations

import os
from typing import Optional, Union

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
  if active() == directory:
    return directory
  os.makedirs(directory, exist_ok=True)
  import jax
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  _reset()
  return directory


def disable() -> None:
  """Turn the persistent cache off (programs compile in this process only)."""
  if active() is not None:
    import jax
    jax.config.update("jax_compilation_cache_dir", None)
    _reset()
  return None


def active() -> Optional[str]:
  """The directory of the persistent cache in use, or None."""
  import jax
  return jax.config.jax_compilation_cache_dir or None


def _reset() -> None:
  """Make JAX take the new directory (the cache object is made once, at the first compile)."""
  try:
    from jax._src import compilation_cache
    compilation_cache.reset_cache()
  except (ImportError, AttributeError):   # pragma: no cover - a jax without it reads the config anew
    pass
