"""An owned partition whose events sit on the log unapplied, its owner idle, is fetched
again from the view's applied offset.

Faust's consumer can drop fetched records without moving its position back
(``stream.worker.faust_batches`` gives back every such record it found: a survivor that took
over a dead owner's partitions once skipped their first events so and never applied
them). Were another such path left, the partition's lag would hold still while nothing
is applied, and the view would stay behind until the next rebalance. This rule notices
that: behind the log's end with the applied offset unmoved for ``after_s`` seconds while
the worker applied nothing at all. A fetch from the applied offset is always safe: the
keeper skips what it applied already.

``StallWatch`` is the rule, pure (the clock and the figures are given); the worker asks
it once a second (``stream.worker.app``).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["StallWatch"]


class StallWatch:
    """Partitions behind the log's end whose applied offset has not moved for a while,
    while no owned partition applied anything either (a worker working through a backlog
    fetches some partitions while others wait their turn: those are not stalled)."""

    def __init__(self, after_s: float = 5.0) -> None:
        self.after_s = after_s
        self._since: dict[int, tuple[int, float]] = {}  # partition -> (applied, unmoved since)
        self._idle_since: float | None = None  # no owned partition applied anything since

    def reset(self) -> None:
        """Forget what was seen (a rebalance: offsets and owners may change meanwhile)."""
        self._since.clear()
        self._idle_since = None

    def stalled(self, figures: Mapping[int, tuple[int, int]], now: float) -> list[int]:
        """The partitions to fetch again, from ``partition -> (applied offset, end offset)``
        of the owned partitions now; each is given once per ``after_s`` it stays so."""
        since = self._since
        moved = any(since.get(partition, (applied,))[0] != applied
                    for partition, (applied, _) in figures.items())
        if moved or self._idle_since is None:
            self._idle_since = now
        for partition in since.keys() - figures.keys():
            del since[partition]  # no longer owned
        idle = now - self._idle_since >= self.after_s
        found = []
        for partition, (applied, end) in figures.items():
            seen = since.get(partition)
            if seen is None or seen[0] != applied:
                since[partition] = (applied, now)  # moving (or new)
            elif idle and applied + 1 < end and now - seen[1] >= self.after_s:
                found.append(partition)
                since[partition] = (applied, now)
        return found
