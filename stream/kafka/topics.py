"""Topic settings and creation, in one place (see README, "Retention and rebuild").

The event topic is the source of truth that ``mmcache rebuild`` replays: it keeps
every event (no time or size limit) unless an operator sets a limit, in which case
a rebuild can only reach back as far as the oldest event kept. The changelog topic
of the state table is compacted, so it holds one record per live LRU entry plus one
applied-offset record per partition, and a worker whose data dir is wiped restores
from it. The dead-letter topic keeps, like the event topic, every record it is given.

Durability: on a cluster of at least 3 brokers every topic mmcache creates is
replicated 3 times with ``min.insync.replicas`` 2 (an acknowledged write survives the
loss of any one broker, and writes go on while one is down); on a smaller cluster (the
embedded broker) 1 and 1. ``MMCACHE_REPLICATION_FACTOR`` and
``MMCACHE_MIN_INSYNC_REPLICAS`` override the choice. Topics that exist are left as they
are.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import NamedTuple

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from stream.config import KafkaSecurity, Settings
from stream.kafka.clients import client_options

__all__ = [
    "CHANGELOG_TOPIC_CONFIG",
    "DEAD_LETTER_TOPIC_CONFIG",
    "EVENTS_TOPIC_CONFIG",
    "TABLE_NAME",
    "Durability",
    "changelog_topic",
    "choose_durability",
    "cluster_durability",
    "ensure_dead_letter_topic",
    "ensure_topic",
    "ensure_topics",
]

#: The Faust table of the per-endpoint state: its changelog topic and its RocksDB files
#: in the data dir are named after it.
TABLE_NAME = "lru"

EVENTS_TOPIC_CONFIG = {
    "cleanup.policy": "delete",
    "retention.ms": "-1",
    "retention.bytes": "-1",
}

CHANGELOG_TOPIC_CONFIG = {
    "cleanup.policy": "compact",
}

DEAD_LETTER_TOPIC_CONFIG = dict(EVENTS_TOPIC_CONFIG)

log = logging.getLogger(__name__)


class Durability(NamedTuple):
    """How the topics mmcache creates are replicated."""

    replication_factor: int
    min_insync_replicas: int

    def topic_config(self, config: dict[str, str]) -> dict[str, str]:
        """``config`` with this ``min.insync.replicas``."""
        return {**config, "min.insync.replicas": str(self.min_insync_replicas)}


def choose_durability(brokers: int, replication_factor: int | None = None,
                      min_insync_replicas: int | None = None) -> Durability:
    """The replication of new topics on a cluster of ``brokers`` brokers.

    Defaults: 3 and 2 with at least 3 brokers, else 1 and 1. A replication factor given
    alone gets ``min.insync.replicas`` of one less (at least 1, at most 2). A setting the
    cluster cannot honour is refused here, naming it, instead of failing every write.
    """
    if replication_factor is None:
        replication_factor = 3 if brokers >= 3 else 1
        if min_insync_replicas is None:
            min_insync_replicas = 2 if brokers >= 3 else 1
    if min_insync_replicas is None:
        min_insync_replicas = max(1, min(2, replication_factor - 1))
    if replication_factor > brokers:
        raise ValueError(f"MMCACHE_REPLICATION_FACTOR={replication_factor} needs at least "
                         f"{replication_factor} brokers; the cluster has {brokers}")
    if min_insync_replicas > replication_factor:
        raise ValueError(f"MMCACHE_MIN_INSYNC_REPLICAS={min_insync_replicas} is more than the "
                         f"replication factor {replication_factor}: no write could succeed")
    return Durability(replication_factor, min_insync_replicas)


def changelog_topic(app_id: str) -> str:
    """The state table's changelog, as Faust names it."""
    return f"{app_id}-{TABLE_NAME}-changelog"


@asynccontextmanager
async def _admin(bootstrap_servers: str, security: KafkaSecurity | None) -> AsyncIterator[
        AIOKafkaAdminClient]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers,
                                **client_options(security or KafkaSecurity()))
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


async def _brokers(admin: AIOKafkaAdminClient) -> int:
    return len((await admin.describe_cluster())["brokers"])


async def cluster_durability(bootstrap_servers: str, settings: Settings) -> Durability:
    """``choose_durability`` for the cluster at ``bootstrap_servers``."""
    async with _admin(bootstrap_servers, settings.kafka) as admin:
        brokers = await _brokers(admin)
    return choose_durability(brokers, settings.replication_factor, settings.min_insync_replicas)


async def _create(admin: AIOKafkaAdminClient, name: str, partitions: int, config: dict[str, str],
                  replication_factor: int) -> int:
    topic = NewTopic(name, partitions, replication_factor, topic_configs=config)
    try:
        await admin.create_topics([topic])
        log.info("created topic %s with %d partitions, replication factor %d",
                 name, partitions, replication_factor)
    except TopicAlreadyExistsError:
        pass
    return await _partitions(admin, name, partitions)


async def _partitions(admin: AIOKafkaAdminClient, name: str, partitions: int) -> int:
    """The topic's partition count; a warning when it is not the configured one."""
    described = await admin.describe_topics([name])
    actual = len(described[0]["partitions"])
    if actual != partitions:
        log.warning("topic %s has %d partitions (configured %d); using %d",
                    name, actual, partitions, actual)
    return actual


async def ensure_topic(
    bootstrap_servers: str,
    name: str,
    partitions: int,
    config: dict[str, str],
    replication_factor: int = 1,
    security: KafkaSecurity | None = None,
) -> int:
    """Create a topic if it is missing; return its actual partition count."""
    async with _admin(bootstrap_servers, security) as admin:
        return await _create(admin, name, partitions, config, replication_factor)


async def ensure_topics(settings: Settings, bootstrap_servers: str) -> int:
    """Create the event, changelog and dead-letter topics that are missing; return the
    event topic's partitions (the other two are created with as many)."""
    return (await _ensure_app_topics(settings, bootstrap_servers))[settings.events_topic]


async def ensure_dead_letter_topic(settings: Settings, bootstrap_servers: str) -> int:
    """``ensure_topics``, returning the dead-letter topic's partitions."""
    return (await _ensure_app_topics(settings, bootstrap_servers))[settings.dead_letter_topic]


async def _ensure_app_topics(settings: Settings, bootstrap_servers: str) -> dict[str, int]:
    """Partitions of each of the app's topics, creating the missing ones replicated as
    ``choose_durability`` says. The brokers are counted only when a topic is missing:
    the cluster lists only the brokers that are up, so with one down a count would
    refuse a replication factor the topics already have, or pick 1 for the defaults."""
    async with _admin(bootstrap_servers, settings.kafka) as admin:
        existing = set(await admin.list_topics())
        names = [settings.events_topic, changelog_topic(settings.app_id), settings.dead_letter_topic]
        configs = [EVENTS_TOPIC_CONFIG, CHANGELOG_TOPIC_CONFIG, DEAD_LETTER_TOPIC_CONFIG]
        durability = None
        if not existing.issuperset(names):
            durability = choose_durability(await _brokers(admin), settings.replication_factor,
                                           settings.min_insync_replicas)
        counts: dict[str, int] = {}
        partitions = settings.partitions
        for name, config in zip(names, configs, strict=True):
            if name in existing or durability is None:
                counts[name] = await _partitions(admin, name, partitions)
            else:
                counts[name] = await _create(admin, name, partitions,
                                             durability.topic_config(config),
                                             durability.replication_factor)
            partitions = counts[settings.events_topic]
    return counts
