"""Every p50/p90/p99 mmcache prints is ranked by one rule (``stream.percentiles``): a
figure of the simulator and one of the bench mean the same thing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

STREAM = Path(__file__).resolve().parents[2] / "stream"
_RANKER = re.compile(r"(percentile|quantile|^_?p\d\d$)", re.IGNORECASE)


def test_no_module_ranks_a_percentile_but_the_one_helper():
    others = sorted(f"{path.relative_to(STREAM.parent)}:{node.name}"
                    for path in STREAM.rglob("*.py") if path.name != "percentiles.py"
                    for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.FunctionDef) and _RANKER.search(node.name))
    assert others == []


def test_the_rule_is_the_nearest_rank():
    from stream.percentiles import percentile

    values = [35.0, 20.0, 15.0, 50.0, 40.0]  # sorted: 15 20 35 40 50
    assert [percentile(values, q) for q in (0.05, 0.3, 0.4, 0.5, 0.99, 1.0)] == [15, 20, 20, 35, 50, 50]
    assert percentile(list(range(1, 101)), 0.5) == 50  # 50 of 100 at or below it, not the 51st
    assert percentile(list(range(1, 101)), 0.99) == 99
    assert percentile([7.0], 0.99) == 7.0


def test_no_values_or_a_share_outside_zero_to_one_is_refused():
    from stream.percentiles import percentile

    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)
    for share in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="share"):
            percentile([1.0], share)
