"""Rules of the suite itself: an exception in a test's helper thread fails that test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_exception_in_a_helper_thread_fails_the_test(tmp_path):
    test = tmp_path / "test_helper_thread.py"
    test.write_text("import threading\n\n"
                    "def test_loader():\n"
                    "    loader = threading.Thread(target=lambda: 1 / 0)\n"
                    "    loader.start()\n"
                    "    loader.join()\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(test)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "1 failed" in done.stdout and "ZeroDivisionError" in done.stdout, done.stdout[-2000:]
