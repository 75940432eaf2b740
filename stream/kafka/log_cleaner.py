"""Compaction and retention of the embedded broker's kept log, and giving it back to a
new broker at the offsets it had.

Tansu's memory storage never shrinks a topic: it applies neither ``cleanup.policy=compact``
nor retention, and it refuses ``DeleteRecords``. So the log is bounded where mmcache holds
it, in the data dir, each time `serve` starts on it, before the new broker gets it:

- **the changelog** keeps the latest record of each key, as Kafka's log cleaner does. A
  tombstone (a ``None`` value: a removed entry) is kept only while a table file may still
  hold its key: those at or below the offset a partition's table file holds (or all, when
  no table file is kept) are dropped;
- **the event and dead-letter topics** keep what the retention allows (by age and by bytes
  per partition, as ``retention.ms`` / ``retention.bytes``; ``-1`` keeps everything), and
  never an event the state has not applied yet;
- every partition keeps its last record, so its end offset (the high watermark) is what it
  was: the table files, the view snapshot and Faust's offsets stay true.

The broker is then given the compacted changelog and, of the events, only those after the
state's applied offset (plus the last one): the changelog is a checkpoint of the state at
that offset, so the broker's memory follows the live state, not the history or the
retention. Records keep their offsets: a record batch may leave gaps between the offsets
of its records (as a compacted Kafka log does), and Tansu keeps them (the next batch starts
after the last record's offset; measured on Tansu 0.6.0, ``tests/integration``).

A partition file is rewritten whole into ``<partition>.log.compacting`` and renamed over
the old one: a kill at any point leaves either file, each a valid log holding every record
that matters, and a leftover ``.compacting`` file is removed at the next start.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

__all__ = ["COMPACTING_SUFFIX", "Frame", "PartitionPlan", "Retention", "compact_changelog",
           "mapped", "now_ms", "plan_events", "relocate", "rewrite", "scan"]

COMPACTING_SUFFIX = ".compacting"
_FRAME = struct.Struct(">II")
_POSITION = struct.Struct(">qqb")
_LENGTH = struct.Struct(">i")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Retention:
    """How much of the event and dead-letter topics the kept log holds: records younger
    than ``ms`` and, per partition, the newest ``bytes`` of frames (-1: no bound)."""

    ms: int = 7 * 24 * 3600 * 1000
    bytes: int = 128 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("ms", "bytes"):
            value = getattr(self, name)
            if value < -1 or value == 0:
                raise ValueError(f"retention {name} must be -1 (keep everything) or positive, "
                                 f"not {value}")


@dataclass(frozen=True, slots=True)
class Frame:
    """Where one whole record lies in a partition file, and what compaction reads of it."""

    start: int
    end: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    tombstone: bool
    value: bytes | None  # only when asked for (``scan(values=...)``)


def scan(data: bytes | mmap.mmap, values: Callable[[bytes | None], bool] = lambda key: False,
         ) -> tuple[list[Frame], int]:
    """The whole frames at the start of ``data`` and the length they take; a torn or
    corrupt frame (and all after it) is left out. Only the values of keys for which
    ``values`` is true are copied (compaction needs keys, not values)."""
    frames: list[Frame] = []
    at, size = 0, len(data)
    view = memoryview(data)
    try:
        while at + 8 <= size:
            length, crc = _FRAME.unpack_from(data, at)
            body = at + 8
            end = body + length
            if end > size or zlib.crc32(view[body:end]) != crc:
                break
            offset, timestamp, _ = _POSITION.unpack_from(data, body)
            cursor = body + 17
            (key_length,) = _LENGTH.unpack_from(data, cursor)
            cursor += 4
            key = None if key_length < 0 else bytes(view[cursor:cursor + key_length])
            cursor += max(key_length, 0)
            (value_length,) = _LENGTH.unpack_from(data, cursor)
            value = (bytes(view[cursor + 4:cursor + 4 + value_length])
                     if value_length >= 0 and values(key) else None)
            frames.append(Frame(at, end, offset, timestamp, key, value_length < 0, value))
            at = end
    finally:
        view.release()
    return frames, at


def compact_changelog(frames: list[Frame], tombstones_through: int) -> list[Frame]:
    """The frames Kafka's cleaner would keep: the latest of each key, less tombstones at
    or below ``tombstones_through``; the last frame always (it holds the end offset)."""
    latest: dict[bytes | None, int] = {}
    for index, frame in enumerate(frames):
        latest[frame.key if frame.key is not None else index.to_bytes(8, "big")] = index
    last = len(frames) - 1
    kept = []
    for index, frame in enumerate(frames):
        key = frame.key if frame.key is not None else index.to_bytes(8, "big")
        if index == last or (latest[key] == index
                             and not (frame.tombstone and frame.offset <= tombstones_through)):
            kept.append(frame)
    return kept


@dataclass(frozen=True, slots=True)
class PartitionPlan:
    """What one partition file keeps on disk and what of it the new broker gets."""

    kept: list[Frame]
    to_broker: list[Frame]
    dropped: int = field(default=0)


def plan_events(frames: list[Frame], retention: Retention, now_ms: int,
                applied: int | None) -> PartitionPlan:
    """Retention of an event (``applied``: the state's applied offset, or -1) or
    dead-letter (``applied`` None) partition. Kept: the longest suffix within the
    retention, every event after ``applied``, the last frame. To the broker: the events
    after ``applied`` and the last frame (dead letters: all kept)."""
    if not frames:
        return PartitionPlan([], [])
    first = 0
    if retention.ms != -1:
        cutoff = now_ms - retention.ms
        while first < len(frames) and frames[first].timestamp_ms < cutoff:
            first += 1
    if retention.bytes != -1:
        end = frames[-1].end
        while first < len(frames) and end - frames[first].start > retention.bytes:
            first += 1
    if applied is not None:
        while first > 0 and frames[first - 1].offset > applied:
            first -= 1
    first = min(first, len(frames) - 1)
    kept = frames[first:]
    if applied is None:
        return PartitionPlan(kept, kept, first)
    to_broker = [frame for frame in kept[:-1] if frame.offset > applied] + [kept[-1]]
    return PartitionPlan(kept, to_broker, first)


def compacting_path(path: Path) -> Path:
    """Where ``rewrite`` writes a partition file's new content before its rename."""
    return path.with_name(path.name + COMPACTING_SUFFIX)


def relocate(kept: list[Frame], frames: list[Frame]) -> list[Frame]:
    """``frames`` (some of ``kept``) where ``rewrite`` puts them in the new file."""
    moved, at = {}, 0
    for frame in kept:
        moved[frame.start] = at
        at += frame.end - frame.start
    return [replace(frame, start=moved[frame.start], end=moved[frame.start] + frame.end - frame.start)
            for frame in frames]


def rewrite(path: Path, data: bytes | mmap.mmap, kept: list[Frame],
            chunk_bytes: int = 1 << 20) -> None:
    """Replace the partition file by the ``kept`` frames of ``data`` (its old content),
    through a new file renamed over it (atomic: a kill leaves one or the other); the
    frames are then where ``relocate`` says."""
    tmp = compacting_path(path)
    with open(tmp, "wb") as out:
        pending: list[bytes] = []
        size = 0
        for frame in kept:
            pending.append(data[frame.start:frame.end])
            size += frame.end - frame.start
            if size >= chunk_bytes:
                out.write(b"".join(pending))
                pending, size = [], 0
        out.write(b"".join(pending))
        out.flush()
        os.fsync(out.fileno())  # the rename must not reach the disk before the content
    os.replace(tmp, path)


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[bytes | mmap.mmap]:
    """A partition file's bytes, mapped (not read into the process's memory): a log of
    gigabytes costs page cache, not resident memory."""
    if not path.exists() or path.stat().st_size == 0:
        yield b""
        return
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        yield data


def now_ms() -> int:
    """The wall clock in ms, for the retention by age (record timestamps are wall clock)."""
    return int(time.time() * 1000)
