"""The compiled hot modules against their own Python source, stage by stage (issue 12).

Each stage is timed as installed (compiled by ``setup.py``) and as its ``.py`` source run
uncompiled (``reference_module``), each copy on its own state built from the match
bench's workload (1,000 endpoints x 1,024 entries from 600,000 events) and on the same
match bodies, in the way and with the timers of ``stream.bench.costs``: the two copies
of a stage are timed one after the other in each pass, each figure is a median.

Run: ``python -m stream.bench.stages``.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson

from stream.bench.costs import _timed, ingest_costs
from stream.bench.match import full_state, request_bodies

__all__ = ["StageCost", "reference_module", "stage_costs"]


@cache
def reference_module(name: str) -> ModuleType:
    """Module ``name`` executed from its ``.py`` source, never compiled, as
    ``<name>_reference``, and so is every compiled module it imports (the core's types
    are split over several modules: a reference ``stream.core.cache`` on the compiled
    fold would compare the compiled code with itself). What else it imports is the
    installed code."""
    from stream.compiled import MODULES

    importlib.import_module("stream.core")  # the installed core first: what is not
    saved = {module: importlib.import_module(module) for module in MODULES}  # swapped stays so
    try:
        for module in MODULES:  # in dependency order: each sees the ones before it
            sys.modules[module] = _from_source(module)
        return _from_source(name)
    finally:
        sys.modules.update(saved)


@cache
def _from_source(name: str) -> ModuleType:
    installed = importlib.import_module(name)
    source = Path(installed.__file__ or "").with_name(name.rpartition(".")[2] + ".py")
    spec = importlib.util.spec_from_file_location(f"{name}_reference", source)
    if spec is None or spec.loader is None:
        raise ImportError(f"no Python source for {name} at {source}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pydantic look their module up
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class StageCost:
    """Median microseconds per request (per event) of one stage, uncompiled and compiled."""

    stage: str
    reference_us: float
    compiled_us: float


COPIES = {"reference": reference_module, "compiled": importlib.import_module}


def stage_costs(events: int = 600_000, requests: int = 1_000, passes: int = 15,
                ingest_events: int = 10_000, ingest_passes: int = 5) -> list[StageCost]:
    """The match stages of both copies, then ``Fold.apply`` (which changes the
    states, so it comes last), with the loaded states frozen out of the collector's
    reach as the worker freezes its view."""
    modules = {copy: [load(f"stream.core.{name}") for name in ("items", "cache", "render")]
               for copy, load in COPIES.items()}
    states = {copy: full_state(cache.CacheState(cache.Capacity.from_params()), events)
              for copy, (_, cache, _) in modules.items()}
    queries = [orjson.loads(raw) for raw in request_bodies(states["compiled"], requests)]
    per_copy = {copy: _match_stages(items.extract_items, states[copy], render.render_match, queries)
                for copy, (items, _, render) in modules.items()}
    stages = {f"{stage}/{copy}": per_copy[copy][stage] for stage in per_copy["compiled"] for copy in COPIES}
    gc.freeze()
    try:
        match = _timed(stages, passes, requests)
        apply = {copy: ingest_costs(state, ingest_events, ingest_passes)["apply"]
                 for copy, state in states.items()}
    finally:
        gc.unfreeze()
    return [*(StageCost(stage, match[f"{stage}/reference"], match[f"{stage}/compiled"])
              for stage in per_copy["compiled"]),
            StageCost("Fold.apply", apply["reference"], apply["compiled"])]


def _match_stages(extract_items: Callable[..., Any], state: Any, render_match: Callable[..., Any],
                  queries: list[Any]) -> dict[str, Callable[[], Any]]:
    """One copy's match stages, each fed with what this copy's stage before it gave."""
    asked = [(extract_items(q["body"]), q["endpoints"]) for q in queries]
    found = [(items, *state.index.hits(items, endpoints)) for items, endpoints in asked]
    return {
        "extract_items": lambda: [extract_items(q["body"]) for q in queries],
        "Index.hits": lambda: [state.index.hits(items, endpoints) for items, endpoints in asked],
        "render_match": lambda: [render_match(*args) for args in found],
    }


def main() -> None:
    """Print each stage's reference and compiled microseconds and their ratio."""
    print(f"{'stage':<22} {'reference':>10} {'compiled':>10} {'speed-up':>9}")
    for cost in stage_costs():
        print(f"{cost.stage:<22} {cost.reference_us:>8.2f}us {cost.compiled_us:>8.2f}us "
              f"{cost.reference_us / cost.compiled_us:>8.2f}x")


if __name__ == "__main__":
    main()
