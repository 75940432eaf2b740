"""Big request bodies are read in a child process, so that no body holds the event loop.

orjson and pydantic hold the GIL for a whole parse, and their cost follows the number of
JSON values: 16 MiB of small objects took 330-640 ms in one ``orjson.loads`` call on the
2-core test machine, and in a thread the loop waited just as long (a thread helps only
code that lets the GIL go: hashlib does for big inputs, Python code every 5 ms switch
interval, orjson never). So a body that could cost more than ~1 ms is sent to one
long-lived child process, which runs the route's reader of ``stream.http.bodies`` on it and
sends back only the checked values (at most the limits' endpoints and items). A body is
read inline when it is at most ``INLINE_BYTES`` long and holds at most ``INLINE_VALUES``
commas (every JSON value after the first of its array or object follows one): there the
parse and the extraction cost at most ~1-2 ms on that machine. What stays on the loop
for a big body is reading it from the socket and writing it to a pipe, both in slices.

The child is started on the first big body (a service that gets none never has one),
reads frames from its stdin and answers in order on its stdout: it ends when its stdin
closes, so it never outlives the service (killed or not) by more than the body it reads.
If it dies, the bodies it held are read again by a new one (a 503 if that one dies too).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
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
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from stream.config import Limits
from stream.http.bodies import READERS, ApiError

__all__ = ["INLINE_BYTES", "INLINE_VALUES", "BodyReader", "main"]

log = logging.getLogger(__name__)

#: Bodies up to this many bytes and ``INLINE_VALUES`` commas are read on the loop (a
#: 256 KiB string costs ~1 ms to parse and hash there, 1 MiB ~4 ms).
INLINE_BYTES = 256 * 1024
#: 8,192 small JSON values cost ~1 ms to parse and walk.
INLINE_VALUES = 8192

#: Bytes written to the child a turn of the loop. One write of a whole 16 MiB body to a
#: pipe that the child drains as it fills copied for ~10 ms in one call (20-40 ms of
#: the loop's time on a busy machine); 256 KiB copy in ~0.1 ms.
WRITE_SLICE = 256 * 1024
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux
_REQUEST = struct.Struct(">HQ")  # reader name length, body length
_ANSWER = struct.Struct(">Q")    # pickled answer length
_NAMES = {reader: name for name, reader in READERS.items()}
_PROJECT = str(Path(__file__).resolve().parents[1])

T = TypeVar("T")


class BodyReader:
    """Runs a reader of ``stream.http.bodies`` on a body: inline when it is small, else in the
    child process. Same answers (values and ``ApiError`` refusals) either way."""

    def __init__(self, limits: Limits, inline_bytes: int = INLINE_BYTES,
                 inline_values: int = INLINE_VALUES) -> None:
        self.limits = limits
        self.inline_bytes = inline_bytes
        self.inline_values = inline_values
        self._child: _Child | None = None
        self._starting = asyncio.Lock()
        self._closed = False

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

    async def read(self, reader: Callable[[bytes, Limits], T], chunks: Sequence[bytes]) -> T:
        """``reader(body, limits)`` of the body made of ``chunks``, wherever it is cheap
        for the loop."""
        raw = self.small(chunks)
        if raw is not None:
            return reader(raw, self.limits)
        return await self.in_child(reader, chunks)

    async def in_child(self, reader: Callable[[bytes, Limits], T], chunks: Sequence[bytes]) -> T:
        """``reader(body, limits)`` run by the child process (the body is never joined
        here); once more in a new child if the one that held it ended meanwhile."""
        try:
            return await self._ask(reader, chunks)
        except _ChildEnded:
            try:
                return await self._ask(reader, chunks)
            except _ChildEnded:
                raise ApiError(503, "body_reader_unavailable", "the process that reads big "
                               "bodies ended twice while it held this one; nothing was written, "
                               "retry is safe") from None

    async def _ask(self, reader: Callable[[bytes, Limits], T], chunks: Sequence[bytes]) -> T:
        if self._closed:
            raise ApiError(503, "body_reader_unavailable", "the service is stopping; nothing was "
                           "written, retry is safe")
        child = self._child
        if child is None or child.dead:
            async with self._starting:
                child = self._child
                if child is None or child.dead:
                    child = self._child = await _Child.start(self.limits)
        return await child.ask(_NAMES[reader], chunks)  # type: ignore[no-any-return,index]

    async def close(self) -> None:
        """Stop the child, if one was started (the application's cleanup: no request is
        in flight any more)."""
        self._closed = True
        child, self._child = self._child, None
        if child is not None:
            await child.stop()


class _Child:
    """One child process and the requests it has not answered yet, oldest first."""

    def __init__(self, process: subprocess.Popen[bytes], requests: asyncio.StreamWriter,
                 answers: asyncio.StreamReader) -> None:
        self.process = process
        self.requests = requests
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.dead = False
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
                log.warning("the body reader child (pid %d) ended; the bodies it held are read "
                            "again by a new one", self.process.pid)
        finally:
            self._fail()
            self.process.poll()  # reaped now if it is gone already

    def _fail(self) -> None:
        """Mark the child gone: every request it still held is told so."""
        self.dead = True
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
    if _trim is not None:
        _trim(0)


try:
    _trim: Callable[[int], int] | None = ctypes.CDLL(None).malloc_trim  # glibc
except (OSError, AttributeError):
    _trim = None


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
