"""Topic settings, in one place (see README, "Retention and rebuild").

The event topic is the source of truth that ``mmcache rebuild`` replays: it keeps
every event (no time or size limit) unless an operator sets a limit, in which case
a rebuild can only reach back as far as the oldest event kept. The changelog topic
of the state table (created by Faust) is compacted, so it holds one record per live
LRU entry plus one applied-offset record per partition, and a worker whose data dir
is wiped restores from it.
"""

from __future__ import annotations

import logging

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

__all__ = ["EVENTS_TOPIC_CONFIG", "ensure_events_topic"]

EVENTS_TOPIC_CONFIG = {
    "cleanup.policy": "delete",
    "retention.ms": "-1",
    "retention.bytes": "-1",
}

log = logging.getLogger(__name__)


async def ensure_events_topic(
    bootstrap_servers: str, name: str, partitions: int, replication_factor: int = 1
) -> int:
    """Create the event topic if it is missing; return its actual partition count."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        topic = NewTopic(name, partitions, replication_factor, topic_configs=EVENTS_TOPIC_CONFIG)
        try:
            await admin.create_topics([topic])
            log.info("created event topic %s with %d partitions", name, partitions)
        except TopicAlreadyExistsError:
            pass
        described = await admin.describe_topics([name])
        actual = len(described[0]["partitions"])
    finally:
        await admin.close()
    if actual != partitions:
        log.warning("event topic %s has %d partitions (configured %d); using %d",
                    name, actual, partitions, actual)
    return actual
