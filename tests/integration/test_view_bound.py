"""The engine view bound is a bound of the fold, as the capacity is: `serve` records it in
the data dir it builds and refuses that dir under another bound, with one message naming
both values, rather than folding the rest of the log with a different bound."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_a_data_dir_built_under_one_view_bound_is_refused_under_another(make_service):
    service = make_service(env={"MMCACHE_ENGINE_VIEW_MAX_ENTRIES": "16"})
    assert service.stop() == 0

    service.env = {"MMCACHE_ENGINE_VIEW_MAX_ENTRIES": "32"}
    service.start(wait_ready=False)
    assert service.process is not None
    code = service.process.wait(120)
    service.process = None
    assert code != 0
    assert "engine_view_max_entries 16 here, 32 given" in service.tail()

    service.env = {"MMCACHE_ENGINE_VIEW_MAX_ENTRIES": "16"}
    service.start()  # the bound it was built under: accepted
    assert service.get("/readyz")[0] == 200
