"""Carries engine events from vLLM's scheduler thread to mmcache without ever slowing it.

Two threads, no lock between them:

- The scheduler thread (``stored``, ``removed``, ``cleared``) appends one tuple per item
  to a deque and returns: no I/O, no lock, O(1) per item. When the deque is full the
  item is dropped and counted.
- A daemon sender thread wakes every ``interval_s``, takes up to ``batch_size`` items at
  a time, folds runs of one type into one event and POSTs them with a short timeout.
  A POST that fails (refused, timed out, redirected, any answer but 202) loses its
  items; they are counted, never retried.
- A 400 or 413 is the one exception: the service read the whole body and applied
  nothing, and sending it again would be refused again. The same items go again in
  POSTs of half the size, from then on; an item refused even alone is dropped and
  counted (``refused``), and the rest goes on. Nothing is lost, so no resync follows.

Once anything was lost, mmcache's view of this server is wrong until it is rebuilt, so
the reporter *resyncs*: the sender asks for a snapshot (after a back-off that doubles on
each failure), the scheduler thread takes it at the end of its next scheduling pass (a
copy of what the cache holds then) and appends it as a marker. The sender discards what
came before the marker (the snapshot covers it) and sends ``cleared`` followed by
``stored`` for every item of the snapshot, then the items queued after it. The same
happens when the scheduler thread itself had to drop an item. Each field below is
written by one thread only; the other only reads it.

An idle engine runs no scheduling pass, so the sender takes the snapshot itself when the
scheduler thread has been outside the plugin's hooks for a whole interval: every hook
bumps ``_activity`` on entry and on exit (odd while inside one), the sender copies the
cache (one C-level dict copy, atomic under the GIL) and queues the marker, and if
``_activity`` moved meanwhile it asks for another snapshot, which supersedes its own. The
next scheduling pass takes that one; if none comes (the engine idles again), the sender takes
it itself once the scheduler thread has again been outside the hooks for a whole interval.
Until one of them has, ``resync_pending`` stays true.

At a clean exit of vLLM's process (``close``, run by multiprocessing's exit handlers) the
reporter sends ``cleared``: the engine's cache is gone with it. The token file is read
again before a POST when it changed (a rotated Secret), never on the scheduler thread.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .config import ConfigError, ReporterConfig, read_token, stamp
from .transport import EventsConnection

__all__ = ["Counters", "EngineEventReporter", "Item", "LOGGER_NAME"]

# a child of vLLM's logger, so that the plugin's lines are in vLLM's log, in its format
LOGGER_NAME = "vllm.mmcache_vllm"
log = logging.getLogger(LOGGER_NAME)

MAX_HASH_CHARS = 256
MAX_MODALITY_CHARS = 64
MAX_SIZE = 2**31 - 1
# what a stored item says when its feature has no modality the service takes
UNKNOWN_MODALITY = "unknown"
# of an answer's body, at most this much is read: the status says what happened
MAX_ANSWER_BYTES = 4096

Item = tuple[str, int, "str | None"]
"""One cache entry as the service takes it: (hash, size in embeddings, modality)."""

_CLEARED = ("c",)


class _Snapshot:
    """A marker in the queue: everything the cache held when it was appended."""

    __slots__ = ("items",)

    def __init__(self, items: list[Item]) -> None:
        self.items = items


@dataclass(frozen=True)
class Counters:
    """What became of what the scheduler reported; a stored item, a removed hash and a
    cleared event count one each.

    - Each report is one of ``queued``, ``dropped_queue_full`` or ``unreportable`` (a hash
      over 256 characters, a size outside 1 to 2^31-1: the service would refuse it).
    - What was queued is ``sent`` (mmcache answered 202), ``unsent`` (its POST failed, or a
      snapshot superseded it) or still on its way.
    - ``resynced``: snapshot items delivered (``cleared`` and ``stored`` for each);
      ``resyncs``: snapshots delivered whole.
    - ``refused``: items mmcache refused (400 or 413) even in a POST of their own, from
      the queue (also counted ``unsent``) or from a snapshot; they were dropped.
    - ``errors``: exceptions caught inside the plugin, on either thread.
    """

    queued: int
    dropped_queue_full: int
    unreportable: int
    sent: int
    unsent: int
    resynced: int
    refused: int
    posts_ok: int
    posts_failed: int
    resyncs: int
    errors: int
    queue_length: int
    resync_pending: bool

    @property
    def dropped(self) -> int:
        """Items that never reached mmcache, whatever the reason."""
        return self.dropped_queue_full + self.unsent


class EngineEventReporter:
    """Queue, sender thread and counters for one scheduler's encoder cache.

    ``snapshot`` is called on the scheduler thread only, from within a reporting call,
    and returns every item the cache holds at that moment.
    """

    def __init__(self, config: ReporterConfig, snapshot: Callable[[], list[Item]]) -> None:
        self.config = config
        self._snapshot = snapshot
        self._queue: deque[tuple | _Snapshot] = deque([_CLEARED])  # a restarted engine starts empty
        # written by the scheduler thread
        self._queued = 1
        self._dropped_queue_full = 0
        self._unreportable = 0
        self._scheduler_errors = 0
        self._last_scheduler_error: str | None = None
        self._dirty = False  # an item was dropped here since the last snapshot
        self._markers_queued = 0
        self._requests_served = 0
        self._activity = 0  # bumped on entry to and exit from each hook: odd while inside one
        # written by the sender thread
        self._markers_taken = 0
        self._requests = 0  # snapshots asked for
        self._sender_markers = 0  # snapshots the sender took itself, the engine being idle
        self._served_by_sender = 0  # the request the sender's last own snapshot answered
        self._seen_activity = -1  # _activity at the sender's previous wake
        self._closed = False
        self._sent = 0
        self._unsent = 0
        self._resynced = 0
        self._refused = 0
        self._posts_ok = 0
        self._posts_failed = 0
        self._resyncs = 0
        self._sender_errors = 0
        self._lost = False  # items were lost and no snapshot has been taken since
        self._asked = False
        self._failures = 0  # consecutive
        self._retry_at = 0.0
        self._resync_left = 0  # items of the snapshot being sent, still to send
        self._outbox: deque[tuple] = deque()
        self._in_flight: list[tuple] = []  # the batch taken from the outbox, until accounted for
        self._batch_size = config.batch_size  # halved by each 400 or 413 of several items
        self._smallest_told = config.batch_size
        self._refusal_logged_at = -float("inf")
        self._logged_at = -float("inf")
        self._told_failure = False  # a failure was logged and its end not yet
        self._reported_errors = 0
        self._headers = {"Content-Type": "application/json"}
        self._token = config.token
        self._token_stamp = config.token_stamp  # of the file as it was before the token was read
        if config.token is not None:
            self._headers["Authorization"] = f"Bearer {config.token}"
        self._context = ssl.create_default_context(cafile=config.ca_file) if config.ca_file else None
        self._connection = EventsConnection(config.events_url, config.timeout_s, self._context)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmcache-vllm-reporter", daemon=True)

    # -- the scheduler thread ----------------------------------------------------------

    def stored(self, mm_hash: str, size: int, modality: str | None) -> None:
        """``mm_hash`` was added to the cache (call after the cache changed)."""
        if _acceptable(mm_hash, size):
            self._offer(_stored(mm_hash, size, modality))
        else:
            self._unreportable += 1

    def removed(self, hashes: Iterable[str]) -> None:
        """These hashes left the cache. Called at the end of every scheduling pass, with
        no hashes too: that is where a snapshot is taken when one is due."""
        for mm_hash in hashes:
            if _reportable(mm_hash):
                self._offer(("r", mm_hash))
            else:
                self._unreportable += 1
        self._resync_if_due()

    def cleared(self) -> None:
        """The cache was emptied."""
        self._offer(_CLEARED)
        self._resync_if_due()

    def enter(self) -> None:
        """The scheduler thread enters a hook (before vLLM's own code changes the cache)."""
        self._activity += 1

    def leave(self) -> None:
        """The scheduler thread leaves a hook (after what changed was queued)."""
        self._activity += 1

    def failed(self, exc: BaseException) -> None:
        """The manager caught ``exc`` while reporting: counted, logged later by the sender."""
        self._scheduler_errors += 1
        self._last_scheduler_error = f"{type(exc).__name__}: {exc}"
        self._dirty = True  # whatever it was reporting may be missing

    def _offer(self, entry: tuple) -> None:
        if len(self._queue) >= self.config.queue_size:
            self._dropped_queue_full += 1
            self._dirty = True
        else:
            self._queue.append(entry)
            self._queued += 1

    def _resync_if_due(self) -> None:
        """Queues a snapshot after an item was dropped here or the sender asked for one,
        unless one is still queued. It goes in even when the queue is full: it supersedes
        everything before it, and there is never more than one in the queue."""
        requests = self._requests
        asked = requests != self._requests_served and requests != self._served_by_sender
        if (self._dirty or asked) and self._markers_queued + self._sender_markers == self._markers_taken:
            self._queue.append(_Snapshot(self._snapshot()))
            self._markers_queued += 1
            self._requests_served = requests
            self._dirty = False

    # -- reading, starting, stopping ---------------------------------------------------

    def counters(self) -> Counters:
        """A snapshot of the counters (readable from any thread)."""
        return Counters(
            queued=self._queued, dropped_queue_full=self._dropped_queue_full,
            unreportable=self._unreportable, sent=self._sent, unsent=self._unsent, resynced=self._resynced,
            refused=self._refused,
            posts_ok=self._posts_ok, posts_failed=self._posts_failed, resyncs=self._resyncs,
            errors=self._scheduler_errors + self._sender_errors, queue_length=len(self._queue),
            resync_pending=self._lost or self._dirty or self._resync_left > 0 or self._owed()
            or self._markers_queued + self._sender_markers != self._markers_taken)

    def _owed(self) -> bool:
        """A snapshot was asked for that neither thread has taken yet."""
        return self._requests not in (self._requests_served, self._served_by_sender)

    def start(self) -> None:
        """Starts the sender thread; says the effective settings once."""
        log.info("mmcache-vllm: reporting the encoder cache to %s as endpoint %r (%s, batch %d, "
                 "every %.3g s, queue %d, timeout %.3g s)", self.config.events_url, self.config.endpoint,
                 "with a token" if self.config.token else "without a token", self.config.batch_size,
                 self.config.interval_s, self.config.queue_size, self.config.timeout_s)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stops the sender after its current POST, saying nothing more (tests)."""
        self._closed = True
        self._stop.set()
        self._thread.join(timeout)

    def close(self) -> None:
        """Stops the sender and sends ``cleared`` once: vLLM's process is exiting, and the
        engine's cache goes with it. Runs once; nothing after ``stop``.

        The sender may still be inside a POST after ``timeout_s`` (each socket wait is
        bounded, the whole answer is not): this thread waits for it up to ``timeout_s``
        once more, so that ``cleared`` comes after the batch it is sending, and then posts
        on a connection of its own. The sender's connection and headers stay the sender's
        while it lives."""
        if self._closed:
            return
        self.stop(self.config.timeout_s)
        if self._thread.is_alive():
            self._thread.join(self.config.timeout_s)
        try:
            if self._thread.is_alive():
                headers = dict(self._headers)
            else:  # the sender has ended: what it wrote is this thread's now
                self._refresh_token()
                headers = self._headers
            connection = EventsConnection(self.config.events_url, self.config.timeout_s, self._context)
            try:
                status, reason = self._post([_CLEARED], connection, headers)
            finally:
                connection.close()
        except Exception as exc:  # exiting: say it, never raise
            status, reason = None, f"{type(exc).__name__}: {exc}"
        if status == 202:
            self._posts_ok += 1
            log.info("mmcache-vllm: told %s that this engine's cache is gone (cleared)",
                     self.config.events_url)
        else:
            self._posts_failed += 1
            self._say(logging.WARNING, f"mmcache-vllm: could not tell {self.config.events_url} that this "
                      f"engine's cache is gone ({reason}); its view of {self.config.endpoint!r} stays "
                      "until the engine starts again")

    # -- the sender thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                more = self._step()
            except Exception as exc:  # a bug here must not kill the thread
                self._sender_errors += 1
                self._lose(len(self._outbox) + len(self._in_flight) - self._resync_left,
                           f"{type(exc).__name__}: {exc}", posted=False)
                more = False
            if not more:
                self._stop.wait(self.config.interval_s)

    def _step(self) -> bool:
        """Sends one batch if there is one; True when another one is ready right away."""
        self._take()
        self._log_errors()
        if self._lost:
            if not self._asked and time.monotonic() >= self._retry_at:
                self._requests += 1
                self._asked = True
            elif self._asked:
                self._resync_if_idle()
            return False
        if self._owed():  # the scheduler thread ran while the sender copied: it takes another
            self._resync_if_idle()
        if not self._outbox:
            return False
        batch = [self._outbox.popleft() for _ in range(min(self._batch_size, len(self._outbox)))]
        self._in_flight = batch
        self._refresh_token()
        status, reason = self._post(batch)  # an exception here: _run counts the batch in flight
        self._in_flight = []
        if status in (400, 413):
            self._refused_batch(batch, reason)
        elif status != 202:
            self._lose(len(batch) + len(self._outbox) - self._resync_left, reason, posted=True)
            return False
        else:
            self._delivered(batch)
        return bool(self._outbox or self._queue)

    def _delivered(self, batch: list[tuple]) -> None:
        from_snapshot = min(self._resync_left, len(batch))
        self._posts_ok += 1
        self._sent += len(batch) - from_snapshot
        self._resynced += from_snapshot
        if self._failures and self._told_failure:
            log.warning("mmcache-vllm: %s answers again after %d failed attempts; %d items dropped "
                        "so far, the view is resynced", self.config.events_url, self._failures,
                        self.counters().dropped)
            self._told_failure = False
        self._failures = 0
        if from_snapshot:
            self._resync_left -= from_snapshot
            if not self._resync_left:
                self._resyncs += 1

    def _refused_batch(self, batch: list[tuple], reason: str) -> None:
        """The service read the whole batch and applied none of it (a limit, or an item it
        does not take): several items go back to the outbox's front, to be sent again in
        batches of half the size; one item alone is dropped. The view stays exact but
        for dropped items, so no resync is due."""
        self._posts_failed += 1
        if len(batch) > 1:
            self._outbox.extendleft(reversed(batch))
            self._batch_size = max(1, min(self._batch_size, len(batch) // 2))
            if self._batch_size < self._smallest_told:
                self._smallest_told = self._batch_size
                self._say(logging.ERROR, f"mmcache-vllm: {self.config.events_url} refused a batch of "
                          f"{len(batch)} items ({reason}); sending them again, at most {self._batch_size} "
                          "per POST (check the service's MMCACHE_MAX_ITEMS and batch_size)")
            return
        self._refused += 1
        if self._resync_left:
            self._resync_left -= 1
            if not self._resync_left:
                self._resyncs += 1
        else:
            self._unsent += 1
        self._batch_size = self.config.batch_size  # that item was refused, not the batch's size
        now = time.monotonic()
        if now - self._refusal_logged_at >= self.config.log_interval_s:
            self._refusal_logged_at = now
            self._say(logging.ERROR, f"mmcache-vllm: {self.config.events_url} refused an item even alone "
                      f"({reason}); dropped, the view misses that change ({self._refused} refused so far)")

    def _resync_if_idle(self) -> None:
        """Takes the snapshot asked for on this thread when the scheduler thread has been
        outside the hooks since the previous wake (no scheduling pass would take it): after
        a loss, or when its own previous copy raced a hook."""
        activity = self._activity
        idle = activity % 2 == 0 and activity == self._seen_activity
        self._seen_activity = activity
        if not idle or self._requests in (self._requests_served, self._served_by_sender) \
                or self._markers_queued + self._sender_markers != self._markers_taken:
            return
        self._served_by_sender = self._requests
        self._queue.append(_Snapshot(self._snapshot()))
        self._sender_markers += 1
        if self._activity != activity:  # a hook ran meanwhile: the copy may miss its change
            self._requests += 1

    def _refresh_token(self) -> None:
        """Reads the token file again when it changed since it was last read (a Secret
        rotated in place); a file without a token leaves the previous one in use."""
        now = stamp(self.config.token_file)
        if now == self._token_stamp or self.config.token_file is None:
            return
        self._token_stamp = now
        try:
            token = read_token(self.config.token_file)
        except ConfigError as exc:
            self._say(logging.WARNING, f"{exc}; still sending the token read before")
            return
        if token != self._token:
            self._token = token
            self._headers["Authorization"] = f"Bearer {token}"
            log.info("mmcache-vllm: %s changed; sending its token from now on", self.config.token_file)

    def _take(self) -> None:
        """Moves queued items to the outbox, up to one batch; while items are lost, drops
        everything until a snapshot comes, which supersedes what came before it. The
        snapshot's own items (``cleared``, then ``stored`` for each) are the first
        ``_resync_left`` of the outbox."""
        while self._lost or len(self._outbox) < self._batch_size:
            try:
                entry = self._queue.popleft()
            except IndexError:
                return
            if isinstance(entry, _Snapshot):
                self._markers_taken += 1
                self._unsent += len(self._outbox) - self._resync_left
                self._outbox.clear()
                self._outbox.append(_CLEARED)
                self._outbox.extend(_stored(*item) for item in entry.items if _acceptable(item[0], item[1]))
                self._resync_left = len(self._outbox)
                self._lost = False
            elif self._lost:
                self._unsent += 1
            else:
                self._outbox.append(entry)

    def _lose(self, unsent: int, reason: str, posted: bool) -> None:
        """The outbox (and the batch in flight) was not delivered: a snapshot is asked for
        after the back-off, which doubles with each failure in a row."""
        self._posts_failed += posted
        self._unsent += unsent
        self._outbox.clear()
        self._in_flight = []
        self._resync_left = 0
        self._lost = True
        self._asked = False
        self._failures += 1
        backoff = min(self.config.interval_s * 2 ** min(self._failures - 1, 30),
                      max(self.config.max_backoff_s, self.config.interval_s))
        self._retry_at = time.monotonic() + backoff
        self._warn(f"mmcache-vllm: events not delivered to {self.config.events_url}: {reason}; "
                   f"{self.counters().dropped} items dropped so far, resyncing when it answers again")

    def _post(self, batch: list[tuple], connection: EventsConnection | None = None,
              headers: dict[str, str] | None = None) -> tuple[int | None, str]:
        """POSTs one batch: the answer's status (None without one) and what it said
        (never the token). Only 202 means mmcache took it. The sender's own connection
        and headers unless others are given (``close``)."""
        body = json.dumps({"endpoint": self.config.endpoint, "engine": "vllm", "events": _events(batch)},
                          separators=(",", ":")).encode()
        connection = self._connection if connection is None else connection
        try:  # over one kept-alive connection (``transport``); a 3xx is never followed
            answer = connection.post(body, self._headers if headers is None else headers, MAX_ANSWER_BYTES)
        except Exception as exc:  # refused, reset, timed out, bad status line, TLS
            reason = getattr(exc, "reason", None)
            return None, f"{type(exc).__name__}: {reason if reason is not None else exc}"
        status = answer.status
        if 300 <= status < 400:
            return status, f"HTTP {status} to {str(answer.location)[:200]!r}, not followed"
        if status < 300:
            return status, f"HTTP {status}" if status == 202 else f"HTTP {status}, not mmcache's 202"
        return status, f"HTTP {status} {answer.body[:300].decode(errors='replace').strip()}".strip()

    def _log_errors(self) -> None:
        if self._scheduler_errors != self._reported_errors:
            self._reported_errors = self._scheduler_errors
            self._warn(f"mmcache-vllm: {self._scheduler_errors} errors while reporting, caught "
                       f"(the last: {self._last_scheduler_error}); the view will be resynced")

    def _warn(self, message: str) -> None:
        """At most one warning per ``log_interval_s``; the token is never in one."""
        now = time.monotonic()
        if now - self._logged_at < self.config.log_interval_s:
            return
        self._logged_at = now
        self._told_failure = True
        self._say(logging.WARNING, message)

    def _say(self, level: int, message: str) -> None:
        for token in (self.config.token, self._token):
            if token:
                message = message.replace(token, "***")
        log.log(level, message)


def _reportable(mm_hash: object) -> bool:
    return isinstance(mm_hash, str) and 0 < len(mm_hash) <= MAX_HASH_CHARS


def _acceptable(mm_hash: object, size: object) -> bool:
    """Whether the service takes this item: the limits of its defaults, which a POST
    never exceeds (one item over them and the whole POST would be refused)."""
    return _reportable(mm_hash) and isinstance(size, int) and 1 <= size <= MAX_SIZE


def _stored(mm_hash: str, size: int, modality: object) -> tuple:
    """A stored item. The service requires a modality of at most 64 characters; one it
    would refuse (none, empty, longer, not a string) is sent as ``unknown``, which
    changes nothing: the engine view names an item by its hash."""
    if not (isinstance(modality, str) and 0 < len(modality) <= MAX_MODALITY_CHARS):
        modality = UNKNOWN_MODALITY
    return ("s", mm_hash, size, modality)


def _events(batch: list[tuple]) -> list[dict]:
    """Runs of one type become one event, in order."""
    events: list[dict] = []
    for entry in batch:
        kind = entry[0]
        last = events[-1] if events else None
        if kind == "s":
            item = {"hash": entry[1], "size": entry[2], "modality": entry[3]}
            if last is not None and last["type"] == "stored":
                last["items"].append(item)
            else:
                events.append({"type": "stored", "items": [item]})
        elif kind == "r":
            if last is not None and last["type"] == "removed":
                last["hashes"].append(entry[1])
            else:
                events.append({"type": "removed", "hashes": [entry[1]]})
        elif last is None or last["type"] != "cleared":
            events.append({"type": "cleared"})
    return events
