"""Where a takeover's time went, read from a survivor's log (``stream.bench.failover``)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from stream.bench.failover import phases_note, takeover_phases


def _line(at: float, text: str) -> str:
    stamp = datetime.fromtimestamp(at)  # local time, as logging writes it
    return f"{stamp:%Y-%m-%d %H:%M:%S},{stamp.microsecond // 1000:03d} {text}\n"


def test_each_step_is_its_first_line_after_the_kill(tmp_path: Path) -> None:
    kill = 1_800_000_000.0
    log = tmp_path / "w0.log"
    before = _line(kill - 5, "INFO stream.worker.keeper: state loaded: 9 endpoints (read from the files: [])")
    log.write_text(before + "".join([
        _line(kill - 1, "INFO stream.worker.table_mirror: recovery after a rebalance: changelog partitions [0]"),
        _line(kill + 0.25, "INFO stream.worker.keeper: state loaded: 9 endpoints (read from the files: [])"),
        _line(kill + 2.125, "WARNING aiokafka.consumer.group_coordinator: Heartbeat failed for group g "
                            "because it is rebalancing"),
        "a line without a time: recovery after a rebalance:\n",
        _line(kill + 3.5, "INFO stream.worker.table_mirror: recovery after a rebalance: changelog partitions [0, 1]"),
        _line(kill + 3.625, "INFO stream.worker.keeper: state loaded: 9 endpoints (read from the files: [])"),
        _line(kill + 4.0, "INFO stream.worker.keeper: state loaded: 9 endpoints (read from the files: [])"),
    ]))
    # from byte ``len(before)`` on: the line before it is not read at all; the view whole
    # right after the kill is an earlier recovery's, not the takeover's
    phases = takeover_phases(log, len(before.encode()), kill)
    assert phases == {"noticed": 2.125, "assigned": 3.5, "loaded": 3.625}
    assert phases_note([phases, {"noticed": 2.0, "assigned": 3.0, "loaded": 3.25}]) == (
        "after the kill: the rebalance reached the survivor at 2.06 s (2.00-2.12), its recovery "
        "began at 3.25 s (3.00-3.50), its view was whole at 3.44 s (3.25-3.62)")


def test_each_step_is_read_on_its_own_and_one_not_logged_is_left_out(tmp_path: Path) -> None:
    kill = 1_800_000_000.0
    log = tmp_path / "w0.log"
    log.write_text(_line(kill + 1.5, "INFO x: recovery after a rebalance: changelog partitions [2]")
                   + _line(kill + 1.75, "INFO x: state loaded: 1 endpoints (read from the files: [])")
                   + _line(kill + 2.5, "WARNING aiokafka: Heartbeat failed for group g because it "
                                       "is rebalancing"))
    phases = takeover_phases(log, 0, kill)
    # each step is found on its own, whatever the order of the lines
    assert phases == {"assigned": 1.5, "loaded": 1.75, "noticed": 2.5}
    phases.pop("noticed")
    # a step some trials did not log is not summarised from the others
    assert phases_note([phases, {"noticed": 1.0, **phases}]) == (
        "after the kill: its recovery began at 1.50 s (1.50-1.50), its view was whole at 1.75 s "
        "(1.75-1.75)")
