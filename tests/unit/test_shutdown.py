"""The repeat filter and the shutdown deadline, with a fake clock and a fake exit."""

from __future__ import annotations

import logging
import threading

from stream.logs import RepeatFilter, install_repeat_filter
from stream.worker.shutdown import FORCED_EXIT_CODE, ShutdownDeadline


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(msg: str, *args: object, name: str = "aiokafka", level: int = logging.ERROR):
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_identical_errors_pass_once_per_window_then_say_how_many_were_left_out():
    clock = Clock()
    limit = RepeatFilter(window_s=5.0, clock=clock)
    passed = []
    for step in range(100):  # 10 s of one error every 0.1 s
        clock.now = step * 0.1
        r = record("Unable connect to node with id %d", 111)
        if limit.filter(r):
            passed.append(r.getMessage())
    assert passed == [
        "Unable connect to node with id 111",
        "Unable connect to node with id 111 (repeated 49 more times in the last 5 s)",
    ]


def test_different_messages_loggers_and_levels_are_limited_apart():
    limit = RepeatFilter(clock=Clock())
    records = [record("a"), record("b"), record("a", name="other"),
               record("a", level=logging.WARNING)]
    assert all(limit.filter(r) for r in records)
    assert not any(limit.filter(r) for r in [record("a"), record("b")])


def test_info_lines_are_never_limited():
    limit = RepeatFilter(clock=Clock())
    assert all(limit.filter(record("Stopping...", level=logging.INFO)) for _ in range(10))


def test_the_filter_remembers_a_bounded_number_of_messages():
    limit = RepeatFilter(clock=Clock(), max_keys=3)
    for i in range(10):
        limit.filter(record(f"m{i}"))
    assert len(limit._seen) == 3
    assert limit.filter(record("m0"))  # forgotten, so it passes again


def test_install_adds_one_filter_per_handler_once():
    logger = logging.getLogger("test-install-repeat")
    handlers = [logging.NullHandler(), logging.NullHandler()]
    for handler in handlers:
        logger.addHandler(handler)
    try:
        install_repeat_filter(logger)
        install_repeat_filter(logger)
        filters = [[f for f in h.filters if isinstance(f, RepeatFilter)] for h in handlers]
        assert [len(f) for f in filters] == [1, 1]
        assert filters[0][0] is not filters[1][0]
    finally:
        for handler in handlers:
            logger.removeHandler(handler)


def test_the_deadline_runs_the_last_steps_and_exits_only_once_stopping_has_lasted():
    stopping = threading.Event()
    exited = threading.Event()
    codes: list[int] = []
    steps: list[str] = []

    def exit(code: int) -> None:
        codes.append(code)
        exited.set()

    deadline = ShutdownDeadline(stopping.is_set, 0.2, [lambda: steps.append("release")],
                                poll_s=0.01, exit=exit).start()
    assert not exited.wait(0.3)  # not stopping: never exits
    stopping.set()
    assert exited.wait(5)
    assert codes == [FORCED_EXIT_CODE] and steps == ["release"]
    assert deadline.timeout_s == 0.2


def test_a_failing_last_step_does_not_keep_the_process_alive():
    exited = threading.Event()

    def fail() -> None:
        raise OSError("disk gone")

    ShutdownDeadline(lambda: True, 0.0, [fail], poll_s=0.01,
                     exit=lambda code: exited.set()).start()
    assert exited.wait(5)
