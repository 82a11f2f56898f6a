"""A small numpy model of the PTX opcodes that the kernels' and probes' inline assembly uses
(32-bit integer ops, `prmt` in its default mode, `lop3`, f16x2 `sub` / `mul` rounded once), so
tests can run the very strings the GPU runs (test_span_decode_asm.py, test_magic_ptx.py)."""

from __future__ import annotations

import numpy as np


def _f16x2(x_u32):
  return x_u32.astype(np.uint32).view(np.uint16).view(np.float16).reshape(-1, 2)


def _from_f16x2(h):
  return np.ascontiguousarray(h.astype(np.float16)).view(np.uint32).reshape(-1)


def _prmt(a, b, sel: int):
  """PTX prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of (b:a)."""
  src = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)]
                 + [(b >> (8 * i)) & 0xFF for i in range(4)])
  out = np.zeros_like(a)
  for i in range(4):
    s = (sel >> (4 * i)) & 0xF
    if s & 8:
      raise NotImplementedError("sign-replicate prmt selectors are not modelled")
    out |= src[s] << np.uint32(8 * i)
  return out


def run_ptx(asm: str, operands: dict):
  """Execute `asm` (the kernel's inline PTX) on uint32 numpy arrays; `operands` maps "$k" -> array
  for inputs; returns the "$k" outputs written."""
  regs = dict(operands)
  body = asm.strip()
  if not body.startswith("{"):          # a single instruction
    body = "{" + body + "}"
  assert body.endswith("}")
  n = next(iter(operands.values())).shape

  def val(tok):
    tok = tok.strip()
    if tok.startswith("0x") or tok.isdigit():
      return np.full(n, int(tok, 0), np.uint32)
    return regs[tok]

  written = {}
  for line in body[1:-1].split(";"):
    line = line.strip()
    if not line or line.startswith(".reg"):
      continue
    op, args = line.split(None, 1)
    dst, *src = [a.strip() for a in args.split(",")]
    if op == "mov.b32":
      r = val(src[0])
    elif op == "xor.b32":
      r = val(src[0]) ^ val(src[1])
    elif op == "and.b32":
      r = val(src[0]) & val(src[1])
    elif op == "or.b32":
      r = val(src[0]) | val(src[1])
    elif op in ("shr.u32", "shr.b32"):
      r = val(src[0]) >> np.uint32(int(src[1], 0))
    elif op == "lop3.b32":           # bit i of the result: LUT bit (a_i << 2 | b_i << 1 | c_i)
      a, b, c = (val(x) for x in src[:3])
      lut = int(src[3], 0)
      r = np.zeros_like(a)
      for i in range(32):
        idx = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
        r |= ((np.uint32(lut) >> idx.astype(np.uint32)) & 1) << np.uint32(i)
    elif op == "prmt.b32":
      sel = src[2].strip()
      if sel.startswith("$"):         # a selector in a register: one value for all lanes here
        sels = np.unique(regs[sel])
        assert len(sels) == 1, "per-lane prmt selectors are not modelled"
        sel = str(int(sels[0]))
      r = _prmt(val(src[0]), val(src[1]), int(sel, 0))
    elif op in ("sub.rn.f16x2", "mul.rn.f16x2", "sub.f16x2"):
      a, b = _f16x2(val(src[0])), _f16x2(val(src[1]))
      with np.errstate(over="ignore"):
        r = _from_f16x2(a - b if op.startswith("sub") else a * b)  # numpy: exact, rounded once
    else:
      raise NotImplementedError(f"opcode {op!r} is not modelled")
    regs[dst] = r.astype(np.uint32)
    if dst.startswith("$"):
      written[dst] = regs[dst]
  return written
