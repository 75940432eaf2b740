"""Write the language-neutral JSON Schemas of every event and HTTP body to ``schemas/``,
plus one example file per event type and the OpenAPI document of a deployment whose
writes need a token, from the pydantic models (the one source).

Run ``make schemas``; a unit test fails when the committed files drift from the models.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson
from pydantic import TypeAdapter

from stream.core.codec import encode_event
from stream.core.events import (
    EndpointDeleted,
    EndpointsSynced,
    EngineCleared,
    EngineEventsReported,
    EngineItemsRemoved,
    EngineItemsStored,
    Event,
    ItemsPlaced,
)
from stream.core.items import Item
from stream.http import models as api_models
from stream.http.openapi import build_document

__all__ = ["EXAMPLES", "render", "write"]

SCHEMAS: dict[str, Any] = {
    "event.schema.json": Event,
    "match-request.schema.json": api_models.MatchRequest,
    "match-response.schema.json": api_models.MatchResponse,
    "placement-request.schema.json": api_models.PlacementRequest,
    "endpoint-event-request.schema.json": api_models.EndpointEventRequest,
    "engine-events-request.schema.json": api_models.EngineEventsRequest,
    "events-accepted.schema.json": api_models.EventsAccepted,
    "state-response.schema.json": api_models.StateResponse,
    "error.schema.json": api_models.ErrorBody,
}

EXAMPLES = {
    "examples/items_placed.json": ItemsPlaced(
        endpoint="default/pod-a",
        request_id="r-1",
        items=[Item("9f2b5c0e1d7a4b3c8e6f0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f", 1, "image")],
    ),
    "examples/endpoint_deleted.json": EndpointDeleted(endpoint="default/pod-a"),
    "examples/endpoints_synced.json": EndpointsSynced(live=["default/pod-a", "default/pod-b"]),
    "examples/engine_events_reported.json": EngineEventsReported(
        endpoint="default/pod-a",
        engine="vllm",
        events=[
            EngineItemsStored(items=[Item("9f2b5c0e1d7a4b3c8e6f0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f",
                                          1450, "image")]),
            EngineItemsRemoved(hashes=["0c1d2e3f405162738495a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e7f8091"]),
            EngineCleared(),
        ],
    ),
}


def render() -> dict[str, bytes]:
    """Every file's content, keyed by its path under ``schemas/``."""
    files = {
        name: orjson.dumps(
            {"$schema": "https://json-schema.org/draft/2020-12/schema",
             "$id": name, **TypeAdapter(model).json_schema()},
            option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS,
        ) + b"\n"
        for name, model in SCHEMAS.items()
    }
    files["openapi.json"] = orjson.dumps(
        build_document(writes_need_token=True, match_needs_token=False),
        option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS,
    ) + b"\n"
    for name, event in EXAMPLES.items():
        files[name] = orjson.dumps(orjson.loads(encode_event(event)), option=orjson.OPT_INDENT_2) + b"\n"
    return files


def write(root: Path) -> None:
    """Write every file under ``root``."""
    for name, content in render().items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("schemas"))
