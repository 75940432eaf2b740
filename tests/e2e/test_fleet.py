"""A real fleet, short: two vLLM servers with the plugin, `mmcache serve` and the
reference gateway on a seeded trace of chat requests (repeated and fresh images, with and
without uuids, multi-turn conversations), round-robin against index-bounded.

It runs ``python -m stream.bench.fleet_real`` from the project's ``.venv`` (serve and the
gateway live there), which starts the vLLM servers with this interpreter (the e2e
environment's). What the data supports, and only that: routing on mmcache's index saves
encoder work over round-robin on a trace with repeats, every request is answered, and the
estimate the index routed on agrees with what the engines reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("MMCACHE_TINY_MODEL", REPO / ".e2e" / "tiny-qwen2-vl"))
PROJECT_PYTHON = REPO / ".venv" / "bin" / "python"
REQUESTS = 60


def _run_fleet() -> dict:
    for path, what in ((PROJECT_PYTHON, "the project's .venv (make .venv/.installed)"),
                       (MODEL / "config.json", "the tiny model (make e2e builds it)")):
        assert path.exists(), f"{path} is missing: {what}"
    env = {**os.environ, "MMCACHE_VLLM_PYTHON": sys.executable, "MMCACHE_TINY_MODEL": str(MODEL)}
    done = subprocess.run([str(PROJECT_PYTHON), "-m", "stream.bench.fleet_real", "--requests", str(REQUESTS),
                           "--policies", "round-robin,index-bounded"],
                          cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_index_bounded_saves_encoder_work_over_round_robin_and_its_estimate_agrees() -> None:
    doc = _run_fleet()
    trace, real = doc["trace"], doc["real"]
    assert trace["requests"] == REQUESTS
    assert trace["distinct_items"] < trace["items"]  # the trace repeats images
    for policy in ("round-robin", "index-bounded"):
        assert real[policy]["failed"] == 0
        assert real[policy]["requests"] == REQUESTS
    round_robin, bounded = real["round-robin"], real["index-bounded"]
    # the same items, fewer encodings: the index sends an image back where it was encoded
    assert bounded["encoder"]["lookups"] == round_robin["encoder"]["lookups"] == trace["items"]
    assert bounded["encoder"]["misses"] < round_robin["encoder"]["misses"]
    assert bounded["layers"]["processor"] > round_robin["layers"]["processor"]
    # the closed loop: the engines reported (checks were counted) and the estimate the
    # gateway routed on named what they held
    checks = bounded["checks"]
    assert checks.get("true_hit", 0) > 0
    assert bounded["precision"] >= 0.9
    assert bounded["recall"] >= 0.9
    assert bounded["match_failures"] == 0
    # round-robin never asks mmcache: no checks
    assert round_robin["precision"] is None
