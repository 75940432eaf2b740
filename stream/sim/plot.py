"""The tuning plot, written as SVG by hand: no plotting library to install.

Two panels, items mode and size mode, hit ratio against capacity on a log-2 axis; the
false-hit rate dashed when the true cache size was given; the recommendation circled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from stream.sim.tune import Recommendation, TuneRow

__all__ = ["tune_svg"]

_W, _H = 420, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 16, 34, 52


def tune_svg(rows: Sequence[TuneRow], recommendation: Recommendation, title: str) -> str:
    """The whole SVG document."""
    panels = [(mode, [r for r in rows if r.capacity.mode == mode]) for mode in ("items", "size")]
    panels = [(mode, sorted(group, key=lambda r: r.capacity.per_endpoint))
              for mode, group in panels if group]
    width = _W * len(panels)
    height = _H + 60
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">{escape(title)}</text>']
    for index, (mode, group) in enumerate(panels):
        parts.append(_panel(index * _W, 20, mode, group, recommendation))
    legend_y = _H + 30
    parts.append(f'<line x1="20" y1="{legend_y}" x2="44" y2="{legend_y}" stroke="#1f5fa8" stroke-width="2"/>'
                 f'<text x="48" y="{legend_y + 4}">hit ratio (index)</text>')
    if any(r.false_hits is not None for r in rows):
        parts.append(f'<line x1="170" y1="{legend_y}" x2="194" y2="{legend_y}" stroke="#c0392b" '
                     f'stroke-width="2" stroke-dasharray="5,3"/>'
                     f'<text x="198" y="{legend_y + 4}">false-hit rate (vs true cache)</text>')
    parts.append(f'<circle cx="32" cy="{legend_y + 20}" r="5" fill="none" stroke="#27ae60" '
                 f'stroke-width="2"/><text x="48" y="{legend_y + 24}">recommended: '
                 f'{escape(_label(recommendation.row))}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _panel(x0: float, y0: float, mode: str, group: Sequence[TuneRow], rec: Recommendation) -> str:
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    logs = [math.log2(r.capacity.per_endpoint) for r in group]
    low, high = min(logs), max(logs)
    span = high - low or 1.0

    def px(row: TuneRow) -> float:
        return x0 + _LEFT + (math.log2(row.capacity.per_endpoint) - low) / span * plot_w

    def py(value: float) -> float:
        return y0 + _TOP + (1.0 - value) * plot_h

    unit = "items per endpoint" if mode == "items" else "embeddings per endpoint"
    out = [f'<text x="{x0 + _LEFT + plot_w / 2}" y="{y0 + 22}" text-anchor="middle">{mode} mode</text>',
           f'<rect x="{x0 + _LEFT}" y="{y0 + _TOP}" width="{plot_w}" height="{plot_h}" fill="none" '
           f'stroke="#888"/>']
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = py(tick)
        out.append(f'<line x1="{x0 + _LEFT - 4}" y1="{y}" x2="{x0 + _LEFT + plot_w}" y2="{y}" '
                   f'stroke="#eee"/><text x="{x0 + _LEFT - 6}" y="{y + 4}" text-anchor="end">'
                   f'{tick:.0%}</text>')
    step = max(1, len(group) // 7)
    for row in group[::step]:
        x = px(row)
        out.append(f'<line x1="{x}" y1="{py(0)}" x2="{x}" y2="{py(0) + 4}" stroke="#888"/>'
                   f'<text x="{x}" y="{py(0) + 16}" text-anchor="middle">'
                   f'{_short(row.capacity.per_endpoint)}</text>')
    out.append(f'<text x="{x0 + _LEFT + plot_w / 2}" y="{py(0) + 34}" text-anchor="middle">'
               f'capacity ({unit}, log scale)</text>')
    hits = " ".join(f"{px(r):.1f},{py(r.hit_ratio):.1f}" for r in group)
    out.append(f'<polyline points="{hits}" fill="none" stroke="#1f5fa8" stroke-width="2"/>')
    out.extend(f'<circle cx="{px(r):.1f}" cy="{py(r.hit_ratio):.1f}" r="2.5" fill="#1f5fa8"/>'
               for r in group)
    if all(r.false_hit_rate is not None for r in group):
        false = " ".join(f"{px(r):.1f},{py(r.false_hit_rate or 0.0):.1f}" for r in group)
        out.append(f'<polyline points="{false}" fill="none" stroke="#c0392b" stroke-width="2" '
                   f'stroke-dasharray="5,3"/>')
    if rec.row in group:
        out.append(f'<circle cx="{px(rec.row):.1f}" cy="{py(rec.row.hit_ratio):.1f}" r="7" '
                   f'fill="none" stroke="#27ae60" stroke-width="2"/>')
    return "\n".join(out)


def _short(n: int) -> str:
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}Ki"
    return str(n)


def _label(row: TuneRow) -> str:
    unit = "items" if row.capacity.mode == "items" else "embeddings"
    return f"{row.capacity.per_endpoint:,} {unit} ({row.hit_ratio:.1%} hits)"
