"""POST /v1/engine-events and the match's ``source``, in process: a body is checked
before anything is written (400 naming the field or limit, 413 for an event the log could
never take), a valid one is one event keyed by its endpoint; each match entry says whether
it was answered from the endpoint's engine view or its estimate LRU, by --match-source;
and the estimate's checks against the engine views are counted."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from stream.config import Limits, Settings
from stream.core.cache import CacheState, Capacity
from stream.core.codec import decode_event, encode_event
from stream.core.events import (
    EngineCleared,
    EngineEventsReported,
    EngineItemsRemoved,
    EngineItemsStored,
    ItemsPlaced,
    Position,
)
from stream.core.items import Item
from stream.http.api import HttpApi
from stream.metrics import Metrics
from tests.unit.served import served

DEFAULT_LIMITS = Limits()


class FakePublisher:
    """Takes events as the log would, and keeps them."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def publish(self, events: list[Any]) -> int:
        self.events.extend(events)
        return len(events)


def tokenized(*hashes: str) -> dict:
    return {"tokenized": {"prompts": [{"mm_features": [
        {"hash": h, "modality": "image", "length": 2} for h in hashes]}]}}


def report(endpoint: str, *events: Any) -> EngineEventsReported:
    return EngineEventsReported(endpoint=endpoint, engine="vllm", events=list(events))


def stored(*hashes: str) -> EngineItemsStored:
    return EngineItemsStored(items=[Item(h, 2, "image") for h in hashes])


def state_with_views() -> CacheState:
    """ns/a: LRU {h1, h2}, engine view {h2, h3}; ns/b: LRU {h1} only; ns/c: engine view
    {h1}, no LRU."""
    state = CacheState(Capacity.from_params(6))
    events = [
        ItemsPlaced(endpoint="ns/a", items=[Item("h1", 2, "image"), Item("h2", 2, "image")]),
        ItemsPlaced(endpoint="ns/b", items=[Item("h1", 2, "image")]),
        report("ns/a", stored("h1", "h2", "h3"), EngineItemsRemoved(hashes=["h1"])),
        report("ns/c", stored("h1")),
    ]
    for offset, event in enumerate(events):
        state.fold.apply(event, Position(0, offset))
    return state


def run_calls(api: HttpApi, calls: list[tuple[str, str, Any]]) -> list[tuple[int, Any]]:
    async def run() -> list[tuple[int, Any]]:
        answers = []
        async with served(api) as client:
            for method, path, body in calls:
                data = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
                response = await client.request(method, path, data=data)
                raw = await response.read()
                try:
                    answers.append((response.status, orjson.loads(raw)))
                except orjson.JSONDecodeError:
                    answers.append((response.status, raw.decode()))
        return answers

    return asyncio.run(run())


def make(state: CacheState | None = None, limits: Limits = DEFAULT_LIMITS, match_source: str = "auto",
         ) -> tuple[HttpApi, FakePublisher]:
    state = state if state is not None else CacheState(Capacity.from_params(6))
    publisher = FakePublisher()
    api = HttpApi(state, publisher, Metrics(state, dict), limits, lambda: True,  # type: ignore[arg-type]
                  match_source=match_source)
    return api, publisher


CONTRACT_BODY = {"endpoint": "default/pod-a", "engine": "vllm",
                 "events": [{"type": "stored", "items": [{"hash": "h", "size": 1450, "modality": "image"}]},
                            {"type": "removed", "hashes": ["h2"]},
                            {"type": "cleared"}]}


def test_the_contracts_body_is_one_event_keyed_by_its_endpoint_that_round_trips_the_log():
    api, publisher = make()
    assert run_calls(api, [("POST", "/v1/engine-events", CONTRACT_BODY)]) == [(202, {"events": 1})]
    [event] = publisher.events
    assert event == EngineEventsReported(endpoint="default/pod-a", engine="vllm", events=[
        EngineItemsStored(items=[Item("h", 1450, "image")]), EngineItemsRemoved(hashes=["h2"]),
        EngineCleared()])
    assert decode_event(encode_event(event)) == event


def test_an_empty_report_writes_nothing():
    api, publisher = make()
    answer = run_calls(api, [("POST", "/v1/engine-events", {"endpoint": "e", "engine": "vllm", "events": []})])
    assert answer == [(202, {"events": 0})] and publisher.events == []


def _bad(body: dict, limits: Limits = DEFAULT_LIMITS) -> tuple[int, str, str]:
    api, publisher = make(limits=limits)
    [(status, answer)] = run_calls(api, [("POST", "/v1/engine-events", body)])
    assert publisher.events == []  # nothing invalid is written
    return status, answer["error"]["code"], answer["error"]["message"]


def with_(**fields: Any) -> dict:
    return {**CONTRACT_BODY, **fields}


@pytest.mark.parametrize(("body", "names"), [
    (with_(endpoint=""), "endpoint"),
    (with_(endpoint="a\u0001b"), "endpoint"),
    (with_(endpoint="x" * 254), "max_endpoint_chars"),
    (with_(engine=""), "engine"),
    ({"endpoint": "e", "events": []}, "engine"),
    (with_(events=[{"type": "evicted", "hashes": ["h"]}]), "events[0]"),
    (with_(events=[{"type": "stored", "items": [{"hash": "h", "size": 0, "modality": "image"}]}]),
     "events[0].items[0].size: must be from 1 to 2147483647"),
    (with_(events=[{"type": "stored", "items": [{"hash": "", "size": 1, "modality": "image"}]}]),
     "events[0].items[0].hash"),
    (with_(events=[{"type": "stored", "items": [{"hash": "h", "size": "1", "modality": "image"}]}]),
     "events[0].items[0].size"),
    (with_(events=[{"type": "removed", "hashes": [""]}]), "events[0].hashes[0]"),
    (with_(events=[{"type": "cleared", "hashes": ["h"]}]), "events[0].hashes"),
    (with_(events=[{"type": "removed", "hashes": ["h" * 257]}]),
     "events[0].hashes[0]: at most 256 characters (max_hash_chars)"),
    (with_(events=[{"type": "stored", "items": [{"hash": "h" * 257, "size": 1, "modality": "image"}]}]),
     "events[0].items[0].hash: at most 256 characters (max_hash_chars)"),
    (with_(extra=1), "extra"),
])
def test_a_bad_report_is_400_naming_the_field_and_changes_nothing(body, names):
    status, code, message = _bad(body)
    assert (status, code) == (400, "invalid_request"), message
    assert names in message


def test_the_limits_of_a_report_are_named():
    limits = Limits(max_items=2, max_references=4, max_engine_events=3)
    facts = [{"type": "cleared"}] * 4
    assert _bad(with_(events=facts), limits)[2] == "events: at most 3 events (max_engine_events)"
    two = {"type": "stored", "items": [{"hash": f"h{i}", "size": 1, "modality": "image"} for i in range(2)]}
    assert _bad(with_(events=[two, two]), limits)[2] == (
        "events[1].items: at most 2 stored items over all events (max_items)")
    assert _bad(with_(events=[{"type": "removed", "hashes": ["a", "b", "c"]}]), limits)[2] == (
        "events[0].hashes: at most 2 removed hashes over all events (max_items)")


def test_a_report_the_log_could_never_take_is_413():
    many = [{"type": "stored", "items": [{"hash": f"{i:0>250}", "size": 1, "modality": "m" * 60}]}
            for i in range(4000)]
    limits = Limits(max_engine_events=5000, max_items=5000, max_references=5000)
    status, code, _ = _bad(with_(events=many), limits)
    assert (status, code) == (413, "event_too_large")


def test_a_report_for_a_new_endpoint_past_max_total_endpoints_is_400():
    state = CacheState(Capacity.from_params(6))
    state.fold.apply(report("ns/a", stored("h")), Position(0, 0))
    api, publisher = make(state, Limits(max_total_endpoints=1))
    answers = run_calls(api, [("POST", "/v1/engine-events", with_(endpoint="ns/b")),
                              ("POST", "/v1/engine-events", with_(endpoint="ns/a"))])
    assert answers[0][0] == 400 and "max_total_endpoints" in answers[0][1]["error"]["message"]
    assert answers[1] == (202, {"events": 1})
    assert [e.endpoint for e in publisher.events] == ["ns/a"]


def match(api: HttpApi, *hashes: str, endpoints: list[str]) -> list[dict]:
    [(status, answer)] = run_calls(api, [("POST", "/v1/match", {"endpoints": endpoints,
                                                                 "body": tokenized(*hashes)})])
    assert status == 200, answer
    return answer["endpoints"]


def hits(entries: list[dict]) -> dict[str, tuple[str, list[str]]]:
    return {e["endpoint"]: (e["source"], [i["hash"] for i in e["matched_items"]]) for e in entries}


ASKED = ["ns/a", "ns/b", "ns/c", "ns/unknown"]


def test_auto_answers_reporting_endpoints_from_their_engine_views_and_the_others_from_the_estimate():
    api, _ = make(state_with_views())
    assert hits(match(api, "h1", "h2", "h3", endpoints=ASKED)) == {
        "ns/a": ("engine", ["h2", "h3"]),
        "ns/b": ("estimate", ["h1"]),
        "ns/c": ("engine", ["h1"]),
        "ns/unknown": ("estimate", []),
    }


def test_estimate_answers_every_endpoint_from_its_lru():
    api, _ = make(state_with_views(), match_source="estimate")
    assert hits(match(api, "h1", "h2", "h3", endpoints=ASKED)) == {
        "ns/a": ("estimate", ["h1", "h2"]), "ns/b": ("estimate", ["h1"]),
        "ns/c": ("estimate", []), "ns/unknown": ("estimate", [])}


def test_engine_answers_every_endpoint_from_its_view_and_one_that_never_reported_holds_nothing():
    api, _ = make(state_with_views(), match_source="engine")
    assert hits(match(api, "h1", "h2", "h3", endpoints=ASKED)) == {
        "ns/a": ("engine", ["h2", "h3"]), "ns/b": ("engine", []),
        "ns/c": ("engine", ["h1"]), "ns/unknown": ("engine", [])}
    bare, _ = make(match_source="engine")  # no view at all
    assert hits(match(bare, "h1", endpoints=["ns/x"])) == {"ns/x": ("engine", [])}


def test_without_engine_views_every_entry_is_an_estimate_and_otherwise_as_before():
    state = CacheState(Capacity.from_params(6))
    state.fold.apply(ItemsPlaced(endpoint="ns/a", items=[Item("h1", 2, "image")]), Position(0, 0))
    api, _ = make(state)
    assert match(api, "h1", endpoints=["ns/a", "ns/b"]) == [
        {"endpoint": "ns/a", "matched_items": [{"hash": "h1", "size": 2, "modality": "image"}],
         "matched_weight": 2, "total_weight": 2, "score": 1.0, "source": "estimate"},
        {"endpoint": "ns/b", "matched_items": [], "matched_weight": 0, "total_weight": 2,
         "score": 0.0, "source": "estimate"}]


def test_a_cleared_view_still_answers_engine_with_nothing():
    state = state_with_views()
    state.fold.apply(report("ns/a", EngineCleared()), Position(0, 10))
    api, _ = make(state)
    assert hits(match(api, "h1", "h2", endpoints=["ns/a"])) == {"ns/a": ("engine", [])}


@pytest.mark.parametrize("mode", ["auto", "estimate", "engine"])
def test_a_wide_match_answers_as_a_narrow_one(mode):
    """Over _ONE_GO_PAIRS the answer is built in slices: the same entries and sources."""
    state = state_with_views()
    names = [f"ns/p{i}" for i in range(300)]
    for offset, name in enumerate(names):
        if offset % 3 == 0:
            state.fold.apply(report(name, stored("h1", f"x{offset}")), Position(0, 100 + 2 * offset))
        if offset % 2 == 0:
            state.fold.apply(ItemsPlaced(endpoint=name, items=[Item("h2", 2, "image")]),
                             Position(0, 101 + 2 * offset))
    assert len(state.lrus.engine.views) == 102
    api, _ = make(state, match_source=mode)
    asked = ASKED + names
    wide = match(api, "h1", "h2", "h3", "h4", endpoints=asked)
    wide_checks = checks(api)
    one_by_one, _ = make(state, match_source=mode)
    narrow = [entry for name in asked for entry in match(one_by_one, "h1", "h2", "h3", "h4", endpoints=[name])]
    assert wide == narrow
    assert wide_checks == checks(one_by_one) and sum(wide_checks.values()) == 4 * 102  # 100 + ns/a, ns/c


def checks(api: HttpApi) -> dict[str, float]:
    [(status, text)] = run_calls(api, [("GET", "/metrics", None)])
    found = {}
    for line in text.splitlines():
        if line.startswith("mmcache_estimate_checks_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            found[outcome] = float(line.rsplit(" ", 1)[1])
    return found


def test_the_estimates_checks_count_each_reporting_endpoint_and_requested_item():
    api, _ = make(state_with_views(), match_source="estimate")  # counted whatever answers
    match(api, "h1", "h2", "h3", "h4", endpoints=ASKED)
    # ns/a: estimate {h1, h2}, view {h2, h3}; ns/c: estimate {}, view {h1}; of h1..h4
    assert checks(api) == {"true_hit": 1, "false_hit": 1, "missed_hit": 2, "true_miss": 4}


def test_the_views_bound_drops_are_counted():
    state = CacheState(Capacity.from_params(6), 2)
    state.fold.apply(report("ns/a", stored("h1", "h2", "h3", "h4")), Position(0, 0))
    api, _ = make(state)
    [(status, text)] = run_calls(api, [("GET", "/metrics", None)])
    assert "mmcache_engine_view_bound_drops_total 2.0" in text
    assert "mmcache_engine_views 1.0" in text and "mmcache_engine_view_entries 2.0" in text


def test_no_checks_are_counted_without_reporting_endpoints():
    state = CacheState(Capacity.from_params(6))
    state.fold.apply(ItemsPlaced(endpoint="ns/a", items=[Item("h1", 2, "image")]), Position(0, 0))
    api, _ = make(state)
    match(api, "h1", endpoints=["ns/a"])
    assert checks(api) == {"true_hit": 0, "false_hit": 0, "missed_hit": 0, "true_miss": 0}


def test_state_lists_the_engine_views_beside_the_endpoints():
    api, _ = make(state_with_views())
    [(status, answer)] = run_calls(api, [("GET", "/v1/state", None)])
    assert status == 200
    assert answer["engine_views"] == [{"endpoint": "ns/a", "items": 2, "weight": 4},
                                      {"endpoint": "ns/c", "items": 1, "weight": 2}]
    assert answer["total_engine_views"] == 2
    assert answer["total_endpoints"] == 2 and {e["endpoint"] for e in answer["endpoints"]} == {"ns/a", "ns/b"}


def test_match_source_comes_from_the_flag_or_the_environment(monkeypatch):
    assert Settings().match_source == "auto"
    monkeypatch.setenv("MMCACHE_MATCH_SOURCE", "ENGINE")
    assert Settings().match_source == "engine"
    with pytest.raises(ValueError, match="match_source"):
        Settings(match_source="lru")


def test_reports_need_a_write_token_as_placements_do(tmp_path):
    from stream.http.auth import TokenFile

    tokens = tmp_path / "tokens"
    tokens.write_text("a-write-token\n")
    api, publisher = make()
    api.write_tokens = TokenFile(tokens)

    async def run() -> list[int]:
        async with served(api) as client:
            statuses = []
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer a-write-token"}):
                response = await client.post("/v1/engine-events", data=orjson.dumps(CONTRACT_BODY),
                                             headers=headers)
                statuses.append(response.status)
            return statuses

    assert asyncio.run(run()) == [401, 401, 202]
    assert len(publisher.events) == 1


def test_serve_takes_match_source_as_a_flag(monkeypatch):
    from stream.cli import _parser, _settings

    monkeypatch.setenv("MMCACHE_MATCH_SOURCE", "estimate")
    assert _settings(_parser().parse_args(["serve", "--match-source", "engine"])).settings.match_source == "engine"
    assert _settings(_parser().parse_args(["serve"])).settings.match_source == "estimate"
