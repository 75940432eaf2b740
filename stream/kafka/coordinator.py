"""Asking the group coordinator whether this consumer still owns its partitions.

A worker frozen past its session timeout (SIGSTOP, a long GC pause, a stalled VM) loses its
partitions to another worker but does not know it until it next talks to the coordinator.
Resumed, it would finish the batch it was handling and write that batch's changelog
records after the new owner's: the applied offset in the changelog went backwards and
every follower of the partition diverged from a replay of the log (measured in
``tests/integration/test_zombie_owner.py``). The embedded broker has no idempotent or
transactional producer, so no broker-side fence exists; instead the batch handler asks
the coordinator, right before it writes, whether its generation is still current, and
stops without writing when it is not.

This reaches into aiokafka's group coordinator (``_coordinator``, ``_send_req``,
``generation``, ``member_id``, ``group_id``) of the pinned aiokafka release.
"""

from __future__ import annotations

import asyncio
import logging
from importlib.metadata import version
from typing import Any

import aiokafka.errors as errors
from aiokafka.protocol.group import HeartbeatRequest

__all__ = ["AIOKAFKA_VERSION", "LostMembership", "confirm_membership", "generation_of"]

AIOKAFKA_VERSION = "0.14.0"

log = logging.getLogger(__name__)

# The coordinator's answers that mean "you are not in this generation any more".
_LOST = (errors.UnknownMemberIdError, errors.IllegalGenerationError)
# Still the owner: the group may be rebalancing, but until this member has been asked to
# revoke (Faust's revocation waits for the batch in flight) its partitions are its own.
_CURRENT = (errors.NoError, errors.RebalanceInProgressError)
_ATTEMPTS = 3
_RETRY_S = 0.5


class LostMembership(RuntimeError):
    """The coordinator no longer counts this worker in the group's current generation."""


def generation_of(consumer: Any) -> int:
    """The group generation ``consumer`` (an ``AIOKafkaConsumer``) is a member of now."""
    if version("aiokafka") != AIOKAFKA_VERSION:
        raise RuntimeError(f"stream.kafka.coordinator needs aiokafka=={AIOKAFKA_VERSION}")
    return int(consumer._coordinator.generation)


async def confirm_membership(consumer: Any, generation: int) -> None:
    """Return once the coordinator confirmed that ``consumer`` (an ``AIOKafkaConsumer``)
    is still a member of ``generation``, the one its batch in flight was fetched in;
    raise ``LostMembership`` when it has rejoined since or the coordinator answered that
    the generation is stale, and the last error when the coordinator could not be asked
    ``_ATTEMPTS`` times (to be run on the loop the consumer runs on)."""
    coordinator = consumer._coordinator
    last: Exception | None = None
    for attempt in range(_ATTEMPTS):
        if generation_of(consumer) != generation:
            raise LostMembership(f"the group coordinator no longer counts this worker in "
                                 f"generation {generation}: it rejoined since the batch "
                                 "was fetched")
        request = HeartbeatRequest(coordinator.group_id, generation, coordinator.member_id)
        try:
            response = await coordinator._send_req(request)
        except errors.KafkaError as exc:
            last = exc
        else:
            error = errors.for_code(response.error_code)
            if error in _CURRENT:
                return
            if error in _LOST:
                raise LostMembership(f"the group coordinator no longer counts this worker "
                                     f"(generation {generation}): {error.__name__}")
            last = error()
        if attempt + 1 < _ATTEMPTS:
            await asyncio.sleep(_RETRY_S)
    assert last is not None
    raise last
