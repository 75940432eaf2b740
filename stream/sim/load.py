"""Where affinity hurts: the fleet's capacity, and which policy wins on TTFT p90 by load.

*Capacity* is what round-robin serves when offered more than it can: the same workload
played :data:`PROBE_SPEEDUP` times faster (arrivals and the gaps between turns alike), and
the requests served over the time from the first arrival to the last first token: the
arrivals are over long before the servers are, so this is their rate of work. Round-robin
because it needs no signal, so the capacity is the fleet's, not a policy's.

The load table runs, at each share of that capacity, the policies that need no items
(``round-robin``, ``least-loaded``), and the naive (``index``) and the recommended
(``index-bounded``) index policies on both items paths: tokenizer-free (mmcache's
extraction: nothing on the routing path) and render (a render call per request, the
token producer). Each cell is the median over the seeds.

Pure and deterministic.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from stream.sim.fleet import FleetSpec, simulate
from stream.sim.workload import WorkloadSpec, generate

__all__ = ["COLUMNS", "LOADS", "PROBE_SPEEDUP", "LoadRow", "format_load_table", "load_table",
           "measure_capacity"]

LOADS = (0.2, 0.4, 0.6, 0.8, 1.0, 1.2)
PROBE_SPEEDUP = 25.0

# (column, policy, items path); "-" where the policy needs no items
COLUMNS = (("round-robin", "round-robin", "-"), ("least-loaded", "least-loaded", "-"),
           ("index", "index", "tokenizer-free"), ("index-bounded", "index-bounded", "tokenizer-free"),
           ("render index", "index", "render"), ("render bounded", "index-bounded", "render"))


def measure_capacity(spec: WorkloadSpec, fleet: FleetSpec, seed: int) -> float:
    """Requests a second round-robin serves when offered far more (see the module doc)."""
    probe = generate(replace(spec, rate=spec.rate * PROBE_SPEEDUP, think_s=spec.think_s / PROBE_SPEEDUP))
    return simulate(probe, fleet, "round-robin", seed=seed, replicas=spec.replicas).throughput


@dataclass(frozen=True, slots=True)
class LoadRow:
    """One load: the offered rate (median over seeds), and per column the TTFT p90
    medians and spreads (half the range) over the seeds."""

    load: float
    rate: float
    p90: dict[str, float] = field(default_factory=dict)
    spread: dict[str, float] = field(default_factory=dict)

    def winner(self, columns: Sequence[str]) -> str:
        """The column of the lowest TTFT p90 among ``columns``."""
        return min(columns, key=self.p90.__getitem__)

    def summary(self) -> dict[str, object]:
        """The ``--format json`` row."""
        return {"load": self.load, "rate_rps": self.rate, "ttft_p90_s": dict(self.p90),
                "spread_s": dict(self.spread),
                "winner_tokenizer_free_naive": self.winner(("round-robin", "least-loaded", "index")),
                "winner_tokenizer_free_fixed": self.winner(("round-robin", "least-loaded", "index-bounded")),
                "winner_render_naive": self.winner(("round-robin", "least-loaded", "render index")),
                "winner_render_fixed": self.winner(("round-robin", "least-loaded", "render bounded"))}


def load_table(specs: Sequence[WorkloadSpec], fleet: FleetSpec, loads: Sequence[float],
               replicas: int = 3) -> list[LoadRow]:
    """One row per load, each figure over the workloads ``specs`` (one per seed)."""
    capacities = [measure_capacity(spec, fleet, spec.seed) for spec in specs]
    rows = []
    for load in loads:
        cells: dict[str, list[float]] = {column: [] for column, _, _ in COLUMNS}
        rates = []
        for spec, capacity in zip(specs, capacities, strict=True):
            rate = load * capacity
            rates.append(rate)
            requests = generate(replace(spec, rate=rate))
            for column, policy, path in COLUMNS:
                variant = fleet if path == "-" else replace(fleet, items_path=path)
                result = simulate(requests, variant, policy, seed=spec.seed, replicas=replicas)
                cells[column].append(result.ttft_p90_s)
        rows.append(LoadRow(load, statistics.median(rates),
                            {c: statistics.median(v) for c, v in cells.items()},
                            {c: (max(v) - min(v)) / 2 for c, v in cells.items()}))
    return rows


def format_load_table(rows: Sequence[LoadRow]) -> str:
    """The terminal table: TTFT p90 per column, then the winners on each path without
    and with the fix (rr = round-robin, ll = least-loaded)."""
    several = any(row.spread.get(c, 0.0) for row in rows for c, _, _ in COLUMNS)
    width = 15 if several else 10
    short = {"round-robin": "rr", "least-loaded": "ll", "index": "index", "index-bounded": "bounded",
             "render index": "index", "render bounded": "bounded"}
    head = (f"{'load':>5}{'req/s':>8}" + "".join(f"{column:>{width}}" for column, _, _ in COLUMNS)
            + f"{'tf naive':>10}{'tf fixed':>10}{'rd naive':>10}{'rd fixed':>10}")
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = []
        for column, _, _ in COLUMNS:
            text = f"{row.p90[column]:.2f}"
            if several:
                text += f" ±{row.spread[column]:.2f}"
            cells.append(f"{text:>{width}}")
        winners = [row.winner(("round-robin", "least-loaded", fixed))
                   for fixed in ("index", "index-bounded", "render index", "render bounded")]
        lines.append(f"{row.load:>5.0%}{row.rate:>8.1f}" + "".join(cells)
                     + "".join(f"{short[w]:>10}" for w in winners))
    return "\n".join(lines)
