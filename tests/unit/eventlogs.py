"""Random event logs as the service writes them, for the property tests: endpoint-keyed
events in their endpoint's partition, syncs written to every partition, offsets with gaps."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

from hypothesis import strategies as st

from stream.core.cache import CacheState, Capacity
from stream.core.events import EndpointDeleted, EndpointsSynced, Event, ItemsPlaced, Position
from stream.core.items import Item

MODALITIES = ["image", "video", "audio"]

Record = tuple[Position, Event]


@dataclass
class Scenario:
    capacity: Capacity
    partitions: int
    log: list[Record]  # in the order the producer wrote it

    def by_partition(self) -> dict[int, list[Record]]:
        out: dict[int, list[Record]] = defaultdict(list)
        for record in self.log:
            out[record[0].partition].append(record)
        return out


capacities = st.one_of(
    st.builds(Capacity, st.just("items"), st.integers(1, 4)),
    st.builds(Capacity, st.just("size"), st.integers(1, 7)),
)


class EventLogs:
    """Logs over a fixed pool of endpoint names and hashes."""

    def __init__(self, endpoints: list[str], hashes: list[str]) -> None:
        self.endpoints = endpoints
        self.hashes = hashes

    def partition_of(self, endpoint: str, partitions: int) -> int:
        return self.endpoints.index(endpoint) % partitions

    def decode_op(self, code: int) -> tuple:
        """Turn one integer into an operation; 0 shrinks to the simplest placement.

        Drawing one integer per operation (instead of nested strategies) keeps generation
        cheap enough for long logs while hypothesis can still shrink every choice.
        """
        code, kind = divmod(code, 8)
        if kind < 5:
            code, endpoint = divmod(code, len(self.endpoints))
            code, count = divmod(code, 4)
            items = []
            for _ in range(count + 1):
                code, h = divmod(code, len(self.hashes))
                code, size = divmod(code, 4)
                code, modality = divmod(code, len(MODALITIES))
                items.append(Item(self.hashes[h], size + 1, MODALITIES[modality]))
            return ("place", self.endpoints[endpoint], items)
        if kind < 7:
            return ("delete", self.endpoints[code % len(self.endpoints)])
        names = self.endpoints + ["ns/elsewhere"]
        if code % 4 == 0:
            return ("sync", [])
        return ("sync", [name for bit, name in enumerate(names) if code >> (bit + 2) & 1])

    def scenarios(self, max_ops: int = 30, partitions: int | None = None) -> st.SearchStrategy[Scenario]:
        @st.composite
        def build(draw) -> Scenario:
            capacity = draw(capacities)
            count_partitions = partitions or draw(st.integers(1, 3))
            count = draw(st.integers(0, max_ops))
            ops = [self.decode_op(draw(st.integers(0, 2**36))) for _ in range(count)]
            # Offset gaps and request ids vary with one draw, keeping generation cheap.
            rng = random.Random(draw(st.integers(0, 2**16)))
            next_offset = [0] * count_partitions
            log: list[Record] = []

            def emit(partition: int, event: Event) -> None:
                offset = next_offset[partition] + rng.choice((0, 0, 0, 1, 5))
                next_offset[partition] = offset + 1
                log.append((Position(partition, offset), event))

            for op in ops:
                if op[0] == "place":
                    _, endpoint, items = op
                    event = ItemsPlaced(endpoint=endpoint, items=items, request_id=rng.choice((None, "r")))
                    emit(self.partition_of(endpoint, count_partitions), event)
                elif op[0] == "delete":
                    emit(self.partition_of(op[1], count_partitions), EndpointDeleted(endpoint=op[1]))
                else:
                    for partition in range(count_partitions):
                        emit(partition, EndpointsSynced(live=op[1]))
            return Scenario(capacity, count_partitions, log)

        return build()


def fold(capacity: Capacity, records: list[Record]) -> CacheState:
    state = CacheState(capacity)
    for position, event in records:
        state.fold.apply(event, position)
    return state


def view(state: CacheState) -> dict[str, list[tuple[str, int]]]:
    return {name: list(cache.entries.items()) for name, cache in state.lrus.endpoints.items()}


def placement_log(placements: list[tuple[str, list[Item]]], partitions: int = 2) -> list[Record]:
    """Placements as the service writes them: each in its endpoint's partition (Kafka's
    key partitioner), offsets without gaps, one request id each; in the given order."""
    from stream.core.routing import key_partition

    offsets = [0] * partitions
    log: list[Record] = []
    for n, (endpoint, items) in enumerate(placements):
        partition = key_partition(endpoint.encode(), partitions)
        log.append((Position(partition, offsets[partition]),
                    ItemsPlaced(endpoint=endpoint, items=items, request_id=f"r{n}")))
        offsets[partition] += 1
    return log
