"""Failover between two real workers of one app id: ``kill -9`` of one under steady
placement and match traffic (the trial of ``stream.bench.failover``; times are that
benchmark's business, this test asserts the counts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream.bench.failover import takeover_trial

pytestmark = pytest.mark.integration


def test_kill_9_of_one_of_two_workers_loses_nothing_and_the_survivor_equals_the_replay(
        bootstrap: str, tmp_path: Path) -> None:
    # the benchmark's traffic window before the kill: long enough for > 100 placements
    # on a busy machine (2 s gave 28-61 with the suite's 4 workers and two busy loops)
    trial = takeover_trial(bootstrap, tmp_path, steady_s=4.0, after_kill_s=0.5)

    assert trial.victim_exit == -9
    # every placement that got its 202, through either worker, before or after the kill,
    # is on its endpoint in the survivor's view
    assert trial.placements_acked > 100
    assert trial.placements_found == trial.placements_acked
    # the survivor answered every match, during the takeover too
    assert trial.matches_sent > 100
    assert trial.match_errors == []
    assert trial.matches_ok == trial.matches_sent
    # and its whole state is what an offline replay of the log gives
    assert trial.takeover_s is not None
    assert trial.live_digest == trial.replay_digest
    # without reading a partition from its files: its own were in the view as stored, the
    # victim's as its follower had read them to the changelog's end (stream.worker.view_marks)
    assert trial.read_from_files == [], trial.read_from_files
    # the survivor's log says where the takeover went (stream.bench.failover.PHASES), each
    # step found on its own: its recovery for the new assignment began, then its view was
    # whole (and the rebalance had reached it before, when aiokafka's warning was not held
    # back as a repeat)
    phases = trial.phases
    assert {"assigned", "loaded"} <= phases.keys(), phases
    assert phases["assigned"] <= phases["loaded"], phases
    assert phases.get("noticed", 0) <= phases["assigned"], phases
