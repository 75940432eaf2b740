"""Waiting on a condition, for every part of the suite (the e2e environment too: standard
library only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["eventually"]


def eventually(check: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05) -> Any:
    """Poll until ``check`` returns a truthy value, and return it; fail after ``timeout``
    seconds (a bound on what the condition is about, never on a start-up)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last: {result!r})")
        time.sleep(interval)
