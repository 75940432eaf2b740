"""The one place where events become bytes and bytes become events."""

from __future__ import annotations

import orjson
from pydantic import TypeAdapter, ValidationError

from stream.core.events import Event

__all__ = ["MalformedEvent", "decode_event", "encode_event"]

# The adapter's compiled validator, called directly: the adapter's own wrapper costs
# ~0.5 us per record, a tenth of a replayed event.
_VALIDATE_JSON = TypeAdapter(Event).validator.validate_json


class MalformedEvent(ValueError):
    """A record on the log is not a valid event of a known version."""


def encode_event(event: Event) -> bytes:
    """Serialize an event for the log (orjson, version field included)."""
    return orjson.dumps(event.model_dump(exclude_none=True))


def decode_event(raw: bytes | None) -> Event:
    """Parse and validate one record value; raise ``MalformedEvent`` if it is not an event."""
    if raw is None:
        raise MalformedEvent("empty record")
    try:
        return _VALIDATE_JSON(raw)  # type: ignore[no-any-return]
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "record"
        raise MalformedEvent(f"{where}: {first['msg']}") from None
