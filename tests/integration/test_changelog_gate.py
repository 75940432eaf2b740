"""A changelog holding events written again after later ones (what a resumed zombie
owner's producer leaves when it resends a batch whose request timed out while it was
frozen): a worker restoring from that changelog, and a worker following it, skip the
stale events and hold only what the owner's fold made."""

from __future__ import annotations

import asyncio
import uuid

from aiokafka import AIOKafkaProducer

from stream.config import Settings
from stream.core.cache import Entry
from stream.core.routing import key_partition
from stream.kafka.topics import changelog_topic, ensure_topics
from stream.state.store import APPLIED_KEY, encode_applied, encode_entry, entry_key
from tests.integration.conftest import eventually, http

ENDPOINT = "ns/gated"


def _event(offset: int, *hashes: str) -> list[tuple[bytes, bytes]]:
    """One applied event's changelog records: its entries, then its applied offset."""
    records = [(entry_key(ENDPOINT, h), encode_entry(Entry(ENDPOINT, h, 1, offset, i)))
               for i, h in enumerate(hashes)]
    return [*records, (APPLIED_KEY, encode_applied(offset))]


def _write_changelog(bootstrap: str, app_id: str,
                     records: list[tuple[bytes, bytes | None]] | None = None) -> None:
    if records is None:
        records = (_event(0, "h-first") + _event(1, "h-second")
                   + _event(0, "h-stale"))  # event 0 again, after event 1

    async def write() -> None:
        await ensure_topics(Settings(app_id=app_id, bootstrap_servers=bootstrap), bootstrap)
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        await producer.start()
        try:
            partition = key_partition(ENDPOINT.encode(), 8)
            for key, value in records:
                await producer.send_and_wait(changelog_topic(app_id), value, key=key,
                                             partition=partition)
        finally:
            await producer.stop()

    asyncio.run(write())


def _matched(url: str, hashes: tuple[str, ...] = ("h-first", "h-second", "h-stale")) -> list[str]:
    body = {"generate": {"features": {"mm_hashes": {"image": list(hashes)}}}}
    answer = http("POST", url + "/v1/match", {"endpoints": [ENDPOINT], "body": body})[1]
    return [item["hash"] for item in answer["endpoints"][0]["matched_items"]]


def test_restore_and_follower_skip_events_written_again_after_later_ones(make_service, bootstrap, tmp_path):
    app_id = f"it-{uuid.uuid4().hex[:10]}"
    _write_changelog(bootstrap, app_id)
    owner = make_service(app_id=app_id, data_dir=tmp_path / "owner")  # restores from the changelog
    assert _matched(owner.url) == ["h-first", "h-second"]
    follower = make_service(app_id=app_id, data_dir=tmp_path / "follower")
    # the two split the partitions: whichever follows the endpoint's partition re-reads it
    for service in (owner, follower):
        eventually(lambda s=service: _matched(s.url) == ["h-first", "h-second"], timeout=30)
    assert owner.digest() == follower.digest()


def test_a_restore_caught_up_in_bulk_leaves_an_event_read_in_part_to_faust(make_service, bootstrap,
                                                                         tmp_path):
    # event 1 removes h-a; event 2 was cut off after its removal of h-b (no applied
    # record): its removal waits, and is not applied, as Faust's own restore does
    app_id = f"it-{uuid.uuid4().hex[:10]}"
    _write_changelog(bootstrap, app_id, _event(0, "h-a", "h-b")
                     + [(entry_key(ENDPOINT, "h-a"), None)] + _event(1, "h-c")
                     + [(entry_key(ENDPOINT, "h-b"), None)])
    hashes = ("h-a", "h-b", "h-c")
    owner = make_service(app_id=app_id, data_dir=tmp_path / "owner")
    assert sorted(_matched(owner.url, hashes)) == ["h-b", "h-c"]
    said = owner.log_path.read_text()
    assert "caught up 7 changelog records of partitions" in said, said[-3000:]  # in bulk
    follower = make_service(app_id=app_id, data_dir=tmp_path / "follower")
    for service in (owner, follower):
        eventually(lambda s=service: sorted(_matched(s.url, hashes)) == ["h-b", "h-c"], timeout=30)
    assert owner.digest() == follower.digest()


def test_an_event_read_in_part_is_completed_after_a_restart_on_the_same_files(make_service,
                                                                            bootstrap, tmp_path):
    # the removal of h-b waits for its event's applied record, which is written only
    # after the worker stopped: the files must not claim to hold the changelog past it
    app_id = f"it-{uuid.uuid4().hex[:10]}"
    _write_changelog(bootstrap, app_id, _event(0, "h-a", "h-b")
                     + [(entry_key(ENDPOINT, "h-b"), None)])
    hashes = ("h-a", "h-b")
    owner = make_service(app_id=app_id, data_dir=tmp_path / "owner")
    assert sorted(_matched(owner.url, hashes)) == ["h-a", "h-b"]
    assert owner.stop() == 0
    _write_changelog(bootstrap, app_id, [(APPLIED_KEY, encode_applied(1))])
    owner.start()
    assert _matched(owner.url, hashes) == ["h-a"]
