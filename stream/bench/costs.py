"""Where the time of one match request and of one ingested event goes, stage by stage.

Each stage is timed in this process over every request body (or event record) at once,
fed with what the stage before it produced, and quoted as the median over passes of
microseconds per request (per event). Stages are timed one after the other within a
pass, so drift on a shared machine weighs on all of them alike.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson

from stream.bench.figures import Figure
from stream.bench.workload import Workload
from stream.config import Limits
from stream.core.cache import CacheState
from stream.core.codec import decode_event, encode_event
from stream.core.events import Position
from stream.core.items import extract_items
from stream.core.render import render_match
from stream.http.models import read_match
from stream.metrics import Metrics

__all__ = ["INGEST_STAGES", "MATCH_STAGES", "cost_figures", "ingest_costs", "match_costs"]

# stage -> what it is, in the order a request (an event) goes through them
MATCH_STAGES = {
    "orjson_loads": "the floor: orjson.loads of the body alone (also inside read_match)",
    "read_match": "body parse and checks (stream.http.models.read_match)",
    "extract_items": "item extraction (stream.core.items.extract_items)",
    "hits": "index walk (Index.hits)",
    "record_match": "metrics (Metrics.record_match)",
    "render_match": "the answer (stream.core.render.render_match)",
}
INGEST_STAGES = {
    "decode_event": "decoding a placement record of the log (stream.core.codec.decode_event)",
    "apply": "the fold (Fold.apply) into the full state",
}
_FLOOR = "orjson_loads"  # inside read_match: not added to the total again


def _timed(stages: dict[str, Callable[[], Any]], passes: int, count: int) -> dict[str, float]:
    """Median microseconds per unit of each stage, a stage being one call over ``count``
    units."""
    taken: dict[str, list[float]] = {name: [] for name in stages}
    for _ in range(passes):
        for name, run in stages.items():
            started = time.perf_counter_ns()
            run()
            taken[name].append((time.perf_counter_ns() - started) / count / 1000)
    return {name: statistics.median(times) for name, times in taken.items()}


def match_costs(state: CacheState, bodies: list[bytes], passes: int) -> dict[str, float]:
    """Microseconds per match request of each of ``MATCH_STAGES``, on ``state``."""
    limits, metrics = Limits(), Metrics(state, dict)
    queries = []
    for raw in bodies:
        query = read_match(raw, limits)
        if query is None:
            raise ValueError(f"not a valid match body: {raw[:80]!r}")
        queries.append(query)
    items = [extract_items(body) for _, body in queries]
    hits = [state.index.hits(request, endpoints)
            for request, (endpoints, _) in zip(items, queries, strict=True)]
    pairs = list(zip(items, hits, strict=True))
    loads = orjson.loads
    stages: dict[str, Callable[[], Any]] = {
        "orjson_loads": lambda: [loads(raw) for raw in bodies],
        "read_match": lambda: [read_match(raw, limits) for raw in bodies],
        "extract_items": lambda: [extract_items(body) for _, body in queries],
        "hits": lambda: [state.index.hits(request, endpoints)
                         for request, (endpoints, _) in zip(items, queries, strict=True)],
        "record_match": lambda: [metrics.record_match(request, found) for request, (_, found) in pairs],
        "render_match": lambda: [render_match(request, requested, found)
                                 for request, (requested, found) in pairs],
    }
    return _timed(stages, passes, len(bodies))


def ingest_costs(state: CacheState, events: int, passes: int) -> dict[str, float]:
    """Microseconds per event of each of ``INGEST_STAGES``: new placements of the
    workload (another seed), encoded as the producer encodes them, decoded as the keeper
    decodes them and folded into ``state``, which they change (``events`` a pass).

    Each pass takes fresh events at the next log positions: a position already applied
    would be skipped, not folded.
    """
    source = Workload(seed=13).placed_events(events * passes)
    offset = state.lrus.applied.get(0, -1) + 1
    timings: dict[str, list[float]] = {name: [] for name in INGEST_STAGES}
    for _ in range(passes):
        records = [encode_event(next(source)) for _ in range(events)]
        positions = [Position(0, offset + index) for index in range(events)]
        offset += events
        started = time.perf_counter_ns()
        decoded = [decode_event(raw) for raw in records]
        between = time.perf_counter_ns()
        for event, position in zip(decoded, positions, strict=True):
            state.fold.apply(event, position)
        ended = time.perf_counter_ns()
        timings["decode_event"].append((between - started) / events / 1000)
        timings["apply"].append((ended - between) / events / 1000)
    return {name: statistics.median(times) for name, times in timings.items()}


def cost_figures(state: CacheState, bodies: list[bytes], passes: int = 20,
                 ingest_events: int = 20_000, ingest_passes: int = 5) -> list[Figure]:
    """The match stages on ``state`` and ``bodies``, then the ingest stages, which fold
    new events into ``state`` (so they come last), as breakdown figures in microseconds.

    The loaded objects are frozen out of the collector's reach meanwhile, as the worker
    freezes its view after loading it.
    """
    gc.freeze()
    try:
        match = match_costs(state, bodies, passes)
        ingest = ingest_costs(state, ingest_events, ingest_passes)
    finally:
        gc.unfreeze()
    return (_breakdown("match_cost", match, MATCH_STAGES, "request", f"{len(bodies)} bodies")
            + _breakdown("ingest_cost", ingest, INGEST_STAGES, "event", f"{ingest_events:,} events"))


def _breakdown(prefix: str, costs: dict[str, float], stages: dict[str, str], unit: str,
               sample: str) -> list[Figure]:
    """One figure per stage, its share of the stages' total (the floor left out of it) in
    its note."""
    total = sum(us for name, us in costs.items() if name != _FLOOR)
    return [Figure(f"{prefix}_{name}", round(costs[name], 2), "us", "breakdown (no target)", True,
                   note=f"{stages[name]}; {100 * costs[name] / total:.0f}% of the {total:.1f} us "
                        f"per {unit} in process; median of passes over {sample}")
            for name in stages]
