"""Measure (not a test): how long a write takes to answer 503 with the broker frozen.

    .venv/bin/python -m tests.integration.measure_frozen_write [runs] [produce_timeout_s]

Starts its own embedded broker and one `serve`, freezes the broker with SIGSTOP, times
``runs`` placements and syncs one after another, thaws it, prints the median and max.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from stream.kafka.embedded import EmbeddedBroker
from tests.integration.conftest import Service

PLACEMENT = {"endpoints": ["ns/a"], "items": [{"hash": "h1", "size": 1, "modality": "image"}]}


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    timeout = sys.argv[2] if len(sys.argv) > 2 else "2"
    with tempfile.TemporaryDirectory() as root, EmbeddedBroker() as broker:
        service = Service(broker.bootstrap_servers, Path(root) / "data", f"m-{uuid.uuid4().hex[:8]}", [],
                          {"MMCACHE_PRODUCE_TIMEOUT_S": timeout})
        pid = broker._process.pid
        try:
            service.start()
            assert service.post("/v1/placements", PLACEMENT)[0] == 202
            os.kill(pid, signal.SIGSTOP)
            times: dict[str, list[float]] = {"placement": [], "sync": []}
            for _ in range(runs):
                for kind, path, body in [("placement", "/v1/placements", PLACEMENT),
                                         ("sync", "/v1/endpoint-events", {"type": "sync", "live": ["ns/a"]})]:
                    started = time.monotonic()
                    status, _ = service.post(path, body)
                    times[kind].append(time.monotonic() - started)
                    assert status == 503, status
            for kind, values in times.items():
                print(f"{kind}: 503 after median {statistics.median(values):.3f} s, max {max(values):.3f} s "
                      f"over {runs} runs (produce_timeout_s={timeout})")
        finally:
            os.kill(pid, signal.SIGCONT)
            if service.process is not None:
                service.stop(signal.SIGKILL)


if __name__ == "__main__":
    main()
