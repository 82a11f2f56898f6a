"""The packed PTX decode of the Triton span kernel (`triton._asm_plane`), run on the CPU.

The GPU runs these strings as inline assembly; the CPU interpreter cannot. So this test executes
the very same strings in a small numpy model of the opcodes they use (32-bit integer ops, `prmt`,
f16x2 `sub` / `mul` with round-to-nearest) and requires the same bits as the jnp decode of the
kernel (`decode_blocks`, asm=False) for every halfword value and scales from subnormal to large.
The GPU test class checks the compiled asm against the jnp decode inside the kernel
(tests/test_span_attention.py, `test_asm_decode_same_bits`).
"""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from kvjax_pallas.span_attention import triton as kt
from ptx_model import run_ptx


def _scales():
  """f16 scales: subnormal, tiny, ordinary, negative, large (bits)."""
  vals = np.array([2.0 ** -24, 3 * 2.0 ** -20, 1e-3, 0.0123, -0.25, 1.0, 1.5, -7.75, 300.0, 1e4],
                  np.float16)
  return vals.view(np.uint16)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_ptx_decode_equals_jnp_decode(kind):
  assert kt._ASM_CONSTRAINTS == "=r,r,r"           # $0 out; $1 halfwords; $2 scales
  n_planes = len(kt._PLANES[kind])
  # every halfword value as h0, a shuffled copy as h1, each against every scale
  rng = np.random.default_rng(0)
  h0 = np.arange(65536, dtype=np.uint32)
  h1 = rng.permutation(65536).astype(np.uint32)
  x = h0 | (h1 << np.uint32(16))
  data = jnp.asarray(np.stack([h0, h1], -1).astype(np.uint16)[:, None, :])         # [N, 1, 2]
  for sc in _scales():
    sc = np.uint32(sc)
    scales = np.full(x.shape, sc | (sc << np.uint32(16)), np.uint32)
    # the jnp decode of the kernel, asm=False: columns halfword-major, plane-minor
    scale = jnp.full((65536, 1, 1), sc, jnp.uint16)
    ref = np.asarray(kt.decode_blocks(data, scale, kind, f32=False)).view(np.uint16)
    ref = ref.reshape(65536, 2, n_planes)                                             # [N, hw, plane]
    for p in range(n_planes):
      out = run_ptx(kt._asm_plane(kind, p), {"$1": x, "$2": scales})
      assert sorted(out) == ["$0"]
      got = out["$0"]
      np.testing.assert_array_equal(got & 0xFFFF, ref[:, 0, p], err_msg=f"{kind} plane {p} h0")
      np.testing.assert_array_equal(got >> 16, ref[:, 1, p], err_msg=f"{kind} plane {p} h1")


def test_ptx_output_written_last():
  """The output may share a register with an input: it is written once, by the last line."""
  strings = [kt._asm_plane(kind, p) for kind in ("q8_0", "q4_0") for p in range(len(kt._PLANES[kind]))]
  for asm in strings:
    lines = [l.strip() for l in asm.strip()[1:-1].split(";") if l.strip()]
    writes = [i for i, l in enumerate(lines) if not l.startswith(".reg")
              and l.split(None, 1)[1].split(",")[0].strip() == "$0"]
    assert writes == [len(lines) - 1], asm


def test_decode_option_checked():
  with pytest.raises(ValueError, match="unknown decode 'fast'"):
    kt.tile_config(1, 6, 256, options=kt.TritonOptions(decode="fast"))
  assert kt.tile_config(1, 6, 256).decode == kt.DEFAULT_DECODE

