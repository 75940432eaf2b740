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
    """The endpoint is gone; its whole LRU is dropped."""

    type: Literal["endpoint_deleted"] = "endpoint_deleted"
    endpoint: EndpointName


class EndpointsSynced(_Event):
    """Only ``live`` endpoints exist; every other endpoint is dropped."""

    type: Literal["endpoints_synced"] = "endpoints_synced"
    live: list[EndpointName]


Event = Annotated[ItemsPlaced | EndpointDeleted | EndpointsSynced, Field(discriminator="type")]


class Position(NamedTuple):
    """Where an event sits in the log; recency comes from here, never from a clock."""

    partition: int
    offset: int
