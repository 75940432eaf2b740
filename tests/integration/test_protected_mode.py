"""A real `mmcache serve` is protected by default: on an address other than loopback and
without write tokens it exits at once with one line saying what to give, before a broker,
a data dir or a port is touched; with tokens, or with --allow-unauthenticated-writes, it
goes on to its next step (here: an unreachable cluster, the quickest next failure)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stream.kafka.embedded import free_port

pytestmark = pytest.mark.integration

# CPU seconds (user + system) of the whole process: far below what importing Faust and
# aiokafka and starting a worker costs (the refusal is made before anything but the
# settings is looked at), and, unlike wall-clock seconds, not stretched by a busy machine.
QUICK_CPU_S = 5.0


def serve(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    """The finished process and the CPU seconds it used (its own, from its exit status)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MMCACHE_")}
    with open(cwd / "out", "w+") as out, open(cwd / "err", "w+") as err:
        process = subprocess.Popen([sys.executable, "-m", "stream.cli", "serve", "--port", str(free_port()),
                                    "--data-dir", "d", *args], cwd=cwd, text=True, stdout=out, stderr=err,
                                   env={**clean, **(env or {})})
        deadline = time.monotonic() + 45
        while not (reaped := os.wait4(process.pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise AssertionError("serve is still running: it was not refused")
            time.sleep(0.02)  # paces the polls of the exit status
        _, status, usage = reaped
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read())
    (cwd / "out").unlink()
    (cwd / "err").unlink()
    return done, usage.ru_utime + usage.ru_stime


def refused_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, done.stderr  # nothing else happened: no broker, no worker
    return lines[0]


@pytest.mark.parametrize(("args", "env"), [
    (("--host", "0.0.0.0"), {}),
    (("--host", "::"), {}),
    ((), {"MMCACHE_HOST": "0.0.0.0"}),
    (("--host", "0.0.0.0"), {"MMCACHE_ALLOW_UNAUTHENTICATED_WRITES": "0"}),
])
def test_a_public_address_without_tokens_is_refused_at_once_with_one_line(tmp_path, args, env):
    done, cpu = serve(*args, cwd=tmp_path, env=env)
    line = refused_line(done)
    assert "--auth-token-file" in line and "--allow-unauthenticated-writes" in line, line
    assert "writes" in line and "open" in line, line
    assert cpu < QUICK_CPU_S, cpu
    assert not (tmp_path / "d").exists()  # the data dir was not even created


def test_a_missing_token_file_is_refused_before_a_broker_starts(tmp_path):
    done, cpu = serve("--host", "0.0.0.0", "--auth-token-file", "nope", cwd=tmp_path)
    assert "--auth-token-file: token file nope: cannot read it" in refused_line(done)
    assert cpu < QUICK_CPU_S and not (tmp_path / "d").exists()


@pytest.mark.parametrize(("args", "env"), [
    (("--host", "0.0.0.0", "--allow-unauthenticated-writes"), {}),
    (("--host", "0.0.0.0"), {"MMCACHE_ALLOW_UNAUTHENTICATED_WRITES": "1"}),
    (("--host", "0.0.0.0", "--auth-token-file", "tokens"), {}),
    (("--host", "127.0.0.2"), {}),
    (("--host", "localhost"), {}),
    ((), {}),  # the default host: loopback
])
def test_tokens_loopback_or_saying_so_on_purpose_go_past_the_check(tmp_path, args, env):
    (tmp_path / "tokens").write_text("a-write-token\n")
    port = free_port()
    done, _ = serve(*args, "--bootstrap-servers", f"127.0.0.1:{port}", cwd=tmp_path, env=env)
    assert f"cannot reach the Kafka cluster at 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "a-write-token" not in done.stderr
    if "--allow-unauthenticated-writes" in args or env:
        assert "anyone who reaches" in done.stderr  # said once, as a warning
