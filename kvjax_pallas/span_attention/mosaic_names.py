"""Mosaic GPU kernel modules named by their content, so that a program's persistent-cache key does
not depend on what the process lowered before it.

From jaxlib 0.11.1, lowering a Warpgroup-semantics Mosaic GPU kernel asks
`mosaic_gpu_dialect.get_or_set_dump_options(module)`, which names the module for debug dumps once:
an attribute `mosaic_gpu.dump_basename` = `<module name>_<a per-process counter>`. The attribute
travels inside the kernel's serialized module, in the custom call's backend config, so the same
kernel lowered after two other Mosaic GPU modules in one process and after none in another gives
two different programs to XLA and two keys to JAX's persistent compilation cache: a second
process compiled every layer step and copy-wave step again (measured on an H200, jax 0.11.2,
2026-12-05: the wave steps' payloads differed only in `anonymous_2` against `anonymous_0`).

`install()` wraps that call so that a module without the attribute gets one derived from its own
text (debug locations excluded) before the counter is consulted: the same kernel has the same
bytes in every process. The name is used for dump files only (`MOSAIC_GPU_DUMP_TO`), where the hash
still tells kernels apart. Where the jaxlib has no such call (0.10, 0.11.0) nothing is changed.
"""

from __future__ import annotations

import hashlib

DUMP_ATTR = "mosaic_gpu.dump_basename"


def _dialect():
  """jax's Mosaic GPU dialect module (the object the lowering looks the call up on), or None."""
  try:
    from jax.experimental.mosaic.gpu import core
  except ImportError:    # pragma: no cover - a jaxlib without Mosaic GPU
    return None
  return getattr(core, "dialect", None)


def content_name(module) -> str:
  """`<sym_name or mosaic_gpu_module>_<16 hex digits of the module's text, debug info excluded>`."""
  from jax._src.lib.mlir import ir
  attrs = module.operation.attributes
  base = ir.StringAttr(attrs["sym_name"]).value if "sym_name" in attrs else "mosaic_gpu_module"
  text = module.operation.get_asm(enable_debug_info=False)
  return f"{base}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def name_by_content(module) -> None:
  """Give `module` its content name where it has no dump basename yet."""
  from jax._src.lib.mlir import ir
  attrs = module.operation.attributes
  if DUMP_ATTR not in attrs:
    attrs[DUMP_ATTR] = ir.StringAttr.get(content_name(module), context=module.context)


def install(dialect=None) -> bool:
  """Wrap `dialect.get_or_set_dump_options` (default: jax's Mosaic GPU dialect) so that modules are
  named by content first. -> True when the call exists and is wrapped (once; later calls keep the
  wrapper), False where this jaxlib does not name modules."""
  dialect = _dialect() if dialect is None else dialect
  original = getattr(dialect, "get_or_set_dump_options", None)
  if original is None:
    return False
  if getattr(original, "names_by_content", False):
    return True

  def get_or_set_dump_options(module, *args, **kwargs):
    name_by_content(module)
    return original(module, *args, **kwargs)

  get_or_set_dump_options.names_by_content = True
  get_or_set_dump_options.__wrapped__ = original
  dialect.get_or_set_dump_options = get_or_set_dump_options
  return True
