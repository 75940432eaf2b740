"""The picker rules (stream.core.picking) that the simulator and the reference gateway
share: the weighted total, the load bound of index-bounded, and the tie-break."""

from __future__ import annotations

import math
import random

import pytest

from stream.core.picking import PickRule, least_loaded, pick, totals

PROFILE = PickRule(cache_weight=4.0, load_weight=2.0)
BOUNDED = PickRule(cache_weight=4.0, load_weight=2.0, bound_factor=1.25, bound_slack=2)


def test_total_is_weighted_score_plus_normalized_load() -> None:
    # loads 0, 5, 10: the least loaded gets the whole load weight, the most loaded none
    assert totals(PROFILE, [0.0, 0.5, 1.0], [0, 5, 10]) == [2.0, 3.0, 4.0]


def test_equal_loads_give_every_server_the_load_weight() -> None:
    assert totals(PROFILE, [0.0, 1.0], [3, 3]) == [2.0, 6.0]


def test_affinity_wins_over_a_busier_server_without_the_bound() -> None:
    # server 0 holds every item but has 3 requests more: 4 x 1 + 0 beats 0 + 2
    assert pick(totals(PROFILE, [1.0, 0.0], [3, 0]), None) == 0


def test_the_bound_takes_a_server_hotter_than_the_limit_out_of_the_contest() -> None:
    # limit = max(0 + 2, 1.25 x 1.5) = 2: server 0 (load 3) is excluded
    scored = totals(BOUNDED, [1.0, 0.0], [3, 0])
    assert scored[0] == -math.inf
    assert pick(scored, None) == 1


def test_the_bound_keeps_a_server_within_the_limit() -> None:
    # limit = max(0 + 2, 1.25 x 1) = 2: server 0 (load 2) still competes and wins on its cache
    assert pick(totals(BOUNDED, [1.0, 0.0], [2, 0]), None) == 0


def test_ties_go_to_the_first_without_a_generator_and_spread_with_one() -> None:
    tied = [1.0, 3.0, 3.0, 3.0]
    assert pick(tied, None) == 1
    drawn = {pick(tied, random.Random(seed)) for seed in range(50)}
    assert drawn == {1, 2, 3}


def test_least_loaded_breaks_ties_at_random() -> None:
    assert least_loaded([4, 1, 2], random.Random(1)) == 1
    assert {least_loaded([1, 1, 5], random.Random(seed)) for seed in range(50)} == {0, 1}


def test_a_score_per_load_is_required() -> None:
    with pytest.raises(ValueError, match="one score and one load per server"):
        totals(PROFILE, [1.0], [0, 0])
