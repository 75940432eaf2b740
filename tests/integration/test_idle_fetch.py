"""An idle `serve` on its embedded default costs nothing: its consumers (the worker's, the
kept log's journal) send no fetch request while nothing is written, and a write it takes
is still in its view at once, long before the idle poll would have found it
(stream.kafka.fetch_gate). Counts and an ordering, not wall-clock bounds."""

from __future__ import annotations

import subprocess
import time

import pytest

from stream.kafka.embedded import free_port
from tests.integration.conftest import eventually, http
from tests.integration.test_docs_live import documented_metrics
from tests.integration.test_process_safety import cli, env, placement, reap, tansu_child  # noqa: F401

pytestmark = pytest.mark.integration

# --idle-poll-s: far beyond this test's waits, so what ends an idle consumer's wait here is
# this process's own write, or the test fails
POLL_S = 600
WINDOW_S = 3.0  # the window fetch requests are counted over (not a wait for a condition)
# Fetches one idle window may see: the last few of each consumer after the write before it
# (seen 1-2; room for a slow machine that spreads them into the window). Without the gate
# the consumers send ~180 a second (the broker answers an idle 10 ms fetch after ~5 ms):
# 515-546 a window were seen.
IDLE_FETCHES = 20


def fetches(url: str) -> float:
    status, text = http("GET", url + "/metrics")
    assert status == 200
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("mmcache_log_fetch_requests_total ")]
    assert values, "no mmcache_log_fetch_requests_total on the embedded default"
    return values[0]


def idle_fetches(url: str) -> float:
    before = fetches(url)
    time.sleep(WINDOW_S)  # the window counted over
    return fetches(url) - before


def test_an_idle_serve_sends_no_fetches_and_its_own_writes_are_seen_at_once(tmp_path, reap):  # noqa: F811
    log = open(tmp_path / "serve.log", "ab")  # noqa: SIM115
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(cli("serve", "--port", str(port), "--data-dir", str(tmp_path / "data"),
                                   "--idle-poll-s", str(POLL_S)),
                               stdout=log, stderr=subprocess.STDOUT, env=env())
    try:
        def ready() -> bool:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                return http("GET", url + "/readyz")[0] == 200
            except OSError:
                return False

        eventually(ready, timeout=120, interval=0.1)
        reap.append(tansu_child(process.pid))
        _, text = http("GET", url + "/metrics")
        embedded_only = documented_metrics(embedded_only=True)
        assert "mmcache_log_fetch_requests_total" in embedded_only
        assert all(f"# TYPE {name} " in text for name in embedded_only), text[-2000:]
        assert http("POST", url + "/v1/placements", placement(0, "ns/warm"))[0] == 202
        counted = [idle_fetches(url)]
        for i in range(1, 4):
            endpoint, query = f"ns/pod-{i}", {"endpoints": [f"ns/pod-{i}"], "body": {
                "generate": {"features": {"mm_hashes": {"image": [f"h-{i}"]}}}}}
            assert http("POST", url + "/v1/placements", placement(i, endpoint))[0] == 202
            # in the view before the idle poll could have fetched it: the write woke the worker
            eventually(lambda q=query: http("POST", url + "/v1/match", q)[1]["endpoints"][0]["score"] == 1.0,
                       timeout=30, interval=0.01)
            counted.append(idle_fetches(url))
        print(f"fetch requests in each idle window of {WINDOW_S} s: {counted}")
        assert max(counted) <= IDLE_FETCHES, counted
    finally:
        log.close()
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
