"""kvjax_pallas.span_attention.mosaic_names: a Mosaic GPU kernel module gets a dump name derived from
its text, so the same kernel serializes to the same bytes whatever the process lowered before it
(jaxlib >= 0.11.1 names modules with a per-process counter otherwise; the call is stood in for
here where this jaxlib lacks it)."""

import types

from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir

from kvjax_pallas.span_attention import mosaic_names

KERNEL = 'module @anonymous {{ func.func @k(%a: i32) -> i32 {{ %b = arith.addi %a, %a : i32 {extra} return %b : i32 }} }}'


def _module(ctx, extra=""):
  with ctx, ir.Location.unknown():
    return ir.Module.parse(KERNEL.format(extra=extra))


class Counter:
  """A stand-in for jaxlib's call: names an unnamed module `<name>_<count>` and counts."""

  def __init__(self):
    self.count, self.seen = 0, []

  def get_or_set_dump_options(self, module):
    attrs = module.operation.attributes
    if mosaic_names.DUMP_ATTR not in attrs:
      attrs[mosaic_names.DUMP_ATTR] = ir.StringAttr.get(f"anonymous_{self.count}", context=module.context)
      self.count += 1
    name = ir.StringAttr(attrs[mosaic_names.DUMP_ATTR]).value
    self.seen.append(name)
    return types.SimpleNamespace(module_basename=name)


def test_the_same_kernel_gets_the_same_name_whatever_was_lowered_before():
  ctx = jax_mlir.make_ir_context()
  plain, wrapped = Counter(), Counter()
  assert mosaic_names.install(wrapped) and mosaic_names.install(wrapped)     # wrapped once
  assert getattr(wrapped.get_or_set_dump_options, "__wrapped__").__self__ is wrapped
  other = "%c = arith.muli %b, %b : i32"
  # process 1 lowers another kernel first, process 2 does not: the counter names them apart ...
  first = [plain.get_or_set_dump_options(_module(ctx, other)), plain.get_or_set_dump_options(_module(ctx))]
  again = plain.get_or_set_dump_options(_module(ctx))
  assert first[1].module_basename != again.module_basename
  # ... the content names do not
  a = [wrapped.get_or_set_dump_options(_module(ctx, other)), wrapped.get_or_set_dump_options(_module(ctx))]
  b = wrapped.get_or_set_dump_options(_module(ctx))
  assert a[1].module_basename == b.module_basename == mosaic_names.content_name(_module(ctx))
  assert a[0].module_basename != a[1].module_basename                       # other text, other name
  assert a[1].module_basename.startswith("anonymous_") and wrapped.count == 0
  m = _module(ctx)
  with ctx:
    m.operation.attributes[mosaic_names.DUMP_ATTR] = ir.StringAttr.get("given")
  assert wrapped.get_or_set_dump_options(m).module_basename == "given"      # a given name stays
  # the serialized module (what the persistent cache's key hashes) is the same bytes
  ma, mb = _module(ctx), _module(ctx)
  wrapped.get_or_set_dump_options(_module(ctx, other))
  wrapped.get_or_set_dump_options(ma)
  wrapped.get_or_set_dump_options(mb)
  assert str(ma) == str(mb)


def test_install_is_a_no_op_where_jaxlib_does_not_name_modules():
  assert mosaic_names.install(types.SimpleNamespace()) is False
  dialect = mosaic_names._dialect()
  assert mosaic_names.install() == (dialect is not None and hasattr(dialect, "get_or_set_dump_options"))
