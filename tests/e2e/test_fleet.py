"""A real fleet, short: two vLLM servers with the plugin, `mmcache serve` and the
reference gateway on the fleet bench's seeded trace (repeated and fresh images, with and
without uuids, multi-turn conversations), round-robin against index-bounded
(``tests/e2e/fleet.py``; the bench runs the same with 150 requests and the plain index).

What the data supports, and only that: routing on mmcache's index saves encoder and
processor work over round-robin on a trace with repeats, every request is answered, and
the estimate the gateway routed on agrees with what the engines reported.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from stream.bench.fleet_trace import FleetTrace
from tests.e2e.fleet import run_real

REQUESTS = 60


def test_index_bounded_saves_encoder_work_over_round_robin_and_its_estimate_agrees(tmp_path: Path) -> None:
    doc = asyncio.run(run_real(FleetTrace(requests=REQUESTS), ["round-robin", "index-bounded"], tmp_path))
    trace, real = doc["trace"], doc["real"]
    assert trace["requests"] == REQUESTS
    assert trace["distinct_items"] < trace["items"]  # the trace repeats images
    for policy in ("round-robin", "index-bounded"):
        assert real[policy]["failed"] == 0
        assert real[policy]["requests"] == REQUESTS
        assert real[policy]["resyncs"] == 0  # no report lost: the encoder misses are allocations only
    round_robin, bounded = real["round-robin"], real["index-bounded"]
    # the same items, fewer encodings: the index sends an image back where it was encoded.
    # Each distinct image is encoded at least once; the repeats encoded again are what a
    # policy loses. On this trace the simulator has round-robin encode 11 repeats again and
    # index-bounded 2 (least-loaded, blind to items: 11); the claim is at most half.
    assert bounded["encoder"]["lookups"] == round_robin["encoder"]["lookups"] == trace["items"]
    again = {policy: real[policy]["encoder"]["misses"] - trace["distinct_items"] for policy in real}
    assert 2 * again["index-bounded"] <= again["round-robin"], again
    assert bounded["layers"]["processor"] > round_robin["layers"]["processor"]
    # the closed loop: the engines reported (checks were counted), and the estimate the
    # gateway routed on named what they held
    assert bounded["checks"].get("true_hit", 0) > 0
    assert bounded["precision"] >= 0.9
    assert bounded["recall"] >= 0.9
    assert bounded["match_failures"] == 0
    assert round_robin["precision"] is None  # round-robin never asks mmcache
