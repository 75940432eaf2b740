"""A bound on how long `serve` takes to stop, whatever the broker does.

Faust's worker (mode's ``Worker``) installs its own SIGINT/SIGTERM handlers and then
stops its services one by one; with the broker unreachable, each client's stop waits
for requests that never get an answer (~61 s were measured, past Kubernetes' 30 s
grace period). A watcher thread notices that the worker started to stop (mode's public
``should_stop``) and, if the process is still there ``timeout_s`` later, runs the
given last steps and exits with ``FORCED_EXIT_CODE``, saying so in the log.

The only hooks into mode are its public ones: ``Service.should_stop`` and
``Worker.on_setup_root_logger`` (called after mode replaced the root log handlers,
so the repeat filter goes onto the new ones).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from stream.logs import install_repeat_filter

__all__ = ["FORCED_EXIT_CODE", "ShutdownDeadline", "guard_worker"]

FORCED_EXIT_CODE = 3

log = logging.getLogger("mmcache")


class ShutdownDeadline:
    """Exit the process ``timeout_s`` after ``stopping()`` first returned True."""

    def __init__(self, stopping: Callable[[], bool], timeout_s: float,
                 last_steps: Iterable[Callable[[], None]] = (), poll_s: float = 0.1,
                 exit: Callable[[int], Any] = os._exit) -> None:
        self.stopping = stopping
        self.timeout_s = timeout_s
        self.last_steps = list(last_steps)
        self.poll_s = poll_s
        self._exit = exit
        self._thread = threading.Thread(target=self._watch, name="shutdown-deadline",
                                        daemon=True)

    def start(self) -> ShutdownDeadline:
        """Start watching (a daemon thread: it never keeps the process alive)."""
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self.stopping():
            time.sleep(self.poll_s)
        time.sleep(self.timeout_s)
        log.error("shutdown did not finish within %.1f s (is the Kafka broker reachable?): "
                  "exiting now with code %d; the local state is kept", self.timeout_s,
                  FORCED_EXIT_CODE)
        for step in self.last_steps:
            try:
                step()
            except Exception:  # a failed last step must not keep the process alive
                log.exception("while exiting")
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(FORCED_EXIT_CODE)


def guard_worker(worker: Any, timeout_s: float,
                 last_steps: Iterable[Callable[[], None]] = ()) -> ShutdownDeadline:
    """Bound ``worker``'s shutdown to ``timeout_s`` and rate-limit repeated log lines
    once mode has set up logging; call before ``execute_from_commandline``."""
    setup_root_logger = worker.on_setup_root_logger

    def on_setup_root_logger(logger: logging.Logger, level: int) -> None:
        setup_root_logger(logger, level)
        install_repeat_filter(logger)

    worker.on_setup_root_logger = on_setup_root_logger
    return ShutdownDeadline(lambda: bool(worker.should_stop), timeout_s, last_steps).start()
