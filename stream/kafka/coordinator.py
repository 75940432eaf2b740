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
``generation``, ``member_id``, ``group_id``) of the pinned aiokafka release, listed in
``stream.internals``.
"""

from __future__ import annotations

import asyncio
import logging
from importlib.metadata import version
from typing import Any

import aiokafka.errors as errors
from aiokafka.protocol.group import HeartbeatRequest

from stream.internals import PINNED

__all__ = ["AIOKAFKA_VERSION", "ANSWER_S", "LostMembership", "check_version",
           "confirm_membership", "generation_of"]

AIOKAFKA_VERSION = PINNED["aiokafka"]  # stream.internals lists what this module uses of it

log = logging.getLogger(__name__)

# The coordinator's answers that mean "you are not in this generation any more".
_LOST = (errors.UnknownMemberIdError, errors.IllegalGenerationError)
# How long the coordinator's answer is waited for.
ANSWER_S = 1.0


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
    """Raise ``LostMembership`` when ``consumer`` (an ``AIOKafkaConsumer``) is no longer a
    member of ``generation``, the one its batch in flight came in: it has been reset or
    has rejoined since, or the coordinator answers at once that the generation is stale.
    Only such a definite answer stops the batch: an answer that does not come within
    ``ANSWER_S`` (the coordinator busy forming a group, which can wait for this very
    batch's revocation) or any other error lets the write go on, as it did before the
    check, so a slow or unreachable coordinator never stops or stalls a healthy worker.
    To be run on the loop the consumer runs on."""
    coordinator = consumer._coordinator
    if generation_of(consumer) != generation:
        raise LostMembership(f"the group coordinator no longer counts this worker in "
                             f"generation {generation}: it was reset or rejoined since "
                             "the batch came")
    request = HeartbeatRequest(coordinator.group_id, generation, coordinator.member_id)
    try:
        response = await asyncio.wait_for(coordinator._send_req(request), ANSWER_S)
    except (errors.KafkaError, TimeoutError) as exc:
        log.debug("ownership not confirmed (%r): the write goes on", exc)
        return
    error = errors.for_code(response.error_code)
    if error in _LOST:
        raise LostMembership(f"the group coordinator no longer counts this worker "
                             f"(generation {generation}): {error.__name__}")
