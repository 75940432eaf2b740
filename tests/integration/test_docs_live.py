"""docs/metrics.md against a real serve's /metrics (issue 10, items 1 and 7): every
documented mmcache metric is exported, and every exported one is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.conftest import eventually, http

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented_metrics(embedded_only: bool = False) -> set[str]:
    """The metrics docs/metrics.md lists: all of them, or those it says are exported only on
    the embedded default (tests/integration/test_idle_fetch.py holds those to a real one)."""
    rows = re.findall(r"^\| `((?:mmcache|encoder_cache)_[a-z_]+)` \|[^|]*\|[^|]*\| (.*)$", DOCS.read_text(), re.M)
    return {name for name, meaning in rows
            if not embedded_only or meaning.startswith("only on the embedded default")}


def test_documented_metrics_are_the_exported_ones(service):
    """The fixture's serve uses the test broker (--bootstrap-servers): not the embedded default."""
    documented = documented_metrics() - documented_metrics(embedded_only=True)
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
