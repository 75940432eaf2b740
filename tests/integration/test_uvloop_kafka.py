"""aiokafka on uvloop meets a transport closed under a connection (stream.event_loop).

When the broker goes away, uvloop closes a connection's transport before aiokafka's
reader closes the connection; a request sent in between raised ``RuntimeError`` from
uvloop, which crashed Faust's consumer thread in a rebase of the embedded broker and
stopped `serve`. It must be aiokafka's own retriable ``KafkaConnectionError``.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.conn import AIOKafkaConnection, create_conn
from aiokafka.errors import KafkaConnectionError
from aiokafka.protocol.metadata import MetadataRequest

from stream import event_loop


def _send_after_the_transport_closed(bootstrap: str) -> BaseException:
    host, _, port = bootstrap.split(",")[0].rpartition(":")

    async def attempt() -> BaseException:
        connection = await create_conn(host, int(port))
        assert connection.connected()
        connection._writer.transport.close()  # what uvloop does when the peer goes away
        await asyncio.sleep(0)  # uvloop closes the handle in its next turn ...
        assert connection._writer is not None  # ... before aiokafka's reader closes the connection
        try:
            await connection.send(MetadataRequest([]))
        except BaseException as exc:  # noqa: BLE001 - what the caller would meet
            return exc
        raise AssertionError("a send on a closed transport succeeded")

    before = asyncio.get_event_loop_policy()
    try:
        return event_loop.run(attempt())
    finally:
        asyncio.set_event_loop_policy(before)


def test_a_send_on_a_transport_uvloop_closed_is_a_retriable_connection_error(bootstrap: str) -> None:
    error = _send_after_the_transport_closed(bootstrap)
    assert isinstance(error, KafkaConnectionError) and error.retriable, repr(error)


def test_without_the_wrapper_uvloop_raises_runtime_error(bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finding, kept: the wrapper is what turns it into a connection error."""
    monkeypatch.setattr(event_loop, "_send_on_uvloop", event_loop._send)
    monkeypatch.setattr(AIOKafkaConnection, "send", AIOKafkaConnection.send)  # restored after
    error = _send_after_the_transport_closed(bootstrap)
    assert isinstance(error, RuntimeError) and "closed" in str(error), repr(error)
