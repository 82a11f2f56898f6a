"""The device scratch a compiled step needs beside the KV pool, measured once per program.

An arena holds, beside its pool, the scratch of the widest forward it runs (`kvjax.kv_build.measure`):
XLA's memory analysis of the compiled layer step. Compiling the 27B step takes seconds, so each
measurement is remembered beside the persistent compilation cache (`compile_cache.remembered`,
keyed by the program's structure, shapes and options, the jax version, the device and kvjax's
source): a second process sizes the same cache without compiling.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kvjax import compile_cache, engine
from kvjax.streaming.arena import workspace_bytes_from_compiled


def group_step_workspace_bytes(runner: engine.Runner, rows: int, max_tokens: Optional[int] = None,
                               verify=False) -> int:
  """Device scratch of the compiled group step for `rows` query rows (XLA memory analysis).

  The prefill phase runs `rows = ubatch` (chunked Gated DeltaNet), decode `rows = 1`, a
  speculative verify (`verify`: its capture, True or "replay") `rows` in the scan form. The page
  table is sized for `max_tokens`; the pool argument is donated (aliased to the output), so the
  pool size does not enter.
  """
  cfg, layout = runner.cfg, runner.layout
  k = next((i for i, a in enumerate(runner.attn_index) if a is not None), 0)
  gd, gs = runner.groups[k]
  pages = layout.pages_for(max_tokens) if max_tokens else 4
  chunked = rows > 1 and not verify

  def measure():
    compiled = engine._group_step.lower(
        gd, gs, jnp.zeros((rows, cfg.hidden_size), runner.token_embd.dtype), runner.zero_states()[k],
        jnp.zeros((min(pages, 4), layout.page_bytes), jnp.uint8), jnp.zeros((pages,), jnp.int32),
        jnp.int32(0), jnp.int32(rows), layout=layout, opts=runner.opts, chunked=chunked, capture=verify).compile()
    return workspace_bytes_from_compiled(compiled)

  arrays = [(a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves((gs, jax.eval_shape(runner.zero_states)[k]))]
  program = (f"{gd.graphdef!r}{gd.treedef!r}{arrays}{cfg!r}{layout!r}{runner.opts!r}"
             f"{runner.token_embd.dtype} rows={rows} pages={pages} chunked={chunked} capture={verify!r}")
  return int(compile_cache.remembered("group_step_workspace", program, measure))
