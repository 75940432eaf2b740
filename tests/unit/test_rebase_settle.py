"""A rebase of the embedded broker settles the worker only when no batch is being handled
and every event up to the log's end is applied (a batch whose changelog records were not
sent yet would reach the new broker in the middle of its restore)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from stream.core.cache import CacheState, Capacity
from stream.worker.app import _RebasedWorker


class _Producer:
    def __init__(self) -> None:
        self.flushed = 0

    async def flush(self) -> None:
        self.flushed += 1


def _worker() -> tuple[_RebasedWorker, CacheState, _Producer]:
    state = CacheState(Capacity.from_params(8))
    producer = _Producer()
    app = SimpleNamespace(producer=producer)
    worker = _RebasedWorker(app, publisher=None, state=state, lag=dict, partitions=2,  # type: ignore[arg-type]
                            persisted_offset=lambda p: None)
    return worker, state, producer


async def _settled_within(worker: _RebasedWorker, ends: dict[int, int], seconds: float) -> bool:
    try:
        await asyncio.wait_for(worker.settle(ends), seconds)
        return True
    except TimeoutError:
        return False


def test_a_batch_being_handled_holds_the_settle_even_once_its_events_are_applied():
    worker, state, producer = _worker()
    state.lrus.applied.update({0: 9, 1: 4})
    worker.batches = 1  # applied in the view, its records not yet written

    async def run() -> tuple[bool, bool]:
        held = await _settled_within(worker, {0: 10, 1: 5}, 0.2)
        worker.batches = 0
        return held, await _settled_within(worker, {0: 10, 1: 5}, 1.0)

    held, settled = asyncio.run(run())
    assert not held and settled and producer.flushed == 1


def test_events_not_applied_yet_hold_the_settle():
    worker, state, producer = _worker()
    state.lrus.applied.update({0: 9})

    async def run() -> tuple[bool, bool]:
        held = await _settled_within(worker, {0: 10, 1: 5}, 0.2)  # partition 1: nothing applied
        state.lrus.applied[1] = 4
        return held, await _settled_within(worker, {0: 10, 1: 5}, 1.0)

    held, settled = asyncio.run(run())
    assert not held and settled
    # a partition with no event at all is settled from the start
    assert asyncio.run(_settled_within(worker, {2: 0}, 1.0))
