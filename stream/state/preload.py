"""Reading a restarted worker's local state while Faust starts.

A worker's start is mostly waiting: Faust's table manager sleeps 1 s and the group join
takes another 1-2 s on the embedded broker. Reading 1M local entries into the view
costs ~2.5 s of Python, so the reading is started first, in forked reader processes
(one per core, each over some partition files), while the worker process imports and
starts Faust. Each reader hands its partitions' view back through a pipe as one
``marshal`` blob, ~0.5 µs per entry to load against ~2.5 µs to read; a thread waits for
the blobs, so the event loop is not held up while they come. After a clean stop that
left a view snapshot (``stream.state.snapshot``), the readers only check that the files
still hold what it was written with, and the thread loads the snapshot instead (~0.35 s
at 1M entries).

This module imports no Faust: the readers are forked before the worker's own imports.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import marshal
import multiprocessing
import os
import threading
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from stream.core.cache import CacheState, Capacity
from stream.state.datadir import DataDir
from stream.state.snapshot import FileMarks, file_marks, read_snapshot, snapshot_marks
from stream.state.store import FAUST_OFFSET_KEY, load_partition

__all__ = ["LocalPreload"]

log = logging.getLogger(__name__)


class LocalPreload:
    """The view of the partition files found in a data dir, read in the background.

    Each partition's changelog offset (Faust's offset record) is noted with it: if
    Faust's recovery writes to a partition afterwards, the offset moves and the partition
    is read again from the table (``unchanged``).
    """

    def __init__(self, datadir: DataDir, capacity: Capacity, readers: int | None = None) -> None:
        self.datadir = datadir
        self.capacity = capacity
        self.readers = readers or os.cpu_count() or 1
        self.state: CacheState | None = None
        self.marks: dict[int, bytes | None] = {}
        self.merged = False
        self._thread: threading.Thread | None = None

    def start(self) -> LocalPreload:
        """Fork the readers (while no other thread runs) and collect their views in a thread."""
        partitions = self.datadir.partitions()
        expected = snapshot_marks(self.datadir, self.capacity) if partitions else None
        context = multiprocessing.get_context("fork")
        pipes = []
        for group in (partitions[i::self.readers] for i in range(self.readers)):
            if not group:
                continue
            receiver, sender = context.Pipe(duplex=False)
            reader = context.Process(target=_read,
                                     args=(self.datadir, self.capacity, group, sender, expected),
                                     name="mmcache-preload", daemon=True)
            reader.start()
            sender.close()
            pipes.append((receiver, reader))
        self._thread = threading.Thread(target=self._collect, args=(pipes, expected),
                                        name="preload", daemon=True)
        self._thread.start()
        return self

    async def wait(self) -> LocalPreload:
        """Wait for the view, without blocking the event loop."""
        assert self._thread is not None, "start() first"
        await asyncio.to_thread(self._thread.join)
        return self

    def merge_into(self, state: CacheState) -> None:
        """Add the preloaded view to ``state``, once: before the group join when it is
        already caught up with the log (``stream.worker.app``), else at the first recovery."""
        if self.state is not None and not self.merged:
            state.merge(self.state)
            self.merged, self.state = True, None  # ``state`` holds its parts now

    def drop_snapshot(self) -> None:
        """Remove the view snapshot this preload read, once the worker's files are open
        for writing (its first recovery): a start refused before that (no room to open
        them) leaves it for the next one, and its room counts until then."""
        self.datadir.drop_snapshot()

    def holds_changelog(self, ends: Mapping[int, int]) -> bool:
        """Whether the files read hold every record of the changelog, whose end offsets
        are ``ends`` (a partition without a file: an empty one)."""
        for partition, end in ends.items():
            mark = self.marks.get(partition)
            if end != (-1 if mark is None else int(mark)) + 1:
                return False
        return True

    def unchanged(self, partition: int, db: Any) -> bool:
        """Whether the table's partition is still what was read."""
        return partition in self.marks and db.get(FAUST_OFFSET_KEY) == self.marks[partition]

    def _collect(self, pipes: list[tuple[Connection, Any]], expected: FileMarks | None) -> None:
        used = False  # the snapshot: kept until ``drop_snapshot``, else dropped here
        try:
            used = self._take(pipes, expected)
        finally:
            if not used:
                self.datadir.drop_snapshot()  # outdated or unreadable, if there is one

    def _take(self, pipes: list[tuple[Connection, Any]], expected: FileMarks | None) -> bool:
        """Take the readers' views, or the snapshot when they all found its files; say
        whether the snapshot was used."""
        try:
            blobs = [receiver.recv_bytes() for receiver, _ in pipes]
        except EOFError:
            log.warning("could not preload the local state (a reader failed); it is read "
                        "at recovery instead")
            return False
        finally:
            for receiver, reader in pipes:
                receiver.close()  # a reader still sending gets a broken pipe and ends
                reader.join()
        snapshot = expected is not None and bool(blobs) and not any(blobs)
        gc.disable()  # a million new objects, none in a cycle: collections only cost time
        try:
            if snapshot:  # every file still holds what the snapshot was written with
                state = read_snapshot(self.datadir, self.capacity)
                marks = {partition: mark for partition, (mark, _) in (expected or {}).items()}
                source = "the view snapshot of the last clean stop"
            elif all(blobs):
                state, marks = CacheState(self.capacity), {}
                for blob in blobs:
                    exported, part_marks = marshal.loads(blob)
                    state.merge(CacheState.from_export(self.capacity, exported))
                    marks.update(part_marks)
                source = "partitions " + str(sorted(marks))
            else:  # the files changed between two readers' looks: none of this is sure
                log.warning("could not preload the local state (its files changed while read); "
                            "it is read at recovery instead")
                return False
        except (OSError, ValueError, EOFError, TypeError) as exc:
            log.warning("could not preload the local state (%s); it is read at recovery instead",
                        exc)
            return False
        finally:
            gc.enable()
        self.state, self.marks = state, marks
        log.info("preloaded %d endpoints from %s", len(state.lrus.endpoints), source)
        return snapshot

def _read(datadir: DataDir, capacity: Capacity, partitions: list[int], sender: Connection,
          expected: FileMarks | None = None) -> None:
    """A reader process: the view of some partitions, sent as one blob; or nothing (an
    empty blob) when every file still holds what the view snapshot was written with."""
    if expected is not None and file_marks(datadir) == expected:
        sender.send_bytes(b"")
        sender.close()
        return
    gc.disable()
    state, marks = CacheState(capacity), {}
    for partition in partitions:
        db = datadir.open_partition(partition, read_only=True)
        try:
            marks[partition] = db.get(FAUST_OFFSET_KEY)
            load_partition(state, partition, db.items())
        finally:
            db.close()
    sender.send_bytes(marshal.dumps((state.loading.export(), marks)))
    sender.close()
