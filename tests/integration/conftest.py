"""Integration fixtures: a real Kafka-protocol broker per test session and real
`mmcache serve` processes (Faust worker, RocksDB files, HTTP) with unique app ids.

MMCACHE_BOOTSTRAP_SERVERS points the same tests at a real Kafka instead of the
embedded Tansu broker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stream.kafka.embedded import EmbeddedBroker, free_port
from tests.polling import eventually

pytestmark = pytest.mark.integration

# an upper bound, not a wait: a restart recovering 100k entries from the changelog took over
# 60 s with the suite's 4 workers and two busy loops on 2 cores
READY_TIMEOUT_S = 180.0

# Under pytest-xdist (`make test`: `-n 4 --dist loadgroup`) each worker process has its own
# session, hence its own broker (``bootstrap``). The benchmark tests, which pin processes to
# cores and measure against controls, run one after another on one worker, never beside
# each other. (A group is one worker's queue: the long serial tests would make it the
# suite's longest path, so the others, which bound timings loosely, are not in it.)
SERIAL = {"test_bench.py", "test_bench_redis.py"}


def _group(item: pytest.Item, name: str) -> None:
    """Put ``item`` in the xdist group ``name``. pytest 9 keeps a node's id in ``_id``, so
    the ``@name`` suffix that xdist 3.8 gives it (by setting ``_nodeid``), and that
    ``--dist loadgroup`` schedules by, is lost: it is set here (grouped tests were spread
    over the workers like the others)."""
    item.add_marker(pytest.mark.xdist_group(name))
    node_id = getattr(item, "_id", None)
    if getattr(item.config.option, "loadgroup", False) and node_id is not None \
            and "@" not in item.nodeid:
        item._id = type(node_id).parse(f"{item.nodeid}@{name}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the tests of ``SERIAL`` in one xdist group, and those of a module that share its
    ``service`` in a group of their own, so that one worker runs them one after another on
    one start of it (spread over the workers, the module-scoped service started again on
    each, and again after another module's test came between). A no-op without xdist."""
    for item in items:
        if item.path.parent != Path(__file__).parent:
            continue
        if item.path.name in SERIAL:
            _group(item, "serial")
        elif "service" in getattr(item, "fixturenames", ()):
            _group(item, f"service-{item.path.stem}")


@pytest.fixture(scope="session")
def bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Kafka-protocol broker for the whole session."""
    external = os.environ.get("MMCACHE_BOOTSTRAP_SERVERS")
    if external:
        yield external
        return
    log_file = tmp_path_factory.mktemp("broker") / "tansu.log"
    with EmbeddedBroker(log_file=log_file) as broker:
        yield broker.bootstrap_servers


def http(method: str, url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    """One HTTP call; returns (status, parsed JSON or text)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode()


class Service:
    """One `mmcache serve` child process."""

    def __init__(self, bootstrap: str, data_dir: Path, app_id: str, extra: list[str],
                 env: dict[str, str], wrapper: list[str] | None = None) -> None:
        self.bootstrap = bootstrap
        self.data_dir = data_dir
        self.app_id = app_id
        self.extra = extra
        self.env = env
        # a command that runs serve's (as its arguments), e.g. in a mount namespace
        self.wrapper = wrapper or []
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{app_id}-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True) -> Service:
        log = open(self.log_path, "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            [*self.wrapper, sys.executable, "-m", "stream.cli", "serve", "--host", "127.0.0.1",
             "--port", str(self.port), "--app-id", self.app_id,
             "--data-dir", str(self.data_dir), "--bootstrap-servers", self.bootstrap,
             *self.extra],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
        )
        if wait_ready:
            self.wait_ready()
        return self

    def wait_ready(self) -> float:
        started = time.monotonic()

        def ready() -> bool:
            assert self.process is not None and self.process.poll() is None, self.tail()
            try:
                return self.get("/readyz")[0] == 200
            except OSError:
                return False

        eventually(ready, timeout=READY_TIMEOUT_S, interval=0.1)
        return time.monotonic() - started

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        try:
            code = self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.process = None
        return code

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def get(self, path: str) -> tuple[int, Any]:
        return http("GET", self.url + path)

    def post(self, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
        return http("POST", self.url + path, body, raw)

    def digest(self) -> str:
        return self.get("/v1/state?limit=0")[1]["digest"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the test item, for fixtures that act on a failure."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


@pytest.fixture
def make_service(bootstrap: str, tmp_path: Path,
                 request: pytest.FixtureRequest) -> Iterator[Callable[..., Service]]:
    """Factory of services with a unique app id (hence unique topics) per test; when the
    test failed, the end of each service's log is printed (shown with the failure)."""
    started: list[Service] = []

    def make(app_id: str | None = None, data_dir: Path | None = None,
             extra: list[str] | None = None, env: dict[str, str] | None = None,
             wait_ready: bool = True, wrapper: list[str] | None = None) -> Service:
        service = Service(bootstrap, data_dir or tmp_path / "data",
                          app_id or f"it-{uuid.uuid4().hex[:10]}", extra or [], env or {}, wrapper)
        started.append(service)
        return service.start(wait_ready)

    yield make
    failed = getattr(request.node, "report_call", None)
    for service in started:
        if failed is not None and failed.failed:
            print(f"--- end of the log of {service.app_id} on port {service.port} ---\n"
                  f"{service.tail()}")
        if service.process is not None:
            service.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def service(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One shared service for tests that use their own endpoint names."""
    root = tmp_path_factory.mktemp("shared")
    svc = Service(bootstrap, root / "data", f"it-{uuid.uuid4().hex[:10]}",
                  ["--cache-size-mb-per-server", "6"], {"MMCACHE_MAX_BODY_BYTES": "65536"})
    svc.start()
    yield svc
    svc.stop()
