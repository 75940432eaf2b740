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

`serve` compacts in a process of its own (``compact_apart``): a compaction scans every
kept frame into objects, hundreds of MiB for a log at its retention, and a process that
frees that much memory among live objects keeps most of it (Python's and glibc's
allocators return only whole free regions): run in `serve`, each compaction of a rebase
left its RSS higher, ~400 MiB an hour in the soak. The child's memory goes with it.

A partition file is rewritten whole into ``<partition>.log.compacting`` and renamed over
the old one: a kill at any point leaves either file, each a valid log holding every record
that matters, and a leftover ``.compacting`` file is removed at the next start.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from stream.kafka.embedded_log import (
    COMPACTING_SUFFIX,
    AppliedAt,
    EmbeddedLog,
    Frame,
    applied_prefix,
    mapped,
    scan,
)

__all__ = ["Admit", "PartitionPlan", "Retention", "compact", "compact_apart", "compact_changelog",
           "compacting_path",
           "now_ms", "plan_events", "relocate", "rewrite"]

#: The changelog records every reader applies, in log order (``stream.state.store.ChangelogGate``,
#: given by the caller: this package is below the state's): a batch written again after
#: later ones (a resend, a zombie owner) is dropped by every reader, so by compaction too.
Admit = Callable[[list[Frame]], list[Frame]]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Retention:
    """How much of the event and dead-letter topics the kept log holds: records younger
    than ``ms`` and, per partition, the newest ``bytes`` of frames (-1: no bound)."""

    ms: int
    bytes: int

    def __post_init__(self) -> None:
        for name in ("ms", "bytes"):
            value = getattr(self, name)
            if value < -1 or value == 0:
                raise ValueError(f"retention {name} must be -1 (keep everything) or positive, "
                                 f"not {value}")


def compact_changelog(frames: list[Frame], tombstones_through: int,
                      admit: Admit = lambda frames: frames) -> list[Frame]:
    """The frames Kafka's cleaner would keep, of those every reader applies (``admit``):
    the latest of each key, less tombstones at or below ``tombstones_through``; and the
    last frame, whatever it is (it holds the end offset; a reader drops it as before)."""
    admitted = admit(frames)
    latest: dict[bytes, Frame] = {}
    for frame in admitted:
        latest[frame.key if frame.key is not None else frame.offset.to_bytes(8, "big")] = frame
    kept = sorted((frame for frame in latest.values()
                   if not (frame.tombstone and frame.offset <= tombstones_through)),
                  key=lambda frame: frame.offset)
    if frames and (not kept or kept[-1].offset != frames[-1].offset):
        kept.append(frames[-1])
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


def now_ms() -> int:
    """The wall clock in ms, for the retention by age (record timestamps are wall clock)."""
    return int(time.time() * 1000)


def compact(files: EmbeddedLog, applied_at: AppliedAt, admit: Admit,
            tombstones_through: Callable[[int], int], retention: Retention, now: int,
            killed: bool = False) -> dict[tuple[str, int], list[Frame]]:
    """Compact the kept log's changelogs and apply the retention to its other topics,
    rewriting each file that loses records; return, per (topic, partition), the frames
    the new broker is to get (``EmbeddedLog.restore``). ``tombstones_through(p)``: the
    changelog offset partition p's table file holds (its tombstones up to there go).
    ``killed``: the last run was killed, so each changelog is first cut after its last
    applied record whose event the kept events hold (``applied_prefix``: what follows may
    hold entries of events the kept log lost, written just before the kill). Every file is
    scanned before any is rewritten, so a damaged one (``CorruptLog``) leaves all as they were."""
    for leftover in files.root.glob(f"*/*.log{COMPACTING_SUFFIX}"):
        leftover.unlink()  # a rewrite a kill interrupted: the old file is whole
    topics = files.topics()
    changelogs = {spec["applied_offsets_of"]: name for name, spec in topics.items()
                  if spec.get("applied_offsets_of") is not None}
    plans: dict[tuple[str, int], list[Frame]] = {}
    dropped: dict[str, int] = {}
    cut = 0

    def retain(name: str, partition: int, data: bytes | mmap.mmap, frames: list[Frame],
               length: int, applied: int | None) -> None:
        plan = plan_events(frames, retention, now, applied)
        to_broker = plan.to_broker
        if plan.dropped or length < len(data):
            path = files.partition_path(name, partition)
            rewrite(path, data, plan.kept)
            to_broker = relocate(plan.kept, to_broker)
            length = sum(frame.end - frame.start for frame in plan.kept)
        files.remember(name, partition, length, plan.kept[-1].offset + 1 if plan.kept else 0)
        dropped[name] = dropped.get(name, 0) + plan.dropped
        plans[(name, partition)] = to_broker

    with ExitStack() as maps:
        # every file is scanned before any is rewritten: a damaged one (CorruptLog) refuses
        # the whole compaction with nothing changed, as its message says; the maps stay
        # open and the frames are kept for the rewrites, so no CRC is computed twice
        scanned: dict[tuple[str, int], tuple[bytes | mmap.mmap, list[Frame], int]] = {}
        for name, spec in topics.items():
            for partition in range(int(spec["partitions"])):
                path = files.partition_path(name, partition)
                data = maps.enter_context(mapped(path))
                # the changelog's values say what is applied; compaction needs keys only
                changelog_file = spec.get("applied_offsets_of") is not None
                frames, length = (scan(data, lambda key: True, path) if changelog_file
                                  else scan(data, path=path))
                scanned[(name, partition)] = (data, frames, length)

        for name, spec in topics.items():
            if spec.get("applied_offsets_of") is not None:
                continue
            changelog = changelogs.get(name)
            for partition in range(int(spec["partitions"])):
                events, frames, length = scanned[(name, partition)]
                if changelog is None:  # dead letters
                    retain(name, partition, events, frames, length, None)
                    continue
                # the changelog first: it says what is applied, and so what to keep of these
                data, records, whole = scanned[(changelog, partition)]
                unfinished = 0
                if killed:
                    keep = applied_prefix(records, frames[-1].offset + 1 if frames else 0, applied_at)
                    unfinished, records = len(records) - keep, records[:keep]
                    cut += unfinished
                kept = compact_changelog(records, tombstones_through(partition), admit)
                applied = max((found for frame in kept
                               if (found := applied_at(frame.key, frame.value)) is not None), default=-1)
                if unfinished or len(kept) < len(records) or whole < len(data):
                    rewrite(files.partition_path(changelog, partition), data, kept)
                    kept = relocate(kept, kept)
                    whole = kept[-1].end if kept else 0
                files.remember(changelog, partition, whole, kept[-1].offset + 1 if kept else 0)
                dropped[changelog] = dropped.get(changelog, 0) + len(records) - len(kept)
                plans[(changelog, partition)] = kept
                retain(name, partition, events, frames, length, applied)
    if cut:
        log.warning("cut %d changelog records past what the kept event log holds (written "
                    "just before a kill); the events it holds are applied again", cut)
    if any(dropped.values()):
        log.info("embedded broker's log compacted in %s: dropped %s", files.root,
                 ", ".join(f"{topic} {n} records" for topic, n in dropped.items() if n))
    return plans


def compact_apart(files: EmbeddedLog, applied_at: AppliedAt, admit: Admit,
                  tombstones_through: Callable[[int], int], retention: Retention, now: int,
                  killed: bool = False) -> dict[tuple[str, int], list[Frame]]:
    """``compact``, run in a new process (spawned: `serve` has threads) so that its
    transient memory is not `serve`'s (module docstring); ``applied_at`` and ``admit``
    are module-level functions (pickled by name). What it found of each file is remembered
    in ``files`` and what it logged is logged here, as if it had run in this process;
    its ``CorruptLog`` is raised here."""
    partitions = max((int(spec["partitions"]) for spec in files.topics().values()), default=0)
    tombstones = {partition: tombstones_through(partition) for partition in range(partitions)}
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_die_with, initargs=(os.getpid(),)) as child:
        plans, known, records = child.submit(_compact_in_child, files.root, applied_at, admit,
                                             tombstones, retention, now, killed).result()
    for (topic, partition), (length, next_offset) in known.items():
        files.remember(topic, partition, length, next_offset)
    for record in records:
        if (logger := logging.getLogger(record.name)).isEnabledFor(record.levelno):
            logger.handle(record)
    return plans


def _die_with(parent: int) -> None:
    """The child ends with `serve`: one left over from a killed `serve` would go on
    rewriting files that the next `serve` on the data dir compacts too (Linux: the parent's
    death signal; elsewhere the child finishes its compaction, atomic file by file). A
    Ctrl-C reaches the whole process group: `serve` stops gracefully, the child goes on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


_PR_SET_PDEATHSIG = 1


class _Kept(logging.Handler):
    """The log records of a child's compaction, made picklable for its parent."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args, record.exc_info, record.exc_text = record.getMessage(), None, None, None
        self.records.append(record)


def _compact_in_child(root: Path, applied_at: AppliedAt, admit: Admit, tombstones: dict[int, int],
                      retention: Retention, now: int, killed: bool,
                      ) -> tuple[dict[tuple[str, int], list[Frame]], dict[tuple[str, int], tuple[int, int]],
                                 list[logging.LogRecord]]:
    kept = _Kept()
    log.addHandler(kept)
    log.setLevel(logging.INFO)
    log.propagate = False  # the parent logs them
    files = EmbeddedLog(root)
    plans = compact(files, applied_at, admit, lambda partition: tombstones.get(partition, -1),
                    retention, now, killed)
    return plans, files.remembered(), kept.records
