"""clients/vllm (mmcache-vllm) against vLLM's own EncoderCacheManager from its wheel, driven
as vLLM's scheduler drives it, reporting to a real HTTP server on 127.0.0.1.

The plugin is imported from clients/vllm without being installed (tests/unit/vllm_scheduler.py
puts its directory on sys.path, after tests.vllm_wheel registered vLLM's module under its
real name).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from stream.config import Limits
from stream.http.bodies import ApiError, engine_events
from tests.unit.vllm_scheduler import (
    ENDPOINT,
    LOGGER_NAME,
    ConfigError,
    MmcacheEncoderCacheManager,
    ReporterConfig,
    Scheduler,
    make_request,
    vllm_config,
)

# -- a stand-in for mmcache's POST /v1/engine-events -----------------------------------


@dataclass
class Post:
    headers: dict[str, str]
    body: dict[str, Any]
    status: int


class Recorder:
    """Records every POST. ``answer`` is the status it gives; while ``hold`` is clear it
    hangs each POST until the hold is set, then answers 503 (the plugin gave up on it
    long before, and nothing of it was applied). While ``gate`` is clear a POST waits
    for it and is then taken as usual (``arrived`` counts the POSTs that came).
    ``reader`` (the service's own, e.g. ``stream.http.bodies.engine_events`` with some
    ``Limits``) checks each body first: what it refuses gets its status and error body.
    While ``redirect_to`` is set, every POST is answered 302 to that URL."""

    def __init__(self, port: int = 0, reader: Callable[[bytes], Any] | None = None) -> None:
        self.posts: list[Post] = []
        self.answer = 202
        self.reader = reader
        self.redirect_to: str | None = None
        self.hold = threading.Event()
        self.hold.set()
        self.gate = threading.Event()
        self.gate.set()
        self.arrived = 0
        self.lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                body = json.loads(raw)
                recorder.arrived += 1
                recorder.gate.wait(60)
                held = not recorder.hold.is_set()
                if held:
                    with recorder.lock:
                        recorder.posts.append(Post(dict(self.headers), body, 0))
                    recorder.hold.wait(60)
                status = 503 if held else recorder.answer
                answer = b"{}" if status == 202 else b'{"error": {"code": "log_unavailable", "message": "x"}}'
                if not held and recorder.redirect_to is not None:
                    status, answer = 302, b""
                elif not held and status == 202 and recorder.reader is not None:
                    try:
                        recorder.reader(raw)
                    except ApiError as exc:
                        status = exc.status
                        answer = json.dumps({"error": {"code": exc.code, "message": exc.message}}).encode()
                if not held:
                    with recorder.lock:
                        recorder.posts.append(Post(dict(self.headers), body, status))
                try:
                    self.send_response(status)
                    if status == 302:
                        self.send_header("Location", recorder.redirect_to or "")
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except OSError:
                    pass  # the plugin hung up (its timeout)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def applied(self) -> list[Post]:
        with self.lock:
            return [post for post in self.posts if post.status == 202]

    def view(self) -> dict[str, tuple[int, str | None]]:
        """The applied events folded as the service folds them: hash -> (size, modality)."""
        view: dict[str, tuple[int, str | None]] = {}
        for post in self.applied():
            assert post.body["endpoint"] == ENDPOINT and post.body["engine"] == "vllm"
            for event in post.body["events"]:
                if event["type"] == "stored":
                    for item in event["items"]:
                        view[item["hash"]] = (item["size"], item.get("modality"))
                elif event["type"] == "removed":
                    for digest in event["hashes"]:
                        view.pop(digest, None)
                else:
                    assert event == {"type": "cleared"}
                    view.clear()
        return view

    def close(self) -> None:
        self.hold.set()
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder():
    server = Recorder()
    yield server
    server.close()


def resynced(manager: MmcacheEncoderCacheManager) -> Any:
    """The counters once a resync was delivered whole and none is owed, else None."""
    counters = manager.reporter.counters()
    return counters if counters.resyncs >= 1 and not counters.resync_pending else None


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition: Callable[[], Any], timeout: float = 20.0, step: Callable[[], None] | None = None) -> Any:
    """Polls ``condition`` until it holds, failing after ``timeout`` seconds. ``step`` runs
    before each poll (an engine with work ends a scheduling pass now and then)."""
    deadline = time.monotonic() + timeout
    while True:
        if step is not None:
            step()
        result = condition()
        if result:
            return result
        assert time.monotonic() < deadline, f"not within {timeout} s: {result!r}"
        time.sleep(0.01)


@pytest.fixture
def make_manager():
    made: list[MmcacheEncoderCacheManager] = []

    def make(url: str, cache_size: int = 4000, **settings: Any) -> MmcacheEncoderCacheManager:
        # a POST's timeout far above any test's wait: only the tests that want one time out
        settings = {"url": url, "endpoint": ENDPOINT, "interval_s": 0.01, "timeout_s": 30.0, **settings}
        manager = MmcacheEncoderCacheManager.create_manager(cache_size=cache_size,
                                                            vllm_config=vllm_config(**settings))
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.reporter.stop(5)


# -- the view equals what the manager holds ---------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_trace_folds_to_what_the_manager_holds(recorder, make_manager, seed):
    manager = make_manager(recorder.url, batch_size=64)
    scheduler = Scheduler(manager, seed)
    for _ in range(600):
        scheduler.step()
    assert scheduler.evicted > 50 and len(manager.num_embeds_by_hash) > 5  # the trace evicts
    expected = scheduler.holdings()
    assert set(expected) == set(manager.cached)
    wait_for(lambda: recorder.view() == expected)
    counters = wait_for(lambda: (c := manager.reporter.counters()).sent == c.queued and c)
    assert (counters.dropped, counters.unreportable, counters.errors, counters.resyncs) == (0, 0, 0, 0)
    removed = {h for post in recorder.applied() for e in post.body["events"] if e["type"] == "removed"
               for h in e["hashes"]}
    assert len(removed) > 20  # evictions were reported
    first = recorder.applied()[0].body["events"][0]
    assert first == {"type": "cleared"}  # a (re)started engine holds nothing yet


def test_removed_is_what_the_workers_drop(recorder, make_manager):
    """An eviction is reported at the end of its pass (get_freed_mm_hashes); an entry
    evicted and allocated again in the same pass is never reported removed, and keeps
    its newer size."""
    manager = make_manager(recorder.url, cache_size=100)
    a, b = make_request("r1", [("a", 60, "image")]), make_request("r2", [("b", 40, "audio")])
    for request in (a, b):
        assert manager.can_allocate(request, 0, 1000, 0)
        manager.allocate(request, 0)
    manager.free(a)
    manager.free(b)
    assert manager.get_freed_mm_hashes() == []
    wait_for(lambda: recorder.view() == {"a": (60, "image"), "b": (40, "audio")})

    c = make_request("r3", [("c", 50, "video")])
    assert manager.can_allocate(c, 0, 1000, 0)  # evicts a (oldest freeable) only
    manager.allocate(c, 0)
    assert manager.freed == ["a"]
    again = make_request("r4", [("a", 50, "image")])  # a reused uuid: same hash, new size
    manager.free(c)
    assert manager.can_allocate(again, 0, 1000, 0)  # evicts b (c is newer)
    manager.allocate(again, 0)
    posts = len(recorder.applied())
    wait_for(lambda: manager.reporter.counters().sent == manager.reporter.counters().queued)
    assert all("removed" not in str(post.body) for post in recorder.applied())  # not before the pass ends
    assert manager.get_freed_mm_hashes() == ["b"]  # a was allocated again: kept
    wait_for(lambda: recorder.view() == {"a": (50, "image"), "c": (50, "video")})
    later = [e for post in recorder.applied()[posts:] for e in post.body["events"]]
    assert {"type": "removed", "hashes": ["b"]} in later
    assert not any(e["type"] == "removed" and "a" in e["hashes"] for post in recorder.applied()
                   for e in post.body["events"])
    assert dict(manager.num_embeds_by_hash) == {"a": 50, "c": 50}


def test_reset_is_reported_cleared(recorder, make_manager):
    manager = make_manager(recorder.url)
    scheduler = Scheduler(manager, 7)
    for _ in range(50):
        scheduler.step()
    manager.reset()
    scheduler.running.clear()
    wait_for(lambda: recorder.applied() and recorder.applied()[-1].body["events"][-1] == {"type": "cleared"})
    assert recorder.view() == {} and manager.num_embeds_by_hash == {}
    for _ in range(50):
        scheduler.step()
    wait_for(lambda: recorder.view() == scheduler.holdings())


# -- batching ---------------------------------------------------------------------------


def test_batches_hold_at_most_batch_size_items_one_event_per_run(recorder, make_manager):
    recorder.gate.clear()
    manager = make_manager(recorder.url, cache_size=10**6, batch_size=16, interval_s=5.0)
    wait_for(lambda: recorder.arrived == 1)  # the sender waits in its first POST (the start's cleared)
    for n in range(100):
        request = make_request(f"r{n}", [(f"x{n}", 5, "image")])
        manager.allocate(request, 0)
    manager.get_freed_mm_hashes()
    recorder.gate.set()  # then sends what was queued meanwhile at once, a batch after the other
    wait_for(lambda: manager.reporter.counters().sent == 101)
    posts = recorder.applied()[1:]
    assert [len(post.body["events"][0]["items"]) for post in posts] == [16] * 6 + [4]
    assert all(len(post.body["events"]) == 1 for post in posts)  # a run of stored is one event
    assert posts[0].body["events"][0]["items"][0] == {"hash": "x0", "size": 5, "modality": "image"}
    assert manager.reporter.counters().posts_ok == 8


def test_mixed_batch_keeps_order(recorder, make_manager):
    recorder.gate.clear()
    manager = make_manager(recorder.url, cache_size=100, interval_s=5.0)
    wait_for(lambda: recorder.arrived == 1)
    first, second = make_request("r1", [("p", 60, "image")]), make_request("r2", [("q", 60, "image")])
    manager.can_allocate(first, 0, 1000, 0)
    manager.allocate(first, 0)
    manager.free(first)
    manager.get_freed_mm_hashes()
    manager.can_allocate(second, 0, 1000, 0)  # evicts p
    manager.allocate(second, 0)
    manager.get_freed_mm_hashes()
    manager.reset()
    recorder.gate.set()
    wait_for(lambda: len(recorder.applied()) == 2)
    assert recorder.applied()[1].body["events"] == [  # p's eviction is told at the end of its pass
        {"type": "stored", "items": [{"hash": "p", "size": 60, "modality": "image"},
                                     {"hash": "q", "size": 60, "modality": "image"}]},
        {"type": "removed", "hashes": ["p"]},
        {"type": "cleared"}]


# -- mmcache slow or down: the scheduler never waits, drops are counted, then resynced ----


def test_a_hanging_service_never_slows_the_scheduler(recorder, make_manager):
    recorder.hold.clear()
    manager = make_manager(recorder.url, batch_size=16, queue_size=64, timeout_s=10.0, max_backoff_s=0.05)
    scheduler = Scheduler(manager, 11)
    wait_for(lambda: recorder.posts)  # the sender is stuck in its first POST, for up to 10 s
    for _ in range(1500):
        scheduler.step()
    counters = manager.reporter.counters()
    # the whole trace ran while the sender was still inside that POST: no call waited for it
    assert (counters.posts_ok, counters.posts_failed) == (0, 0)
    # and no call waited for it: each far below the POST's 10 s (room for a busy machine)
    assert len(scheduler.durations) > 5000 and max(scheduler.durations) < 2.0, max(scheduler.durations)
    assert counters.dropped_queue_full > 0 and counters.queue_length <= 64 + 1  # + the snapshot
    assert counters.queued + counters.dropped_queue_full == 1 + scheduler.reports()  # 1: the start's cleared
    assert recorder.applied() == []

    recorder.hold.set()  # the service answers again (the stuck POST gets its 503)
    expected = scheduler.holdings()
    counters = wait_for(lambda: recorder.view() == expected and resynced(manager),
                        step=scheduler.idle_pass)
    assert counters.posts_failed >= 1
    assert counters.resynced >= len(expected) + 1
    wait_for(lambda: (c := manager.reporter.counters()).sent + c.unsent == c.queued, step=scheduler.idle_pass)


def test_a_post_that_times_out_is_counted_and_resynced(recorder, make_manager, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    recorder.hold.clear()
    manager = make_manager(recorder.url, timeout_s=0.2, max_backoff_s=0.05)
    scheduler = Scheduler(manager, 12)
    for _ in range(50):
        scheduler.step()
    # the sender counts the failure, then logs it on its next step
    wait_for(lambda: manager.reporter.counters().posts_failed >= 1
             and any("timed out" in record.getMessage() for record in caplog.records))
    recorder.hold.set()
    expected = scheduler.holdings()
    assert expected
    wait_for(lambda: recorder.view() == expected and resynced(manager), step=scheduler.idle_pass)


def test_a_service_down_then_up_gets_the_whole_view(make_manager):
    port = unused_port()
    manager = make_manager(f"http://127.0.0.1:{port}", batch_size=32, max_backoff_s=0.05)
    scheduler = Scheduler(manager, 5)
    for _ in range(300):
        scheduler.step()
    wait_for(lambda: manager.reporter.counters().posts_failed >= 1, step=scheduler.step)
    down = manager.reporter.counters()
    assert down.unsent > 0 and down.resync_pending and down.posts_ok == 0

    recorder = Recorder(port)  # it comes up
    try:
        for _ in range(100):
            scheduler.step()
        expected = scheduler.holdings()
        counters = wait_for(lambda: recorder.view() == expected and resynced(manager), step=scheduler.idle_pass)
        first = recorder.applied()[0].body
        assert first["events"][0] == {"type": "cleared"}  # the resync starts afresh
        assert counters.errors == 0 and counters.dropped > 0
    finally:
        recorder.close()


def test_an_error_inside_the_plugin_is_caught_counted_and_resynced(recorder, make_manager):
    manager = make_manager(recorder.url)

    class Failing(dict):
        def __setitem__(self, key, value):
            raise RuntimeError("a bug in the plugin")

    manager._modalities = Failing()
    request = make_request("r1", [("e", 10, "image")])
    manager.can_allocate(request, 0, 100, 0)
    manager.allocate(request, 0)  # does not raise
    assert manager.num_embeds_by_hash == {"e": 10}
    assert manager.reporter.counters().errors == 1
    manager._modalities = {}
    manager.get_freed_mm_hashes()  # the end of the pass: the snapshot is taken
    wait_for(lambda: recorder.view() == {"e": (10, "unknown")})  # its modality was lost with the error
    wait_for(lambda: manager.reporter.counters().resyncs == 1)


def test_vllm_errors_pass_through(recorder, make_manager):
    """vLLM's own asserts are its behaviour: the plugin does not swallow them."""
    manager = make_manager(recorder.url, cache_size=10)
    with pytest.raises(AssertionError):
        manager.allocate(make_request("r1", [("big", 50, "image")]), 0)  # can_allocate said no
    assert manager.reporter.counters().errors == 0


def test_unreportable_items_are_counted_not_sent(recorder, make_manager):
    manager = make_manager(recorder.url, max_backoff_s=0.05)
    long_hash = "u" * 257  # over the service's 256 characters: it would refuse the whole POST
    for n, digest in enumerate((long_hash, "ok")):
        request = make_request(f"r{n}", [(digest, 10, "image")])
        manager.can_allocate(request, 0, 100, 0)
        manager.allocate(request, 0)
    manager.get_freed_mm_hashes()
    wait_for(lambda: recorder.view() == {"ok": (10, "image")})
    assert manager.reporter.counters().unreportable == 1
    recorder.answer = 503  # a resync after a loss leaves it out too
    extra = make_request("r2", [("later", 10, "image")])
    manager.can_allocate(extra, 0, 100, 0)
    manager.allocate(extra, 0)
    wait_for(lambda: manager.reporter.counters().posts_failed >= 1)
    recorder.answer = 202
    wait_for(lambda: manager.reporter.counters().resyncs == 1, step=manager.get_freed_mm_hashes)
    assert recorder.view() == {"ok": (10, "image"), "later": (10, "image")}
    assert all(long_hash not in json.dumps(post.body) for post in recorder.posts)


def test_an_exception_in_the_sender_counts_its_batch_unsent_and_resyncs(recorder, make_manager):
    manager = make_manager(recorder.url, max_backoff_s=0.05)
    wait_for(lambda: manager.reporter.counters().sent == 1)  # the start's cleared
    post = manager.reporter._post
    calls = []

    def failing(batch):  # a bug in the sender, raised after the batch left the outbox
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("a bug in the sender")
        return post(batch)

    manager.reporter._post = failing
    scheduler = Scheduler(manager, 8)
    for _ in range(30):
        scheduler.step()
    counters = wait_for(lambda: recorder.view() == scheduler.holdings() and resynced(manager),
                        step=scheduler.idle_pass)
    assert calls[0] >= 1 and counters.errors == 1 and counters.posts_failed == 0  # no POST went out
    counters = wait_for(lambda: (c := manager.reporter.counters()).sent + c.unsent == c.queued and c,
                        step=scheduler.idle_pass)
    assert counters.unsent >= calls[0]


# -- what mmcache refuses: never the same content again, never forever ------------------


def test_a_redirect_is_a_failed_post_and_the_token_never_leaves(recorder, make_manager, tmp_path):
    """An auth proxy in front of mmcache answering 302 to a login page on another host:
    urllib's default opener would follow it with a GET carrying the token, and count
    its 200 as delivered."""
    seen: list[tuple[str, str | None]] = []

    class Login(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: Any) -> None:
            pass

    login = ThreadingHTTPServer(("127.0.0.1", 0), Login)
    threading.Thread(target=login.serve_forever, args=(0.05,), daemon=True).start()
    try:
        recorder.redirect_to = f"http://localhost:{login.server_address[1]}/login"
        token = "s3cret-" + "9" * 20
        manager = make_manager(recorder.url, token_file=token_file(tmp_path, token + "\n"), max_backoff_s=0.05)
        scheduler = Scheduler(manager, 9)
        counters = wait_for(lambda: (c := manager.reporter.counters()).posts_failed >= 3 and c, step=scheduler.step)
        assert seen == [] and counters.posts_ok == 0 and counters.sent == 0 and counters.resync_pending
        recorder.redirect_to = None
        wait_for(lambda: recorder.view() == scheduler.holdings() and resynced(manager), step=scheduler.idle_pass)
        assert seen == []
    finally:
        login.shutdown()
        login.server_close()


def test_an_answer_other_than_202_is_a_failed_post(recorder, make_manager):
    recorder.answer = 200  # not what mmcache answers: something else took the POST
    manager = make_manager(recorder.url, max_backoff_s=0.05)
    scheduler = Scheduler(manager, 10)
    counters = wait_for(lambda: (c := manager.reporter.counters()).posts_failed >= 2 and c, step=scheduler.step)
    assert counters.sent == 0 and counters.resync_pending
    recorder.answer = 202
    wait_for(lambda: recorder.view() == scheduler.holdings() and resynced(manager), step=scheduler.idle_pass)


def service_reader(**limits: Any) -> Callable[[bytes], Any]:
    """The service's own reader of ``POST /v1/engine-events``, with these limits."""
    checked = Limits(**limits)
    return lambda raw: engine_events(raw, checked)


def test_a_modality_the_service_would_refuse_is_sent_as_unknown(make_manager):
    service = Recorder(reader=service_reader())
    try:
        manager = make_manager(service.url, max_backoff_s=0.05)
        request = make_request("r1", [("ok", 10, "image"), ("long", 10, "m" * 65), ("empty", 10, "")])
        for i in range(3):
            manager.can_allocate(request, i, 1000, 0)
            manager.allocate(request, i)
        manager.get_freed_mm_hashes()
        wait_for(lambda: service.view() == {"ok": (10, "image"), "long": (10, "unknown"), "empty": (10, "unknown")})
        counters = manager.reporter.counters()
        assert (counters.posts_failed, counters.refused, counters.unreportable) == (0, 0, 0)
        assert all(post.status == 202 for post in service.posts)
    finally:
        service.close()


def under_6000_bytes(raw: bytes) -> None:
    """A service whose producer takes records of at most 6,000 bytes."""
    if len(raw) >= 6000:
        raise ApiError(413, "event_too_large", "the event is over the producer's max_request_size")


@pytest.mark.parametrize("reader", [
    pytest.param(service_reader(max_items=256), id="max_items"),  # MMCACHE_MAX_ITEMS below batch_size
    pytest.param(under_6000_bytes, id="event_too_large"),
])
def test_a_batch_over_the_services_limits_is_split_until_taken(make_manager, caplog, reader):
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    service = Recorder(reader=reader)
    try:
        service.gate.clear()  # the start's clear is held in flight: the 300 wait behind it
        manager = make_manager(service.url, cache_size=10**6, max_backoff_s=0.05)  # batch_size 512
        wait_for(lambda: service.arrived == 1)
        for n in range(300):  # one pass
            manager.allocate(make_request(f"r{n}", [(f"k{n}", 1 + n % 7, "image")]), 0)
        manager.get_freed_mm_hashes()
        service.gate.set()  # so the next POST takes all 300: over the limit
        expected = {f"k{n}": (1 + n % 7, "image") for n in range(300)}
        counters = wait_for(lambda: service.view() == expected
                            and (c := manager.reporter.counters()).sent == c.queued and c)
        assert counters.refused == 0 and counters.resync_pending is False and counters.posts_failed >= 1
        refusals = [post for post in service.posts if post.status in (400, 413)]
        assert refusals and len(service.posts) - len(refusals) < 40  # split, never re-sent whole
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert errors and all("batch" in r.getMessage() for r in errors)

        service.answer = 503  # a loss: the resync, over the limit too, is split the same way
        manager.allocate(make_request("later", [("later", 3, "audio")]), 0)
        wait_for(lambda: manager.reporter.counters().posts_failed > counters.posts_failed)
        service.answer = 202
        expected["later"] = (3, "audio")
        counters = wait_for(lambda: service.view() == expected and resynced(manager),
                            step=manager.get_freed_mm_hashes)
        assert counters.refused == 0
    finally:
        service.close()


def test_an_item_refused_even_alone_is_dropped_counted_and_logged(make_manager, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    service = Recorder(reader=service_reader(max_hash_chars=8))  # a limit the plugin cannot know
    try:
        service.gate.clear()
        manager = make_manager(service.url, batch_size=4, max_backoff_s=0.05)
        wait_for(lambda: service.arrived == 1)  # the start's cleared waits: the rest goes in batches of 4
        for n, digest in enumerate(("a1", "a2", "too-long-hash", "a3", "a4", "a5")):
            request = make_request(f"r{n}", [(digest, 5, "image")])
            manager.can_allocate(request, 0, 1000, 0)
            manager.allocate(request, 0)
        manager.get_freed_mm_hashes()
        service.gate.set()
        expected = {digest: (5, "image") for digest in ("a1", "a2", "a3", "a4", "a5")}
        counters = wait_for(lambda: service.view() == expected
                            and (c := manager.reporter.counters()).sent + c.unsent == c.queued and c)
        assert counters.refused == 1 and counters.unsent == 1 and counters.dropped == 1
        assert not counters.resync_pending
        refused = [post for post in service.posts if "too-long-hash" in json.dumps(post.body)]
        assert [post.status for post in refused] == [400, 400, 400]  # 4 items, 2, then alone: once each
        assert any(r.levelno == logging.ERROR and "refused" in r.getMessage() for r in caplog.records)

        later = make_request("r9", [("a6", 5, "image")])  # the rest goes on
        manager.can_allocate(later, 0, 1000, 0)
        manager.allocate(later, 0)
        expected["a6"] = (5, "image")
        wait_for(lambda: service.view() == expected)
    finally:
        service.close()


# -- the token and the logs -------------------------------------------------------------


def test_token_is_sent_as_bearer_and_never_logged(recorder, make_manager, tmp_path, caplog):
    token = "s3cret-" + "7" * 20
    token_file = tmp_path / "tokens"
    token_file.write_text(f"# the writers' token\n\n  {token}  \nsecond-token\n")
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    manager = make_manager(recorder.url, token_file=str(token_file), log_interval_s=0.01, max_backoff_s=0.05)
    wait_for(lambda: recorder.applied())
    assert recorder.applied()[0].headers["Authorization"] == f"Bearer {token}"

    recorder.answer = 401  # a wrong token: refused, logged, resynced once accepted again
    scheduler = Scheduler(manager, 3)
    wait_for(lambda: manager.reporter.counters().posts_failed >= 2, step=scheduler.step)
    recorder.answer = 202
    wait_for(lambda: recorder.view() == scheduler.holdings() and resynced(manager), step=scheduler.idle_pass)
    wait_for(lambda: any("answers again" in record.getMessage() for record in caplog.records))
    messages = [record.getMessage() for record in caplog.records]
    assert any("HTTP 401" in message for message in messages)
    assert all(token not in message for message in messages)
    assert token not in repr(manager.reporter.config) and token not in str(manager.reporter.counters())


def test_warnings_at_most_once_per_log_interval(make_manager, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    manager = make_manager(f"http://127.0.0.1:{unused_port()}", log_interval_s=3600, max_backoff_s=0.01)
    scheduler = Scheduler(manager, 4)
    wait_for(lambda: manager.reporter.counters().posts_failed >= 5, step=scheduler.step)
    assert len([r for r in caplog.records if r.name == LOGGER_NAME]) == 1


# -- configuration: bad settings fail at start, with one line naming the key ------------


def token_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "token"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("settings", "message"), [
    ({}, "manager_config.url is required"),
    ({"url": "mmcache:8080"}, "manager_config.url must be http:// or https://"),
    ({"url": "ftp://mmcache"}, "manager_config.url must be http:// or https://"),
    ({"url": "http://user:pw@mmcache"}, "must not hold credentials"),
    ({"url": "http://mmcache", "urls": "x"}, "unknown key(s) 'urls'"),
    ({"url": "http://mmcache", "batch_size": 0}, "manager_config.batch_size must be an integer from 1 to 1024"),
    ({"url": "http://mmcache", "batch_size": 2048}, "manager_config.batch_size must be an integer from 1 to 1024"),
    ({"url": "http://mmcache", "batch_size": True}, "manager_config.batch_size"),
    ({"url": "http://mmcache", "batch_size": "16"}, "manager_config.batch_size"),
    ({"url": "http://mmcache", "batch_size": 64, "queue_size": 10}, "manager_config.queue_size must be an integer from 64"),
    ({"url": "http://mmcache", "interval_s": 0}, "manager_config.interval_s must be a number of seconds above 0"),
    ({"url": "http://mmcache", "timeout_s": -1}, "manager_config.timeout_s"),
    ({"url": "http://mmcache", "timeout_s": "1"}, "manager_config.timeout_s"),
    ({"url": "http://mmcache", "token_file": "/nonexistent/token"}, "manager_config.token_file: /nonexistent/token is not a readable file"),
    ({"url": "http://mmcache", "endpoint": ""}, "endpoint must be 1 to 253 characters"),
    ({"url": "http://mmcache", "endpoint": "a" * 254}, "endpoint must be 1 to 253 characters"),
    ({"url": "http://mmcache", "endpoint": "ns/pod\n"}, "without control characters"),
    ({"url": "http://mmcache", "endpoint": 7}, "manager_config.endpoint must be a string"),
])
def test_bad_settings_fail_at_create(settings, message):
    if settings:
        settings = {"endpoint": ENDPOINT, **settings}
    with pytest.raises(ConfigError) as error:
        MmcacheEncoderCacheManager.create_manager(cache_size=100, vllm_config=vllm_config(**settings))
    assert message in str(error.value) and str(error.value).startswith("mmcache-vllm: ")


@pytest.mark.parametrize(("text", "message"), [
    ("", "holds no token"),
    ("# a remark\n\n", "holds no token"),
    ("hunter2 again\n", "visible ASCII characters without spaces"),
])
def test_bad_token_files_fail_without_showing_the_file(tmp_path, text, message):
    with pytest.raises(ConfigError) as error:
        ReporterConfig.from_manager_config({"url": "http://mmcache", "endpoint": ENDPOINT,
                                            "token_file": token_file(tmp_path, text)})
    assert message in str(error.value)
    assert all(word not in str(error.value) for word in ("hunter2", "again", "remark"))


def test_no_server_side_of_vllm_it_cannot_serve():
    encoder_decoder = vllm_config(url="http://mmcache", endpoint=ENDPOINT)
    encoder_decoder.model_config.is_encoder_decoder = True
    with pytest.raises(ConfigError, match="encoder-decoder model"):
        MmcacheEncoderCacheManager.create_manager(cache_size=100, vllm_config=encoder_decoder)
    shared = vllm_config(url="http://mmcache", endpoint=ENDPOINT)
    shared.parallel_config.data_parallel_size = 2
    with pytest.raises(ConfigError, match="several data-parallel ranks share"):
        MmcacheEncoderCacheManager.create_manager(cache_size=100, vllm_config=shared)
    shared.parallel_config.data_parallel_external_lb = True  # one rank per server: fine
    manager = MmcacheEncoderCacheManager.create_manager(cache_size=100, vllm_config=shared)
    manager.reporter.stop(5)


def test_endpoint_defaults_to_the_pods_namespaced_name(tmp_path):
    def endpoint(environ: dict[str, str], namespace: str | None = None) -> str:
        namespace_file = tmp_path / "namespace"
        if namespace is not None:
            namespace_file.write_text(namespace + "\n")
        return ReporterConfig.from_manager_config({"url": "http://mmcache:8080/"}, environ, namespace_file).endpoint

    assert endpoint({"POD_NAMESPACE": "serving", "POD_NAME": "vllm-0", "HOSTNAME": "other"}) == "serving/vllm-0"
    assert endpoint({"POD_NAMESPACE": "serving", "HOSTNAME": "vllm-1"}) == "serving/vllm-1"
    assert endpoint({"HOSTNAME": "vllm-2"}, namespace="from-service-account") == "from-service-account/vllm-2"
    (tmp_path / "namespace").unlink()
    with pytest.raises(ConfigError, match="POD_NAMESPACE not set"):
        endpoint({"HOSTNAME": "vllm-3"})
    with pytest.raises(ConfigError, match=r"POD_NAMESPACE and POD_NAME \(or HOSTNAME\) not set"):
        endpoint({})
    config = ReporterConfig.from_manager_config({"url": "http://mmcache:8080/", "endpoint": "x/y"}, {})
    assert config.events_url == "http://mmcache:8080/v1/engine-events"


def test_a_vllm_whose_manager_differs_is_refused_at_start():
    class Renamed(MmcacheEncoderCacheManager):
        def __init__(self, cache_size: int) -> None:
            super().__init__(cache_size)
            del self.num_embeds_by_hash  # as if a later vLLM named it otherwise

    with pytest.raises(ConfigError, match="EncoderCacheManager has no num_embeds_by_hash; mmcache-vllm needs vLLM 0.31.0 or later"):
        Renamed.create_manager(cache_size=100, vllm_config=vllm_config(url="http://mmcache", endpoint=ENDPOINT))


# -- an idle engine, a rotated token, a clean exit ---------------------------------------


def test_an_idle_engine_resyncs_on_the_plugins_own_timer(make_manager):
    """mmcache down while the engine works, then up while the engine is idle: the view is
    whole again without another scheduling pass."""
    port = unused_port()
    manager = make_manager(f"http://127.0.0.1:{port}", batch_size=32, max_backoff_s=0.05)
    scheduler = Scheduler(manager, 6)
    for _ in range(200):
        scheduler.step()
    wait_for(lambda: manager.reporter.counters().posts_failed >= 1, step=scheduler.step)
    expected = scheduler.holdings()  # from here on, no pass: the engine is idle
    assert expected
    recorder = Recorder(port)
    try:
        counters = wait_for(lambda: recorder.view() == expected and resynced(manager))
        assert counters.errors == 0
    finally:
        recorder.close()


def test_a_resync_taken_while_the_scheduler_works_still_ends_exact(make_manager):
    """The sender's own snapshot races the scheduler thread (a hook ran while it copied):
    the scheduler's next pass takes another one, and the view ends equal to the cache."""
    port = unused_port()
    manager = make_manager(f"http://127.0.0.1:{port}", batch_size=16, max_backoff_s=0.01)
    scheduler = Scheduler(manager, 7)
    for _ in range(100):
        scheduler.step()
    wait_for(lambda: manager.reporter.counters().posts_failed >= 1, step=scheduler.step)
    recorder = Recorder(port)
    try:
        for _ in range(300):  # passes now and then, the sender's timer between them
            scheduler.step()
            time.sleep(0.001)
        expected = scheduler.holdings()  # from here on, no pass: the engine is idle
        wait_for(lambda: recorder.view() == expected and resynced(manager))
    finally:
        recorder.close()


def test_a_pass_inside_the_senders_own_snapshot_is_resynced_though_the_engine_idles(make_manager):
    """One scheduling pass runs while the sender copies the cache for its own snapshot,
    before it queues the marker; the pass's events come before the marker and are
    discarded. The engine then idles, so no pass answers the sender's request for another
    snapshot: the sender takes that one too, and until then a resync is pending."""
    port = unused_port()
    manager = make_manager(f"http://127.0.0.1:{port}", batch_size=32, max_backoff_s=0.05)
    reporter = manager.reporter
    scheduler = Scheduler(manager, 11)
    for _ in range(100):
        scheduler.step()
    wait_for(lambda: reporter.counters().posts_failed >= 1, step=scheduler.step)
    # from here on the scheduler thread runs no pass of its own: the next snapshot the
    # sender thread takes is its own, and mmcache comes up while it copies
    copied, passed = threading.Event(), threading.Event()
    snapshot = reporter._snapshot

    def racing() -> list:
        items = snapshot()
        if threading.current_thread() is reporter._thread and not copied.is_set():
            copied.set()  # the copy is taken, the marker not yet queued: one pass runs now
            passed.wait(10)
        return items

    reporter._snapshot = racing
    recorder = None
    try:
        assert copied.wait(20), "the sender never took its own snapshot"
        recorder = Recorder(port)
        scheduler.items.append(("late-item", 50, "image"))
        for request in scheduler.running:  # one pass: the running requests finish, one comes
            scheduler.call(manager.free, request)
        scheduler.running.clear()
        for attempt in range(20):  # schedule() may give a request no KV blocks: another then
            if scheduler.schedule(make_request(f"late-{attempt}", [scheduler.items[-1]]), scheduler.budget)[0]:
                break
        scheduler.idle_pass()  # the end of that one pass; the engine is idle from here on
        passed.set()
        expected = scheduler.holdings()
        assert "late-item" in expected
        counters = wait_for(lambda: recorder.view() == expected and resynced(manager), timeout=5)
        assert counters.errors == 0
    finally:
        passed.set()
        if recorder is not None:
            recorder.close()


def test_a_rotated_token_file_is_read_again(recorder, make_manager, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    tokens = tmp_path / "tokens"
    tokens.write_text("first-token\n")
    manager = make_manager(recorder.url, token_file=str(tokens))
    scheduler = Scheduler(manager, 8)
    wait_for(lambda: recorder.applied())
    assert recorder.applied()[-1].headers["Authorization"] == "Bearer first-token"
    rotated = tmp_path / "tokens.new"  # as a Secret's volume does it: a new file swapped in
    rotated.write_text("# rotated\nsecond-token\n")
    rotated.replace(tokens)
    wait_for(lambda: recorder.applied()[-1].headers["Authorization"] == "Bearer second-token",
             step=scheduler.step)
    tokens.write_text("# emptied by mistake\n")  # no token: the last one stays in use
    wait_for(lambda: any("holds no token" in r.getMessage() for r in caplog.records), step=scheduler.step)
    count = len(recorder.applied())
    wait_for(lambda: len(recorder.applied()) > count, step=scheduler.step)
    assert recorder.applied()[-1].headers["Authorization"] == "Bearer second-token"
    messages = [record.getMessage() for record in caplog.records]
    assert all("first-token" not in m and "second-token" not in m for m in messages)


def test_a_token_rotated_while_the_plugin_starts_is_read(tmp_path):
    """The Secret rotates after the settings read the token and before the reporter
    exists: the first POST reads the file again (its stamp is taken before the token)."""
    from mmcache_vllm.reporter import EngineEventReporter

    tokens = tmp_path / "tokens"
    tokens.write_text("old-token\n")
    config = ReporterConfig.from_manager_config({"url": "http://127.0.0.1:1", "endpoint": ENDPOINT,
                                                 "token_file": str(tokens)}, {})
    rotated = tmp_path / "tokens.new"  # vLLM's own EncoderCacheManager starts meanwhile
    rotated.write_text("new-token\n")
    rotated.replace(tokens)
    reporter = EngineEventReporter(config, lambda: [])
    reporter._refresh_token()  # what the sender does before each POST
    assert reporter._headers["Authorization"] == "Bearer new-token"


def test_a_clean_exit_sends_cleared(recorder, make_manager):
    manager = make_manager(recorder.url)
    scheduler = Scheduler(manager, 9)
    for _ in range(50):
        scheduler.step()
    wait_for(lambda: recorder.view() == scheduler.holdings() and recorder.view())
    manager.reporter.close()
    assert recorder.view() == {}
    assert recorder.applied()[-1].body["events"] == [{"type": "cleared"}]
    manager.reporter.close()  # once only
    assert recorder.applied()[-1].body["events"] == [{"type": "cleared"}]


class TricklingService:
    """A service that applies each POST as it reads it (as mmcache does) and records
    (connection, event types); while ``trickle`` holds a delay, it answers a POST of stored
    items one byte of its body at a time, that many seconds apart: each of the plugin's
    socket waits is shorter than its timeout, the whole answer longer."""

    def __init__(self) -> None:
        self.applied: list[tuple[int, list[str]]] = []
        self.trickle = 0.0
        self.stored_read = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        for connection_id in range(1, 1000):
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection, connection_id), daemon=True).start()

    def _serve(self, connection: socket.socket, connection_id: int) -> None:
        reader = connection.makefile("rb")
        with connection:
            while reader.readline():
                length = 0
                while (line := reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                kinds = [event["type"] for event in json.loads(reader.read(length))["events"]]
                self.applied.append((connection_id, kinds))
                trickle = self.trickle if "stored" in kinds else 0.0
                connection.sendall(b"HTTP/1.1 202 Accepted\r\nContent-Type: application/json\r\n"
                                   b"Content-Length: 4\r\n\r\n" + (b"" if trickle else b"{  }"))
                if trickle:
                    self.stored_read.set()
                    for byte in b"{  }":
                        time.sleep(trickle)
                        connection.sendall(bytes([byte]))

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("trickle", [0.2, 0.4], ids=["ends-in-the-second-wait", "outlives-both-waits"])
def test_a_clean_exit_during_a_slow_post_never_shares_the_senders_connection(make_manager, caplog, trickle):
    """``close`` comes while the sender is inside a POST that outlasts ``timeout_s`` (each
    wait shorter): it waits for the sender up to ``timeout_s`` once more, then sends
    ``cleared`` on a connection of its own, never the sender's, and after the batch."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    service = TricklingService()
    try:
        manager = make_manager(service.url, timeout_s=0.5)
        reporter = manager.reporter
        wait_for(lambda: service.applied)  # the first cleared, on the sender's connection
        service.trickle = trickle
        scheduler = Scheduler(manager, 12)
        for _ in range(10):
            scheduler.step()
        assert service.stored_read.wait(10)
        reporter.close()
        reporter._thread.join(5)
        assert not reporter._thread.is_alive()
        sender_connection, _ = service.applied[0]
        closing_connection, last = service.applied[-1]
        assert last == ["cleared"] and closing_connection != sender_connection
        assert any("stored" in kinds for _, kinds in service.applied[:-1])
        counters = reporter.counters()
        assert counters.posts_failed == 0 and counters.errors == 0, counters
        assert any("cache is gone (cleared)" in r.getMessage() for r in caplog.records)
    finally:
        service.close()


def test_a_clean_exit_of_the_process_sends_cleared(recorder):
    """``close`` is registered with multiprocessing's exit handlers, which a forked
    process (vLLM's engine core) runs at its end though it skips atexit."""
    import multiprocessing

    def engine() -> None:
        manager = MmcacheEncoderCacheManager.create_manager(
            cache_size=4000, vllm_config=vllm_config(url=recorder.url, endpoint=ENDPOINT, interval_s=0.01))
        scheduler = Scheduler(manager, 10)
        for _ in range(30):
            scheduler.step()
        wait_for(lambda: manager.reporter.counters().sent == manager.reporter.counters().queued)

    child = multiprocessing.get_context("fork").Process(target=engine)
    child.start()
    child.join(60)
    assert child.exitcode == 0
    applied = recorder.applied()
    assert any(event["type"] == "stored" for post in applied[:-1] for event in post.body["events"])
    assert applied[-1].body["events"] == [{"type": "cleared"}] and recorder.view() == {}


def test_the_loaded_vllm_is_the_one_asked_for():
    """The child run of test_vllm_plugin_newest.py holds the newest wheel's class."""
    import sys

    from tests.vllm_wheel import VLLM_VERSION

    module = sys.modules[MmcacheEncoderCacheManager.__mro__[1].__module__]
    assert f"vllm-{VLLM_VERSION}-" in module.__file__
    assert hasattr(module.EncoderCacheManager, "get_manager_metadata") == (VLLM_VERSION < "0.34")
