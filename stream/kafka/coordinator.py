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

__all__ = ["AIOKAFKA_VERSION", "LostMembership", "check_version", "confirm_membership",
           "generation_of"]

AIOKAFKA_VERSION = "0.14.0"

log = logging.getLogger(__name__)

# The coordinator's answers that mean "you are not in this generation any more".
_LOST = (errors.UnknownMemberIdError, errors.IllegalGenerationError)
# Still the owner: the group may be rebalancing, but until this member has been asked to
# revoke (Faust's revocation waits for the batch in flight) its partitions are its own.
_CURRENT = (errors.NoError, errors.RebalanceInProgressError)
# The coordinator moved or is not known: look it up again.
_MOVED = (errors.NotCoordinatorForGroupError, errors.GroupCoordinatorNotAvailableError)
_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)


class LostMembership(RuntimeError):
    """The coordinator no longer counts this worker in the group's current generation."""


def generation_of(consumer: Any) -> int:
    """The group generation ``consumer`` (an ``AIOKafkaConsumer``) is a member of now
    (-1 once aiokafka reset it, e.g. after its session expired)."""
    return int(consumer._coordinator.generation)


def check_version() -> None:
    """Refuse another aiokafka release than the one whose internals this module uses."""
    if version("aiokafka") != AIOKAFKA_VERSION:
        raise RuntimeError(f"stream.kafka.coordinator needs aiokafka=={AIOKAFKA_VERSION}")


async def confirm_membership(consumer: Any, generation: int) -> None:
    """Return once the coordinator confirmed that ``consumer`` (an ``AIOKafkaConsumer``)
    is still a member of ``generation``, the one its batch in flight came in; raise
    ``LostMembership`` when it has rejoined or been reset since, or the coordinator
    answers that the generation is stale. Transient trouble (the coordinator moving,
    a connection lost, the broker down) is waited out, as a changelog write waits for
    the broker, so an outage does not stop the worker; a non-retriable error is raised.
    To be run on the loop the consumer runs on."""
    coordinator = consumer._coordinator
    attempt = 0
    while True:
        if generation_of(consumer) != generation:
            raise LostMembership(f"the group coordinator no longer counts this worker in "
                                 f"generation {generation}: it was reset or rejoined since "
                                 "the batch came")
        if coordinator._closing.done():
            raise LostMembership("the consumer is closing")
        request = HeartbeatRequest(coordinator.group_id, generation, coordinator.member_id)
        try:
            await coordinator.ensure_coordinator_known()
            response = await coordinator._send_req(request)
        except errors.KafkaError as exc:
            if not exc.retriable:
                raise
        else:
            error = errors.for_code(response.error_code)
            if error in _CURRENT:
                return
            if error in _LOST:
                raise LostMembership(f"the group coordinator no longer counts this worker "
                                     f"(generation {generation}): {error.__name__}")
            if error in _MOVED:
                coordinator.coordinator_dead()
            elif not error.retriable:
                raise error()
        await asyncio.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
        attempt += 1
