"""Kafka's default partitioner and the rule that an endpoint's events sit in its key's
partition, keyed by it (``stream.core.routing``)."""

from __future__ import annotations

import pytest
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.partitioner import murmur2 as aiokafka_murmur2
from hypothesis import given
from hypothesis import strategies as st

from stream.core.events import EndpointDeleted, EndpointsSynced, ItemsPlaced
from stream.core.items import Item
from stream.core.routing import key_partition, misrouted, murmur2


@given(st.binary(max_size=300))
def test_murmur2_is_the_java_clients_hash(data):
    assert murmur2(data) & 0x7FFFFFFF == aiokafka_murmur2(data) & 0x7FFFFFFF
    assert 0 <= murmur2(data) < 2**32


@pytest.mark.parametrize(("key", "partitions"), [
    (b"", 8), (b"a", 8), (b"ab", 3), (b"abc", 5), (b"abcd", 8), (b"default/pod-a", 8),
    ("ns/π-pod".encode(), 12), (b"x" * 253, 7),
])
def test_key_partition_is_aiokafkas_default_partitioner(key, partitions):
    every = list(range(partitions))
    assert key_partition(key, partitions) == DefaultPartitioner()(key, every, every)


@given(st.text(min_size=1, max_size=40), st.integers(1, 64))
def test_key_partition_agrees_with_the_producer_for_any_endpoint(name, partitions):
    key, every = name.encode(), list(range(partitions))
    assert key_partition(key, partitions) == DefaultPartitioner()(key, every, every)


PLACED = ItemsPlaced(endpoint="default/pod-a", items=[Item("h", 1, "image")])
DELETED = EndpointDeleted(endpoint="default/pod-a")
HOME = key_partition(b"default/pod-a", 8)


@pytest.mark.parametrize("event", [PLACED, DELETED], ids=lambda e: e.type)
def test_an_endpoint_keyed_event_in_its_keys_partition_is_in_place(event):
    assert misrouted(event, b"default/pod-a", HOME, 8) is None


@pytest.mark.parametrize("event", [PLACED, DELETED], ids=lambda e: e.type)
@pytest.mark.parametrize("key", [None, b"", b"default/pod-b", b"default/pod-a ", b"DEFAULT/POD-A"])
def test_an_endpoint_keyed_event_with_another_key_is_wrong_key(event, key):
    assert misrouted(event, key, HOME, 8) == "wrong_key"


@pytest.mark.parametrize("event", [PLACED, DELETED], ids=lambda e: e.type)
def test_an_endpoint_keyed_event_in_another_partition_is_wrong_partition(event):
    for partition in set(range(8)) - {HOME}:
        assert misrouted(event, b"default/pod-a", partition, 8) == "wrong_partition"


@pytest.mark.parametrize("key", [None, b"anything", b"default/pod-a"])
def test_a_sync_is_in_place_on_every_partition_whatever_its_key(key):
    sync = EndpointsSynced(live=["default/pod-a"])
    assert all(misrouted(sync, key, p, 8) is None for p in range(8))
