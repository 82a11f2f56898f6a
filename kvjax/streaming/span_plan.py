"""Ordered span plans: one attention history as an immutable list of physical spans.

A plan says where each logical token range of one layer's history sits
physically: `Span(buffer, token_begin, tokens, k_offset, v_offset)`, with
byte offsets into a named buffer (the device pool). Production plans have at
most five spans — resident pages, ring slots before the wrap, ring slots
after the wrap, the open slot (the page a forward writes first), ring slots of
the pages a multi-page forward writes after it — but validation accepts any
number.

`validate_plan` enforces the rules of the original design
(design-details.md, "Ordered span plan") and names the rule that broke:

* no spans;
* query tokens 0 or more than active tokens;
* a span with 0 tokens;
* a span whose token_begin is not the previous span's end (gap, overlap, reorder);
* misaligned offsets (spans are page-granular: a span starts on a page boundary
  of the history and of the buffer, and its V offset is its K offset plus the
  page's V offset);
* offset + tokens x row bytes overflowing or past the buffer (K and V checked
  separately);
* total tokens != active tokens.

A valid plan turns into the kernels' page table with `page_table`.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

from kvjax_pallas.page_layout import PageLayout


class SpanPlanError(ValueError):
  """A span plan broke one of the validation rules (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Span:
  buffer: str          # name of the device buffer (e.g. "pool")
  token_begin: int     # first logical token of the span
  tokens: int          # number of tokens
  k_offset: int        # byte offset of the span's first page in `buffer`
  v_offset: int        # byte offset of that page's V plane


@dataclasses.dataclass(frozen=True)
class SpanPlan:
  spans: Tuple[Span, ...]
  active_tokens: int
  query_tokens: int
  kinds: Tuple[str, ...] = ()   # optional labels: "resident", "ring", "ring_wrapped"

  def __post_init__(self):
    object.__setattr__(self, "spans", tuple(self.spans))
    object.__setattr__(self, "kinds", tuple(self.kinds))


def make_plan(layout: PageLayout, buffer_bytes: Mapping[str, int], spans: Sequence[Span],
              active_tokens: int, query_tokens: int, kinds: Sequence[str] = ()) -> SpanPlan:
  plan = SpanPlan(tuple(spans), active_tokens, query_tokens, tuple(kinds))
  validate_plan(plan, layout, buffer_bytes)
  return plan


def validate_plan(plan: SpanPlan, layout: PageLayout, buffer_bytes: Mapping[str, int]) -> None:
  pt, pb = layout.page_tokens, layout.page_bytes
  if not plan.spans:
    raise SpanPlanError("no spans: a plan needs at least one span")
  if plan.query_tokens <= 0 or plan.query_tokens > plan.active_tokens:
    raise SpanPlanError(f"query tokens {plan.query_tokens} must be in [1, active tokens "
                        f"{plan.active_tokens}]")
  expected = 0
  for i, sp in enumerate(plan.spans):
    if sp.tokens <= 0:
      raise SpanPlanError(f"span {i} has {sp.tokens} tokens (needs >= 1)")
    if sp.token_begin != expected:
      what = "gap" if sp.token_begin > expected else "overlap or reorder"
      raise SpanPlanError(f"span {i} begins at token {sp.token_begin} but the previous span ends at "
                          f"{expected} ({what})")
    if sp.buffer not in buffer_bytes:
      raise SpanPlanError(f"span {i} names unknown buffer {sp.buffer!r}")
    if sp.token_begin % pt or sp.k_offset % pb or sp.v_offset != sp.k_offset + layout.v_offset \
        or sp.k_offset < 0:
      raise SpanPlanError(
          f"span {i} is misaligned: token_begin {sp.token_begin} must be a multiple of {pt}, k_offset "
          f"{sp.k_offset} a non-negative multiple of the page size {pb}, v_offset {sp.v_offset} must "
          f"be k_offset + {layout.v_offset}")
    size = buffer_bytes[sp.buffer]
    pages = layout.pages_for(sp.tokens)
    last_page = sp.k_offset + (pages - 1) * pb
    rows_last = sp.tokens - (pages - 1) * pt
    k_end = last_page + rows_last * layout.k_row_bytes
    v_end = last_page + layout.v_offset + rows_last * layout.v_row_bytes
    if k_end > size:
      raise SpanPlanError(f"span {i} K rows end at byte {k_end}, past buffer {sp.buffer!r} of {size} B "
                          f"({k_end - size} B over)")
    if v_end > size:
      raise SpanPlanError(f"span {i} V rows end at byte {v_end}, past buffer {sp.buffer!r} of {size} B "
                          f"({v_end - size} B over)")
    if i < len(plan.spans) - 1 and sp.tokens % pt:
      raise SpanPlanError(f"span {i} ends mid-page ({sp.tokens} tokens) but is not the last span")
    expected = sp.token_begin + sp.tokens
  if expected != plan.active_tokens:
    raise SpanPlanError(f"spans cover {expected} tokens but the plan has {plan.active_tokens} active "
                        f"tokens")


def page_table(plan: SpanPlan, layout: PageLayout, table_pages: int,
               buffer: Optional[str] = None) -> np.ndarray:
  """Logical page -> physical page index in the (single) buffer, padded with 0 to `table_pages`."""
  pt, pb = layout.page_tokens, layout.page_bytes
  table = np.zeros((table_pages,), np.int32)
  for sp in plan.spans:
    if buffer is not None and sp.buffer != buffer:
      raise SpanPlanError(f"span names buffer {sp.buffer!r}; this page table addresses {buffer!r}")
    first_logical = sp.token_begin // pt
    pages = layout.pages_for(sp.tokens)
    if first_logical + pages > table_pages:
      raise SpanPlanError(f"plan needs {first_logical + pages} table entries; table has {table_pages}")
    table[first_logical:first_logical + pages] = sp.k_offset // pb + np.arange(pages)
  return table


def spans_from_pages(layout: PageLayout, buffer: str, runs: Sequence[Tuple[int, int, str]],
                     active_tokens: int) -> Tuple[Tuple[Span, ...], Tuple[str, ...]]:
  """Spans from runs of (first physical page, page count, kind) in logical order."""
  pt, pb = layout.page_tokens, layout.page_bytes
  spans, kinds, tok = [], [], 0
  for first, count, kind in runs:
    if count <= 0:
      continue
    tokens = min(count * pt, active_tokens - tok)
    if tokens <= 0:
      break
    spans.append(Span(buffer, tok, tokens, first * pb, first * pb + layout.v_offset))
    kinds.append(kind)
    tok += tokens
  return tuple(spans), tuple(kinds)
