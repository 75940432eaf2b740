"""The embedded broker's log, kept in the data dir (Tansu here keeps its own in memory).

While `serve` runs its own embedded broker, one ``Journal`` (a thread of the serve
process) tails every partition of mmcache's topics on it (events, changelog, dead
letters) and appends each record, with its offset, timestamp, key, value and headers, to
``DATA_DIR/v1/log/<topic>/<partition>.log``. The publisher acknowledges a write only
once the journal has stored its offset (``Journal.wait_stored``), so an acknowledged
write is on disk even when a SIGKILL takes `serve` and its broker down together.

On the next start on the same data dir, ``restore`` gives a new broker (started with the
recorded cluster id, ``cluster.json``) the same topics and partitions, produces every
partition's records in offset order and checks that the broker assigned the journal's
offsets, before Faust starts: restart, recovery and `rebuild` then see the log they saw.

File format, one frame a record: ``>II`` (body length, CRC-32 of the body), then the body
``>qqb`` (offset, timestamp ms, timestamp type), key and value (``>i`` length, -1 for
none, then the bytes) and ``>H`` headers, each ``>H`` name length, name (UTF-8), ``>i``
value length, value. A frame cut short by a kill ends the file: it was never
acknowledged, and it is cut off when the file is opened for appending (a torn tail: no
whole frame follows the bad one). A bad frame (a wrong CRC, or a length past the file)
with whole frames after it is not a kill's doing: the file was damaged, and cutting it
would drop acknowledged records, so every reader (``scan``, and so appending, reading and
compaction) refuses it with ``CorruptLog``, naming the file, the byte and what to do.
Records are written (not fsynced) before they are acknowledged: they survive the
process, not a power cut of the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import re
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from stream.kafka import fetch_gate
from stream.kafka.tansu import FETCH_BYTES

__all__ = ["CLUSTER_FILE", "COMPACTING_SUFFIX", "LOG_DIR_NAME", "CorruptLog", "EmbeddedLog", "Frame",
           "Journal",
           "LogRecord", "RestoreFailed", "is_log_entry", "mapped", "scan"]

LOG_DIR_NAME = "log"
CLUSTER_FILE = "cluster.json"
_FRAME = struct.Struct(">II")
# a frame's fixed start read at once by ``scan``: length, CRC, offset, timestamp, type, key length
_HEAD = struct.Struct(">IIqqbi")
_POSITION = struct.Struct(">qqb")
_LENGTH = struct.Struct(">i")
_COUNT = struct.Struct(">H")
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
#: A partition file's new content while compaction writes it (renamed over it once whole).
COMPACTING_SUFFIX = ".compacting"
_PARTITION_FILE = re.compile(r"^\d+\.log(?:\.compacting)?$")
_RESTORE_CHUNK = 5000
_REFUSED_RETRY_S = 0.5  # a journal whose files refused a write tries again this often
# A write is acknowledged once the journal has fetched it, and an idle fetch on Tansu
# returns after about half its max wait, not when data arrives: when a fetch is in flight
# as a write comes, this wait is most of what the journal adds to its acknowledgement. An
# idle journal has none in flight: the publisher's acknowledged write wakes it
# (stream.kafka.fetch_gate) and its fetch finds the write at once.
JOURNAL_FETCH_WAIT_MS = 10

log = logging.getLogger(__name__)


def is_log_entry(depth: int, name: str, is_dir: bool) -> bool:
    """Whether an entry ``depth`` levels below ``v1/log`` is one the journal writes: the
    cluster file (and its temporary) at the top, a dir per topic, a file per partition."""
    if depth == 0:
        return (not is_dir and name in (CLUSTER_FILE, CLUSTER_FILE + ".tmp")) or (
            is_dir and bool(_TOPIC.match(name)) and name not in (".", ".."))
    return depth == 1 and not is_dir and bool(_PARTITION_FILE.match(name))


class RestoreFailed(SystemExit):
    """The journal could not be given back to the broker as it was; nothing was deleted."""


class CorruptLog(ValueError):
    """A partition file holds a bad frame with whole frames after it: damage, not the torn
    tail of a kill. Nothing is cut; the message is one line naming the file, the byte and
    what the operator can do."""

    def __init__(self, path: Path | str | None, at: int, following: int, next_offset: int) -> None:
        where = str(path) if path is not None else "a kept log file"
        super().__init__(
            f"{where}: the record at byte {at} is damaged (wrong CRC or length) and whole records "
            f"follow it (from byte {following}, offset {next_offset}): the file was corrupted, not "
            f"cut by a kill, and cutting it would drop acknowledged records, so nothing was changed; "
            f"copy the data dir aside, then restore the file from a backup, or drop the records from "
            f"that byte on with 'truncate -s {at} {where}' and start again")
        self.path, self.at, self.following, self.next_offset = path, at, following, next_offset

    def __reduce__(self) -> tuple[type[CorruptLog], tuple[Path | str | None, int, int, int]]:
        """Pickled by its fields: it crosses from the process that compacts (``compact_apart``)."""
        return CorruptLog, (self.path, self.at, self.following, self.next_offset)


@dataclass(frozen=True, slots=True)
class LogRecord:
    """One record of a partition, as the broker gave it."""

    offset: int
    timestamp_ms: int
    timestamp_type: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


def encode_frame(record: LogRecord) -> bytes:
    """The record's frame (length, CRC, body)."""
    parts = [_POSITION.pack(record.offset, record.timestamp_ms, record.timestamp_type)]
    for blob in (record.key, record.value):
        parts.append(_LENGTH.pack(-1 if blob is None else len(blob)))
        if blob is not None:
            parts.append(blob)
    parts.append(_COUNT.pack(len(record.headers)))
    for name, value in record.headers:
        raw = name.encode()
        parts += [_COUNT.pack(len(raw)), raw, _LENGTH.pack(-1 if value is None else len(value))]
        if value is not None:
            parts.append(value)
    body = b"".join(parts)
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def _decode_body(body: bytes) -> LogRecord:
    offset, timestamp, kind = _POSITION.unpack_from(body, 0)
    at = _POSITION.size
    blobs: list[bytes | None] = []
    for _ in range(2):
        (length,) = _LENGTH.unpack_from(body, at)
        at += _LENGTH.size
        blobs.append(None if length < 0 else body[at:at + length])
        at += max(length, 0)
    (count,) = _COUNT.unpack_from(body, at)
    at += _COUNT.size
    headers = []
    for _ in range(count):
        (size,) = _COUNT.unpack_from(body, at)
        at += _COUNT.size
        name = body[at:at + size].decode()
        at += size
        (length,) = _LENGTH.unpack_from(body, at)
        at += _LENGTH.size
        headers.append((name, None if length < 0 else body[at:at + length]))
        at += max(length, 0)
    return LogRecord(offset, timestamp, kind, blobs[0], blobs[1], tuple(headers))  # type: ignore[arg-type]


def read_frames(data: bytes, path: Path | None = None) -> tuple[list[LogRecord], int]:
    """The whole frames at the start of ``data`` and the length they take; a torn tail is
    left out, a damaged frame with whole ones after it refused (``scan``)."""
    frames, length = scan(data, path=path)
    return [_decode_body(bytes(data[f.start + _FRAME.size:f.end])) for f in frames], length


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
         path: Path | None = None) -> tuple[list[Frame], int]:
    """The whole frames at the start of ``data`` and the length they take. A torn tail (a
    bad frame with no whole frame after it: a kill's) is left out; a bad frame with a
    whole frame after it raises ``CorruptLog`` (``path`` names the file). Only the values
    of keys for which ``values`` is true are copied (compaction mostly needs keys)."""
    frames: list[Frame] = []
    append = frames.append
    at, size = 0, len(data)
    view = memoryview(data)
    head, length_at, crc32 = _HEAD.unpack_from, _LENGTH.unpack_from, zlib.crc32
    try:
        while at + _HEAD.size <= size:
            length, crc, offset, timestamp, _, key_length = head(data, at)
            body = at + _FRAME.size
            end = body + length
            if length < _MIN_BODY or end > size or crc32(view[body:end]) != crc:
                break  # zeros too: a length of 0 and the CRC of nothing, 0, are no frame
            cursor = at + _HEAD.size
            key = None if key_length < 0 else bytes(view[cursor:cursor + key_length])
            if key_length > 0:
                cursor += key_length
            (value_length,) = length_at(data, cursor)
            cursor += _LENGTH.size
            value = (bytes(view[cursor:cursor + value_length])
                     if value_length >= 0 and values(key) else None)
            append(Frame(at, end, offset, timestamp, key, value_length < 0, value))
            at = end
    finally:
        view.release()
    if at < size:
        following = _next_whole_frame(data, at)
        if following is not None:
            raise CorruptLog(path, at, following, _HEAD.unpack_from(data, following)[2])
    return frames, at


#: The least body a frame has: position, two lengths, a header count.
_MIN_BODY = _POSITION.size + 2 * _LENGTH.size + _COUNT.size


def _is_whole_frame(data: bytes | mmap.mmap, at: int) -> bool:
    size = len(data)
    if at + _HEAD.size > size:
        return False
    length, crc = _FRAME.unpack_from(data, at)
    end = at + _FRAME.size + length
    if length < _MIN_BODY or end > size:
        return False
    with memoryview(data) as view:
        return zlib.crc32(view[at + _FRAME.size:end]) == crc


def _next_whole_frame(data: bytes | mmap.mmap, bad: int) -> int | None:
    """Where the first whole frame after the bad one at ``bad`` starts, if any: where its
    own length says it ends first (a damaged body), then at every byte (a damaged length).
    A kill's torn tail is a part of one frame, so this reads only that part. Runs of zeros
    (what a filesystem leaves of a write a crash cut) are passed over whole: a frame's
    4-byte length is at least ``_MIN_BODY``, so one of those bytes is not zero."""
    length = _FRAME.unpack_from(data, bad)[0] if bad + _FRAME.size <= len(data) else -1
    claimed = bad + _FRAME.size + length
    if length >= 0 and _is_whole_frame(data, claimed):
        return claimed
    at, last = bad + 1, len(data) - _HEAD.size
    while at <= last:
        found = _NONZERO.search(data, at)
        if found is None:
            return None
        nonzero = found.start()
        for start in range(max(at, nonzero - _LENGTH.size + 1), min(nonzero, last) + 1):
            if _is_whole_frame(data, start):
                return start
        at = nonzero + 1
    return None


_NONZERO = re.compile(rb"[^\x00]")


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[bytes | mmap.mmap]:
    """A partition file's bytes, mapped (not read into the process's memory): a log of
    gigabytes costs page cache, not resident memory."""
    if not path.exists() or path.stat().st_size == 0:
        yield b""
        return
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        yield data


#: The applied offset a changelog record holds, ``None`` for any other record (the state's
#: record format, ``stream.state.store.applied_at``: given by the caller, this package
#: being below the state's).
AppliedAt = Callable[[bytes | None, bytes | None], int | None]


def applied_prefix(records: Sequence[LogRecord | Frame], end: int, applied_at: AppliedAt) -> int:
    """How many of a changelog partition's records to keep when its event partition
    holds offsets below ``end`` only: up to its last applied-offset record below ``end``
    (before any at or past it). What follows may hold entries of events the kept log
    lost (a kill between the broker's acknowledgement and the journal's write) or an
    unfinished batch; the events the kept log does hold are applied again after it."""
    keep = 0
    for index, record in enumerate(records):
        applied = applied_at(record.key, record.value)
        if applied is not None:
            if applied >= end:
                break
            keep = index + 1
    return keep


class EmbeddedLog:
    """The journal's files under ``DATA_DIR/v1/log``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.meta = root / CLUSTER_FILE
        # (topic, partition) -> (length, next offset) of a file this process read whole and
        # did not write since: opening it for appending need not read it again
        self._known: dict[tuple[str, int], tuple[int, int]] = {}

    def remember(self, topic: str, partition: int, length: int, next_offset: int) -> None:
        """Note what a whole read of a partition's file found (``open_for_append`` trusts
        it while the file has that length)."""
        self._known[(topic, partition)] = (length, next_offset)

    def remembered(self) -> dict[tuple[str, int], tuple[int, int]]:
        """What ``remember`` was told: ``{(topic, partition): (length, next offset)}``."""
        return dict(self._known)

    def exists(self) -> bool:
        """Whether the dir holds a kept log (its cluster file)."""
        return self.meta.exists()

    def read_meta(self) -> dict[str, Any]:
        """``{"cluster_id": str, "topics": {name: {"partitions": n, "config": {...}}}}``."""
        return dict(orjson.loads(self.meta.read_bytes()))

    def cluster_id(self) -> str | None:
        """The cluster id of the broker this log was kept for (None: no log here)."""
        return str(self.read_meta()["cluster_id"]) if self.exists() else None

    def topics(self) -> dict[str, dict[str, Any]]:
        """The topics the log holds: ``{name: {"partitions": n, "config": {...}}}``."""
        return dict(self.read_meta().get("topics", {})) if self.exists() else {}

    def create(self, cluster_id: str) -> None:
        """Mark the dir as holding the log of the broker ``cluster_id`` (no topics yet)."""
        self._write_meta({"cluster_id": cluster_id, "topics": {}})

    def record_topics(self, topics: dict[str, tuple[int, dict[str, str]]],
                      changelogs: dict[str, str] | None = None) -> None:
        """Add topics (partitions, config) to those the log holds, with their files;
        ``changelogs`` names the event topic whose applied offsets each changelog holds."""
        meta = self.read_meta()
        known = meta.setdefault("topics", {})
        for name, (partitions, config) in topics.items():
            known[name] = {"partitions": partitions, "config": config}
            if changelogs and name in changelogs:
                known[name]["applied_offsets_of"] = changelogs[name]
            (self.root / name).mkdir(parents=True, exist_ok=True)
            for partition in range(partitions):
                self.partition_path(name, partition).touch()
        self._write_meta(meta)

    def _write_meta(self, meta: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.meta.with_name(CLUSTER_FILE + ".tmp")
        tmp.write_bytes(orjson.dumps(meta))
        tmp.replace(self.meta)

    def partition_path(self, topic: str, partition: int) -> Path:
        """One partition's file."""
        return self.root / topic / f"{partition}.log"

    def records(self, topic: str, partition: int) -> list[LogRecord]:
        """The partition's whole records, in offset order."""
        path = self.partition_path(topic, partition)
        return read_frames(path.read_bytes(), path)[0] if path.exists() else []

    def open_for_append(self, topic: str, partition: int) -> tuple[BinaryIO, int]:
        """The partition's file, cut after its last whole frame, and the next offset."""
        path = self.partition_path(topic, partition)
        path.parent.mkdir(parents=True, exist_ok=True)
        known = self._known.pop((topic, partition), None)
        size = path.stat().st_size if path.exists() else 0
        if known is not None and known[0] == size:
            length, next_offset = known
        else:
            with mapped(path) as data:
                frames, length = scan(data, path=path)
                size = len(data)
            next_offset = frames[-1].offset + 1 if frames else 0
        if length < size:
            log.warning("%s: cutting off %d bytes of a record written when the process was "
                        "killed (never acknowledged)", path, size - length)
        handle = open(path, "r+b" if path.exists() else "w+b", buffering=0)  # noqa: SIM115
        handle.truncate(length)
        handle.seek(length)
        return handle, next_offset

    async def restore(self, bootstrap_servers: str, plans: dict[tuple[str, int], list[Frame]],
                      progress: Callable[[int, int], None] = lambda done, total: None,
                      ) -> dict[str, int]:
        """Give the (new, empty) broker this log's topics and the planned records
        (``compact``) at their own offsets; return the records given per topic. Called
        before anything else uses the broker; ``progress(done, total)`` after each batch."""
        from stream.kafka.batches import RawPartitionWriter
        from stream.kafka.topics import ensure_topic

        topics = self.topics()
        for name, spec in topics.items():
            await ensure_topic(bootstrap_servers, name, int(spec["partitions"]), dict(spec["config"]))
        total = sum(len(frames) for frames in plans.values())
        counts: dict[str, int] = {name: 0 for name in topics}
        done = 0
        progress(done, total)
        async with RawPartitionWriter(bootstrap_servers) as writer:
            for (name, partition), frames in plans.items():
                if not frames:
                    continue
                with mapped(self.partition_path(name, partition)) as data:
                    for start in range(0, len(frames), _RESTORE_CHUNK):
                        chunk = [_decode_body(bytes(data[f.start + _FRAME.size:f.end]))
                                 for f in frames[start:start + _RESTORE_CHUNK]]
                        try:
                            await writer.write(name, partition, chunk)
                        except ValueError as exc:
                            raise RestoreFailed(
                                f"{self.partition_path(name, partition)}: {exc}: the log cannot be "
                                "brought back as it was; nothing was deleted (keep this data dir, "
                                "serve another one)") from None
                        done += len(chunk)
                        counts[name] += len(chunk)
                        progress(done, total)
        return counts


def _is_applied_key(applied_at: AppliedAt, key: bytes | None) -> bool:
    """Whether ``key`` is the applied-offset record's (``applied_at`` reads any 8 bytes
    under that key, and nothing under another): the one value compaction reads."""
    return applied_at(key, bytes(8)) is not None


def _write_all(handle: BinaryIO, data: bytes) -> None:
    """Write every byte or raise: an unbuffered write may take only part of its data
    (a nearly full disk takes what fits), and a part counted as written is a lost write."""
    view = memoryview(data)
    while view:
        written = handle.write(view)
        if not written:
            raise OSError(errno.ENOSPC, "No space left on device")
        view = view[written:]


class Journal:
    """A thread that appends every record of the given topics on the embedded broker to
    the ``EmbeddedLog`` and tells waiting writers when their offsets are stored."""

    def __init__(self, log_files: EmbeddedLog, bootstrap_servers: str, topics: list[str]) -> None:
        self.files = log_files
        self.bootstrap_servers = bootstrap_servers
        self.topic_names = topics
        self._lock = threading.Lock()
        self._stored: dict[tuple[str, int], int] = {}  # next offset to store
        self._waiters: list[tuple[tuple[str, int], int, asyncio.AbstractEventLoop,
                                  asyncio.Future[None]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._progress: asyncio.Condition | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._refused: str | None = None  # why the files refuse writes now (a full disk)
        self.appended_bytes = 0  # written to the files since the start (what a rebase waits for)
        self._thread = threading.Thread(target=self._main, name="embedded-log-journal", daemon=True)

    def start(self, timeout: float = 30.0) -> Journal:
        """Start tailing and wait until every partition is assigned and positioned."""
        self._thread.start()
        ready = self._ready.wait(timeout)
        if isinstance(self._failure, CorruptLog):
            raise self._failure  # a damaged file: its own one-line message
        if not ready or self._failure is not None:
            raise RuntimeError(f"the embedded log's journal did not start: {self._failure!r}")
        log.info("embedded broker's log kept in %s (%s)", self.files.root,
                 ", ".join(self.topic_names))
        return self

    def stored_offsets(self) -> dict[tuple[str, int], int]:
        """Next offset to store, per (topic, partition)."""
        with self._lock:
            return dict(self._stored)

    def problem(self) -> str | None:
        """Why writes are refused now (for ``/readyz``'s reason), or None."""
        if self._failure is not None or (self._ready.is_set() and not self._thread.is_alive()):
            return f"the embedded broker's log cannot be kept: its journal stopped ({self._failure!r})"
        return self._refused

    async def wait_stored(self, topic: str, positions: list[tuple[int, int]]) -> None:
        """Return once every (partition, offset) of ``topic`` is in the files (the caller
        bounds the wait); raise if the journal stopped or its files refuse writes now.
        With no positions it only checks that: a write is not sent to the broker (where
        the worker would apply it) while it could not be kept."""
        loop = asyncio.get_running_loop()
        futures = []
        with self._lock:
            problem = self.problem()
            if problem is not None:
                raise OSError(problem)
            for partition, offset in positions:
                if self._stored.get((topic, partition), 0) <= offset:
                    future: asyncio.Future[None] = loop.create_future()
                    self._waiters.append(((topic, partition), offset, loop, future))
                    futures.append(future)
        if futures:
            await asyncio.gather(*futures)

    def drain(self, timeout: float) -> bool:
        """Wait until the files hold everything the broker holds now; False if they do not
        within ``timeout`` (or the journal stopped)."""
        if self._loop is None or not self._thread.is_alive():
            return False
        future = asyncio.run_coroutine_threadsafe(self._drain(), self._loop)
        try:
            return bool(future.result(timeout))
        except Exception as exc:  # timeout, or the broker gone
            future.cancel()
            log.warning("the embedded log's journal did not catch up with the broker within "
                        "%.1f s: %r", timeout, exc)
            return False

    def stop(self, timeout: float = 5.0) -> None:
        """Stop tailing and close the files."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)

    # -- the journal's thread -------------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # noqa: BLE001 - reported to writers and at stop
            self._failure = exc
            log.error("the embedded log's journal stopped: %r; writes are refused from now on "
                      "(503) until serve is restarted", exc)
        finally:
            self._ready.set()
            self._fail_waiters()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._progress = asyncio.Condition()
        topics = self.files.topics()
        files: dict[TopicPartition, BinaryIO] = {}
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap_servers, group_id=None,
                                    enable_auto_commit=False, auto_offset_reset="earliest",
                                    fetch_max_wait_ms=JOURNAL_FETCH_WAIT_MS,
                                    fetch_max_bytes=FETCH_BYTES,
                                    max_partition_fetch_bytes=FETCH_BYTES)
        self._consumer = consumer
        await consumer.start()
        try:
            partitions = [TopicPartition(name, p) for name in self.topic_names
                          for p in range(int(topics[name]["partitions"]))]
            consumer.assign(partitions)
            for tp in partitions:
                files[tp], next_offset = self.files.open_for_append(tp.topic, tp.partition)
                self._stored[(tp.topic, tp.partition)] = next_offset
                consumer.seek(tp, next_offset)
            derived = {name for name in self.topic_names if topics[name].get("applied_offsets_of")}
            sources = [tp for tp in partitions if tp.topic not in derived]
            # changelog batches waiting for the source topics to be stored as far as the
            # broker held them when the batch was fetched (None: that is still to be asked)
            held: list[tuple[dict[TopicPartition, list[Any]], dict[TopicPartition, int] | None]] = []
            self._ready.set()
            while not self._stop.is_set():
                batches = await consumer.getmany(timeout_ms=100, max_records=20_000)
                later = {tp: records for tp, records in batches.items() if tp.topic in derived}
                refused = False
                for tp, records in batches.items():
                    if tp.topic not in derived and not self._append(files[tp], tp, records):
                        consumer.seek(tp, self._stored[(tp.topic, tp.partition)])  # fetched again
                        refused = True
                if later:
                    held.append((later, None))
                if held:
                    await self._release_held(consumer, held, sources, files)
                if batches:
                    self._wake_waiters()
                    async with self._progress:
                        self._progress.notify_all()
                if refused or (held and self._refused is not None):
                    with contextlib.suppress(TimeoutError):  # room may come back: try again
                        await asyncio.wait_for(self._stop.wait(), _REFUSED_RETRY_S)
        finally:
            await consumer.stop()
            for handle in files.values():
                handle.close()

    async def _release_held(self, consumer: AIOKafkaConsumer,
                            held: list[tuple[dict[TopicPartition, list[Any]],
                                             dict[TopicPartition, int] | None]],
                            sources: list[TopicPartition],
                            files: dict[TopicPartition, BinaryIO]) -> None:
        """Store held changelog batches, oldest first, once the event and dead-letter
        topics are stored up to where the broker held them when the batch was fetched: a
        changelog record is written after the event it applies and the letters of its
        batch, so the kept changelog is never ahead of the kept events or letters."""
        for index, (batch, needs) in enumerate(held):
            if needs is None:
                try:
                    held[index] = (batch, await consumer.end_offsets(sources))
                except Exception as exc:  # noqa: BLE001 - asked again on the next turn
                    log.warning("embedded log: cannot read the end offsets (%r); the changelog "
                                "waits", exc)
                    return
        while held:
            batch, needs = held[0]
            assert needs is not None
            with self._lock:
                ready = all(self._stored[(tp.topic, tp.partition)] >= end for tp, end in needs.items())
            if not ready:
                return
            for tp, records in batch.items():
                if not self._append(files[tp], tp, records):
                    return  # kept at the head; what was stored of it is skipped next time
            held.pop(0)

    def _append(self, handle: BinaryIO, tp: TopicPartition, records: list[Any]) -> bool:
        """Append the records not stored yet; False if the file refused them (nothing of
        them is then in it, and they are not counted as stored)."""
        expected = self._stored[(tp.topic, tp.partition)]
        frames = []
        for record in records:
            if record.offset < expected:
                continue  # fetched twice
            if record.offset != expected:
                log.warning("%s[%d]: offsets %d..%d are missing on the broker; the log cannot "
                            "be restored past them", tp.topic, tp.partition, expected,
                            record.offset - 1)
            frames.append(encode_frame(LogRecord(
                record.offset, record.timestamp, record.timestamp_type, record.key, record.value,
                tuple(record.headers or ()))))
            expected = record.offset + 1
        if not frames:
            return True
        start = handle.tell()
        try:
            _write_all(handle, b"".join(frames))  # unbuffered: in the kernel once this returns
        except OSError as exc:
            handle.truncate(start)  # no torn frame: a later frame must follow a whole one
            handle.seek(start)
            if self._refused is None:
                log.warning("cannot keep the embedded broker's log in %s (%s): writes get 503 "
                            "until there is room, then it goes on by itself", self.files.root, exc)
            self._refused = (f"the embedded broker's log cannot be kept in {self.files.root} "
                             f"({exc.strerror or exc}): writes get 503 until there is room")
            return False
        with self._lock:
            self._stored[(tp.topic, tp.partition)] = expected
        self.appended_bytes += handle.tell() - start
        if self._refused is not None:
            log.warning("the embedded broker's log is kept again")
            self._refused = None
        return True

    def _wake_waiters(self) -> None:
        with self._lock:
            waiting = []
            for waiter in self._waiters:
                key, offset, loop, future = waiter
                if self._stored.get(key, 0) > offset:
                    _resolve(loop, future)
                elif not future.done():
                    waiting.append(waiter)
            self._waiters = waiting

    def _fail_waiters(self) -> None:
        with self._lock:
            for _key, _offset, loop, future in self._waiters:
                _resolve(loop, future, OSError("the embedded log's journal stopped"))
            self._waiters = []

    async def _drain(self) -> bool:
        assert self._consumer is not None and self._progress is not None
        ends = await self._consumer.end_offsets(list(self._consumer.assignment()))
        fetch_gate.GATE.wake()  # an idle journal fetches what the broker holds now, not later

        def done() -> bool:
            with self._lock:
                return all(self._stored.get((tp.topic, tp.partition), 0) >= end
                           for tp, end in ends.items())

        async with self._progress:
            while not done():
                await self._progress.wait()
        return True


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None],
             error: BaseException | None = None) -> None:
    def settle() -> None:
        if not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
        loop.call_soon_threadsafe(settle)
