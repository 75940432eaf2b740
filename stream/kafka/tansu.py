"""Client-side remedies for the embedded Tansu broker, applied only when it is the peer.

Measured deviations from Kafka and what is done here about them:

1. ListOffsets(LATEST) answers the newest batch's base offset + 1, too low when that
   batch holds several records, which breaks Faust's recovery. The end offsets are
   taken from a Fetch response's high watermark instead.
2. An idle fetch is not woken when data arrives; it returns after about half its
   max wait. Consumers' fetch wait is capped so that events reach the state fast. On
   `serve`'s own broker that cap would poll all day: there ``stream.kafka.fetch_gate``
   holds a repeated empty fetch until one of the process's writes is acknowledged.
3. A group whose members leave (LeaveGroup) while it is forming, its leader among them,
   can keep that leader's id: every member that joins afterwards waits for a leader that
   never syncs, with no end (seen as two fenced and restarted workers given no partitions
   for minutes; reproduced in 10 of 12 tries, ``tests/integration/test_tansu_group_leave.py``).
   Members that stop do not leave: each expires after its session timeout (2 s on the
   embedded broker), and the group forms again without them.
4. A fetch's per-partition limit (``max_partition_fetch_bytes``) is not applied: a
   partition's answer carries up to about the request's ``fetch_max_bytes`` plus one
   record batch (measured: 6 MiB a partition under aiokafka's default of 50 MiB). A
   consumer keeps one answer per assigned partition until it is read, so a consumer that
   lags held about 6 MiB per partition (serve has three: Faust's, the kept log's
   journal, the follower). ``fetch_max_bytes`` is capped to ``FETCH_BYTES`` for every
   consumer left at aiokafka's defaults (all of serve's): one holds at most about
   partitions x (``FETCH_BYTES`` + one batch, <= 1 MiB) of fetched records, and reads
   about as fast (measured: 48 MiB over 8 partitions in 0.79 s, 0.71 s uncapped). The bulk
   readers that read everything once and end (``rebuild``, the replay bench) ask for
   sizes of their own and keep them.

Group timing is not a deviation to patch but a setting: see ``stream.worker.app``.
Nothing here runs against a real Kafka: ``is_tansu`` recognises the broker by its
cluster id (``cluster_id``, also what a data dir records) before anything is patched.
The aiokafka internals used (``Fetcher.end_offsets`` and
``GroupCoordinator._maybe_leave_group`` replaced, the fetcher's and the client's private
names, the protocol requests) are listed in ``stream.internals``.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import aiokafka.client
from aiokafka import AIOKafkaClient
from aiokafka.consumer.fetcher import Fetcher
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.structs import TopicPartition

from stream.config import KafkaSecurity
from stream.kafka.fetcher import cap_fetcher_setting

__all__ = ["FETCH_BYTES", "FETCH_WAIT_MS", "apply_remedies", "cluster_id", "is_tansu", "is_tansu_id",
           "refuse_topic_creation_by_metadata"]

FETCH_WAIT_MS = 10
#: At most this much asked for in one fetch (remedy 4); a batch bigger than it still comes
#: whole, alone.
FETCH_BYTES = 256 * 1024

log = logging.getLogger(__name__)
_applied = False


async def cluster_id(bootstrap_servers: str, security: KafkaSecurity | None = None) -> str:
    """The cluster id from the broker's Metadata response ('' if it reports none)."""
    from stream.kafka.clients import client_options  # imports Faust: only when asked

    options = client_options(security) if security is not None else {}
    client = AIOKafkaClient(bootstrap_servers=bootstrap_servers, **options)
    try:
        await client.bootstrap()
        node_id = client.get_random_node()
        response = await client.send(node_id, MetadataRequest([]))
        found = getattr(response, "cluster_id", None) or ""
    finally:
        await client.close()
    return str(found)


def is_tansu_id(cluster: str) -> bool:
    """Whether a cluster id is Tansu's (every embedded broker's id contains 'tansu')."""
    return "tansu" in cluster.lower()


async def is_tansu(bootstrap_servers: str, security: KafkaSecurity | None = None) -> bool:
    """Ask the cluster for its id; Tansu's ids contain 'tansu'."""
    return is_tansu_id(await cluster_id(bootstrap_servers, security))


async def _end_offsets_from_fetch(
    self: Fetcher, partitions: list[TopicPartition], timeout_ms: int
) -> dict[TopicPartition, int]:
    """End offsets as the high watermarks of a one-byte fetch of each partition."""
    async with asyncio.timeout(timeout_ms / 1000 if timeout_ms else None):
        while True:
            await self._client._maybe_wait_metadata()
            by_node: dict[int, dict[str, list[tuple[int, int, int]]]] = collections.defaultdict(
                lambda: collections.defaultdict(list)
            )
            missing = False
            for tp in partitions:
                node_id = self._client.cluster.leader_for_partition(tp)
                if node_id is None or node_id == -1:
                    self._client.add_topic(tp.topic)
                    missing = True
                else:
                    by_node[node_id][tp.topic].append((tp.partition, 0, 1))
            if missing:
                await self._client.force_metadata_update()
                continue
            offsets: dict[TopicPartition, int] = {}
            for node_id, topics in by_node.items():
                request = FetchRequest(1, 0, 1, self._isolation_level, list(topics.items()))
                response = await self._client.send(node_id, request)
                for topic, parts in response.topics:
                    for partition, _error, highwater, *_rest in parts:
                        if highwater >= 0:
                            offsets[TopicPartition(topic, partition)] = highwater
            if len(offsets) == len(set(partitions)):
                return offsets
            await asyncio.sleep(self._retry_backoff)


async def _expire_instead_of_leaving(self: GroupCoordinator) -> None:
    """What aiokafka does where it would leave the group, less the LeaveGroup request:
    the member forgets its generation and the broker expires it (remedy 3)."""
    if self.generation > 0:
        log.debug("not leaving group %s (Tansu): member %s expires after its session timeout",
                  self.group_id, self.member_id)
    self.reset_generation()


class _MetadataRequestNoCreation(MetadataRequest):
    """aiokafka's metadata request, asking the broker not to create a missing topic."""

    def __init__(self, topics: list[str] | None = None,
                 allow_auto_topic_creation: bool | None = False) -> None:
        super().__init__(topics, allow_auto_topic_creation)


def refuse_topic_creation_by_metadata() -> None:
    """Make every aiokafka client of this process ask metadata without creating missing
    topics (Tansu honours the flag; aiokafka sets it on every request). `serve`'s own
    broker is started again under running clients (``stream.kafka.rebase``): a client that
    reached it before its topics were made would have them created with Tansu's default
    4 partitions. mmcache creates every topic it uses itself (``stream.kafka.topics``)."""
    aiokafka.client.MetadataRequest = _MetadataRequestNoCreation  # type: ignore[misc]


def apply_remedies() -> None:
    """Patch aiokafka in this process for Tansu; idempotent."""
    global _applied
    if _applied:
        return
    cap_fetcher_setting("fetch_max_wait_ms", 500, FETCH_WAIT_MS)
    cap_fetcher_setting("fetch_max_bytes", 52_428_800, FETCH_BYTES, only_default=True)
    cap_fetcher_setting("max_partition_fetch_bytes", 1_048_576, FETCH_BYTES, only_default=True)
    Fetcher.end_offsets = _end_offsets_from_fetch  # type: ignore[method-assign]
    GroupCoordinator._maybe_leave_group = _expire_instead_of_leaving  # type: ignore[method-assign]
    _applied = True
    log.info("embedded Tansu broker detected: end offsets from fetch, fetch wait %d ms, "
             "fetches of %d KiB, stopping members expire instead of leaving the group",
             FETCH_WAIT_MS, FETCH_BYTES // 1024)
