"""The bench reads like a report (issue 10, item 9): --quick never overwrites the committed
full results, and the table explains each column, unit and what NO means."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson

from stream.bench.figures import Figure, render_table

ROOT = Path(__file__).resolve().parents[2]


def test_quick_refuses_to_overwrite_a_full_run_through_the_real_command(tmp_path):
    out = tmp_path / "results.json"
    full = orjson.dumps({"quick": False, "figures": [{"name": "kept"}]})
    out.write_bytes(full)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMCACHE_")}
    result = subprocess.run([sys.executable, "-m", "stream.cli", "bench", "--quick", "--only", "match",
                             "--out", str(out)], capture_output=True, text=True, timeout=60, env=env,
                            cwd=ROOT)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("--quick would overwrite the full results")
    assert "Traceback" not in result.stderr
    assert out.read_bytes() == full


def test_quick_goes_to_its_own_file_by_default():
    from stream.cli import _parser

    args = _parser().parse_args(["bench", "--quick"])
    assert args.out is None  # _bench then writes bench/quick.json
    assert "bench/quick.json" in " ".join(
        subprocess.run([sys.executable, "-m", "stream.cli", "bench", "--help"], capture_output=True,
                       text=True, cwd=ROOT).stdout.split())


def test_the_table_says_what_each_figure_means_its_unit_and_what_no_means():
    table = render_table([Figure("match_p99", 120.0, "us", "< 1000 us", False, control=100.0,
                                 ratio=1.2, note="match latency, 99th percentile")])
    assert "| match_p99 | 120.0 us | 100.0 us | 1.2 | < 1000 us | NO | match latency, 99th percentile |" in table
    assert "`NO` when it does not" in table and "in its unit" in table
