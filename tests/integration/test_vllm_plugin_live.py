"""mmcache-vllm against a live `serve`: vLLM's own encoder cache manager (from its wheel),
driven through a seeded scheduler-like trace with evictions, reports to the service with
a write token; then /v1/match answers that endpoint from what the manager holds (its
engine view), not from the estimate the placements built, and nothing it evicted; the
estimate's checks against that view are counted, and `rebuild` gives the live digest."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest

from tests.integration.conftest import eventually
from tests.unit.vllm_scheduler import ENDPOINT, MmcacheEncoderCacheManager, Scheduler, vllm_config

pytestmark = pytest.mark.integration


def call(method: str, url: str, token: str, body: Any = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def engine_hits(service, items: list[dict[str, Any]]) -> tuple[str, dict[str, int]]:
    """(source, hash -> size of each hit) of a match of ``items`` on ``ENDPOINT``."""
    status, body = service.post("/v1/match", {
        "endpoints": [ENDPOINT],
        "body": {"tokenized": {"prompts": [{"mm_features": [
            {"hash": item["hash"], "modality": item["modality"], "offset": 0, "length": item["size"]}
            for item in items]}]}}})
    assert status == 200, body
    entry = body["endpoints"][0]
    return entry["source"], {item["hash"]: item["size"] for item in entry["matched_items"]}


def estimate_checks(service) -> dict[str, float]:
    text = service.get("/metrics")[1]
    return {outcome: float(value) for outcome, value in
            re.findall(r'^mmcache_estimate_checks_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def trace_items(scheduler: Scheduler) -> list[dict[str, Any]]:
    return [{"hash": digest, "size": size, "modality": modality} for digest, size, modality in scheduler.items]


def settled(manager: MmcacheEncoderCacheManager, scheduler: Scheduler) -> Any:
    """The counters once everything queued was sent or given up (a 503 on a busy machine
    loses a batch, which a resync makes good) and no resync is owed, else None. Ends a
    scheduling pass first: that is where a resync's snapshot is taken."""
    scheduler.idle_pass()
    counters = manager.reporter.counters()
    return counters if counters.sent + counters.unsent == counters.queued and not counters.resync_pending else None


def start(make_service, tmp_path, **settings: Any) -> tuple[Any, str, MmcacheEncoderCacheManager]:
    token = "it-vllm-" + uuid.uuid4().hex
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{token}\n")
    service = make_service(env={"MMCACHE_AUTH_TOKEN_FILE": str(tokens)})
    manager = MmcacheEncoderCacheManager.create_manager(cache_size=4000, vllm_config=vllm_config(
        url=service.url, endpoint=ENDPOINT, token_file=str(tokens), interval_s=0.05, batch_size=64, **settings))
    return service, token, manager


def test_match_answers_from_what_vllms_cache_holds(make_service, tmp_path):
    service, token, manager = start(make_service, tmp_path)
    try:
        scheduler = Scheduler(manager, seed=21)
        ever_held: set[str] = set()
        for _ in range(400):
            scheduler.step()
            ever_held |= set(manager.num_embeds_by_hash)
        expected = scheduler.holdings()
        evicted = ever_held - set(expected)
        assert scheduler.evicted > 50 and len(evicted) > 20 and len(expected) > 5

        # the gateway's estimate: the endpoint got every item of the trace
        items = trace_items(scheduler)
        assert call("POST", service.url + "/v1/placements", token,
                    {"request_id": "r-all", "endpoints": [ENDPOINT], "items": items})[0] == 202

        counters = eventually(lambda: settled(manager, scheduler), timeout=60)
        assert (counters.errors, counters.unreportable, counters.refused) == (0, 0, 0)
        assert counters.posts_ok >= 2

        source, hits = eventually(lambda: (answer := engine_hits(service, items))[1].keys() == expected.keys()
                                  and answer, timeout=60)
        assert source == "engine"
        assert hits == {digest: size for digest, (size, _) in expected.items()}
        assert not evicted & hits.keys()

        status, state = call("GET", service.url + "/v1/state", token)
        assert status == 200, state
        view = next(v for v in state["engine_views"] if v["endpoint"] == ENDPOINT)
        assert view == {"endpoint": ENDPOINT, "items": len(expected),
                        "weight": sum(size for size, _ in expected.values())}

        # one more match, checked item by item: the estimate (every trace item placed, within
        # its default 1,024 items) against the view the plugin filled
        assert len(items) <= 1024
        before = estimate_checks(service)
        engine_hits(service, items)
        after = estimate_checks(service)
        delta = {outcome: after.get(outcome, 0) - before.get(outcome, 0)
                 for outcome in ("true_hit", "false_hit", "missed_hit", "true_miss")}
        assert delta == {"true_hit": len(expected), "false_hit": len(items) - len(expected),
                         "missed_hit": 0, "true_miss": 0}

        # the log replayed offline gives the live state, engine view included
        live = call("GET", service.url + "/v1/state?limit=0", token)[1]["digest"]
        done = subprocess.run([sys.executable, "-m", "stream.cli", "rebuild", "--bootstrap-servers",
                               service.bootstrap, "--data-dir", str(tmp_path / "rebuilt"), "--app-id",
                               service.app_id], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1] == live
        assert token not in service.tail()
    finally:
        manager.reporter.stop(5)


def test_a_service_back_from_a_stop_gets_the_view_by_resync(make_service, tmp_path):
    """While the service is down the plugin drops and counts; once it answers again the
    resync (cleared, then everything held) makes its view exact again."""
    service, _, manager = start(make_service, tmp_path, max_backoff_s=0.2)
    try:
        scheduler = Scheduler(manager, seed=22)
        for _ in range(150):
            scheduler.step()
        eventually(lambda: settled(manager, scheduler), timeout=60)
        before = scheduler.holdings()
        service.stop()
        for _ in range(250):  # the engine goes on: evictions and new entries mmcache misses
            scheduler.step()
        def failed() -> bool:
            scheduler.step()
            return manager.reporter.counters().posts_failed >= 1

        eventually(failed, timeout=60)
        expected = scheduler.holdings()
        assert expected.keys() != before.keys()
        service.start()  # same data dir and port: it recovers the view it had
        items = trace_items(scheduler)

        def exact() -> Any:
            scheduler.idle_pass()
            source, hits = engine_hits(service, items)
            counters = manager.reporter.counters()
            return (source == "engine" and hits.keys() == expected.keys() and counters.resyncs >= 1
                    and not counters.resync_pending and counters)

        counters = eventually(exact, timeout=90)
        assert counters.dropped > 0 and counters.errors == 0
        assert not (before.keys() - expected.keys()) & engine_hits(service, items)[1].keys()
    finally:
        manager.reporter.stop(5)
