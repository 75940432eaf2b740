"""The facts on the event log, one model per kind, each carrying a schema version.

Every event that touches an endpoint is keyed by that endpoint, so all of them land
in one partition in log order. ``EndpointsSynced`` is written once to every
partition, and each copy acts on the endpoints of its own partition only.
"""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from stream.core.items import Item

__all__ = [
    "EVENT_VERSION",
    "EndpointDeleted",
    "EndpointName",
    "EndpointsSynced",
    "EngineCleared",
    "EngineEvent",
    "EngineEventsReported",
    "EngineItemsRemoved",
    "EngineItemsStored",
    "Event",
    "ItemsPlaced",
    "Position",
]

EVENT_VERSION = 1

EndpointName = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=r"^[^\x00-\x1f\x7f]+$")
]


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    v: Literal[1] = EVENT_VERSION


class ItemsPlaced(_Event):
    """Request ``request_id`` with ``items`` was sent to ``endpoint``."""

    type: Literal["items_placed"] = "items_placed"
    endpoint: EndpointName
    items: list[Item] = Field(min_length=1)
    request_id: str | None = None


class EndpointDeleted(_Event):
    """The endpoint is gone; its whole LRU and its engine view are dropped."""

    type: Literal["endpoint_deleted"] = "endpoint_deleted"
    endpoint: EndpointName


class EndpointsSynced(_Event):
    """Only ``live`` endpoints exist; every other endpoint is dropped (LRU and engine view)."""

    type: Literal["endpoints_synced"] = "endpoints_synced"
    live: list[EndpointName]


class _EngineFact(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineItemsStored(_EngineFact):
    """The model server's encoder cache now holds these items (added, or stored again)."""

    type: Literal["stored"] = "stored"
    items: list[Item]


class EngineItemsRemoved(_EngineFact):
    """The model server's encoder cache no longer holds these hashes."""

    type: Literal["removed"] = "removed"
    hashes: list[Annotated[str, StringConstraints(min_length=1)]]


class EngineCleared(_EngineFact):
    """The model server's encoder cache was emptied."""

    type: Literal["cleared"] = "cleared"


EngineEvent = Annotated[
    EngineItemsStored | EngineItemsRemoved | EngineCleared, Field(discriminator="type")
]


class EngineEventsReported(_Event):
    """The model server ``endpoint`` reported changes of its own encoder cache, in order.

    They change its engine view only (``stream.core.engine``), never its estimate LRU;
    ``engine`` names the reporting engine (``vllm``) and changes nothing.
    """

    type: Literal["engine_events_reported"] = "engine_events_reported"
    endpoint: EndpointName
    engine: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    events: list[EngineEvent] = Field(min_length=1)


Event = Annotated[
    ItemsPlaced | EndpointDeleted | EndpointsSynced | EngineEventsReported,
    Field(discriminator="type"),
]


class Position(NamedTuple):
    """Where an event sits in the log; recency comes from here, never from a clock."""

    partition: int
    offset: int
