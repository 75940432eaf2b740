"""One figure of the benchmark: a value, its same-run control, and its target."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Figure", "median_of"]


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
