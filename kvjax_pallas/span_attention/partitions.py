"""Partition sizing: the `block_pages="auto"` rules of the span-attention kernels.

A logical partition is `block_pages` pages; every kernel runs its partitions as independent CTAs
and the combine folds them in logical order. Each rule is a pure function of static shapes and
the GPU's SM count, so one call resolves to the same size wherever it is traced. The kernels say
how many CTAs a partition needs and how many an SM holds; the rules here turn that into a size:

* `fewest_rounds` (Triton kernel): CTAs run in rounds of `ctas_per_sm x num_sms`; the size with
  the fewest page-reads per CTA slot, rounds x (pages a CTA + CTA_OVERHEAD_PAGES), the larger
  size on a tie (fewer partitions to combine).
* `one_wave` (Mosaic GPU decode kernel: one CTA a partition for all heads): the fewest pages
  that keep every partition in one wave of `num_sms` CTAs.
* `fullest_waves` (Mosaic GPU prefill kernel: one CTA an SM): the partition count whose CTAs
  fill their waves best, up to `max_waves` waves, the fewest partitions among equals.

The measurements behind them: docs/PERFORMANCE.md, 'Span attention kernels'.
"""

from __future__ import annotations

import jax

DEFAULT_NUM_SMS = 132      # the H200's streaming multiprocessors (used where no GPU is present)
CTA_OVERHEAD_PAGES = 1     # per-CTA fixed cost (query load, partial write), in page-reads


def num_sms() -> int:
  """Streaming multiprocessors of the default GPU (DEFAULT_NUM_SMS where there is none)."""
  dev = jax.devices()[0]
  if dev.platform == "gpu":
    return int(getattr(dev, "core_count", 0) or DEFAULT_NUM_SMS)
  return DEFAULT_NUM_SMS


def fewest_rounds(num_pages: int, ctas_per_part: int, ctas_per_sm: int,
                  num_sms: int = DEFAULT_NUM_SMS) -> int:
  """Pages a partition: the fewest page-reads per CTA slot over rounds of ctas_per_sm x num_sms
  CTAs (a CTA costs its pages + CTA_OVERHEAD_PAGES), the larger size on a tie."""
  num_pages = max(1, int(num_pages))
  slots = ctas_per_sm * num_sms
  best, best_cost = 1, None
  for bp in range(1, num_pages + 1):
    rounds = -(-ctas_per_part * -(-num_pages // bp) // slots)
    cost = rounds * (bp + CTA_OVERHEAD_PAGES)
    if best_cost is None or cost <= best_cost:
      best, best_cost = bp, cost
  return best


def one_wave(num_pages: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
  """Pages a partition: the fewest that keep the partitions (one CTA each) in one wave of
  `num_sms` CTAs."""
  return max(1, -(-max(1, int(num_pages)) // num_sms))


def fullest_waves(num_pages: int, ctas_per_part: int, num_sms: int = DEFAULT_NUM_SMS,
                  max_waves: int = 4) -> int:
  """Pages a partition: the partition count whose ctas_per_part x partitions CTAs (one an SM)
  fill their waves of `num_sms` best, up to `max_waves` waves, the fewest partitions among
  equals."""
  num_pages = max(1, int(num_pages))
  best_bp, best_fill = num_pages, 0.0
  for parts in range(1, num_pages + 1):
    bp = -(-num_pages // parts)
    real = -(-num_pages // bp)                 # the partitions that bp gives
    waves = -(-ctas_per_part * real // num_sms)
    if waves > max_waves:
      break
    fill = ctas_per_part * real / (waves * num_sms)
    if fill > best_fill + 1e-9:
      best_bp, best_fill = bp, fill
  return best_bp
