"""The one rule that decides, for every record of the event topic, whether it is applied
to the state or skipped as a dead letter, and with which reason.

The live keeper (``stream.worker.app.StateKeeper``) and the offline ``rebuild`` both fold
records through ``fold_record``, so they skip exactly the same records and live equals
replay for any producer. A skipped record still advances its partition's applied offset,
as an applied one does.

Reasons (the ``mmcache.reason`` header of a dead letter and the label of
``mmcache_dead_letters_total``): ``not_json``, ``bad_schema``, ``unknown_version``
(``stream.core.codec``), ``wrong_key``, ``wrong_partition`` (``stream.core.routing``) and
``apply_failed`` (the fold raised).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stream.core.cache import CacheState, Effects
from stream.core.codec import MalformedEvent, decode_event
from stream.core.events import Event, Position
from stream.core.routing import misrouted

__all__ = ["REASONS", "Applied", "Reason", "Rejected", "fold_record"]

Reason = Literal["not_json", "bad_schema", "unknown_version", "wrong_key", "wrong_partition",
                 "apply_failed"]

REASONS: tuple[Reason, ...] = ("not_json", "bad_schema", "unknown_version", "wrong_key",
                               "wrong_partition", "apply_failed")


@dataclass(frozen=True, slots=True)
class Applied:
    """The record was an event and was applied; the store must write ``effects``."""

    event: Event
    effects: Effects


@dataclass(frozen=True, slots=True)
class Rejected:
    """The record was skipped; its position is applied, with no change to any LRU."""

    reason: Reason
    detail: str


def fold_record(state: CacheState, partition: int, offset: int, key: bytes | None,
                value: bytes | None, partitions: int) -> Applied | Rejected | None:
    """Fold one record read at ``(partition, offset)`` of a topic of ``partitions``
    partitions into ``state``; ``None`` if that position was applied already (a
    redelivery: nothing changes and nothing is to be written again).

    Order: redelivery, decoding, routing, then the fold. A fold that raises has applied
    the position (``Fold.apply`` advances it first); what it changed in memory
    before raising is not mirrored, so it is reported as ``apply_failed``.
    """
    position = Position(partition, offset)
    fold = state.fold
    if offset <= state.lrus.applied.get(partition, -1):
        return None
    try:
        event = decode_event(value)
    except MalformedEvent as exc:
        fold.advance(position)
        return Rejected(exc.reason, str(exc))
    wrong = misrouted(event, key, partition, partitions)
    if wrong is not None:
        fold.advance(position)
        return Rejected(wrong, f"{event.type} of endpoint {getattr(event, 'endpoint', '')!r}")
    try:
        effects = fold.apply(event, position)
    except Exception as exc:  # noqa: BLE001 - any failure of one record must not stop the log
        fold.advance(position)
        return Rejected("apply_failed", repr(exc))
    assert effects is not None  # the position was checked above
    return Applied(event, effects)
