"""StallWatch: an owned partition behind the log with its applied offset unmoved."""

from __future__ import annotations

from stream.worker.stall_watch import StallWatch


def test_a_partition_behind_and_unmoved_for_the_interval_is_stalled_once_per_interval():
    watch = StallWatch(after_s=5)
    assert watch.stalled({0: (1, 4)}, now=0) == []
    assert watch.stalled({0: (1, 4)}, now=4.9) == []
    assert watch.stalled({0: (1, 4)}, now=5) == [0]
    assert watch.stalled({0: (1, 4)}, now=6) == []  # given once, then another interval
    assert watch.stalled({0: (1, 4)}, now=10) == [0]


def test_a_partition_that_moves_or_is_caught_up_is_never_stalled():
    watch = StallWatch(after_s=5)
    for second in range(20):
        # partition 0 applies one event a second and stays behind; 1 is at the end
        assert watch.stalled({0: (second, second + 100), 1: (9, 10)}, now=second) == []


def test_a_partition_no_longer_owned_is_forgotten():
    watch = StallWatch(after_s=5)
    watch.stalled({0: (1, 4)}, now=0)
    watch.stalled({}, now=3)  # revoked
    assert watch.stalled({0: (1, 4)}, now=6) == []  # owned again: a new interval
    assert watch.stalled({0: (1, 4)}, now=11) == [0]


def test_partitions_waiting_their_turn_in_a_backlog_are_not_stalled():
    """While any owned partition applies events, the worker is busy (a fetch returns a few
    partitions' records at a time): the others are not stalled, however long they wait."""
    watch = StallWatch(after_s=5)
    for second in range(30):
        figures = {0: (second * 1000, 10**6), 1: (7, 10**6)}  # 0 moves, 1 waits its turn
        assert watch.stalled(figures, now=second) == []
    # the backlog of 0 is done and nothing moves any more: 1 is stalled after the interval
    for second in range(30, 35):
        assert watch.stalled({0: (10**6 - 1, 10**6), 1: (7, 10**6)}, now=second) == []
    assert watch.stalled({0: (10**6 - 1, 10**6), 1: (7, 10**6)}, now=35) == [1]


def test_a_reset_starts_afresh():
    """After a rebalance (reset) the time a partition was seen unmoved before it does not count."""
    watch = StallWatch(after_s=5)
    watch.stalled({0: (1, 4)}, now=0)
    watch.reset()
    assert watch.stalled({0: (1, 4)}, now=6) == []
    assert watch.stalled({0: (1, 4)}, now=11) == [0]
