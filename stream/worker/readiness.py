"""Readiness and staleness of one worker's view (CONTRACT, "Readiness and staleness").

The view answers ``/v1/match`` from memory, through rebalances and broker outages, so
``/readyz`` says "ready" from the moment the view was first loaded and caught up with
the log after start, and stays so (a stale best-effort answer is better than taking
every pod out of the Service at once), unless ``max_lag_events`` is set and exceeded.
Lag counts the events on the log not yet in the view over every partition, owned
(the keeper's applied offset) or followed (the owner's, mirrored from the changelog);
staleness is the age of the oldest of them.

``view_lag``, ``caught_up`` and ``decide`` are the rule, pure (no clock, no I/O):
``Readiness`` feeds them the figures of the running worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

from stream.http.models import ReadinessBody

log = logging.getLogger(__name__)

__all__ = ["LogEnds", "Readiness", "ViewLag", "caught_up", "decide", "view_lag"]


@dataclass(frozen=True, slots=True)
class ViewLag:
    """Events on the log not in the view, per partition, and the age of the oldest
    (``None`` while not known)."""

    partitions: dict[int, int]
    staleness_seconds: float | None

    @property
    def events(self) -> int | None:
        """The lag over every partition (``None`` before the log's end was read)."""
        return sum(self.partitions.values()) if self.partitions else None


def view_lag(ends: Mapping[int, int], applied: Mapping[int, int],
             first_missing: Mapping[int, tuple[int, float]], now: float) -> ViewLag:
    """The lag from the log's end offsets, the view's applied offsets and the timestamps
    of first missing events; a timestamp read for an earlier offset than the first one
    missing now is an upper bound, used until it is read again."""
    lags = {p: max(0, end - applied.get(p, -1) - 1) for p, end in ends.items()}
    if not lags:
        return ViewLag({}, None)
    ages = []
    for partition, behind in lags.items():
        if behind:
            seen = first_missing.get(partition)
            if seen is None or seen[0] > applied.get(partition, -1) + 1:
                return ViewLag(lags, None)
            ages.append(max(0.0, now - seen[1]))
    return ViewLag(lags, max(ages, default=0.0))


def caught_up(target: Mapping[int, int], applied: Mapping[int, int]) -> bool:
    """Whether every partition's applied offset reached the end read for it."""
    return all(applied.get(p, -1) + 1 >= end for p, end in target.items())


def decide(ready_once: bool, lag: ViewLag, max_lag_events: int | None,
           problem: str | None = None) -> ReadinessBody:
    """The answer of ``/readyz``: not ready before the first load and catch-up, or while
    the lag is over ``max_lag_events``; ready otherwise. A ``problem`` of the worker (its
    state files refuse writes) changes no status: the view still answers ``/v1/match``
    from memory, and the events it cannot apply show as lag, which ``max_lag_events``
    bounds; the reason names it whatever the status."""
    figures = {"lag_events": lag.events, "staleness_seconds": lag.staleness_seconds}
    if not ready_once:
        status, reason = "not_ready", "loading: the view is being loaded and caught up with the event log"
    elif max_lag_events is not None and lag.events is None:
        status, reason = "not_ready", (f"the event log's end is not known yet, and "
                                       f"--max-lag-events is {max_lag_events}")
    elif max_lag_events is not None and lag.events is not None and lag.events > max_lag_events:
        status, reason = "not_ready", (f"lagging: the view lacks {lag.events} events of the log, "
                                       f"more than --max-lag-events {max_lag_events}")
    else:
        status, reason = "ready", "the view answers /v1/match"
    if problem is not None:
        reason = f"{reason} (from memory); {problem}" if status == "ready" else f"{reason}; {problem}"
    return ReadinessBody(status=status, reason=reason, **figures)


class LogEnds(Protocol):
    """What ``Readiness`` reads of the event log (``stream.kafka.log_probe.EventLogProbe``)."""

    ends: dict[int, int]
    first_missing: dict[int, tuple[int, float]]
    begun: int
    samples: int


class Readiness:
    """The running worker's readiness: latched once the first recovery has loaded the view
    (``loaded``), the follower has read the other partitions (``follower_caught_up``) and
    every partition has applied the log's end as first read after that, or earlier when
    the local files held all of it (``loaded_whole``); then ``decide``, told of
    ``problem()`` (``stream.worker.table_mirror.StateWrites.problem``).
    """

    def __init__(self, applied: Callable[[], Mapping[int, int]], log_ends: LogEnds,
                 follower_caught_up: Callable[[], bool], max_lag_events: int | None = None,
                 clock: Callable[[], float] = time.time,
                 problem: Callable[[], str | None] = lambda: None) -> None:
        self.applied = applied
        self.problem = problem
        self.log_ends = log_ends
        self.follower_caught_up = follower_caught_up
        self.max_lag_events = max_lag_events
        self.clock = clock
        self.ready_once = False
        self._loaded_at: int | None = None  # the probe's sample count when loaded
        self._target: dict[int, int] | None = None  # the log's end read after that

    def loaded(self) -> None:
        """A recovery has loaded the view (only the first counts)."""
        if self._loaded_at is None:
            self._loaded_at = self.log_ends.begun

    def loaded_whole(self, applied: Mapping[int, int], since: int) -> bool:
        """The view was loaded from every partition's local file (a restart's preload,
        before the group join) with these ``applied`` offsets: ready at once if they reach
        the log's end as read after the load (a probe sample past ``since``), so a
        restart on files that hold the whole log answers without waiting for the join
        and the recovery; returns whether it is ready. ``since`` is the probe's ``begun``
        when the load ended."""
        ends = self.log_ends
        if not self.ready_once and ends.samples > since and ends.ends \
                and caught_up(ends.ends, applied):
            self.ready_once = True
            log.info("ready: the view is loaded from the local state files, which hold "
                     "every event of the log; /v1/match answers from it (the group join "
                     "goes on)")
        return self.ready_once

    def lag(self) -> ViewLag:
        """The view's lag now."""
        ends = self.log_ends
        return view_lag(ends.ends, self.applied(), ends.first_missing, self.clock())

    def report(self) -> ReadinessBody:
        """``/readyz``'s body (its status is 200 when ready)."""
        if not self.ready_once and self._loaded_at is not None and self.follower_caught_up():
            ends = self.log_ends
            if self._target is None and ends.samples > self._loaded_at:
                self._target = dict(ends.ends)  # fixed: steady traffic must not outrun it
            if self._target is not None and caught_up(self._target, self.applied()):
                self.ready_once = True
                log.info("ready: the view is loaded and caught up with the event log, "
                         "/v1/match answers from it")
        return decide(self.ready_once, self.lag(), self.max_lag_events, self.problem())

    def collect(self) -> Iterator[Metric]:
        """``mmcache_view_lag_events{partition}`` and ``mmcache_view_staleness_seconds``
        (a prometheus_client collector: register it on the service's registry)."""
        lag = self.lag()
        events = GaugeMetricFamily("mmcache_view_lag_events", "Events on the event log not yet "
                                   "in this worker's view, by partition (owned or followed)",
                                   labels=["partition"])
        for partition, behind in sorted(lag.partitions.items()):
            events.add_metric([str(partition)], behind)
        yield events
        if lag.staleness_seconds is not None:
            yield GaugeMetricFamily("mmcache_view_staleness_seconds", "Age of the oldest event "
                                    "on the log not yet in this worker's view (0: none)",
                                    value=lag.staleness_seconds)
