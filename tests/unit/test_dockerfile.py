"""The image (issue 10, item 10): built in stages, run as a non-root user, with a
HEALTHCHECK whose probe really tells a live API from a dead one."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

from tests.unit.test_http_api import make_api

DOCKERFILE = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()


def test_stages_user_and_healthcheck():
    assert len(re.findall(r"^FROM ", DOCKERFILE, re.M)) >= 2
    assert re.search(r"^COPY --from=build ", DOCKERFILE, re.M)
    users = re.findall(r"^USER (\S+)", DOCKERFILE, re.M)
    assert users and users[-1] not in ("root", "0")
    assert len(re.findall(r"^HEALTHCHECK ", DOCKERFILE, re.M)) == 1


def _probe() -> list[str]:
    line = re.search(r"^HEALTHCHECK .*? CMD (\[.*\])$", DOCKERFILE, re.M).group(1)
    return json.loads(line)


def test_the_healthcheck_probe_passes_on_a_live_api_and_fails_without_one():
    argv = _probe()
    assert argv[0] == "python"

    async def run() -> tuple[int, int]:
        server = make_api().server()
        port = await server.start("127.0.0.1", 0)
        env = {"MMCACHE_PORT": str(port), "PATH": "/usr/bin:/bin"}
        live = await asyncio.to_thread(subprocess.run, [sys.executable, *argv[1:]], env=env,
                                       capture_output=True, timeout=10)
        await server.close()
        dead = await asyncio.to_thread(subprocess.run, [sys.executable, *argv[1:]], env=env,
                                       capture_output=True, timeout=10)
        return live.returncode, dead.returncode

    live, dead = asyncio.run(run())
    assert live == 0 and dead != 0
