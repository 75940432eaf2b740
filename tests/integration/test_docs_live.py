"""docs/metrics.md against a real serve's /metrics (issue 10, items 1 and 7): every
documented mmcache metric is exported, and every exported one is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.conftest import eventually, http

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_documented_metrics_are_the_exported_ones(service):
    # the embedded default's own metrics are exported only by a serve on its own broker
    # (tests/integration/test_log_compaction.py); this service uses the session's broker
    rows = re.findall(r"^\| `((?:mmcache|encoder_cache)_[a-z_]+)`(.*)$", DOCS.read_text(), re.M)
    documented = {name for name, rest in rows if "embedded default only" not in rest}
    def exported() -> set[str] | None:
        status, text = http("GET", service.url + "/metrics")
        types = re.findall(r"^# TYPE ((?:mmcache|encoder_cache)_[a-z_]+) (\w+)$", text, re.M)
        # counters' TYPE lines carry _total; their _created gauges are not metrics of ours
        ours = {name for name, _ in types if not name.endswith("_created")}
        return ours if ours >= documented else None

    ours = eventually(exported, timeout=20, interval=0.5)
    assert ours == documented
    _, text = http("GET", service.url + "/metrics")
    assert "process_resident_memory_bytes" in text and "process_open_fds" in text
    assert "mmcache_ready 1.0" in text
