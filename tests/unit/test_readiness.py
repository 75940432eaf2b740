"""Readiness and staleness (issue 9, items 1 and 2): the lag rule, the /readyz decision,
and the latch that keeps a worker ready through rebalances."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from stream.worker.readiness import Readiness, ViewLag, caught_up, decide, view_lag


def test_lag_counts_events_past_the_applied_offset_per_partition():
    lag = view_lag({0: 10, 1: 5, 2: 0}, {0: 9, 1: 1}, {1: (2, 100.0)}, now=103.5)
    assert lag.partitions == {0: 0, 1: 3, 2: 0}
    assert lag.events == 3
    assert lag.staleness_seconds == 3.5


def test_a_partition_never_applied_lags_by_its_whole_log():
    assert view_lag({0: 4}, {}, {0: (0, 10.0)}, now=12.0) == ViewLag({0: 4}, 2.0)


def test_staleness_is_unknown_until_the_first_missing_event_was_read():
    assert view_lag({0: 10}, {0: 5}, {}, now=1.0).staleness_seconds is None
    # read for a later offset than the first one missing now (the view went back): unknown
    assert view_lag({0: 10}, {0: 5}, {0: (8, 0.5)}, now=1.0).staleness_seconds is None
    # read for an earlier one (the view moved on since): an upper bound
    assert view_lag({0: 10}, {0: 5}, {0: (3, 0.5)}, now=1.0).staleness_seconds == 0.5


def test_no_lag_is_zero_staleness_and_an_unread_log_is_unknown():
    assert view_lag({0: 3}, {0: 2}, {}, now=9.0) == ViewLag({0: 0}, 0.0)
    assert view_lag({}, {0: 2}, {}, now=9.0) == ViewLag({}, None)
    assert ViewLag({}, None).events is None


@given(st.dictionaries(st.integers(0, 7), st.integers(0, 1000)),
       st.dictionaries(st.integers(0, 7), st.integers(-1, 1000)))
def test_lag_is_never_negative_and_zero_exactly_when_caught_up(ends, applied):
    lag = view_lag(ends, applied, {}, now=0.0)
    assert all(behind >= 0 for behind in lag.partitions.values())
    assert (lag.events == 0) == (bool(ends) and caught_up(ends, applied))


def test_decide():
    behind = ViewLag({0: 5}, 1.5)
    assert decide(False, behind, None).status == "not_ready"
    assert decide(False, behind, None).reason.startswith("loading")
    ready = decide(True, behind, None)
    assert (ready.status, ready.lag_events, ready.staleness_seconds) == ("ready", 5, 1.5)
    assert decide(True, behind, 5).status == "ready"
    lagging = decide(True, behind, 4)
    assert lagging.status == "not_ready" and "--max-lag-events 4" in lagging.reason
    assert decide(True, ViewLag({}, None), 0).status == "not_ready"


@dataclass
class Ends:
    ends: dict[int, int] = field(default_factory=dict)
    first_missing: dict[int, tuple[int, float]] = field(default_factory=dict)
    begun: int = 0
    samples: int = 0

    def read(self, ends: dict[int, int]) -> None:
        self.begun += 1
        self.ends = ends
        self.samples = self.begun


def test_ready_once_loaded_and_caught_up_then_through_any_lag_unless_bounded():
    applied: dict[int, int] = {}
    ends = Ends()
    follower_done = [False]
    readiness = Readiness(lambda: applied, ends, lambda: follower_done[0], clock=lambda: 0.0)
    ends.read({0: 3, 1: 2})
    assert readiness.report().status == "not_ready"  # not loaded
    readiness.loaded()
    applied.update({0: 2, 1: 1})
    assert readiness.report().status == "not_ready"  # the follower is still reading
    follower_done[0] = True
    assert readiness.report().status == "not_ready"  # no end read after the load yet
    ends.read({0: 5, 1: 2})
    assert readiness.report().status == "not_ready"  # partition 0 lacks 2 events
    ends.read({0: 50, 1: 20})  # steady traffic: the target stays the first end read
    applied[0] = 4
    assert readiness.report().status == "ready"
    # a rebalance: the follower re-reads, applied offsets fall behind; still ready
    follower_done[0] = False
    ends.read({0: 500, 1: 200})
    body = readiness.report()
    assert (body.status, body.lag_events) == ("ready", 495 + 198)
    readiness.max_lag_events = 100
    assert readiness.report().status == "not_ready"
    applied.update({0: 499, 1: 199})
    assert readiness.report().status == "ready"


def test_files_that_hold_the_whole_log_are_ready_before_any_recovery():
    ends = Ends()
    readiness = Readiness(dict, ends, lambda: False, clock=lambda: 0.0)
    files = {0: 4, 1: 2}  # the preload's applied offsets
    since = ends.begun
    assert not readiness.loaded_whole(files, since)  # no end read after the files were
    ends.read({0: 5, 1: 4})
    assert not readiness.loaded_whole(files, since)  # partition 1 lacks an event
    assert readiness.report().status == "not_ready"
    ends.read({0: 5, 1: 3, 2: 0})  # partition 2 is empty: nothing to hold
    assert readiness.loaded_whole(files, since)
    assert readiness.report().status == "ready"  # latched, no recovery, no follower
    ends.read({0: 9, 1: 3, 2: 1})
    assert readiness.report().status == "ready"


def test_files_behind_a_partition_the_files_lack_are_not_ready():
    ends = Ends()
    readiness = Readiness(dict, ends, lambda: True, clock=lambda: 0.0)
    ends.read({0: 5, 1: 1})
    assert not readiness.loaded_whole({0: 4}, 0)  # no file for partition 1, which has an event


def test_the_gauges_are_collected_per_partition():
    ends = Ends()
    ends.read({0: 3, 1: 2})
    ends.first_missing[0] = (1, 10.0)
    readiness = Readiness(lambda: {0: 0, 1: 1}, ends, lambda: True, clock=lambda: 12.0)
    families = {f.name: f for f in readiness.collect()}
    samples = {s.labels.get("partition"): s.value for s in families["mmcache_view_lag_events"].samples}
    assert samples == {"0": 2, "1": 0}
    assert families["mmcache_view_staleness_seconds"].samples[0].value == 2.0


def test_a_worker_problem_is_named_in_the_reason_and_changes_no_status():
    problem = "state writes fail for partitions [2] for 3 s (IO error: No space left on device)"
    ready = decide(True, ViewLag({0: 40}, 1.0), None, problem)
    assert ready.status == "ready" and problem in ready.reason and "from memory" in ready.reason
    loading = decide(False, ViewLag({}, None), None, problem)
    assert loading.status == "not_ready" and loading.reason.startswith("loading")
    assert problem in loading.reason
    bounded = decide(True, ViewLag({0: 40}, 1.0), 10, problem)  # the unapplied events count
    assert bounded.status == "not_ready" and "lagging" in bounded.reason and problem in bounded.reason
    assert decide(True, ViewLag({0: 0}, 0.0), None).reason == "the view answers /v1/match"


def test_the_readiness_of_a_worker_asks_its_problem_on_every_report():
    problems: list[str | None] = [None]
    readiness = Readiness(lambda: {0: 4}, Ends(), lambda: True, problem=lambda: problems[-1])
    assert readiness.report().reason.startswith("loading")
    problems.append("state writes fail")
    assert readiness.report().reason.endswith("; state writes fail")


def test_a_probe_reading_in_flight_when_the_load_ended_is_not_taken_as_read_after_it():
    import asyncio

    from stream.kafka.log_probe import EventLogProbe

    class Consumer:
        """Answers end offsets when told to (a probe's reading in flight)."""

        def __init__(self) -> None:
            self.answer = asyncio.Event()

        async def end_offsets(self, tps):
            await self.answer.wait()
            return {tp: 0 for tp in tps}

    async def scene() -> None:
        probe = EventLogProbe("127.0.0.1:1", "events", 2, dict)
        probe._consumer = Consumer()  # the probe's own consumer, replaced for this unit
        reading = asyncio.ensure_future(probe.sample())
        await asyncio.sleep(0)  # the reading has begun: its end offsets are being asked for
        since = probe.begun  # the load ends now
        probe._consumer.answer.set()
        await reading
        assert probe.ends == {0: 0, 1: 0}
        assert probe.samples <= since  # begun before: not an end read after the load
        await probe.sample()
        assert probe.samples > since

    asyncio.run(scene())
