"""The /v1/match answer rendered as bytes equals the serialized domain answer."""

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.core.render import render_match

NAMES = ["ns/a", "ns/b", 'ns/"quoted"', "ns/ünïcode", "ns/\\slash"]
HASHES = ["h1", "h2", "h3", "h4"]


def estimates(matches):
    """The domain answer's entries as /v1/match writes them: each with its source (the
    LRU's answer is the estimate's)."""
    return [{**match, "source": "estimate"} for match in matches]


def as_json(value):
    return orjson.loads(orjson.dumps(value, default=lambda i: {"hash": i.hash, "size": i.size,
                                                               "modality": i.modality},
                                     option=orjson.OPT_PASSTHROUGH_DATACLASS))


@settings(max_examples=200, deadline=None)
@given(
    placements=st.lists(st.tuples(st.sampled_from(NAMES), st.lists(st.sampled_from(HASHES), min_size=1, unique=True)), max_size=12),
    asked=st.lists(st.tuples(st.sampled_from(HASHES + ["none"]), st.integers(1, 7)), max_size=5, unique_by=lambda t: t[0]),
    endpoints=st.lists(st.sampled_from(NAMES + ["ns/unknown"]), max_size=8),
)
def test_rendered_answer_equals_the_domain_answer(placements, asked, endpoints):
    state = CacheState(Capacity.from_params(6))
    for offset, (name, hashes) in enumerate(placements):
        state.fold.apply(ItemsPlaced(endpoint=name, items=[Item(h, 1, "image") for h in hashes]),
                         Position(0, offset))
    items = [Item(h, size, "video") for h, size in asked]
    rendered = orjson.loads(render_match(items, *state.index.hits(items, endpoints)))
    expected = as_json({"request_items": items, "endpoints": estimates(state.index.match(items, endpoints))})
    assert rendered == expected


PLAIN = [f"ns/pod-{i}" for i in range(40)] + ["ns/ü", "ns/ë-€"]
ODD = ['ns/"quoted"', 'x",', "ns/\\slash", "ns/\u2028"]
ASKED_ONLY = ["ns/unknown", "ns/\x7f", "ns/\x01"]  # names no event may hold


@settings(max_examples=200, deadline=None)
@given(
    holders=st.lists(st.sampled_from(PLAIN + ODD), unique=True, max_size=6),
    endpoints=st.lists(st.sampled_from(PLAIN + ODD + ASKED_ONLY), max_size=40),
)
def test_runs_of_endpoints_without_items_render_like_the_domain_answer(holders, endpoints):
    state = CacheState(Capacity.from_params(6))
    for offset, name in enumerate(holders):
        state.fold.apply(ItemsPlaced(endpoint=name, items=[Item("h1", 1, "image")]), Position(0, offset))
    items = [Item("h1", 2, "image"), Item("h2", 3, "audio")]
    rendered = orjson.loads(render_match(items, *state.index.hits(items, endpoints)))
    expected = as_json({"request_items": items, "endpoints": estimates(state.index.match(items, endpoints))})
    assert rendered == expected
