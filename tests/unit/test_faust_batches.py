"""The batch path: how it sorts one partition's fetched records (``plan_batch``) against
Faust's per-message rules (read offsets, committed offsets, acks, gaps), and one fetch of
the drain loop against a fake consumer (ack after the handler, none after a rebalance)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import SimpleNamespace
from weakref import WeakSet

import faust
import pytest
from faust.types import TP
from hypothesis import given
from hypothesis import strategies as st

from stream import faust_batches
from stream.faust_batches import _BatchDrain, plan_batch


def records(*offsets: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(offset=o, value=b"") for o in offsets]


def offsets(plan) -> list[int]:
    return [r.offset for r in plan.records]


def test_a_fresh_partition_takes_and_acks_everything():
    plan = plan_batch(records(0, 1, 2), read_offset=None, committed=None, acked=set())
    assert offsets(plan) == [0, 1, 2]
    assert plan.acks == [0, 1, 2]
    assert plan.gaps == []
    assert plan.read_offset == 2


def test_records_below_the_read_offset_are_dropped_and_the_one_at_it_is_taken():
    # after a seek the read offset is the committed offset, the next one to read
    plan = plan_batch(records(8, 9, 10, 11), read_offset=10, committed=10, acked=set())
    assert offsets(plan) == [10, 11]
    assert plan.acks == [10, 11]
    assert plan.read_offset == 11


def test_only_offsets_at_or_above_the_committed_one_are_acked():
    plan = plan_batch(records(5, 6, 7), read_offset=None, committed=6, acked=set())
    assert offsets(plan) == [5, 6, 7]
    assert plan.acks == [6, 7]


def test_offsets_acked_already_are_not_acked_twice():
    plan = plan_batch(records(5, 6, 7), read_offset=5, committed=None, acked={5, 6})
    assert plan.acks == [7]


def test_nothing_new_leaves_the_read_offset():
    plan = plan_batch(records(3, 4), read_offset=9, committed=9, acked=set())
    assert plan.records == [] and plan.acks == [] and plan.gaps == []
    assert plan.read_offset == 9


def test_gaps_hold_only_the_absent_offsets():
    plan = plan_batch(records(13, 14, 20), read_offset=10, committed=10, acked=set())
    assert plan.gaps == [(11, 12), (15, 19)]
    assert plan.read_offset == 20


def test_a_read_offset_of_zero_still_registers_a_gap():
    assert plan_batch(records(3), read_offset=0, committed=None, acked=set()).gaps == [(1, 2)]


def test_no_gap_before_the_first_record_of_a_partition_never_read():
    assert plan_batch(records(7, 8), read_offset=None, committed=None, acked=set()).gaps == []


@given(st.lists(st.integers(0, 200), unique=True).map(sorted),
       st.none() | st.integers(0, 200), st.none() | st.integers(0, 200))
def test_taken_acked_and_gap_offsets_cover_the_range_once(log, read, committed):
    plan = plan_batch(records(*log), read_offset=read, committed=committed, acked=set())
    taken = offsets(plan)
    assert taken == [o for o in log if read is None or o >= read]
    assert plan.acks == [o for o in taken if committed is None or o >= committed]
    if taken:
        start = taken[0] if read is None else read + 1
        covered = sorted([*taken, *(o for a, b in plan.gaps for o in range(a, b + 1))])
        expected = list(range(min(start, taken[0]), taken[-1] + 1))
        assert covered == expected
        assert plan.read_offset == taken[-1]
    else:
        assert plan.read_offset == read


def test_install_refuses_another_faust_release(monkeypatch):
    monkeypatch.setattr(faust, "__version__", "0.16.0")
    with pytest.raises(RuntimeError, match="0.15.3"):
        faust_batches.install(faust.App("test-faust-batches"), {})


class FakeConsumer:
    """The parts of a Faust consumer the batch path reads and writes."""

    def __init__(self, fetches):
        self.fetches = list(fetches)
        self.app = SimpleNamespace(
            consumer_generation_id=1,
            flow_control=SimpleNamespace(is_active=lambda: True),
            monitor=SimpleNamespace(track_tp_end_offset=lambda tp, offset: None,
                                    stream_inbound_time={}),
            topics=SimpleNamespace(acks_enabled_for=lambda topic: True),
        )
        self.suspend_flow = asyncio.Event()
        self.flow_active = True
        self.should_stop = False
        self._read_offset = defaultdict(lambda: None)
        self._committed_offset = defaultdict(lambda: None)
        self._acked = defaultdict(list)
        self._acked_index = defaultdict(set)
        self._n_acked = 0
        self._commit_every = None
        self._buffered_partitions = set()
        self._unacked_messages = WeakSet()
        self._waiting_for_ack = None
        self.gaps = []
        self.delivered = []

    async def _wait_next_records(self, timeout):
        return self.fetches.pop(0), None

    async def sleep(self, seconds):
        await asyncio.sleep(seconds)

    def highwater(self, tp):
        return None

    async def _add_gap(self, tp, first, last):
        self.gaps.append((tp, first, last))


EVENTS = TP("events", 0)


def drain_once(consumer, handler) -> None:
    asyncio.run(_BatchDrain(consumer, {"events": handler}).fetch_once())


def test_a_batch_is_acked_after_its_handler_and_while_it_runs_counts_as_unacked():
    consumer = FakeConsumer([{EVENTS: records(4, 5, 7)}])
    consumer._read_offset[EVENTS] = 4
    seen = []

    async def handler(partition, batch):
        seen.append((partition, [r.offset for r in batch], len(consumer._unacked_messages),
                     list(consumer._acked[EVENTS])))

    drain_once(consumer, handler)
    assert seen == [(0, [4, 5, 7], 1, [])]
    assert consumer._acked[EVENTS] == [4, 5, 7] and consumer._acked_index[EVENTS] == {4, 5, 7}
    assert consumer._n_acked == 3
    assert consumer._read_offset[EVENTS] == 7
    assert consumer.gaps == [(EVENTS, 6, 6)]
    assert not consumer._unacked_messages


def test_a_rebalance_during_the_handler_leaves_the_batch_unacked():
    consumer = FakeConsumer([{EVENTS: records(0, 1)}])

    async def handler(partition, batch):
        consumer.app.consumer_generation_id = 2

    drain_once(consumer, handler)
    assert not consumer._acked[EVENTS] and consumer._n_acked == 0
    assert consumer._read_offset[EVENTS] is None


def test_a_suspended_flow_hands_nothing_over():
    consumer = FakeConsumer([{EVENTS: records(0, 1)}])
    consumer.suspend_flow.set()
    called = []

    async def handler(partition, batch):
        called.append(batch)

    drain_once(consumer, handler)
    assert called == [] and not consumer._acked[EVENTS]
