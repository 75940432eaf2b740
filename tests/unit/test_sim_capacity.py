"""The capacity derived from the servers' encoder cache size (stream.core.capacity)."""

from __future__ import annotations

import pytest

from stream.core.cache import Capacity
from stream.core.capacity import capacity_for_encoder_cache


def test_known_sizes_give_size_mode_of_the_encoder_cache():
    assert capacity_for_encoder_cache(8192) == Capacity("size", 8192)


def test_unknown_sizes_give_items_mode_of_the_cache_over_the_mean_item():
    assert capacity_for_encoder_cache(8192, 1450) == Capacity("items", 5)
    assert capacity_for_encoder_cache(2048, 256) == Capacity("items", 8)
    assert capacity_for_encoder_cache(100, 5000) == Capacity("items", 1)


@pytest.mark.parametrize("args", [(0,), (-1, 10.0), (8192, 0.0), (8192, -3.0)])
def test_nonsense_is_refused(args):
    with pytest.raises(ValueError):
        capacity_for_encoder_cache(*args)
