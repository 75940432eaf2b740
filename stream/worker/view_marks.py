"""Which partitions of the view already hold what their state file holds, so that a
recovery need not load them again.

Every recovery (each rebalance) used to load each owned partition into the view from its
file, also those this worker owned before and those its follower had read to the
changelog's end: ~1 s for each 128k entries, during which Faust applies no event of them
(at 1M entries over three workers, ~4 s of a takeover's ~8). A mark says: the view's part
of this partition is the fold of its changelog up to this offset, as a file is whose
offset record (Faust's, where its recovery resumes) says the same offset. A recovery after
which the file says that offset finds the view already equal to it.

Whatever makes the view's part of a partition such a fold sets its mark: a load from the
file, the owner's batch once the file holds it, the follower's records. Whatever changes
it otherwise forgets it: a batch not stored, a fold that failed part-way. No mark, or a
different offset: the partition is loaded, as before.
"""

from __future__ import annotations

from typing import Any

from stream.state.store import FAUST_OFFSET_KEY

__all__ = ["ViewMarks", "file_mark"]


class ViewMarks:
    """Per partition, the changelog offset up to which the view's part is the changelog's
    fold (its records passed through a ``ChangelogGate``, like a file's restore)."""

    def __init__(self) -> None:
        self._through: dict[int, int] = {}
        self._distrusted: set[int] = set()

    def set(self, partition: int, through: int | None) -> None:
        """The view's part of ``partition`` is the fold up to ``through`` (``None``: not known)."""
        if through is None or partition in self._distrusted:
            self._through.pop(partition, None)
        else:
            self._through[partition] = through

    def distrust(self, partition: int) -> None:
        """Never mark ``partition`` again (in this process): its changelog holds another
        writer's records between this worker's (a zombie's, resent after its successor's
        first batch). A reader of the whole changelog may apply some of them, which the
        view, folded from the event log, holds only once it reaches them: the view's part
        is then not what a re-read gives, whatever the offsets say."""
        self._distrusted.add(partition)
        self._through.pop(partition, None)

    def forget(self, partition: int) -> int | None:
        """Drop the mark (the view's part is about to change otherwise); return it."""
        return self._through.pop(partition, None)

    def through(self, partition: int) -> int | None:
        """The mark, or ``None``."""
        return self._through.get(partition)

    def holds(self, partition: int, through: int | None) -> bool:
        """Whether the view's part is the fold a file holding the changelog up to
        ``through`` holds."""
        return through is not None and self._through.get(partition) == through


def file_mark(db: Any) -> int:
    """The changelog offset a partition's file holds everything up to: -1 for a file
    without Faust's offset record (a new one: every write to a file writes the record)."""
    raw = db.get(FAUST_OFFSET_KEY)
    return -1 if raw is None else int(raw)
