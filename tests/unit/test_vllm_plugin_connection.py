"""The plugin's transport (clients/vllm/mmcache_vllm/transport.py): its batches go over one
kept-alive HTTP/1.1 connection, opened again when the server closed it or a POST failed,
without losing a batch to a connection the server closed while it was idle."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.unit.test_vllm_plugin import make_manager, wait_for  # noqa: F401 - a fixture
from tests.unit.vllm_scheduler import make_request


class KeepAliveService:
    """An HTTP/1.1 stand-in for ``POST /v1/engine-events`` that counts the connections it
    accepted; with ``close_after_answer`` it closes each connection after its answer
    without saying so (as a server whose keep-alive timeout ran out between two POSTs)."""

    def __init__(self, close_after_answer: bool = False) -> None:
        self.connections = 0
        self.posts = 0
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                service.connections += 1
                super().setup()

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                service.posts += 1
                self.send_response(202)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                self.close_connection = close_after_answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _send_one_at_a_time(manager: Any, items: int) -> None:
    """``items`` stored items, each sent in a POST of its own (the sender has sent the
    one before when the next is queued)."""
    for n in range(items):
        manager.allocate(make_request(f"r{n}", [(f"x{n}", 1, "image")]), 0)
        wait_for(lambda n=n: manager.reporter.counters().sent == n + 2)  # the start's cleared first


def test_batches_go_over_one_kept_alive_connection(make_manager):  # noqa: F811
    service = KeepAliveService()
    try:
        manager = make_manager(service.url, batch_size=1)
        _send_one_at_a_time(manager, 10)
        assert service.posts == 11
        assert service.connections == 1
        assert manager.reporter.counters().posts_failed == 0
    finally:
        service.close()


@pytest.mark.parametrize("items", [5])
def test_a_connection_the_server_closed_is_opened_again_and_no_batch_is_lost(make_manager, items):  # noqa: F811
    service = KeepAliveService(close_after_answer=True)
    try:
        manager = make_manager(service.url, batch_size=1)
        _send_one_at_a_time(manager, items)
        counters = manager.reporter.counters()
        assert (service.posts, counters.posts_ok, counters.posts_failed, counters.dropped) == (
            items + 1, items + 1, 0, 0)
        assert service.connections == items + 1  # one a POST: the server closed each
    finally:
        service.close()


def test_a_post_that_failed_leaves_its_connection_for_a_new_one(make_manager):  # noqa: F811
    service = KeepAliveService()
    try:
        manager = make_manager(service.url, batch_size=1, max_backoff_s=0.05)
        _send_one_at_a_time(manager, 2)
        connection = manager.reporter._connection
        assert connection.opened == 1
        service.server.shutdown()  # the server goes away: the kept connection fails
        service.server.server_close()
        with connection._connection.sock as sock:  # and its socket is gone too
            sock.shutdown(2)
        manager.allocate(make_request("late", [("late", 1, "image")]), 0)
        wait_for(lambda: manager.reporter.counters().posts_failed >= 1)
        assert connection._connection is None  # closed: the next POST opens a new one
    finally:
        service.close()


def test_a_connection_idle_past_max_idle_s_is_closed_before_the_next_post():
    """Under the server's keep-alive timeout, so that a POST rarely crosses its close (and
    is then sent again, perhaps after the server applied it)."""
    from mmcache_vllm import transport

    service = KeepAliveService()
    connection = transport.EventsConnection(f"{service.url}/v1/engine-events", 5.0)
    try:
        connection.max_idle_s = 0.2
        for _ in range(3):  # back to back: one connection
            assert connection.post(b"{}", {}, 4096).status == 202
        assert connection.opened == 1
        time.sleep(0.3)
        assert connection.post(b"{}", {}, 4096).status == 202
        assert connection.opened == 2 and service.connections == 2 and service.posts == 4
    finally:
        connection.close()
        service.close()
    assert transport.MAX_IDLE_S < 75  # mmcache's KEEPALIVE_S
