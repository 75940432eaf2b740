"""``confirm_membership`` (stream.kafka.coordinator) against the real broker: for each
definite answer of the group coordinator, whether the batch in flight is stopped
(``LostMembership``) or written.

A member here is made with the group protocol's own requests (JoinGroup, SyncGroup,
LeaveGroup) on a client of its own, so that no consumer's heartbeat or rejoin moves it
meanwhile; ``confirm_membership`` asks through that client exactly what it asks through a
worker's consumer (its coordinator's ``group_id``, ``generation``, ``member_id`` and
``_send_req``). The answers differ by broker where Kafka and Tansu do (noted on each).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaClient, AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import for_code
from aiokafka.protocol.group import HeartbeatRequest, JoinGroupRequest, LeaveGroupRequest, SyncGroupRequest

from stream.kafka.coordinator import ANSWER_S, LostMembership, confirm_membership, generation_of
from stream.kafka.embedded import EmbeddedBroker

pytestmark = pytest.mark.integration

# Kafka refuses sessions under group.min.session.timeout.ms (6 s by default); Tansu answers
# a join after about half the session timeout, so a short one keeps these tests quick
SESSION_MS = 6000 if os.environ.get("MMCACHE_BOOTSTRAP_SERVERS") else 2000
MEMBER_ID_REQUIRED = 79  # KIP-394: the first JoinGroup names the member id to join with


class Member:
    """One member of a consumer group, speaking the group protocol itself."""

    def __init__(self, bootstrap: str, group: str) -> None:
        self.client = AIOKafkaClient(bootstrap_servers=bootstrap)
        self.group = group
        self.node = -1
        self.member_id = ""
        self.generation = -1

    async def start(self) -> Member:
        await self.client.bootstrap()
        self.node = await self.client.coordinator_lookup(0, self.group)
        return self

    async def close(self) -> None:
        await self.client.close()

    async def send(self, request: Any) -> Any:
        return await self.client.send(self.node, request)

    async def join(self) -> Member:
        """Join (returns once the coordinator formed the generation) and sync."""
        for _ in range(2):
            response = await self.send(JoinGroupRequest(
                self.group, SESSION_MS, 20000, self.member_id, None, "consumer", [("range", b"")]))
            self.member_id = response.member_id
            if response.error_code != MEMBER_ID_REQUIRED:
                break
        assert response.error_code == 0, for_code(response.error_code)
        self.generation = response.generation_id
        assignments = [(m[0], b"") for m in response.members] if response.leader_id == self.member_id else []
        await self.send(SyncGroupRequest(self.group, self.generation, self.member_id, None, assignments))
        return self

    async def heartbeat(self, generation: int | None = None) -> str:
        """The coordinator's answer to a heartbeat of this member (its error's name)."""
        response = await self.send(HeartbeatRequest(
            self.group, self.generation if generation is None else generation, self.member_id))
        return for_code(response.error_code).__name__

    def as_consumer(self, generation: int | None = None, member_id: str | None = None) -> Any:
        """What ``confirm_membership`` reads of a consumer: its group coordinator."""
        coordinator = type("Coordinator", (), {})()
        coordinator.group_id = self.group
        coordinator.generation = self.generation if generation is None else generation
        coordinator.member_id = self.member_id if member_id is None else member_id
        coordinator._send_req = self.send
        consumer = type("Consumer", (), {})()
        consumer._coordinator = coordinator
        return consumer


def run(body: Callable[[str], Awaitable[None]], bootstrap: str) -> None:
    asyncio.run(asyncio.wait_for(body(f"membership-{uuid.uuid4().hex[:10]}"), 60))


async def lost(consumer: Any, generation: int) -> str | None:
    """The reason ``confirm_membership`` stops the batch for, or None (written)."""
    try:
        await confirm_membership(consumer, generation)
    except LostMembership as exc:
        return str(exc)
    return None


def test_a_current_member_writes_its_batch(bootstrap):
    async def body(group: str) -> None:
        member = await Member(bootstrap, group).start()
        try:
            await member.join()
            assert await member.heartbeat() == "NoError"
            assert await lost(member.as_consumer(), member.generation) is None
        finally:
            await member.close()

    run(body, bootstrap)


def test_a_member_the_coordinator_no_longer_has_stops(bootstrap):
    """UnknownMemberId: the member left (or was dropped: its session expired, or a
    rebalance completed without it)."""
    async def body(group: str) -> None:
        member = await Member(bootstrap, group).start()
        other = await Member(bootstrap, group).start()
        try:
            await member.join()
            generation = member.generation
            response = await member.send(LeaveGroupRequest(group, member.member_id))
            assert response.error_code == 0
            # asked through another member's connection: the coordinator answers for the id
            consumer = other.as_consumer(generation, member.member_id)
            assert await member.heartbeat() == "UnknownMemberIdError"
            reason = await lost(consumer, generation)
            assert reason is not None and "UnknownMemberIdError" in reason, reason
            never = await lost(other.as_consumer(generation, f"never-{uuid.uuid4().hex}"), generation)
            assert never is not None and "UnknownMemberIdError" in never, never
        finally:
            await member.close()
            await other.close()

    run(body, bootstrap)


def test_a_generation_that_is_not_the_groups_stops(bootstrap):
    """IllegalGeneration: on Kafka for any generation but the group's; on Tansu for one
    newer than the group's (an older one gets RebalanceInProgress there: below)."""
    async def body(group: str) -> None:
        member = await Member(bootstrap, group).start()
        try:
            await member.join()
            newer = member.generation + 1
            assert await member.heartbeat(newer) == "IllegalGenerationError"
            reason = await lost(member.as_consumer(newer), newer)
            assert reason is not None and "IllegalGenerationError" in reason, reason
        finally:
            await member.close()

    run(body, bootstrap)


def test_a_consumer_that_rejoined_since_the_batch_came_stops_without_asking(bootstrap):
    """The consumer's own client moved to another generation (a rebalance it took part in,
    or a reset after its session expired): the batch's generation is gone."""
    async def body(group: str) -> None:
        topic = f"{group}-events"
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic(topic, 2, 1)])
        await admin.close()

        def consumer() -> AIOKafkaConsumer:
            return AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group,
                                    session_timeout_ms=SESSION_MS, heartbeat_interval_ms=300,
                                    enable_auto_commit=False)

        first, second = consumer(), consumer()
        await first.start()
        try:
            while not first.assignment():
                await first.getmany(timeout_ms=100)
            generation = generation_of(first)
            assert await lost(first, generation) is None
            await second.start()
            deadline = time.monotonic() + 40
            while generation_of(first) == generation or not second.assignment():
                assert time.monotonic() < deadline, "the second consumer's join did not complete"
                await asyncio.gather(first.getmany(timeout_ms=100), second.getmany(timeout_ms=100))
            reason = await lost(first, generation)
            assert reason is not None and "rejoined" in reason, reason
            assert await lost(first, generation_of(first)) is None  # its new generation: current
        finally:
            await first.stop()
            await second.stop()

    run(body, bootstrap)


def test_a_rebalance_under_way_lets_the_batch_be_written(bootstrap):
    """RebalanceInProgress while another member joins. On Kafka the member and its
    generation are current (checked first) and its partitions stay its own until it
    rejoins; on Tansu the group's generation moved on when the join began, and every
    member mid-batch gets this answer: neither is taken as lost."""
    async def body(group: str) -> None:
        member = await Member(bootstrap, group).start()
        joining = await Member(bootstrap, group).start()
        try:
            await member.join()
            join = asyncio.ensure_future(joining.join())  # answered once the group is formed
            deadline = time.monotonic() + 20
            while (answer := await member.heartbeat()) != "RebalanceInProgressError":
                assert answer == "NoError" and not join.done(), answer
                assert time.monotonic() < deadline, "the join never put the group in a rebalance"
                await asyncio.sleep(0.01)  # paces the heartbeats while the join begins
            assert await lost(member.as_consumer(), member.generation) is None
            join.cancel()
        finally:
            await member.close()
            await joining.close()

    run(body, bootstrap)


def test_no_answer_in_time_lets_the_batch_be_written(tmp_path):
    """A coordinator that does not answer within ANSWER_S (frozen here) never stops or
    stalls a healthy worker: the write goes on after ANSWER_S."""
    async def body(group: str, broker: EmbeddedBroker) -> None:
        member = await Member(broker.bootstrap_servers, group).start()
        try:
            await member.join()
            broker.freeze()
            try:
                # the loop's own clock, which the wait runs on: libuv's is read once a
                # turn, so time.monotonic() taken later in that turn saw 0.99990 s elapse
                clock = asyncio.get_running_loop().time
                started = clock()
                assert await lost(member.as_consumer(), member.generation) is None
                took = clock() - started
                # asked strictly (another writer seen already), no answer is a no
                with pytest.raises(LostMembership, match="not confirmed"):
                    await confirm_membership(member.as_consumer(), member.generation, strict=True)
            finally:
                broker.thaw()
            # the frozen coordinator never answers: returning at all is the wait giving up; the
            # upper bound tells ANSWER_S from the client's request timeout (40 s), with room for
            # a busy machine
            assert ANSWER_S <= took < ANSWER_S + 15, took
        finally:
            await member.close()

    with EmbeddedBroker(log_file=tmp_path / "tansu.log") as broker:
        asyncio.run(asyncio.wait_for(body(f"membership-{uuid.uuid4().hex[:10]}", broker), 60))
