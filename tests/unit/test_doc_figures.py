"""Every measured figure README.md and docs/ quote comes from bench/results.json: marked
figures are written from it (``make docs``) and fail here when they differ; a current figure
copied by hand, outside a mark, fails here too."""

from __future__ import annotations

import re

import orjson
import pytest

from stream.bench.doc_figures import (
    ROOT,
    FigureError,
    default_pages,
    load_results,
    render_page,
    stale_pages,
)

RESULTS = ROOT / "bench" / "results.json"
#: pages that keep earlier rounds' measurements, each with its date and command: history,
#: not the current figures (which they point to)
HISTORY = {"docs/performance.md"}


def test_every_page_shows_the_figures_of_bench_results():
    stale = stale_pages(default_pages(), load_results(RESULTS))
    assert not stale, f"run `make docs`: {[str(p.relative_to(ROOT)) for p in stale]} differ from {RESULTS.name}"


def test_a_figure_changed_in_the_results_makes_the_pages_quoting_it_stale(tmp_path):
    results = orjson.loads(RESULTS.read_bytes())
    for row in results["figures"]:
        if row["name"] == "freshness_p99":
            row["value"] = 11.5
    changed = tmp_path / "results.json"
    changed.write_bytes(orjson.dumps(results))
    stale = {p.relative_to(ROOT).as_posix() for p in stale_pages(default_pages(), load_results(changed))}
    assert {"README.md", "docs/gateway.md"} <= stale


def test_marks_are_written_from_the_results():
    results = load_results(RESULTS)
    page = ("p99 <!-- figure freshness_p99 -->1 ms<!-- /figure --> (control "
            "<!-- figure match_latency_p99_at_half_peak.control -->0<!-- /figure -->)\n"
            "<!-- figures table: disk_per_entry -->\nold\n<!-- /figures table -->\n")
    rendered = render_page(page, results)
    by_name = results["by_name"]
    assert f"-->{by_name['freshness_p99']['value']:,} ms<!--" in rendered
    assert f"-->{by_name['match_latency_p99_at_half_peak']['control']:,}<!--" in rendered
    assert f"| disk_per_entry | {by_name['disk_per_entry']['value']:,} B |" in rendered and "old" not in rendered


@pytest.mark.parametrize("mark", ["<!-- figure no_such_figure -->1<!-- /figure -->",
                                  "<!-- figure disk_per_entry.control -->1<!-- /figure -->",
                                  "<!-- figure disk_per_entry.colour -->1<!-- /figure -->"])
def test_a_mark_naming_no_figure_or_field_is_refused(mark):
    with pytest.raises(FigureError):
        render_page(mark, load_results(RESULTS))


def test_a_quick_run_is_never_quoted(tmp_path):
    quick = tmp_path / "quick.json"
    quick.write_bytes(orjson.dumps({"date": "d", "quick": True, "figures": []}))
    with pytest.raises(FigureError):
        load_results(quick)


def _unmarked(text: str) -> str:
    text = re.sub(r"<!-- figure [a-z0-9_.]+ -->.*?<!-- /figure -->", "", text, flags=re.S)
    return re.sub(r"<!-- figures table: .*?<!-- /figures table -->", "", text, flags=re.S)


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in default_pages()])
def test_no_page_copies_a_current_figure_by_hand(page):
    """A figure of the results written out by hand (its value and unit as the results give
    them, outside a mark) is how figures drifted: it must be a mark."""
    if page in HISTORY:
        pytest.skip("a history page: earlier rounds' figures, each with its date")
    text = _unmarked((ROOT / page).read_text())
    copied = []
    for row in load_results(RESULTS)["figures"]:
        value = f"{row['value']:,}"
        if row["unit"] and len(value.replace(",", "").replace(".", "")) >= 3:
            if re.search(rf"(?<![\d.,]){re.escape(value)} ?{re.escape(row['unit'])}", text):
                copied.append(f"{value} {row['unit']} ({row['name']})")
    assert not copied, f"{page}: mark these with <!-- figure NAME -->: {copied}"


def test_results_md_is_the_table_of_results_json(tmp_path):
    """The two committed files are one run's: results.md is what results.json renders."""
    from stream.bench.run import write_results

    results = orjson.loads(RESULTS.read_bytes())
    rows = results.pop("figures")
    out = tmp_path / "results.json"
    write_results(out, rows, results, [], "unused")
    assert out.with_suffix(".md").read_text() == RESULTS.with_suffix(".md").read_text()
