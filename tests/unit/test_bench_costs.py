"""The cost breakdown of the match bench (issue 12): one positive figure per named stage,
and each figure is the time of the function it names."""

from __future__ import annotations

import time

import orjson
import pytest

from stream.bench import costs
from stream.bench.costs import INGEST_STAGES, MATCH_STAGES, cost_figures, ingest_costs, match_costs
from stream.bench.match import full_state, request_bodies
from stream.core.cache import CacheState, Capacity
from stream.core.fold import Fold
from stream.core.index import Index
from stream.metrics import Metrics

# Far above any stage's own time (tens of us) and medians of 7 passes: a busy machine's
# preemptions (a few ms in one pass of 12 bodies) do not lift a stage past it.
DELAY_US = 1000
PASSES = 7

# where each stage's function is looked up when the breakdown calls it
CALLED = {
    "orjson_loads": (orjson, "loads"),
    "read_match": (costs, "read_match"),
    "extract_items": (costs, "extract_items"),
    "hits": (Index, "hits"),
    "record_match": (Metrics, "record_match"),
    "render_match": (costs, "render_match"),
    "decode_event": (costs, "decode_event"),
    "apply": (Fold, "apply"),
}


@pytest.fixture
def tiny():
    state = full_state(CacheState(Capacity.from_params(8)), 3000)
    return state, request_bodies(state, 12)


def test_every_named_stage_gets_a_positive_breakdown_figure(tiny):
    state, bodies = tiny
    figures = cost_figures(state, bodies, passes=3, ingest_events=200, ingest_passes=3)
    assert [f.name for f in figures] == (
        ["match_cost_orjson_loads", "match_cost_read_match", "match_cost_extract_items", "match_cost_hits",
         "match_cost_record_match", "match_cost_render_match", "ingest_cost_decode_event", "ingest_cost_apply"])
    for figure in figures:
        assert figure.value > 0 and figure.unit == "us"
        assert figure.target == "breakdown (no target)" and figure.passed is True
        assert figure.control is None and figure.ratio is None
        assert "% of the " in figure.note
    # shares are of the stages' total, the floor (inside read_match) left out of it
    shares = [int(f.note.split("% of the ")[0].rsplit(" ", 1)[1]) for f in figures]
    assert 97 <= sum(shares[1:6]) <= 103 and 98 <= sum(shares[6:]) <= 102


def test_the_ingest_stages_fold_fresh_events_at_the_next_positions(tiny):
    state, _ = tiny
    applied = state.lrus.applied[0]
    ingest_costs(state, 100, 2)
    assert state.lrus.applied[0] == applied + 200


@pytest.mark.parametrize("stage", list(CALLED))
def test_each_figure_is_the_time_of_the_function_it_names(tiny, monkeypatch, stage):
    assert set(CALLED) == set(MATCH_STAGES) | set(INGEST_STAGES)
    state, bodies = tiny
    owner, name = CALLED[stage]
    original = getattr(owner, name)

    def slowed(*args, **kwargs):
        until = time.perf_counter() + DELAY_US / 1e6
        while time.perf_counter() < until:
            pass
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, slowed)
    measured = {**match_costs(state, bodies, PASSES), **ingest_costs(state, 50, PASSES)}
    # read_match parses with orjson.loads: slowing the floor slows it too
    expected = {stage, "read_match"} if stage == "orjson_loads" else {stage}
    assert {s for s, us in measured.items() if us >= DELAY_US} == expected
