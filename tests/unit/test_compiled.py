"""The compiled hot modules (issue 12) answer exactly as their Python source does.

Each module listed in ``[tool.mmcache] compiled`` must be the extension that ``setup.py``
built, and no older than its source; its ``.py`` is then run uncompiled as the
reference, and both copies get the same random requests, answers and event logs.
Objects of the two copies are of different classes, so they are compared as tuples.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream import compiled
from stream.bench.stages import reference_module, stage_costs
from stream.core.cache import CacheState
from stream.core.items import MAX_ITEM_SIZE, Item
from tests.unit.eventlogs import EventLogs

ROOT = Path(__file__).resolve().parents[2]
COMPILED = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mmcache"]["compiled"]
SETTINGS = settings(max_examples=300, deadline=None)


@pytest.mark.parametrize("name", COMPILED)
def test_the_module_is_the_extension_and_its_source_the_reference(name):
    built = Path(importlib.import_module(name).__file__)
    if built.suffix != ".so" and not shutil.which(os.environ.get("CC", "cc").split()[0]):
        pytest.skip("no C compiler: the install fell back to the pure-Python core (setup.py)")
    assert built.suffix == ".so", f"{name} is not compiled: run `pip install -e .` (or `make`)"
    source = built.with_name(name.rpartition(".")[2] + ".py")
    assert reference_module(name).__file__ == str(source)
    if built.is_relative_to(ROOT):  # built in place by `pip install -e`: the source may have moved on
        assert built.stat().st_mtime >= source.stat().st_mtime, (
            f"{source} changed after {built.name} was built: rebuild with `pip install -e .`")


def test_serve_checks_the_modules_that_setup_compiles():
    assert list(compiled.MODULES) == COMPILED


def test_the_image_compiles_in_its_build_stage_only():
    build, run = re.split(r"^FROM .*$", (ROOT / "Dockerfile").read_text(), flags=re.M)[1:3]
    assert "gcc" in build and "setup.py" in build
    assert "gcc" not in run


def outcome(call: Any, *args: Any) -> Any:
    """What a call gave, comparable across the two copies: its value, or its error."""
    try:
        return "value", call(*args)
    except Exception as exc:  # the same class name, message and field, whatever the copy
        return "error", type(exc).__name__, str(exc), getattr(exc, "field", None)


def items_as_tuples(items: list[Any]) -> list[tuple[str, int, str]]:
    return [(item.hash, item.size, item.modality) for item in items]


# -- extract_items ----------------------------------------------------------------------

junk = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**63), st.floats(allow_nan=False),
                 st.sampled_from(["", "x", "image", "é\\\""]), st.just([]), st.just({}))
texts = st.one_of(st.sampled_from(["", "h1", "h2", "image", "audio", "wav"]), st.text(max_size=8))


def shaped(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the right shape (19 times in 20), sometimes anything at all (not at the
    ends of the range, which hypothesis draws more often and shrinks to)."""
    return st.integers(0, 19).flatmap(lambda n: junk if n == 13 else inner)


def record(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[Any]:
    return shaped(st.fixed_dictionaries(required, optional=optional))


features = record({"hash": shaped(texts)}, {"modality": shaped(texts), "length": shaped(
    st.one_of(st.integers(-1, 3), st.just(MAX_ITEM_SIZE), st.just(MAX_ITEM_SIZE + 1)))})
prompts = record({"mm_features": shaped(st.lists(features, min_size=1, max_size=4))}, {})
tokenized = record({"prompts": shaped(st.lists(prompts, min_size=1, max_size=3))}, {})
mm_hashes = shaped(st.dictionaries(texts, shaped(st.lists(shaped(texts), min_size=1, max_size=3)),
                                   min_size=1, max_size=3))
generate = record({}, {"features": record({"mm_hashes": mm_hashes}, {})})
url = st.one_of(texts, record({"url": shaped(texts)}, {}))
block = shaped(st.one_of(
    st.sampled_from(["image_url", "video_url", "audio_url"]).flatmap(
        lambda kind: record({"type": st.just(kind), kind: shaped(url)}, {})),
    record({"type": st.just("input_audio"),
            "input_audio": record({"data": shaped(texts), "format": shaped(texts)}, {})}, {}),
    record({"type": shaped(texts)}, {}),
))
message = record({"content": shaped(st.lists(block, min_size=1, max_size=4))}, {"role": texts})
messages = shaped(st.lists(message, min_size=1, max_size=3))
chat = record({"messages": messages}, {})
sources = {"tokenized": tokenized, "generate": generate, "chat_completions": chat}
bodies = st.one_of(
    *(record({key: source}, {k: v for k, v in sources.items() if k != key}) for key, source in sources.items()),
    record({"messages": messages}, {"model": texts, **sources}),
    junk,
)


@SETTINGS
@given(bodies)
def test_extract_items_gives_the_same_items_and_the_same_errors(body):
    compiled, reference = importlib.import_module("stream.core.items"), reference_module("stream.core.items")
    got, want = outcome(compiled.extract_items, body), outcome(reference.extract_items, body)
    if got[0] == want[0] == "value":
        got, want = items_as_tuples(got[1]), items_as_tuples(want[1])
    assert got == want


# -- render_match -----------------------------------------------------------------------

names = st.one_of(st.sampled_from(["ns/a", "ns/b", 'ns/"q"', "ns/\\s", "ns/ü", "ns/\u2028", "ns/\x7f"]),
                  st.text(min_size=1, max_size=6))
items = st.lists(st.builds(Item, st.text(min_size=1, max_size=6),
                           st.integers(1, MAX_ITEM_SIZE), st.sampled_from(["image", "video", "audio"])),
                 max_size=5, unique_by=lambda item: item.hash)


@SETTINGS
@given(items, st.lists(names, unique=True, max_size=12), st.data())
def test_render_match_writes_the_same_bytes(items, requested, data):
    holders = data.draw(st.lists(st.sampled_from(requested), unique=True) if requested else st.just([]))
    found = {name: data.draw(st.lists(st.sampled_from(items), min_size=1, unique=True))
             for name in holders if items}
    compiled, reference = importlib.import_module("stream.core.render"), reference_module("stream.core.render")
    assert outcome(compiled.render_match, items, requested, found) == \
        outcome(reference.render_match, items, requested, found)


# -- CacheState: the fold, the queries, the digests -------------------------------------

ENDPOINTS = [f"ns/pod-{i}" for i in range(5)]
HASHES = [f"h{i}" for i in range(6)]
LOGS = EventLogs(ENDPOINTS, HASHES)


def effects_as_tuples(effects: Any) -> Any:
    return None if effects is None else ([tuple(e) for e in effects.upserts], effects.removals)


def observed(state: Any, queries: list[tuple[list[Item], list[str]]], budget: int) -> dict[str, Any]:
    """Everything a caller can read from a state, as plain values."""
    hits = [state.index.hits(items, endpoints) for items, endpoints in queries]
    rounds = 0
    state.digests.start_round()
    while not state.digests.refresh(budget):
        rounds += 1
    lrus = state.lrus
    restored = type(state)(lrus.capacity)
    for partition, applied in lrus.applied.items():
        restored.loading.restore(partition, applied,
                                 [entry for p, entry in state.loading.entries() if p == partition])
    return {
        "entries": {name: list(cache.entries.items()) for name, cache in lrus.endpoints.items()},
        "partitions": {name: cache.partition for name, cache in lrus.endpoints.items()},
        "weights": {name: cache.weight for name, cache in lrus.endpoints.items()},
        "holders": {digest: sorted(names) for digest, names in state.index.holders.items()},
        "applied": lrus.applied,
        "digest": state.digests.digest(),
        "sliced digest": (state.digests.cached(), rounds),
        "summary": [tuple(row) for row in state.index.summary(3)],
        "hits": [(requested, [(n, items_as_tuples(i)) for n, i in found.items()]) for requested, found in hits],
        "match": [[{**m, "matched_items": items_as_tuples(m["matched_items"])}
                   for m in state.index.match(items, endpoints)] for items, endpoints in queries],
        "entries()": [(partition, tuple(entry)) for partition, entry in state.loading.entries()],
        "restored": (restored.digests.digest(),
                     {name: list(c.entries.items()) for name, c in restored.lrus.endpoints.items()}),
    }


queries = st.lists(st.tuples(
    st.lists(st.builds(Item, st.sampled_from(HASHES + ["absent"]), st.integers(1, 4), st.just("image")),
             max_size=4, unique_by=lambda item: item.hash),
    st.lists(st.sampled_from(ENDPOINTS + ["ns/unknown"]), max_size=7)), max_size=4)


@SETTINGS
@given(LOGS.scenarios(), queries, st.integers(1, 5))
def test_a_state_folds_answers_and_hashes_alike(scenario, queries, budget):
    reference_cache = reference_module("stream.core.cache")
    states = CacheState(scenario.capacity), reference_cache.CacheState(
        reference_cache.Capacity(*scenario.capacity))
    for position, event in scenario.log:
        compiled, reference = (effects_as_tuples(state.fold.apply(event, position)) for state in states)
        assert compiled == reference
    assert observed(states[0], queries, budget) == observed(states[1], queries, budget)


def test_the_stage_bench_times_both_copies():
    costs = stage_costs(events=2_000, requests=10, passes=1, ingest_events=20, ingest_passes=1)
    assert [cost.stage for cost in costs] == ["extract_items", "Index.hits", "render_match",
                                              "Fold.apply"]
    assert all(cost.reference_us > 0 and cost.compiled_us > 0 for cost in costs)
