"""Topic settings, in one place (see README, "Retention and rebuild").

The event topic is the source of truth that ``mmcache rebuild`` replays: it keeps
every event (no time or size limit) unless an operator sets a limit, in which case
a rebuild can only reach back as far as the oldest event kept. The changelog topic
of the state table is compacted, so it holds one record per live LRU entry plus one
applied-offset record per partition, and a worker whose data dir is wiped restores
from it.
"""

from __future__ import annotations

import logging

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

__all__ = ["CHANGELOG_TOPIC_CONFIG", "EVENTS_TOPIC_CONFIG", "ensure_topic"]

EVENTS_TOPIC_CONFIG = {
    "cleanup.policy": "delete",
    "retention.ms": "-1",
    "retention.bytes": "-1",
}

CHANGELOG_TOPIC_CONFIG = {
    "cleanup.policy": "compact",
}

log = logging.getLogger(__name__)


async def ensure_topic(
    bootstrap_servers: str,
    name: str,
    partitions: int,
    config: dict[str, str],
    replication_factor: int = 1,
) -> int:
    """Create a topic if it is missing; return its actual partition count."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        topic = NewTopic(name, partitions, replication_factor, topic_configs=config)
        try:
            await admin.create_topics([topic])
            log.info("created topic %s with %d partitions", name, partitions)
        except TopicAlreadyExistsError:
            pass
        described = await admin.describe_topics([name])
        actual = len(described[0]["partitions"])
    finally:
        await admin.close()
    if actual != partitions:
        log.warning("topic %s has %d partitions (configured %d); using %d",
                    name, actual, partitions, actual)
    return actual
