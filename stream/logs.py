"""Logging for a service that may lose its broker: repeated identical errors are kept
to one line every few seconds, with the count of those left out.

With the broker unreachable, aiokafka and Faust log the same connection error many
times a second (~1,200 lines in 15 s were measured): the first one says everything,
the rest bury other messages and fill the disk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["CHATTY", "FORMAT", "RepeatFilter", "apply_log_level", "install_repeat_filter",
           "logging_config"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries whose INFO lines (group joins, partition tables, every service starting)
# are noise for an operator; they speak at WARNING unless --log-level debug.
CHATTY = ("faust", "mode", "aiokafka", "kafka", "rocksdict", "venusian")


class RepeatFilter(logging.Filter):
    """Lets an identical message (same logger, level and text) through at most once per
    ``window_s``; the next one that passes says how many were left out since.

    Only records at ``level`` or above are limited; at most ``max_keys`` messages are
    remembered (the least recently seen are forgotten first).
    """

    def __init__(self, window_s: float = 5.0, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 1024) -> None:
        super().__init__()
        self.window_s = window_s
        self.level = level
        self.clock = clock
        self.max_keys = max_keys
        self._seen: OrderedDict[tuple[str, int, str], list[float]] = OrderedDict()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to emit ``record``; adds the count of left-out repeats to its text."""
        if record.levelno < self.level:
            return True
        text = record.getMessage()
        key = (record.name, record.levelno, text)
        now = self.clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.window_s:
                seen[1] += 1
                return False
            left_out, since = (int(seen[1]), now - seen[0]) if seen is not None else (0, 0.0)
            self._seen[key] = [now, 0]
            self._seen.move_to_end(key)
            while len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)
        if left_out:
            record.msg = f"{text} (repeated {left_out} more times in the last {since:.0f} s)"
            record.args = ()
        return True


def install_repeat_filter(logger: logging.Logger | None = None, window_s: float = 5.0) -> None:
    """Add a ``RepeatFilter`` to each handler of ``logger`` (the root by default) that
    has none; a filter per handler, so that one handler's count is not another's."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, RepeatFilter) for f in handler.filters):
            handler.addFilter(RepeatFilter(window_s))


def logging_config(level: str) -> dict[str, Any]:
    """Faust resets logging when its worker starts; this is what it sets up instead: our
    format on stderr, the libraries at WARNING unless ``level`` is debug."""
    quiet = "DEBUG" if level == "debug" else "WARNING"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": FORMAT}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain",
                                "stream": "ext://sys.stderr"}},
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        "loggers": {name: {"level": quiet} for name in CHATTY},
    }



def apply_log_level(level: str) -> None:
    """The root logger at ``level``, the chatty libraries at WARNING unless debug."""
    logging.getLogger().setLevel(level.upper())
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
