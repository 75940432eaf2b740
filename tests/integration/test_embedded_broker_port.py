"""A port picked for the embedded broker is free only when asked: another process's bind
or outgoing connection can take it before Tansu binds it, and Tansu then exits (a
busy-machine suite run lost a test worker's whole broker so: 38 errors). A picked port is
picked again; a port the user gave is refused, naming it. Against the real Tansu binary."""

from __future__ import annotations

import socket

import pytest

from stream.kafka import embedded
from stream.kafka.embedded import EmbeddedBroker

pytestmark = pytest.mark.integration


def listener(port: int = 0, *, as_the_broker: bool = False) -> socket.socket:
    """A socket listening on ``port``; ``as_the_broker``: bound as Tansu binds, with
    SO_REUSEADDR, which a port left in TIME_WAIT by another test's closed connection
    allows (a plain bind refused one in a fresh-clone run, 4 test workers beside)."""
    sock = socket.socket()
    if as_the_broker:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def bound(port: int) -> socket.socket:
    """The port held as an outgoing connection holds its own: bound, not listening (a
    listener would answer the broker's readiness poll)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    return sock


def answers_kafka(bootstrap: str) -> bool:
    from stream.event_loop import run
    from stream.kafka.tansu import is_tansu

    return run(is_tansu(bootstrap))


def test_a_picked_port_taken_before_the_start_is_picked_again(tmp_path):
    broker = EmbeddedBroker(log_file=tmp_path / "tansu.log")
    picked = broker.port
    with listener(picked):
        with broker:
            assert broker.port != picked
            assert answers_kafka(broker.bootstrap_servers)


def test_a_picked_port_taken_as_the_broker_binds_it_is_picked_again(tmp_path, monkeypatch):
    broker = EmbeddedBroker(log_file=tmp_path / "tansu.log")
    picked = broker.port
    looked = []
    real = embedded._port_taken

    def free_when_first_looked_at(host: str, port: int) -> bool:
        looked.append(port)
        return False if len(looked) == 1 else real(host, port)

    monkeypatch.setattr(embedded, "_port_taken", free_when_first_looked_at)
    with bound(picked):  # taken between the look and Tansu's bind
        with broker:
            assert broker.port != picked
            assert answers_kafka(broker.bootstrap_servers)
    assert "AddrInUse" in (tmp_path / "tansu.log").read_text()  # Tansu did exit on it


def test_a_given_port_that_is_taken_is_refused_naming_it(tmp_path):
    with listener() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is in use: choose another --port"):
            EmbeddedBroker(port=port, log_file=tmp_path / "tansu.log").start()


def test_a_restart_keeps_the_port_its_clients_know(tmp_path):
    with EmbeddedBroker(log_file=tmp_path / "tansu.log") as broker:
        first = broker.port
    with listener(first), pytest.raises(RuntimeError, match=f"port {first} on 127.0.0.1 is in use"):
        broker.start()
    assert broker.port == first


def test_a_picked_port_is_below_the_ephemeral_range_and_free():
    """Ports of the ephemeral range are what outgoing connections take their local port
    from; a port below it is taken only by a bind."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {embedded.free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), sorted(ports)
    for port in ports:
        listener(port, as_the_broker=True).close()  # each one free to bind as Tansu binds
