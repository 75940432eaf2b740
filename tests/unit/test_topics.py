"""How the topics mmcache creates are replicated (``choose_durability``)."""

from __future__ import annotations

import pytest

from stream.kafka.topics import Durability, choose_durability


@pytest.mark.parametrize(("brokers", "expected"), [(1, (1, 1)), (2, (1, 1)), (3, (3, 2)),
                                                   (5, (3, 2)), (12, (3, 2))])
def test_defaults_are_3_and_2_with_three_brokers_else_1_and_1(brokers, expected):
    assert choose_durability(brokers) == Durability(*expected)


@pytest.mark.parametrize(("rf", "isr"), [(1, 1), (2, 1), (3, 2), (5, 2)])
def test_a_replication_factor_alone_gets_one_less_in_sync_replica_at_most_2(rf, isr):
    assert choose_durability(5, rf) == Durability(rf, isr)


def test_both_settings_are_taken_as_given():
    assert choose_durability(5, 5, 4) == Durability(5, 4)
    assert choose_durability(1, None, 1) == Durability(1, 1)
    assert choose_durability(3, None, 3) == Durability(3, 3)


def test_a_replication_factor_over_the_brokers_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="MMCACHE_REPLICATION_FACTOR=3 needs at least 3 brokers"):
        choose_durability(1, 3)


def test_more_in_sync_replicas_than_replicas_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="MMCACHE_MIN_INSYNC_REPLICAS=2"):
        choose_durability(1, None, 2)


def test_topic_config_adds_min_insync_replicas():
    assert Durability(3, 2).topic_config({"cleanup.policy": "compact"}) == {
        "cleanup.policy": "compact", "min.insync.replicas": "2"}
