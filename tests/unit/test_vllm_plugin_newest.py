"""The plugin's tests against the encoder cache manager of vLLM's newest release (0.34.0
removed ``get_manager_metadata``, which the plugin never used): tests/unit/test_vllm_plugin.py
run again in a child pytest whose tests/vllm_wheel.py loads that wheel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.vllm_wheel import NEWEST_VLLM_VERSION

REPO = Path(__file__).resolve().parents[2]


def test_the_plugins_tests_pass_on_the_newest_vllm() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         "tests/unit/test_vllm_plugin.py"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "MMCACHE_VLLM_WHEEL": NEWEST_VLLM_VERSION})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
