"""The picker rules a gateway runs on mmcache's scores: one definition for the simulator
(``stream.sim.fleet``) and the reference gateway (``stream.gateway``), so the policy the
simulator predicts is the policy the gateway runs.

A pick is over candidate servers, each with a cache score in [0, 1] (``/v1/match``'s
``score``) and a load (requests running and waiting, as scraped, plus what the gateway
routed since). The total is ``cache_weight`` x score + ``load_weight`` x the min-max
normalized load (the least loaded gets the whole ``load_weight``); the best total wins.
With a bound (``index-bounded``), only servers whose load is within
``max(least load + bound_slack, bound_factor x mean load)`` compete: the others get
``-inf``. Ties go to the first server, or to a draw from the caller's seeded generator.

Pure: no clock, no I/O; randomness only from the generator passed in.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PickRule", "least_loaded", "pick", "totals"]


@dataclass(frozen=True, slots=True)
class PickRule:
    """The weights of the scoring profile and the optional load bound (``bound_factor``
    None: no bound). Defaults: the seed profile's 4 for the cache scorer and 2 + 2 for
    the queue and KV-utilization scorers, both reading the same load."""

    cache_weight: float = 4.0
    load_weight: float = 4.0
    bound_factor: float | None = None
    bound_slack: int = 2


def _load_terms(loads: Sequence[float], weight: float) -> list[float]:
    low, high = min(loads), max(loads)
    spread = high - low
    return [weight if spread == 0 else weight * (high - load) / spread for load in loads]


def totals(rule: PickRule, scores: Sequence[float], loads: Sequence[float]) -> list[float]:
    """Each server's total under ``rule`` (``-inf`` for a server the bound excludes)."""
    if len(scores) != len(loads) or not loads:
        raise ValueError("need one score and one load per server, and at least one server")
    result = [rule.cache_weight * score + term
              for score, term in zip(scores, _load_terms(loads, rule.load_weight), strict=True)]
    if rule.bound_factor is not None:
        limit = max(min(loads) + rule.bound_slack, rule.bound_factor * sum(loads) / len(loads))
        result = [total if load <= limit else -math.inf for total, load in zip(result, loads, strict=True)]
    return result


def pick(values: Sequence[float], rng: random.Random | None) -> int:
    """The index of the best value: the first of the tied best without ``rng``, else a
    draw among them (one draw only when there is a tie)."""
    top = max(values)
    tied = [i for i, value in enumerate(values) if value >= top - 1e-12]
    return tied[0] if rng is None or len(tied) == 1 else tied[rng.randrange(len(tied))]


def least_loaded(loads: Sequence[float], rng: random.Random) -> int:
    """The least loaded server, ties at random."""
    return pick([-float(load) for load in loads], rng)
