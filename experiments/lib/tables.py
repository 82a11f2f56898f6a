"""Plain-text tables the experiment scripts print."""

from typing import Mapping, Sequence, Tuple


def outcome_table(counts: Mapping[Tuple[str, str], int], outcomes: Sequence[str], label: str,
                  label_width: int, col_width: int, total: str = "all") -> str:
  """Counts of (row kind, outcome) pairs as a table: a row a kind (sorted), a column an outcome,
  the row totals last, then a row of the column totals ("all")."""
  kinds = sorted({k for k, _ in counts})
  count = lambda k, o: counts.get((k, o), 0)   # noqa: E731
  rows = [f"{label:<{label_width}}" + "".join(f"{o:>{col_width}}" for o in outcomes) + f"{total:>8}"]
  for k in kinds:
    rows.append(f"{k:<{label_width}}" + "".join(f"{count(k, o):>{col_width}}" for o in outcomes)
                + f"{sum(count(k, o) for o in outcomes):>8}")
  rows.append(f"{'all':<{label_width}}" + "".join(f"{sum(count(k, o) for k in kinds):>{col_width}}" for o in outcomes)
              + f"{sum(counts.values()):>8}")
  return "\n".join(rows)
