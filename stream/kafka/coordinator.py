"""Asking the group coordinator whether this consumer is still a member of the generation
its batch in flight came in.

A worker frozen past its session timeout (SIGSTOP, a long GC pause, a stalled VM) loses its
partitions to another worker but does not know it until it next talks to the coordinator.
Resumed, it would finish the batch it was handling and write that batch's changelog
records after the new owner's (measured in ``tests/integration/test_zombie_owner.py``).
The embedded broker has no idempotent or transactional producer, so no broker-side fence
exists; instead the batch handler asks, right before it writes, and stops without writing
on a definite "no".

The definite answers (each held by ``tests/integration/test_membership.py`` against the
real broker), for a heartbeat naming the batch's generation and this member:

- this consumer's own client has reset its generation or rejoined since the batch came
  (``generation_of`` differs): lost, nothing asked;
- ``UnknownMemberId`` (the coordinator dropped the member: its session expired, or a
  rebalance completed without it), ``IllegalGeneration`` (not the group's generation) and
  ``FENCED_INSTANCE_ID`` (a static member replaced; mmcache sets no instance id): lost;
- no error: still a member of that generation, the write goes on;
- ``RebalanceInProgress``: the write goes on. On Kafka the coordinator answers it only
  after checking that the member and its generation are current: a rebalance is being
  prepared, and with Faust's eager assignor the partitions stay this member's until it
  rejoins, which waits for this very batch (Faust's revocation waits for it). On the
  embedded broker (Tansu 0.6) it is the answer to any generation older than the group's,
  and the group's generation moves on as soon as a worker starts to join: every healthy
  member mid-batch at that moment gets it too, so stopping on it would stop each busy
  worker at every join (and its restart, joining, the others). It cannot tell a zombie.

Any other error, or no answer within ``ANSWER_S`` (a coordinator busy forming a group,
which can wait for this very batch's revocation), lets the write go on, as it did before
the check, so a slow or unreachable coordinator never stops or stalls a healthy worker.

What the check cannot fence: a freeze that falls between the coordinator's answer and the
write reaching the broker (the check-then-write window, a few milliseconds of the batch
handler), and a member that the coordinator still counts (``RebalanceInProgress``, or a
freeze shorter than the session timeout). Such a batch lands after the new owner's
records; every reader of the changelog skips it, its applied offsets being below those
already written (``stream.state.store.ChangelogGate``), and the zombie, seeing from the offsets
its batch got that another writer came in between, asks again (``strict``: no answer is
a no) and stops without storing the batch in its files (``stream.worker.table_mirror``).

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

from stream.internals import PINNED

__all__ = ["AIOKAFKA_VERSION", "ANSWER_S", "LostMembership", "check_version",
           "confirm_membership", "generation_of", "member_of"]

AIOKAFKA_VERSION = PINNED["aiokafka"]  # stream.internals lists what this module uses of it

log = logging.getLogger(__name__)

# The coordinator's answers that mean "you are not in this generation any more" (82:
# FENCED_INSTANCE_ID, which aiokafka does not name). Not RebalanceInProgress: see above.
_LOST = {errors.UnknownMemberIdError.errno: "UnknownMemberIdError",
         errors.IllegalGenerationError.errno: "IllegalGenerationError",
         82: "FencedInstanceIdError"}
# How long the coordinator's answer is waited for.
ANSWER_S = 1.0


class LostMembership(RuntimeError):
    """The coordinator no longer counts this worker in the group's current generation."""


def generation_of(consumer: Any) -> int:
    """The group generation ``consumer`` (an ``AIOKafkaConsumer``) is a member of now
    (-1 once aiokafka reset it, e.g. after its session expired)."""
    return int(consumer._coordinator.generation)


def member_of(consumer: Any) -> tuple[str, int]:
    """The member id and generation ``consumer`` (an ``AIOKafkaConsumer``) has in its group
    now (a member id is the coordinator's, new at each join to a coordinator that lost it)."""
    coordinator = consumer._coordinator
    return str(coordinator.member_id), int(coordinator.generation)


def check_version() -> None:
    """Refuse another aiokafka release than the one whose internals this module uses."""
    if version("aiokafka") != AIOKAFKA_VERSION:
        raise RuntimeError(f"stream.kafka.coordinator needs aiokafka=={AIOKAFKA_VERSION}")


async def confirm_membership(consumer: Any, generation: int, strict: bool = False) -> None:
    """Raise ``LostMembership`` when ``consumer`` (an ``AIOKafkaConsumer``) is no longer a
    member of ``generation``, the one its batch in flight came in: it has been reset or
    has rejoined since, or the coordinator answers that the member or its generation is
    gone (the module's docstring lists the answers). Any other answer, or none within
    ``ANSWER_S``, lets the write go on, unless ``strict`` (asked when there is evidence of
    another writer already: then only a confirmation lets it go on). To be run on the
    loop the consumer runs on."""
    coordinator = consumer._coordinator
    if generation_of(consumer) != generation:
        raise LostMembership(f"the group coordinator no longer counts this worker in "
                             f"generation {generation}: it was reset or rejoined since "
                             "the batch came")
    request = HeartbeatRequest(coordinator.group_id, generation, coordinator.member_id)
    try:
        response = await asyncio.wait_for(coordinator._send_req(request), ANSWER_S)
    except (errors.KafkaError, TimeoutError) as exc:
        if strict:
            raise LostMembership(f"membership in generation {generation} not confirmed: "
                                 f"{type(exc).__name__}") from None
        log.debug("ownership not confirmed (%r): the write goes on", exc)
        return
    lost = _LOST.get(response.error_code)
    if lost is not None:
        raise LostMembership(f"the group coordinator no longer counts this worker "
                             f"(generation {generation}): {lost}")
    if strict and response.error_code != 0:
        raise LostMembership(f"membership in generation {generation} not confirmed: "
                             f"{errors.for_code(response.error_code).__name__}")
