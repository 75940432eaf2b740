"""One figure of the benchmark: a value, its same-run control, and its target."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["LEGEND", "Figure", "median_of", "render_table", "span"]


@dataclass(frozen=True)
class Figure:
    """A measured figure as written to ``bench/results.json``."""

    name: str
    value: float
    unit: str
    target: str
    passed: bool
    control: float | None = None
    ratio: float | None = None
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        """The JSON object of the figure (``pass`` is a keyword in Python)."""
        data = asdict(self)
        data["pass"] = data.pop("passed")
        return data


def median_of(runs: int, measure: Callable[[], float]) -> float:
    """Median of ``runs`` measurements (shared machines drift; medians are quoted)."""
    return statistics.median(measure() for _ in range(runs))


def span(values: Sequence[float], digits: int = 0) -> str:
    """The spread of some runs' values, as every note writes it: ``min-max``."""
    return f"{min(values):,.{digits}f}-{max(values):,.{digits}f}"


LEGEND = (
    "Columns: **figure** what was measured; **value** the measurement in its unit (medians "
    "over the runs); **control** the same measurement of a baseline in the same run (same "
    "unit), when there is one; **ratio** value / control; **target** what the figure must "
    "reach; **pass** `yes` when the value meets the target, `NO` when it does not (the run "
    "still completes: NO marks a regression to look at, not a failed run); **what it "
    "means** the figure's own note. A `--quick` run uses reduced sizes: its figures are not "
    "comparable with a full run's and it is written to `bench/quick.json`, never over the "
    "full results."
)


def render_table(figures: list[Figure]) -> str:
    """A Markdown table of the figures, followed by the legend of its columns."""
    lines = ["| figure | value | control | ratio | target | pass | what it means |",
             "|---|---|---|---|---|---|---|"]
    for f in figures:
        control = "" if f.control is None else f"{f.control:,} {f.unit}"
        ratio = "" if f.ratio is None else f"{f.ratio}"
        lines.append(f"| {f.name} | {f.value:,} {f.unit} | {control} | {ratio} | {f.target} | "
                     f"{'yes' if f.passed else 'NO'} | {f.note.replace('|', '/')} |")
    return "\n".join(lines) + "\n\n" + LEGEND
