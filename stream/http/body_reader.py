"""Big request bodies are read by a pool of child processes, so that no body holds the
event loop and no client holds the readers.

orjson and pydantic hold the GIL for a whole parse, and their cost follows the number of
JSON values: 16 MiB of small objects took 330-640 ms in one ``orjson.loads`` call on the
2-core test machine, and in a thread the loop waited just as long (a thread helps only
code that lets the GIL go: hashlib does for big inputs, Python code every 5 ms switch
interval, orjson never). So a body that could cost more than ~1 ms is sent to one of a
pool of long-lived child processes, which runs the route's reader of ``stream.http.bodies``
on it and sends back only the checked values (at most the limits' endpoints and items). A
body is read inline when it is at most ``INLINE_BYTES`` long and holds at most
``INLINE_VALUES`` commas (every JSON value after the first of its array or object follows
one): there the parse and the extraction cost at most ~1-2 ms on that machine. What stays
on the loop for a big body is reading it from the socket and writing it to a pipe, both
in slices.

The pool (``readers`` children, by default one per usable core) holds one body per child
at a time. Bodies waiting for a child are taken in this order: writes (placements,
endpoint and engine events) before matches, and matches never hold the last child when
there are two or more, so a gateway's writes never queue behind a flood of big matches;
within each lane, the client (remote address) holding the fewest children first, the one
served longest ago among them, its oldest body first, so that a client holds more than its
share (``readers`` over the clients present) only until one of its bodies is read (a child
is never taken back from a body). Every body has a deadline (``deadline_s``): one that waits
that long for a child, or whose child does not answer that long after it was handed the
body (a stuck child: stopped, swapping, looping; a new child's deadline runs from when it
has started), is answered 503 ``body_reader_unavailable``, and the stuck child is killed
and replaced.
A connection answers its requests one at a time (``stream.http.server``), so it never has
more than one body here.

Each child is started when a body finds no idle one and the pool is not full (a service
that gets no big body never has one), and stopped once it has been idle ``IDLE_S`` while
another is idle too (a burst on a many-core machine leaves one child, not one per core).
It reads frames from its stdin and answers on its stdout: it ends when its stdin closes,
so it never outlives the service (killed or not) by more than the body it reads. If it
dies, the body it held is read again by a new one (a 503 if that one dies too).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import gc
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from stream import allocator
from stream.config import Limits
from stream.http.bodies import READERS, ApiError, match_query
from stream.metrics import Histogram

__all__ = ["DEADLINE_S", "INLINE_BYTES", "INLINE_VALUES", "LANES", "BodyReader", "main", "usable_cores"]

log = logging.getLogger(__name__)

#: Bodies up to this many bytes and ``INLINE_VALUES`` commas are read on the loop (a
#: 256 KiB string costs ~1 ms to parse and hash there, 1 MiB ~4 ms).
INLINE_BYTES = 256 * 1024
#: 8,192 small JSON values cost ~1 ms to parse and walk.
INLINE_VALUES = 8192
#: Seconds a big body may wait for a child, and again seconds its child may take to
#: answer it (write and parse; a new child's start is not counted): 16 MiB of small values
#: take 0.3-0.6 s on the 2-core test machine, ~2.5 s beside the whole test suite, so a child
#: that takes this long is stuck, and its body is answered 503 within CONTRACT's 5 s.
DEADLINE_S = 4.0
#: Seconds a new child may take to start (import the readers: ~0.2 s on that machine, over
#: 2.5 s beside the whole test suite) before its body is answered 503.
START_S = 30.0
#: What a child writes once it can read bodies.
_READY = b"\x01"
#: Seconds a child may stay idle beside another idle one before it is stopped (~40 MB each).
IDLE_S = 60.0

#: Bytes written to the child a turn of the loop. One write of a whole 16 MiB body to a
#: pipe that the child drains as it fills copied for ~10 ms in one call (20-40 ms of
#: the loop's time on a busy machine); 256 KiB copy in ~0.1 ms.
WRITE_SLICE = 256 * 1024
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux
_REQUEST = struct.Struct(">HQ")  # reader name length, body length
_ANSWER = struct.Struct(">Q")    # pickled answer length
_NAMES = {reader: name for name, reader in READERS.items()}
_PROJECT = str(Path(__file__).resolve().parents[2])  # the directory that holds ``stream``

#: The pool's lanes, first served first: writes (every reader but the match's), then matches.
LANES = ("write", "match")
_LANE = {match_query: "match"}
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

T = TypeVar("T")


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _Body:
    """One big body from its arrival to its answer."""

    __slots__ = ("answer", "child", "chunks", "client", "lane", "name", "since", "timer")

    def __init__(self, name: str, chunks: Sequence[bytes], client: str | None, lane: str,
                 answer: asyncio.Future[Any], since: float) -> None:
        self.name = name
        self.chunks = chunks
        self.client = client
        self.lane = lane
        self.answer = answer
        self.since = since
        self.child: _Child | None = None  # the child reading it
        self.timer: asyncio.TimerHandle | None = None


class BodyReader:
    """Runs a reader of ``stream.http.bodies`` on a body: inline when it is small, else in
    one of the pool's child processes. Same answers (values and ``ApiError`` refusals)
    either way; the pool's own are 503 ``body_reader_unavailable``."""

    def __init__(self, limits: Limits, inline_bytes: int = INLINE_BYTES,
                 inline_values: int = INLINE_VALUES, readers: int | None = None,
                 deadline_s: float = DEADLINE_S, idle_s: float = IDLE_S) -> None:
        self.limits = limits
        self.inline_bytes = inline_bytes
        self.inline_values = inline_values
        self.readers = readers or usable_cores()
        self.deadline_s = deadline_s
        self.idle_s = idle_s
        self._trimming: asyncio.TimerHandle | None = None
        self.children: set[_Child] = set()  # started and not yet stopped
        self._idle: list[_Child] = []
        self._busy = 0  # bodies handed to a child (or to one starting)
        # lane -> client -> its bodies waiting, oldest first; clients in the order they take turns
        self._waiting: dict[str, dict[str | None, deque[_Body]]] = {lane: {} for lane in LANES}
        self._held: Tally[str | None] = Tally()  # bodies in children, by client
        self._lanes: Tally[str] = Tally()  # bodies in children, by lane
        # children matches may hold at most: the last one is kept for writes
        self._for_matches = max(1, self.readers - 1)
        # the turn (a count of bodies handed out) at which each client present last got a child
        self._served: dict[str | None, int] = {}
        self._turn = 0
        self._runs: set[asyncio.Task[None]] = set()
        self._closed = False
        self.waits = {lane: Histogram(_WAIT_BUCKETS) for lane in LANES}
        self.timeouts: Tally[str] = Tally()  # by stage: waiting, reading
        self.ended = 0  # children that ended while they held a body

    def small(self, chunks: Sequence[bytes]) -> bytes | None:
        """The body, if reading it on the loop costs at most ~1-2 ms; else ``None``."""
        if len(chunks) == 1:
            raw = chunks[0]
            if len(raw) > self.inline_bytes:
                return None
        elif sum(map(len, chunks)) > self.inline_bytes:
            return None
        else:
            raw = b"".join(chunks)
        return raw if raw.count(b",") <= self.inline_values else None

    async def read(self, reader: Callable[[bytes, Limits], T], chunks: Sequence[bytes],
                   client: str | None = None) -> T:
        """``reader(body, limits)`` of the body made of ``chunks``, wherever it is cheap
        for the loop; ``client`` (its remote address) is whose share of the pool it takes."""
        raw = self.small(chunks)
        if raw is not None:
            return reader(raw, self.limits)
        return await self.in_child(reader, chunks, client)

    async def in_child(self, reader: Callable[[bytes, Limits], T], chunks: Sequence[bytes],
                       client: str | None = None) -> T:
        """``reader(body, limits)`` run by a child process (the body is never joined here),
        once a child is free for it (module docstring: the order); once more in a new
        child if the one that held it ended meanwhile; 503 past its deadline."""
        if self._closed:
            raise _stopping()
        loop = asyncio.get_running_loop()
        lane = _LANE.get(reader, "write")
        body = _Body(_NAMES[reader], chunks, client, lane, loop.create_future(), loop.time())  # type: ignore[index]
        self._waiting[lane].setdefault(client, deque()).append(body)
        body.timer = loop.call_later(self.deadline_s, self._expire, body)
        self._dispatch()
        try:
            return await body.answer  # type: ignore[no-any-return]
        except asyncio.CancelledError:  # its request went away: its place is given up
            if self._unqueue(body) and body.timer is not None:
                body.timer.cancel()
            raise

    def queued(self, lane: str) -> int:
        """Bodies of ``lane`` waiting for a child."""
        return sum(map(len, self._waiting[lane].values()))

    def _dispatch(self) -> None:
        """Hand waiting bodies to children while the pool has room."""
        while not self._closed and self._busy < self.readers:
            body = self._next()
            if body is None:
                return
            self._busy += 1
            self._held[body.client] += 1
            self._lanes[body.lane] += 1
            self._turn += 1
            self._served[body.client] = self._turn
            loop = asyncio.get_running_loop()
            self.waits[body.lane].observe(loop.time() - body.since)
            if body.timer is not None:  # its child's own deadline from now
                body.timer.cancel()
            body.timer = loop.call_later(self.deadline_s, self._expire, body)
            child = None
            while self._idle and child is None:
                child = self._idle.pop()
                if child.dead:
                    self._drop(child)
                    child = None
            run = loop.create_task(self._run(body, child))
            self._runs.add(run)
            run.add_done_callback(self._runs.discard)

    def _next(self) -> _Body | None:
        """The next body to read: writes first, then matches while they hold fewer than
        ``_for_matches`` children; in a lane, the client holding the fewest children, among
        them the one served longest ago (a newcomer first), its oldest body."""
        held, served = self._held, self._served
        for lane in LANES:
            queues = self._waiting[lane]
            if queues and (lane != "match" or self._lanes[lane] < self._for_matches):
                client = min(queues, key=lambda name: (held[name], served.get(name, 0)))
                waiting = queues[client]
                body = waiting.popleft()
                if not waiting:
                    del queues[client]
                return body
        return None

    def _unqueue(self, body: _Body) -> bool:
        """Take a body that still waits for a child out of its queue; whether it waited."""
        queues = self._waiting[body.lane]
        waiting = queues.get(body.client)
        if waiting is None or body not in waiting:
            return False
        waiting.remove(body)
        if not waiting:
            del queues[body.client]
            self._forget(body.client)
        return True

    def _forget(self, client: str | None) -> None:
        """Drop a client's turn once it holds no child and has no body waiting."""
        if client not in self._held and all(client not in queues for queues in self._waiting.values()):
            self._served.pop(client, None)

    async def _run(self, body: _Body, child: _Child | None) -> None:
        """Read ``body`` in ``child`` (a new one if ``None``, and again in a new one if it
        ends meanwhile); then give the child back to the pool, and its room to the next."""
        answer = body.answer
        try:
            for attempt in (1, 2):
                if answer.done() and body.child is None:  # its deadline passed, or it went away
                    break
                if child is None:
                    try:
                        child = await _Child.start(self.limits)
                    except OSError as exc:
                        log.error("the body reader could not start a child process: %s", exc)
                        _settle(answer, exc=ApiError(503, "body_reader_unavailable", "the service "
                                "could not start a process to read this body; nothing was written, "
                                "retry is safe"))
                        break
                    self.children.add(child)
                    if not await self._started(body, child):
                        break
                body.child = child
                try:
                    value = await child.ask(body.name, body.chunks)
                except _ChildEnded:
                    self._drop(child)
                    child = body.child = None
                    if self._closed:
                        _settle(answer, exc=_stopping())
                        break
                    if answer.done():  # killed past its deadline (already answered)
                        break
                    self.ended += 1
                    if attempt == 2:
                        _settle(answer, exc=ApiError(
                            503, "body_reader_unavailable", "the process that reads big bodies "
                            "ended twice while it held this one; nothing was written, retry is safe"))
                    continue
                except ApiError as exc:
                    _settle(answer, exc=exc)
                else:
                    _settle(answer, value)
                break
        finally:
            body.child = None
            if body.timer is not None:
                body.timer.cancel()
            self._busy -= 1
            self._lanes[body.lane] -= 1
            self._held[body.client] -= 1
            if self._held[body.client] <= 0:
                del self._held[body.client]
                self._forget(body.client)
            if child is not None:
                if child.dead or self._closed:
                    self._drop(child)
                else:
                    self._idle.append(child)
                    child.idle_since = asyncio.get_running_loop().time()
                    if self._trimming is None and len(self._idle) > 1:
                        self._trimming = asyncio.get_running_loop().call_later(self.idle_s, self._trim)
            self._dispatch()

    async def _started(self, body: _Body, child: _Child) -> bool:
        """Wait until a new ``child`` can read (at most ``START_S``), ``body``'s deadline
        held meanwhile; whether it should be read now."""
        if body.timer is not None:
            body.timer.cancel()
        try:
            async with asyncio.timeout(START_S):
                await asyncio.shield(child.ready)
        except (TimeoutError, _ChildEnded):
            log.error("a body reader child (pid %d) did not start within %g s", child.process.pid, START_S)
            self._drop(child)
            _settle(body.answer, exc=ApiError(
                503, "body_reader_unavailable", f"no process to read this body started within {START_S:g} s; "
                "nothing was written, retry is safe"))
            return False
        body.timer = asyncio.get_running_loop().call_later(self.deadline_s, self._expire, body)
        return not (self._closed or body.answer.done())

    def _expire(self, body: _Body) -> None:
        """A body's deadline passed: answered 503; a child still reading it is stuck, and
        is killed (its room goes to a new one)."""
        if self._unqueue(body):
            self.timeouts["waiting"] += 1
            _settle(body.answer, exc=ApiError(
                503, "body_reader_unavailable", f"no body reader was free for this body within "
                f"{self.deadline_s:g} s (all {self.readers} busy); nothing was written, retry is safe"))
            return
        self.timeouts["reading"] += 1
        _settle(body.answer, exc=ApiError(
            503, "body_reader_unavailable", f"the process reading this body did not answer within "
            f"{self.deadline_s:g} s and was replaced; nothing was written, retry is safe"))
        child = body.child
        if child is not None and not child.dead:
            log.warning("a body reader child (pid %d) did not answer within %g s; it is killed and "
                        "replaced", child.process.pid, self.deadline_s)
            self._drop(child)

    def _trim(self) -> None:
        """Stop the children idle ``idle_s`` or longer, but the one idle the shortest."""
        self._trimming = None
        if self._closed or len(self._idle) < 2:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        *older, newest = sorted(self._idle, key=lambda child: child.idle_since)
        for child in older:
            if now - child.idle_since >= self.idle_s:
                self._idle.remove(child)
                self._drop(child)
        if len(self._idle) > 1:
            first = min(child.idle_since for child in self._idle if child is not newest)
            self._trimming = loop.call_later(max(0.0, first + self.idle_s - now), self._trim)

    def _drop(self, child: _Child) -> None:
        """Kill a child and reap it, in the background (``close`` waits for it)."""
        if child in self.children:
            self.children.discard(child)
            stop = asyncio.get_running_loop().create_task(child.stop())
            self._runs.add(stop)
            stop.add_done_callback(self._runs.discard)

    async def close(self) -> None:
        """Stop every child (the application's cleanup: no request is in flight any more);
        a body still waiting or being read is answered 503."""
        self._closed = True
        if self._trimming is not None:
            self._trimming.cancel()
        for lane in LANES:
            for waiting in self._waiting[lane].values():
                for body in waiting:
                    if body.timer is not None:
                        body.timer.cancel()
                    _settle(body.answer, exc=_stopping())
            self._waiting[lane].clear()
        self._idle.clear()
        for child in list(self.children):
            self._drop(child)
        while self._runs:
            await asyncio.wait(list(self._runs))

    def collect(self) -> Iterator[Metric]:
        """The pool's metrics (a prometheus_client collector on the service's registry)."""
        depth = GaugeMetricFamily(
            "mmcache_body_reader_queue_depth", "Big bodies waiting for a body reader process, by "
            "lane (write: placements, endpoint and engine events; match)", labels=["lane"])
        waits = HistogramMetricFamily(
            "mmcache_body_reader_wait_seconds", "Time a big body waited for a body reader "
            "process, by lane", labels=["lane"])
        for lane in LANES:
            depth.add_metric([lane], self.queued(lane))
            waits.add_metric([lane], self.waits[lane].buckets(), self.waits[lane].sum)
        timeouts = CounterMetricFamily(
            "mmcache_body_reader_timeouts", "Big bodies answered 503 body_reader_unavailable at "
            "their deadline, by stage: waiting (no reader was free), reading (the reader was stuck, "
            "and was replaced)", labels=["stage"])
        for stage in ("waiting", "reading"):
            timeouts.add_metric([stage], self.timeouts[stage])
        yield depth
        yield waits
        yield timeouts
        yield CounterMetricFamily(
            "mmcache_body_reader_ended", "Body reader processes that ended while they read a body "
            "(it was read again by a new one)", value=self.ended)
        yield GaugeMetricFamily("mmcache_body_readers", "Body reader processes running",
                                value=len(self.children))
        yield GaugeMetricFamily("mmcache_body_readers_busy", "Body reader processes reading a body",
                                value=self._busy)
        yield GaugeMetricFamily("mmcache_body_readers_max", "Body reader processes at most "
                                "(MMCACHE_BODY_READERS)", value=self.readers)


def _settle(answer: asyncio.Future[Any], value: Any = None, exc: BaseException | None = None) -> None:
    if not answer.done():
        if exc is not None:
            answer.set_exception(exc)
        else:
            answer.set_result(value)


def _stopping() -> ApiError:
    return ApiError(503, "body_reader_unavailable", "the service is stopping; nothing was written, "
                    "retry is safe")


class _Child:
    """One child process and the bodies it has not answered yet, oldest first (the pool
    hands it one at a time)."""

    def __init__(self, process: subprocess.Popen[bytes], requests: asyncio.StreamWriter,
                 answers: asyncio.StreamReader) -> None:
        self.process = process
        self.requests = requests
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.dead = False
        self.idle_since = 0.0  # the loop's time it last went idle
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # it started
        self.ready.add_done_callback(lambda ready: ready.cancelled() or ready.exception())  # read
        self._writing = asyncio.Lock()
        self._writes: set[asyncio.Task[None]] = set()
        self._answers = asyncio.get_running_loop().create_task(self._read_answers(answers))

    @classmethod
    async def start(cls, limits: Limits) -> _Child:
        """Start the child with ``subprocess`` (vfork: ~0.3 ms, where uvloop's own spawn
        forks the whole service: 49 ms with 600 MB resident) and wire its pipes to the loop."""
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": _PROJECT + (os.pathsep + path if path else "")}
        process = subprocess.Popen(
            [sys.executable, "-m", "stream.http.body_reader", limits.model_dump_json()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
            start_new_session=True)  # a Ctrl-C is the service's to handle, not the child's
        with contextlib.suppress(OSError):  # 1 MiB, not 64 KiB, a wake-up: a 16 MiB body in 16
            fcntl.fcntl(process.stdin.fileno(), _F_SETPIPE_SZ, 1 << 20)  # type: ignore[union-attr]
        loop = asyncio.get_running_loop()
        answers = asyncio.StreamReader(loop=loop)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(answers), process.stdout)
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, process.stdin)
        requests = asyncio.StreamWriter(transport, protocol, None, loop)
        log.debug("body reader child started (pid %d)", process.pid)
        return cls(process, requests, answers)

    async def ask(self, name: str, chunks: Sequence[bytes]) -> Any:
        """Send one body; return the reader's value or raise its ``ApiError``."""
        if self.dead:
            raise _ChildEnded()
        answer = asyncio.get_running_loop().create_future()
        # A task of its own, so that a request that goes away still leaves its frame whole.
        write = asyncio.get_running_loop().create_task(self._write_frame(name, chunks, answer))
        self._writes.add(write)
        write.add_done_callback(functools.partial(self._written, answer))
        return await answer

    async def _write_frame(self, name: str, chunks: Sequence[bytes], answer: asyncio.Future[Any]) -> None:
        """Write one body's frame, ``WRITE_SLICE`` bytes a turn of the loop: the frames go
        one at a time, in the order of ``pending``."""
        async with self._writing:
            if self.dead:
                raise _ChildEnded()
            if answer.done():  # its request went away before a byte of it was written
                return
            self.pending.append(answer)
            encoded = name.encode()
            stdin = self.requests
            try:
                stdin.write(_REQUEST.pack(len(encoded), sum(map(len, chunks))) + encoded)
                for piece in _slices(chunks, WRITE_SLICE):
                    stdin.writelines(piece)
                    await stdin.drain()
                    await asyncio.sleep(0)  # the rest of the loop runs between slices
            except (ConnectionError, RuntimeError):  # the child went away
                raise _ChildEnded() from None

    def _written(self, answer: asyncio.Future[Any], write: asyncio.Task[None]) -> None:
        """A frame cut short (the child gone, a stop, a failure) puts every later one out
        of step: nothing more goes to this child, and its request is told so."""
        self._writes.discard(write)
        if write.cancelled() or write.exception() is not None:
            if not write.cancelled() and not isinstance(write.exception(), _ChildEnded):
                log.error("writing a body to the body reader failed: %s", type(write.exception()).__name__)
            self._fail()
            if not answer.done():
                answer.set_exception(_ChildEnded())

    async def _read_answers(self, stdout: asyncio.StreamReader) -> None:
        try:
            await stdout.readexactly(len(_READY))
            if not self.ready.done():
                self.ready.set_result(None)
            while True:
                (size,) = _ANSWER.unpack(await stdout.readexactly(_ANSWER.size))
                ok, value = pickle.loads(await stdout.readexactly(size))
                answer = self.pending.popleft()
                if answer.done():  # its request went away meanwhile
                    continue
                if ok:
                    answer.set_result(value)
                else:
                    answer.set_exception(ApiError(*value))
        except (asyncio.IncompleteReadError, ConnectionError):
            if not self.dead:
                log.warning("the body reader child (pid %d) ended; the body it held is read "
                            "again by a new one", self.process.pid)
        finally:
            self._fail()
            self.process.poll()  # reaped now if it is gone already

    def _fail(self) -> None:
        """Mark the child gone: every request it still held is told so."""
        self.dead = True
        if not self.ready.done():
            self.ready.set_exception(_ChildEnded())
        while self.pending:
            answer = self.pending.popleft()
            if not answer.done():
                answer.set_exception(_ChildEnded())

    async def stop(self) -> None:
        """Close its stdin and kill it (it holds nothing worth waiting for)."""
        self.dead = True
        for write in list(self._writes):
            write.cancel()
        self.requests.close()
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        await asyncio.to_thread(self.process.wait)
        self._answers.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._answers
        self._fail()


def _slices(chunks: Sequence[bytes], limit: int) -> Iterator[list[bytes]]:
    """``chunks`` in order, in groups of at most ``limit`` bytes (a longer chunk cut)."""
    group: list[bytes] = []
    size = 0
    for chunk in chunks:
        for start in range(0, len(chunk), limit) if len(chunk) > limit else (0,):
            piece = chunk if len(chunk) <= limit else chunk[start:start + limit]
            if size + len(piece) > limit and group:
                yield group
                group, size = [], 0
            group.append(piece)
            size += len(piece)
    if group:
        yield group


class _ChildEnded(Exception):
    """The child ended before it answered."""


def main() -> None:
    """The child: answer each framed body with its reader's pickled outcome, in order,
    until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    limits = Limits.model_validate_json(sys.argv[1])
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else printed goes to the log, never into the answers
    answers.write(_READY)
    answers.flush()
    requests = sys.stdin.buffer
    while True:
        header = requests.read(_REQUEST.size)
        if len(header) < _REQUEST.size:
            return
        name_length, size = _REQUEST.unpack(header)
        name, raw = requests.read(name_length).decode(), requests.read(size)
        if len(raw) < size:
            return
        payload = pickle.dumps(_outcome(READERS[name], raw, limits), protocol=pickle.HIGHEST_PROTOCOL)
        del raw
        try:
            answers.write(_ANSWER.pack(len(payload)) + payload)
            answers.flush()
        except BrokenPipeError:
            return
        _give_back_memory()


def _give_back_memory() -> None:
    """Free what the last body's parse left (a 16 MiB body of small values makes ~400 MB
    of objects, some in cycles, and glibc keeps freed memory): the child idles at ~40 MB."""
    gc.collect()
    allocator.give_back()


def _outcome(reader: Callable[[bytes, Limits], Any], raw: bytes, limits: Limits) -> tuple[bool, Any]:
    """``(True, value)`` or ``(False, (status, code, message))``: plain data, so that no
    exception's traceback keeps the parsed body alive past its answer."""
    try:
        return True, reader(raw, limits)
    except ApiError as exc:
        return False, (exc.status, exc.code, exc.message)
    except Exception:
        log.exception("reading a body failed inside the body reader")
        return False, (500, "internal_error", "the request failed inside the service; nothing was written")


if __name__ == "__main__":
    main()
