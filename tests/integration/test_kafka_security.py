"""Kafka client security and topic durability against a real broker.

Tansu 0.6 was tried for its own TLS and SASL (see the README's security section): its
``--cert`` and ``--key`` cannot be given together and, given alone, the listener still
speaks plaintext (a TLS client's hello ends in "early eof" on the broker); with
``--authentication`` it offers no PLAIN (``NoSharedMechanism``), and SCRAM users cannot
be created (``tansu user create`` is refused ``NotAuthenticated``; on a memory broker
started without it they are lost on the restart that enables it). So a real TLS
connection is tested here through a TLS-terminating proxy in front of a dedicated Tansu
that advertises the proxy: every byte between client and proxy is TLS, with certificate
and host name verified by the context ``client_options`` builds. SASL is tested only as
far as the client arguments (tests/unit/test_clients.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError

from stream.config import KafkaSecurity, Settings
from stream.kafka.clients import client_options
from stream.kafka.embedded import broker_binary, free_port
from stream.kafka.topics import changelog_topic, ensure_topics

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _cert(root: Path, name: str) -> tuple[Path, Path]:
    cert, key = root / f"{name}.pem", root / f"{name}-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


@pytest.fixture
def tls_broker(tmp_path: Path) -> Iterator[tuple[int, int, Path, Path]]:
    """A Tansu on a plaintext port, advertising the TLS port that ``serve_tls`` proxies."""
    cert, key = _cert(tmp_path, "broker")
    plain, tls = free_port(), free_port()
    with open(tmp_path / "tansu.log", "wb") as log:
        process = subprocess.Popen(
            [broker_binary(), "broker", "--listener-url", f"tcp://127.0.0.1:{plain}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{tls}",
             "--storage-engine", "memory://tansu/"], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield plain, tls, cert, key
    finally:
        process.kill()
        process.wait()


@contextlib.asynccontextmanager
async def serve_tls(plain: int, tls: int, cert: Path, key: Path):
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    seen = {"tls_connections": 0}

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["tls_connections"] += 1
        assert writer.get_extra_info("ssl_object") is not None
        for _ in range(50):  # the broker needs a few ms to listen
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", plain)
                break
            except OSError:
                await asyncio.sleep(0.05)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", tls, ssl=context)
    try:
        yield seen
    finally:
        server.close()


def test_every_client_kind_talks_tls_through_client_options(tls_broker, tmp_path):
    plain, tls, cert, key = tls_broker
    bootstrap = f"127.0.0.1:{tls}"
    secure = Settings(app_id=f"tls-{uuid.uuid4().hex[:8]}", partitions=2,
                      kafka=KafkaSecurity(security_protocol="SSL", ssl_cafile=cert))
    other_ca, _ = _cert(tmp_path, "other")

    async def scenario() -> None:
        async with serve_tls(plain, tls, cert, key) as seen:
            # the admin of ensure_topics
            assert await ensure_topics(secure, bootstrap) == 2
            options = client_options(secure.kafka)
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", **options)
            await producer.start()
            try:
                meta = await producer.send_and_wait(secure.events_topic, b"over tls", partition=1)
            finally:
                await producer.stop()
            consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                        **options)
            await consumer.start()
            try:
                consumer.assign([meta.topic_partition])
                await consumer.seek_to_beginning(meta.topic_partition)
                record = await asyncio.wait_for(consumer.getone(), 10)
            finally:
                await consumer.stop()
            assert record.value == b"over tls"
            assert seen["tls_connections"] >= 3

            # a client that does not trust the broker's certificate gets nowhere
            distrust = client_options(KafkaSecurity(security_protocol="SSL", ssl_cafile=other_ca))
            stranger = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=3000,
                                        **distrust)
            with pytest.raises(KafkaConnectionError):
                await stranger.start()
            await stranger.stop()

    asyncio.run(asyncio.wait_for(scenario(), 40))


def test_topics_are_created_with_the_durability_for_the_cluster(bootstrap):
    """The embedded broker has one broker: replication 1, min.insync.replicas 1 on the
    event, changelog and dead-letter topics (3 and 2 need three brokers)."""
    settings = Settings(app_id=f"dur-{uuid.uuid4().hex[:8]}", partitions=3)
    names = [settings.events_topic, changelog_topic(settings.app_id), settings.dead_letter_topic]

    async def scenario() -> tuple[dict, dict, int]:
        partitions = await ensure_topics(settings, bootstrap)
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            brokers = len((await admin.describe_cluster())["brokers"])
            replicas = {t["topic"]: {len(p["replicas"]) for p in t["partitions"]}
                        for t in await admin.describe_topics(names)}
            configs = {}
            for response in await admin.describe_configs(
                    [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]):
                for resource in response.resources:
                    configs[resource[3]] = {entry[0]: entry[1] for entry in resource[4]}
        finally:
            await admin.close()
        assert partitions == 3
        return replicas, configs, brokers

    replicas, configs, brokers = asyncio.run(scenario())
    if brokers >= 3:  # MMCACHE_BOOTSTRAP_SERVERS pointing at a real cluster
        expected_rf, expected_isr = 3, "2"
    else:
        expected_rf, expected_isr = 1, "1"
    for name in names:
        assert replicas[name] == {expected_rf}, name
        assert configs[name]["min.insync.replicas"] == expected_isr, name
    assert configs[settings.events_topic]["retention.ms"] == "-1"
    assert configs[changelog_topic(settings.app_id)]["cleanup.policy"] == "compact"
    assert configs[settings.dead_letter_topic]["cleanup.policy"] == "delete"
