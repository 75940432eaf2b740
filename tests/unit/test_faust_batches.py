"""The batch path's pure part: how it sorts one partition's fetched records
(``plan_batch``) against Faust's per-message rules (read offsets, committed offsets, acks,
gaps); its version guard and list of private names, against the installed Faust. The
drain loop itself is tested against the real Faust consumer on the broker in
``tests/integration/test_faust_batches.py``."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import faust
import pytest
from faust.tables import TableManager
from faust.types import TP
from hypothesis import given
from hypothesis import strategies as st

from stream.worker import faust_batches
from stream.worker.faust_batches import PromptTableManager, plan_batch


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


def test_the_pins_are_the_installed_releases_and_pyproject_pins_them_exactly():
    from importlib.metadata import version
    from pathlib import Path

    faust_batches.check_versions()  # the venv holds the pinned releases
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    for name, pinned in faust_batches.PINNED.items():
        assert version(name) == pinned
        assert f'"{name}=={pinned}"' in pyproject


@pytest.mark.parametrize("package", ["faust-streaming", "mode-streaming"])
def test_another_release_of_either_package_is_refused_naming_it(package):
    def installed(name):
        return "9.9.9" if name == package else faust_batches.PINNED[name]

    with pytest.raises(RuntimeError, match=rf"{package} 9\.9\.9 \(needs {faust_batches.PINNED[package]}\)"):
        faust_batches.check_versions(installed)


def test_install_checks_the_versions_first(monkeypatch):
    def refuse(installed=None):
        raise RuntimeError("refused")

    monkeypatch.setattr(faust_batches, "check_versions", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        faust_batches.install(faust.App("test-faust-batches"), {})


def test_every_listed_private_name_is_on_the_real_consumer_of_an_app():
    """The real Faust consumer (not a copy of its fields) has every name the module uses."""
    app = faust.App("test-faust-batches-names", broker="kafka://127.0.0.1:1", web_enabled=False,
                    autodiscover=False)
    consumer = app.consumer  # built lazily, not started: no broker needed
    faust_batches.check_consumer(consumer)
    assert all(name.startswith("_") for name in faust_batches.CONSUMER_PRIVATE)


def test_the_prompt_table_manager_is_fausts_start_less_its_one_second_sleep():
    """PromptTableManager.on_start does what the pinned TableManager.on_start does after
    its sleep; if Faust's changes, this says so before a worker starts differently."""
    def calls(method: object) -> list[str]:
        return [line.strip() for line in inspect.getsource(method).splitlines()
                if line.strip().startswith(("await", "if"))]

    faust_start, ours = calls(TableManager.on_start), calls(PromptTableManager.on_start)
    assert faust_start[0] == "await self.sleep(1.0)"
    assert ours == faust_start[1:] == ["if not self.should_stop:", "await self._update_channels()",
                                       "await self.recovery.start()"]


def test_a_drain_waits_for_the_flow_then_polls_for_an_active_partition_not_a_whole_second():
    """At the end of a recovery Faust resumes the flow a few ms before the partitions, and
    its fetch sleeps a whole second when none is active: the drain waits for both first."""
    tp = TP("events", 0)

    async def run() -> None:
        app = faust.App("test-faust-batches-wait", broker="kafka://127.0.0.1:1",
                        web_enabled=False, autodiscover=False)
        consumer = app.consumer  # the real consumer, built on this loop, not started
        consumer._active_partitions = set()
        drain = faust_batches._BatchDrain(consumer, {})
        drain_wait = drain.wait_for_active_partitions
        consumer.stop_flow()  # a rebalance began
        waiting = asyncio.ensure_future(drain.wait_for_active_partitions(longest=60))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the flow is stopped
        consumer.resume_flow()
        await asyncio.sleep(0.05)
        assert not waiting.done()  # no partition is active yet
        consumer.resume_partitions({tp})
        assert await asyncio.wait_for(waiting, 10)  # within a poll, not the 60 s
        # none ever active: the turn ends after ``longest``, without Faust's fetch
        consumer._active_partitions.clear()
        assert not await asyncio.wait_for(drain.wait_for_active_partitions(longest=0.05), 10)
        fetched: list[float] = []

        async def wait_next_records(timeout: float) -> tuple[None, None]:
            fetched.append(timeout)
            return None, None

        consumer._wait_next_records = wait_next_records
        drain.wait_for_active_partitions = lambda: drain_wait(longest=0.05)
        await asyncio.wait_for(drain.fetch_once(), 10)
        assert fetched == []  # skipped: Faust's would have slept its second
        consumer.resume_partitions({tp})
        await asyncio.wait_for(drain.fetch_once(), 10)
        assert fetched == [1.0]
        # a crashed consumer (stopping, not stopped yet): the wait returns, after a turn
        consumer._active_partitions.clear()
        consumer._crashed.set()
        turns = asyncio.ensure_future(asyncio.sleep(0))
        assert not await drain_wait(longest=60)  # awaited directly: only its own poll turns
        assert turns.done()

    asyncio.run(run())
