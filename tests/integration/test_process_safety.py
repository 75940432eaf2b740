"""Process safety of real `mmcache serve` and `mmcache broker` processes: a data dir that
is not ours is refused and left intact, one worker per data dir, a bounded shutdown with
the broker frozen, and no broker child outliving its parent."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

import stream
from stream.kafka.embedded import EmbeddedBroker, free_port
from stream.worker.shutdown import FORCED_EXIT_CODE
from tests.integration.conftest import Service, eventually, http

pytestmark = pytest.mark.integration

REPO = str(Path(stream.__file__).resolve().parent.parent)
SHUTDOWN_TIMEOUT_S = 3.0
# How long a test waits for a stop beyond the shutdown timeout before it calls it hung. That
# the stop was in time is shown by the process's own clock (its forced exit code and log
# line, or a clean exit code: a stop past the timeout is forced), not by wall-clock seconds
# here, which a busy machine stretches.
MARGIN_S = 30.0
LOST_BROKER_WINDOW_S = 4.0  # process start-up of the watcher, log flushing, a loaded machine


def env(**extra: str) -> dict[str, str]:
    """The environment of a child: this repo's code, no external cluster unless given."""
    base = {k: v for k, v in os.environ.items() if k != "MMCACHE_BOOTSTRAP_SERVERS"}
    return {**base, "PYTHONPATH": REPO, **extra}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "stream.cli", *args]


def run_refused(args: list[str], cwd: Path | None = None,
                timeout: float = 45.0) -> subprocess.CompletedProcess[str]:
    """Run a command that must refuse to start: it ends by itself, non-zero."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env=env())
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"still running after {timeout} s: it did not refuse") from exc
    assert done.returncode != 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    return done


def last_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert lines, "no message"
    return lines[-1]


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root and its bytes (None for a dir)."""
    found: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        found[str(path.relative_to(root))] = None if path.is_dir() else path.read_bytes()
    return found


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def tansu_child(pid: int) -> int | None:
    for child in children(pid):
        try:
            if b"tansu" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    return None


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """Pids to SIGKILL at the end of a test if they still run (orphans on old code)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def placement(i: int, endpoint: str = "ns/pod-a") -> dict[str, object]:
    return {"request_id": f"r-{i}", "endpoints": [endpoint],
            "items": [{"hash": f"h-{i}", "size": 1, "modality": "image"}]}


# -- 1. never delete what is not ours ---------------------------------------------------------


def test_serve_with_data_dir_dot_in_a_users_directory_refuses_and_deletes_nothing(tmp_path):
    """`mmcache serve --data-dir .` with no bootstrap servers used to empty the directory."""
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "notes.txt").write_text("my notes")
    (work / "src" / "main.py").write_text("print('mine')")
    before = snapshot(work)
    done = run_refused(cli("serve", "--port", str(free_port()), "--data-dir", "."), cwd=work)
    line = last_line(done)
    assert "did not create" in line and "nothing was deleted" in line and "--data-dir" in line
    assert snapshot(work) == before


def test_serve_refuses_a_data_dir_built_against_another_cluster(bootstrap, tmp_path):
    data = tmp_path / "data"
    app_id = f"it-{uuid.uuid4().hex[:10]}"
    with EmbeddedBroker(log_file=tmp_path / "other-broker.log") as other:
        first = Service(other.bootstrap_servers, data, app_id, [], env())
        first.start()
        assert first.post("/v1/placements", placement(1))[0] == 202
        assert first.stop() == 0
    before = snapshot(data)
    assert any(name.startswith("v1/tables/lru-") for name in before)
    done = run_refused(cli("serve", "--host", "127.0.0.1", "--port", str(free_port()),
                           "--app-id", app_id, "--data-dir", str(data),
                           "--bootstrap-servers", bootstrap))
    line = last_line(done)
    assert "built against Kafka cluster" in line and "nothing was deleted" in line, line
    assert snapshot(data) == before


def test_a_forgotten_bootstrap_servers_flag_refuses_the_dir_and_clears_nothing(tmp_path, reap):
    """Built on a standalone `mmcache broker`, then `serve` once without
    --bootstrap-servers: refused, naming the cluster and the flag; the right command
    still works afterwards."""
    data = tmp_path / "data"
    app_id = f"it-{uuid.uuid4().hex[:10]}"
    port = free_port()
    errors = open(tmp_path / "broker.log", "ab")  # noqa: SIM115
    broker = subprocess.Popen(cli("broker", "--port", str(port)), stdout=subprocess.PIPE,
                              stderr=errors, text=True, env=env())
    try:
        assert broker.stdout is not None and "listening on" in broker.stdout.readline()
        address = f"127.0.0.1:{port}"
        first = Service(address, data, app_id, [], env())
        first.start()
        assert first.post("/v1/placements", placement(1))[0] == 202
        eventually(lambda: first.get("/v1/state")[1]["total_endpoints"] == 1)
        digest = first.digest()
        assert first.stop() == 0
        before = snapshot(data)
        cluster = orjson.loads((data / "mmcache-state.json").read_bytes())["cluster_id"]
        done = run_refused(cli("serve", "--host", "127.0.0.1", "--port", str(free_port()),
                               "--app-id", app_id, "--data-dir", str(data)))
        line = last_line(done)
        assert f"built against the Kafka cluster {cluster!r}" in line, line
        assert "--bootstrap-servers" in line and "nothing was deleted" in line, line
        assert "started an embedded" not in done.stderr  # refused before any broker started
        assert snapshot(data) == before
        again = Service(address, data, app_id, [], env()).start()
        try:
            assert again.digest() == digest
        finally:
            again.stop()
    finally:
        errors.close()
        broker.send_signal(signal.SIGTERM)
        broker.wait(15)


# -- 5. one worker per data dir -----------------------------------------------------------------


def test_a_second_serve_on_a_live_workers_data_dir_is_refused(make_service, bootstrap):
    first = make_service()
    assert first.post("/v1/placements", placement(1))[0] == 202
    eventually(lambda: first.get("/v1/state")[1]["total_endpoints"] == 1)
    digest = first.digest()
    tables = sorted(p.name for p in (first.data_dir / "v1" / "tables").iterdir())
    done = run_refused(cli("serve", "--host", "127.0.0.1", "--port", str(free_port()),
                           "--app-id", first.app_id, "--data-dir", str(first.data_dir),
                           "--bootstrap-servers", bootstrap))
    assert last_line(done) == (
        f"{first.data_dir} is in use by another mmcache worker (it holds "
        f"{first.data_dir / 'mmcache.lock'}): give each worker its own --data-dir."
    )
    assert (first.data_dir / "RUNNING").exists()
    assert sorted(p.name for p in (first.data_dir / "v1" / "tables").iterdir()) == tables
    assert first.get("/readyz")[0] == 200
    assert first.digest() == digest
    assert first.post("/v1/placements", placement(2))[0] == 202  # still working
    first.stop()
    # its files survived the attempt: a restart takes them (no crash was seen)
    again = make_service(app_id=first.app_id, data_dir=first.data_dir)
    assert "did not stop cleanly" not in again.tail()


def test_a_second_embedded_serve_is_refused_before_it_starts_a_broker(tmp_path, reap):
    """The data dir's lock is taken first: the second serve starts nothing."""
    data = tmp_path / "data"
    log = open(tmp_path / "first.log", "ab")  # noqa: SIM115
    port = free_port()
    first = subprocess.Popen(cli("serve", "--host", "127.0.0.1", "--port", str(port),
                                 "--data-dir", str(data)),
                             stdout=log, stderr=subprocess.STDOUT, env=env())
    try:
        eventually(lambda: _ready(port), timeout=60, interval=0.1)
        reap.append(tansu_child(first.pid) or first.pid)
        done = run_refused(cli("serve", "--host", "127.0.0.1", "--port", str(free_port()),
                               "--data-dir", str(data)))
        assert last_line(done) == (
            f"{data} is in use by another mmcache worker (it holds {data / 'mmcache.lock'}): "
            "give each worker its own --data-dir.")
        assert "broker" not in done.stderr, done.stderr  # no broker was started, or spoken of
        assert _ready(port)
    finally:
        log.close()
        first.kill()
        first.wait()


def _ready(port: int) -> bool:
    try:
        return http("GET", f"http://127.0.0.1:{port}/readyz")[0] == 200
    except OSError:
        return False


# -- 6. bounded shutdown with the broker frozen ---------------------------------------------------


def test_sigterm_with_the_broker_frozen_exits_in_time_quietly_and_keeps_the_local_state(tmp_path):
    data = tmp_path / "data"
    app_id = f"it-{uuid.uuid4().hex[:10]}"
    extra = env(MMCACHE_SHUTDOWN_TIMEOUT_S=str(SHUTDOWN_TIMEOUT_S))
    with EmbeddedBroker(log_file=tmp_path / "broker.log") as broker:
        service = Service(broker.bootstrap_servers, data, app_id, [], extra)
        service.start()
        for i in range(20):
            assert service.post("/v1/placements", placement(i, f"ns/pod-{i % 4}"))[0] == 202
        eventually(lambda: service.get("/v1/state")[1]["total_endpoints"] == 4)
        with _writes_in_flight(service.url) as waiting_since:
            broker.freeze()
            frozen_at = time.monotonic()
            try:
                # a write sent after the freeze waits on the broker
                eventually(lambda: waiting_since(frozen_at), timeout=10, interval=0.02)
                code, took, after = _sigterm(service)
            finally:
                broker.thaw()
        assert code is not None, f"still running {took:.1f} s after SIGTERM"
        assert code == FORCED_EXIT_CODE
        assert any(f"shutdown did not finish within {SHUTDOWN_TIMEOUT_S} s" in line
                   for line in after)
        repeats = _repeated_problems(after)
        assert repeats and max(repeats.values()) <= 2, repeats.most_common(5)
        assert sum(repeats.values()) <= 40, repeats.most_common(10)
        assert not (data / "RUNNING").exists()  # released: the next start keeps the files

        again = Service(broker.bootstrap_servers, data, app_id, [], extra)
        again.start()
        try:
            log = again.log_path.read_text(errors="replace")
            assert "did not stop cleanly" not in log
            found = re.search(r"preloaded (\d+) endpoints", log)
            assert found and int(found.group(1)) >= 4, log
            assert again.get("/v1/state")[1]["total_endpoints"] >= 4
        finally:
            again.stop()


@contextlib.contextmanager
def _writes_in_flight(url: str) -> Iterator[Callable[[float], bool]]:
    """Placements posted without pause from a few threads, so that some wait on the broker;
    gives a test whether a write sent since a ``time.monotonic()`` moment is still waiting."""
    stop = threading.Event()
    started: dict[int, float] = {}  # thread -> when its write in flight was sent
    answered = [0]

    def load() -> None:
        i = 1000
        while not stop.is_set():
            i += 1
            started[threading.get_ident()] = time.monotonic()
            try:
                http("POST", url + "/v1/placements", placement(i))
                answered[0] += 1
            except OSError:
                time.sleep(0.05)  # paces the retries of a load generator
            finally:
                started.pop(threading.get_ident(), None)

    loaders = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for loader in loaders:
        loader.start()
    eventually(lambda: answered[0] >= 3, timeout=30, interval=0.02)  # the writes flow
    try:
        yield lambda since: any(at >= since for at in list(started.values()))
    finally:
        stop.set()
        for loader in loaders:
            loader.join(5)


def _sigterm(service: Service) -> tuple[int | None, float, list[str]]:
    """SIGTERM the service and wait for it a bounded time (then SIGKILL): its exit code
    (None: it did not exit in time), how long it took, the log lines it wrote meanwhile."""
    process = service.process
    assert process is not None
    offset = service.log_path.stat().st_size
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        code: int | None = process.wait(SHUTDOWN_TIMEOUT_S + MARGIN_S)
    except subprocess.TimeoutExpired:
        code = None
        process.kill()
        process.wait()
    took = time.monotonic() - started
    service.process = None
    with open(service.log_path, "rb") as log:
        log.seek(offset)
        return code, took, log.read().decode(errors="replace").splitlines()


def test_a_lost_broker_does_not_flood_the_log_and_sigterm_still_exits_in_time(tmp_path):
    """Connection refused many times a second (a broker gone, not frozen): each identical
    error is logged at most once per few seconds, and the stop is bounded."""
    extra = env(MMCACHE_SHUTDOWN_TIMEOUT_S=str(SHUTDOWN_TIMEOUT_S))
    with EmbeddedBroker(log_file=tmp_path / "broker.log") as broker:
        service = Service(broker.bootstrap_servers, tmp_path / "data",
                          f"it-{uuid.uuid4().hex[:10]}", [], extra)
        service.start()
        offset = service.log_path.stat().st_size
        broker.stop()  # gone with its memory: this test needs nothing of it afterwards
        time.sleep(LOST_BROKER_WINDOW_S)  # the window the log is measured over, not a wait
        with open(service.log_path, "rb") as log:
            log.seek(offset)
            window = log.read().decode(errors="replace").splitlines()
        code, took, _ = _sigterm(service)
    repeats = _repeated_problems(window)
    assert repeats, "the lost broker was not noticed"
    assert max(repeats.values()) <= 2, repeats.most_common(5)
    assert len(window) <= 120, f"{len(window)} lines in {LOST_BROKER_WINDOW_S} s"
    assert code is not None, f"still running {took:.1f} s after SIGTERM"


def _repeated_problems(lines: list[str]) -> Counter[str]:
    """WARNING and ERROR messages (the service's log format: time, level, logger, text) by
    logger and text, counts of repeats cut off."""
    found: Counter[str] = Counter()
    for line in lines:
        match = re.match(r"^\d{4}-\d\d-\d\d [\d:,]+ (WARNING|ERROR) (.*)$", line)
        if match:
            found[re.sub(r" \(repeated \d+ more times in the last \d+ s\)$", "", match[2])] += 1
    return found


# -- 7. no orphaned broker ------------------------------------------------------------------------


def test_mmcache_broker_stops_its_child_on_sigterm(tmp_path, reap):
    port = free_port()
    errors = open(tmp_path / "broker.log", "ab")  # noqa: SIM115
    process = subprocess.Popen(cli("broker", "--port", str(port)), stdout=subprocess.PIPE,
                               stderr=errors, text=True, env=env())
    try:
        assert process.stdout is not None
        assert "listening on" in process.stdout.readline()
        child = tansu_child(process.pid)
        assert child is not None
        reap.append(child)
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0
        eventually(lambda: not alive(child), timeout=30)
        eventually(lambda: port_free(port), timeout=30)
    finally:
        errors.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_killed_serve_takes_its_embedded_broker_with_it(tmp_path, reap):
    log = open(tmp_path / "serve.log", "ab")  # noqa: SIM115
    process = subprocess.Popen(cli("serve", "--host", "127.0.0.1", "--port", str(free_port()),
                                   "--data-dir", str(tmp_path / "data")),
                               stdout=log, stderr=subprocess.STDOUT, env=env())
    try:
        child = eventually(lambda: tansu_child(process.pid), timeout=30)
        reap.append(child)
        process.kill()
        process.wait()
        eventually(lambda: not alive(child), timeout=30)
    finally:
        log.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_ctrl_c_in_a_terminal_stops_serve_and_its_broker_cleanly_in_time(tmp_path, reap):
    """A terminal's Ctrl-C is SIGINT to the whole foreground process group: the embedded
    broker must not die before serve has stopped its clients (it used to: a 5 s hang and
    exit code 3)."""
    log = open(tmp_path / "serve.log", "ab")  # noqa: SIM115
    port = free_port()
    process = subprocess.Popen(cli("serve", "--host", "127.0.0.1", "--port", str(port),
                                   "--data-dir", str(tmp_path / "data")),
                               stdout=log, stderr=subprocess.STDOUT, env=env(),
                               start_new_session=True)
    try:
        eventually(lambda: _ready(port), timeout=60, interval=0.1)
        child = tansu_child(process.pid)
        assert child is not None
        reap.append(child)
        assert http("POST", f"http://127.0.0.1:{port}/v1/placements", placement(1))[0] == 202
        os.killpg(process.pid, signal.SIGINT)
        code = process.wait(30)
        text = (tmp_path / "serve.log").read_text(errors="replace")
        # in time: a stop that outlasts the shutdown timeout (the old hang) exits forced
        # (FORCED_EXIT_CODE) and says so; 0 and no ERROR is a stop within it, by serve's clock
        assert (code, "ERROR" in text) == (0, False), text[-3000:]
        assert "did not finish within" not in text
        eventually(lambda: not alive(child), timeout=30)
        assert not (tmp_path / "data" / "RUNNING").exists()  # a clean stop
    finally:
        log.close()
        if process.poll() is None:
            process.kill()
            process.wait()
