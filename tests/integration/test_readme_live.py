"""README's shell snippets, pasted as they are: the quickstart's calls against the `serve`
that `make run` starts, and the three-worker snippet, which must wait for its workers.

Each runs in a network namespace of its own (``unshare --net``), so the fixed ports the
README uses (8080-8082, 9092) cannot meet another test's or another user's, and in a
directory of its own, where the snippets' data dirs go."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: a hang guard only: the snippets wait on readiness themselves
HANG_S = 900


def _shell_blocks(section: str) -> list[str]:
    readme = (ROOT / "README.md").read_text()
    body = re.search(rf"^## {section}\n(.*?)(?=^## )", readme, re.S | re.M)
    assert body is not None, section
    return re.findall(r"^```sh\n(.*?)^```$", body.group(1), re.S | re.M)


def _in_own_network(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare --net` (root, or user namespaces) to keep the README's fixed ports apart")
    (cwd / ".venv").symlink_to(ROOT / ".venv")
    return subprocess.run(["unshare", "--net", "bash", "-c", "ip link set lo up\n" + script],
                          cwd=cwd, capture_output=True, text=True, timeout=HANG_S,
                          env={**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"})


def _documents(text: str) -> list[object]:
    decoder, found, at = json.JSONDecoder(), [], 0
    while (start := text.find("{", at)) >= 0:
        document, at = decoder.raw_decode(text, start)
        found.append(document)
    return found


def test_the_quickstart_calls_answer_as_make_run_serves(tmp_path):
    make_run = re.search(r"^run: .*\n\t\$\(BIN\)/(mmcache serve)$", (ROOT / "Makefile").read_text(), re.M)
    assert make_run is not None
    calls = _shell_blocks("Run it")[1]
    done = _in_own_network(
        f".venv/bin/{make_run.group(1)} > serve.log 2>&1 &\n"
        "until curl -sf localhost:8080/readyz > /dev/null; do sleep 0.5; done\n"
        f"{calls}\nkill -INT %1; wait %1; echo \"serve exit $?\"\n", tmp_path)
    ready, placed, matched, state = _documents(done.stdout)
    assert ready["status"] == "ready", done.stdout
    assert placed == {"events": 1}
    assert len(matched["request_items"]) == 1 and [e["endpoint"] for e in matched["endpoints"]] == [
        "default/pod-a", "default/pod-b"]
    assert state["total_endpoints"] == 1 and len(state["digest"]) == 64
    assert done.stdout.rstrip().endswith("serve exit 0"), (tmp_path / "serve.log").read_text()[-2000:]


def test_the_three_worker_snippet_works_pasted_as_is(tmp_path):
    snippet = next(block for block in _shell_blocks("Run it") if "mmcache broker" in block)
    done = _in_own_network(f"{snippet}\nkill $(jobs -p); wait\n", tmp_path)
    answers = _documents(done.stdout)
    assert [a["status"] for a in answers] == ["ready"] * 3, done.stdout + done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob(".mmcache-*")) == [".mmcache-0", ".mmcache-1", ".mmcache-2"]
