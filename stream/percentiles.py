"""The one rule by which mmcache ranks every p50/p90/p99 it prints (the simulator's, the
bench's): the nearest rank. The q quantile of n values is the smallest value with at
least ``q * n`` of them at or below it; it is always one of the values measured (no
interpolation between two runs' latencies), and 0.5 of 100 values is the 50th."""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["percentile"]


def percentile(values: Iterable[float], share: float) -> float:
    """The ``share`` (0 < share <= 1) quantile of ``values`` by the nearest rank."""
    if not 0 < share <= 1:
        raise ValueError(f"a percentile's share must be in (0, 1], not {share}")
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values to take a percentile of")
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]
