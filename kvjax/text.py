"""Text safe for a terminal: the one escaping rule of kvjax's output and error messages.

Generated text keeps its newlines and tabs (`printable(text)`); an error message or anything read
from a file and quoted in one is escaped whole (`one_line(text)`), so a crafted key or tensor name
cannot send terminal control sequences or break the message over lines.
"""

from __future__ import annotations

import unicodedata

# controls, surrogates (undecodable bytes read with surrogateescape), private use, unassigned
_UNPRINTABLE = frozenset(("Cc", "Cs", "Co", "Cn"))
# in messages also format characters (bidi overrides, zero-width) and line / paragraph separators
_UNPRINTABLE_STRICT = _UNPRINTABLE | {"Cf", "Zl", "Zp"}


def _escape(ch: str) -> str:
  o = ord(ch)
  return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def printable(text: str, keep: str = "\n\t", strict: bool = False) -> str:
  """`text` with control characters (ESC, BEL, NUL, DEL, C1 ...), surrogates, private-use and
  unassigned code points (with `strict`, also format characters and line separators) written as
  `\\xNN` / `\\uNNNN` / `\\UNNNNNNNN`; the characters of `keep` stay."""
  bad = _UNPRINTABLE_STRICT if strict else _UNPRINTABLE
  return "".join(ch if ch in keep or unicodedata.category(ch) not in bad else _escape(ch) for ch in text)


def one_line(text) -> str:
  """`str(text)` escaped for a one-line message: every control character, newline included."""
  return printable(str(text), keep="", strict=True)


def quote(value, limit: int = 60) -> str:
  """A short, escaped rendering of a value read from a file (strings quoted, long ones cut)."""
  if isinstance(value, (bytes, bytearray, memoryview)):
    value = bytes(value).decode("utf-8", errors="surrogateescape")
  s = repr(value) if isinstance(value, str) else str(value)
  if len(s) > limit:
    s = s[:limit] + "..."
  return one_line(s)
