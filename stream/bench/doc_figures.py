"""The figures of ``bench/results.json`` written into README.md and docs/*.md.

The docs never carry a measured figure copied by hand: they mark where one goes, and this
module writes it there from the results file (``make docs``; ``make bench`` runs it after the
bench). ``tests/unit/test_doc_figures.py`` fails when a marked figure differs from the file,
so a figure can only drift by being left unmarked. The marks, invisible once rendered:

- ``<!-- figure NAME -->9,942 req/s<!-- /figure -->``: a figure's value and unit;
  ``NAME.value``, ``NAME.control``, ``NAME.ratio``, ``NAME.target``, ``NAME.pass``,
  ``NAME.note`` one field (the note has the runs' spread and what was counted);
  ``date`` the full run's day, ``date.SCENARIO`` the day that scenario was last run (a
  partial run, ``mmcache bench --only SCENARIO``, updates its own figures only), ``updated``
  the scenarios run again since the full run, with their days.
- ``<!-- figures table: NAME NAME ... -->`` then a generated table of those figures, up to
  ``<!-- /figures table -->``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import orjson

__all__ = ["ROOT", "FigureError", "default_pages", "load_results", "render_page", "stale_pages",
           "write_pages"]

ROOT = Path(__file__).resolve().parents[2]

_INLINE = re.compile(r"<!-- figure ([a-z0-9_.]+) -->(.*?)<!-- /figure -->", re.S)
_TABLE = re.compile(r"(<!-- figures table: ([a-z0-9_ ]+) -->\n)(.*?)(<!-- /figures table -->)", re.S)
_FIELDS = ("value", "control", "ratio", "target", "pass", "note")


class FigureError(ValueError):
    """A mark names a figure or field the results file does not have."""


def load_results(path: Path) -> dict[str, Any]:
    """The results file, with its figures by name."""
    results = orjson.loads(path.read_bytes())
    if results.get("quick") is not False:
        raise FigureError(f"{path} is not a full run's results: the docs quote full runs only")
    return {**results, "by_name": {row["name"]: row for row in results["figures"]}}


def _number(value: float) -> str:
    return f"{value:,}"


def _with_unit(row: dict[str, Any]) -> str:
    return f"{_number(row['value'])} {row['unit']}".rstrip()


def _figure(results: dict[str, Any], key: str) -> str:
    if key == "date" or key.startswith("date."):
        scenario = key.partition(".")[2]
        stamp = results.get("updated", {}).get(scenario, results["date"]) if scenario else results["date"]
        return str(stamp)[:10]
    if key == "updated":
        days = sorted(results.get("updated", {}).items())
        return ", ".join(f"{scenario} on {stamp[:10]}" for scenario, stamp in days) or "none"
    name, _, field = key.partition(".")
    row = results["by_name"].get(name)
    if row is None:
        raise FigureError(f"no figure {name!r} in the results")
    if not field:
        return _with_unit(row)
    if field not in _FIELDS or (field in ("control", "ratio") and row.get(field) is None):
        raise FigureError(f"figure {name!r} has no {field!r}")
    if field == "pass":
        return "yes" if row["pass"] else "NO"
    return row[field] if field in ("target", "note") else _number(row[field])


def _table(results: dict[str, Any], names: list[str]) -> str:
    lines = ["| figure | value | control | ratio | target | pass |", "|---|---|---|---|---|---|"]
    for name in names:
        cells = [_figure(results, name)]
        for field in ("control", "ratio"):
            cells.append(_figure(results, f"{name}.{field}") if results["by_name"].get(name, {}).get(field)
                         is not None else "")
        cells += [_figure(results, f"{name}.target"), _figure(results, f"{name}.pass")]
        lines.append(f"| {name} | " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def render_page(text: str, results: dict[str, Any]) -> str:
    """``text`` with every marked figure and table written from ``results``."""
    text = _INLINE.sub(lambda m: f"<!-- figure {m[1]} -->{_figure(results, m[1])}<!-- /figure -->", text)
    return _TABLE.sub(lambda m: m[1] + _table(results, m[2].split()) + m[4], text)


def default_pages(root: Path = ROOT) -> list[Path]:
    """The pages users read: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def stale_pages(pages: list[Path], results: dict[str, Any]) -> list[Path]:
    """The pages whose marked figures differ from ``results``."""
    return [page for page in pages if render_page(page.read_text(), results) != page.read_text()]


def write_pages(pages: list[Path], results: dict[str, Any]) -> list[Path]:
    """Write the figures into ``pages``; the pages that changed."""
    changed = stale_pages(pages, results)
    for page in changed:
        page.write_text(render_page(page.read_text(), results))
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stream.bench.doc_figures",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results.json")
    parser.add_argument("--check", action="store_true", help="only say which pages differ; exit 1 if any")
    args = parser.parse_args(argv)
    try:
        results = load_results(args.results)
        pages = default_pages()
        changed = stale_pages(pages, results) if args.check else write_pages(pages, results)
    except FigureError as exc:
        print(f"doc figures: {exc}", file=sys.stderr)
        return 2
    for page in changed:
        print(f"{'stale' if args.check else 'written'}: {page.relative_to(ROOT)}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
