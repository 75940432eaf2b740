"""DataDir: mmcache removes only what it created, one process per dir, one cluster per dir."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson
import pytest

from stream.core.cache import Capacity
from stream.kafka.embedded import STANDALONE_CLUSTER_PREFIX, new_cluster_id
from stream.kafka.embedded_log import EmbeddedLog
from stream.state.datadir import LOCK_NAME, DataDir, DataDirInUse, StateMismatch

IDENTITY = DataDir.identity("app", "app-events", Capacity("items", 1024))
REAL_CLUSTER = "Lk3rYq0bQ9uG1o2JmX8y7w"  # what a real Kafka cluster id looks like


def ours(root, cluster_id: str | None = None) -> DataDir:
    """A dir as a stopped worker leaves it: marker, tables with a RocksDB file, no RUNNING
    (made without claiming it, so that this test process does not hold its lock)."""
    datadir = DataDir(root)
    datadir.check(IDENTITY, cluster_id)
    db = datadir.open_partition(0)
    db[b"k"] = b"v"
    db.close()
    (datadir.tables / "lru-backups").mkdir()
    (root / LOCK_NAME).touch()
    return datadir


def snapshot(root) -> dict[str, bytes | None]:
    """Every path under root with its content (None for dirs)."""
    found: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            found[os.path.relpath(os.path.join(dirpath, name), root)] = None
        for name in filenames:
            path = os.path.join(dirpath, name)
            found[os.path.relpath(path, root)] = open(path, "rb").read()  # noqa: SIM115
    return found


def test_a_user_file_survives_and_the_dir_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(StateMismatch, match="did not create.*notes.txt.*nothing was deleted"):
        DataDir(tmp_path).claim(IDENTITY, cluster_id=new_cluster_id())
    assert snapshot(tmp_path) == before  # not even a marker or a lock file was added


@pytest.mark.parametrize("where", [
    "v1/notes.txt", "v1/tables/notes.txt", "v1/tables/other.db/x", "v2/x", "RUNNING.bak",
    # inside mmcache-named dirs, at every depth (issue: these were deleted)
    "v1/tables/lru-0.db/mine/important.txt", "v1/tables/lru-0.db/important.txt",
    "v1/tables/lru-backups/mine/important.txt", "v1/tables/lru-backups/important.txt",
    "v1/log/notes.txt", "v1/log/app-events/notes.txt", "v1/log/app-events/0.log/x",
    "v1/log/app-events/deeper/0.log"])
def test_a_user_file_next_to_our_state_is_refused_and_nothing_is_deleted(tmp_path, where):
    datadir = ours(tmp_path, new_cluster_id())
    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / where).write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(StateMismatch, match="did not create"):
        DataDir(tmp_path).claim(IDENTITY, cluster_id=new_cluster_id())
    assert snapshot(tmp_path) == before
    assert datadir.partitions() == [0]


def test_a_symlink_is_not_followed_and_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("mine")
    root = tmp_path / "data"
    root.mkdir()
    (root / "v1").symlink_to(outside)
    with pytest.raises(StateMismatch, match="did not create.*v1"):
        DataDir(root).claim(IDENTITY)
    assert (outside / "precious").read_text() == "mine"


def test_a_fresh_volume_with_lost_and_found_is_taken_and_lost_and_found_is_left_alone(tmp_path):
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "lost+found" / "#12").write_text("fsck's")
    datadir = DataDir(tmp_path)
    cluster = new_cluster_id()
    datadir.claim(IDENTITY, cluster_id=cluster)
    datadir.claim(IDENTITY, cluster_id=cluster)  # and again, after a crash (RUNNING left)
    assert (tmp_path / "lost+found" / "#12").read_text() == "fsck's"


def test_a_data_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "data").write_text("mine")
    with pytest.raises(StateMismatch):
        DataDir(tmp_path / "data").claim(IDENTITY)
    assert (tmp_path / "data").read_text() == "mine"


def test_a_dir_built_against_another_cluster_is_refused_and_kept(tmp_path):
    datadir = ours(tmp_path, REAL_CLUSTER)
    before = snapshot(tmp_path)
    with pytest.raises(StateMismatch, match=f"built against Kafka cluster '{REAL_CLUSTER}'"):
        DataDir(tmp_path).claim(IDENTITY, cluster_id=new_cluster_id())
    assert snapshot(tmp_path) == before
    assert datadir.recorded_cluster() == REAL_CLUSTER


def test_a_restarted_shared_broker_is_another_cluster(tmp_path):
    """A `mmcache broker` that restarted lost its log: a dir built on it is refused, not reused."""
    ours(tmp_path, new_cluster_id())
    with pytest.raises(StateMismatch, match="built against Kafka cluster"):
        DataDir(tmp_path).claim(IDENTITY, cluster_id=new_cluster_id())


def test_the_same_cluster_keeps_the_state(tmp_path):
    cluster = new_cluster_id()
    ours(tmp_path, cluster)
    again = DataDir(tmp_path)
    again.claim(IDENTITY, cluster_id=cluster)
    assert again.partitions() == [0]
    assert again.read_identity() == IDENTITY
    assert again.recorded_cluster() == cluster


@pytest.mark.parametrize("recorded", [
    new_cluster_id(STANDALONE_CLUSTER_PREFIX),  # `mmcache broker` + --bootstrap-servers
    new_cluster_id(),  # serve's broker of an earlier version (memory only), or the old prefix
    REAL_CLUSTER], ids=["standalone", "old-embedded", "kafka"])  # ids: the same in every xdist worker
def test_an_embedded_start_on_a_dir_built_against_another_cluster_is_refused_not_cleared(
        tmp_path, recorded):
    """A forgotten --bootstrap-servers never clears state: refused, naming the cluster and
    the flag to give."""
    ours(tmp_path, recorded)
    before = snapshot(tmp_path)
    with pytest.raises(StateMismatch) as refused:
        DataDir(tmp_path).embedded_cluster()
    message = str(refused.value)
    assert f"built against the Kafka cluster {recorded!r}" in message
    assert "--bootstrap-servers" in message and "nothing was deleted" in message
    assert snapshot(tmp_path) == before


def test_an_embedded_start_reuses_the_cluster_whose_log_the_dir_keeps(tmp_path):
    datadir = ours(tmp_path)
    cluster = new_cluster_id()
    EmbeddedLog(datadir.log_root).create(cluster)
    datadir.check(IDENTITY, cluster)
    assert DataDir(tmp_path).embedded_cluster() == cluster
    assert DataDir(tmp_path / "new").embedded_cluster() is None  # a new dir: a new cluster


def test_a_rebuilt_seed_is_never_cleared_by_an_embedded_start(tmp_path):
    datadir = DataDir(tmp_path)
    datadir.check(IDENTITY)  # as `rebuild` writes it: no cluster recorded
    datadir.mark_seed()
    before = snapshot(tmp_path)
    with pytest.raises(StateMismatch, match="rebuilt state"):
        DataDir(tmp_path).embedded_cluster()
    assert snapshot(tmp_path) == before


def test_after_a_crash_only_our_table_files_are_dropped(tmp_path):
    cluster = new_cluster_id()
    datadir = ours(tmp_path, cluster)
    datadir.claim(IDENTITY, cluster_id=cluster)  # RUNNING, as a crashed worker leaves it
    datadir.unlock()
    log_files = EmbeddedLog(datadir.log_root)
    log_files.create(cluster)
    log_files.record_topics({"app-events": (2, {})})
    DataDir(tmp_path).claim(IDENTITY, cluster_id=cluster)
    assert not datadir.tables.exists()
    assert log_files.topics() == {"app-events": {"partitions": 2, "config": {}}}  # the log stays
    assert sorted(os.listdir(tmp_path)) == sorted([LOCK_NAME, "RUNNING", "mmcache-state.json", "v1"])


@pytest.mark.parametrize("name,content", [
    ("RUNNING", b""), ("RUNNING", b"my notes"), ("RUNNING", b'{"mmcache": "SEED"}'),
    ("SEED", b""), ("mmcache-state.json", b"{}"), ("mmcache-state.json", b"not json"),
    ("mmcache-state.json.tmp", b"my notes"), ("RUNNING.tmp", b""), ("SEED.tmp", b"my notes")])
def test_a_mark_or_marker_that_mmcache_did_not_write_is_refused_and_kept(tmp_path, name, content):
    datadir = ours(tmp_path, new_cluster_id())
    (tmp_path / name).write_bytes(content)
    (datadir.tables / "lru-backups" / "mine").mkdir()
    (datadir.tables / "lru-backups" / "mine" / "important.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(StateMismatch, match=f"did not create.*{name}"):
        DataDir(tmp_path).claim(IDENTITY, cluster_id=new_cluster_id())
    with pytest.raises(StateMismatch, match="did not create"):
        DataDir(tmp_path).embedded_cluster()
    assert snapshot(tmp_path) == before


def test_what_rocksdb_and_faust_write_is_ours(tmp_path):
    """A real RocksDB dir, written and reopened (LOG.old, several MANIFEST and OPTIONS files)
    and a worker's own files, the journal's included, are all recognised."""
    cluster = new_cluster_id()
    datadir = ours(tmp_path, cluster)
    for _ in range(3):
        db = datadir.open_partition(0)
        for i in range(2000):
            db[f"k{i}".encode()] = b"v" * 100
        db.flush()
        db.close()
    files = set(os.listdir(datadir.partition_path(0)))
    assert {"CURRENT", "IDENTITY", "LOCK", "LOG", "rocksdict-config.json"} <= files
    assert any(name.startswith("LOG.old.") for name in files)
    assert any(name.endswith(".sst") for name in files)
    datadir.claim(IDENTITY, cluster_id=cluster)
    datadir.mark_seed()
    log_files = EmbeddedLog(datadir.log_root)
    log_files.create(cluster)
    log_files.record_topics({"app-events": (2, {}), "app-lru-changelog": (2, {})})
    assert datadir.foreign() == []


def test_a_state_with_no_recorded_cluster_takes_the_cluster_it_is_first_served_on(tmp_path):
    datadir = DataDir(tmp_path)
    datadir.check(IDENTITY)
    datadir.claim(IDENTITY, cluster_id=REAL_CLUSTER)
    assert orjson.loads(datadir.marker.read_bytes())["cluster_id"] == REAL_CLUSTER
    assert datadir.read_identity() == IDENTITY


def test_an_empty_or_absent_dir_is_taken(tmp_path):
    (tmp_path / "empty").mkdir()
    for root in (tmp_path / "empty", tmp_path / "absent" / "deeper"):
        datadir = DataDir(root)
        datadir.claim(IDENTITY, cluster_id=REAL_CLUSTER)
        assert datadir.running.exists()
        assert datadir.recorded_cluster() == REAL_CLUSTER


CLAIM = """
import sys
from pathlib import Path
from stream.core.cache import Capacity
from stream.state.datadir import DataDir
d = DataDir(Path(sys.argv[1]))
d.claim(DataDir.identity("app", "app-events", Capacity("items", 1024)))
d.release()
"""


def test_a_second_process_is_refused_while_the_first_holds_the_dir(tmp_path):
    datadir = ours(tmp_path)
    datadir.claim(IDENTITY)  # this process holds it, like a live worker
    second = subprocess.run([sys.executable, "-c", CLAIM, str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    assert second.returncode != 0
    assert second.stderr.strip().splitlines() == [
        f"{tmp_path} is in use by another mmcache worker (it holds {tmp_path / LOCK_NAME}): "
        "give each worker its own --data-dir."
    ]
    assert datadir.running.exists()  # the live worker's marker and files are untouched
    assert datadir.partitions() == [0]


def test_the_lock_is_free_again_once_its_process_ended(tmp_path):
    ours(tmp_path)
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CLAIM, str(tmp_path)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert DataDir(tmp_path).partitions() == [0]


def test_a_process_that_does_not_hold_the_lock_releases_nothing(tmp_path):
    datadir = DataDir(tmp_path)
    datadir.check(IDENTITY)
    datadir.claim(IDENTITY)  # another worker's marker (as if it held the lock)
    datadir.unlock()
    DataDir(tmp_path).release()
    assert datadir.running.exists()


def test_the_in_use_refusal_is_a_state_mismatch_exit():
    assert issubclass(DataDirInUse, SystemExit)


def test_a_dir_keeping_an_embedded_log_served_with_bootstrap_servers_says_to_drop_the_flag(tmp_path):
    cluster = new_cluster_id()
    datadir = ours(tmp_path, cluster)
    EmbeddedLog(datadir.log_root).create(cluster)
    before = snapshot(tmp_path)
    with pytest.raises(StateMismatch, match="keeps that embedded broker's log: serve it without "
                                            "--bootstrap-servers"):
        DataDir(tmp_path).claim(IDENTITY, cluster_id=REAL_CLUSTER)
    assert snapshot(tmp_path) == before


def test_a_full_disk_never_leaves_an_empty_running_mark(tmp_path, monkeypatch):
    """RUNNING is written whole or not at all: a write refused half-way (ENOSPC) leaves
    nothing (the half-written RUNNING.tmp is removed), so the next start is not refused for
    a file mmcache wrote; a RUNNING.tmp is ours only when it holds a whole mark."""
    cluster = new_cluster_id()
    datadir = ours(tmp_path, cluster)
    datadir.unlock()
    real_write = type(tmp_path).write_bytes

    def full_disk(self, data):
        real_write(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tmp_path), "write_bytes", full_disk)
    with pytest.raises(OSError):
        DataDir(tmp_path).claim(IDENTITY, cluster_id=cluster)
    monkeypatch.undo()
    assert not (tmp_path / "RUNNING").exists() and not (tmp_path / "RUNNING.tmp").exists()
    assert not (tmp_path / "mmcache-state.json.tmp").exists()
    DataDir(tmp_path).unlock()
    fresh = DataDir(tmp_path)
    assert fresh.foreign() == []
    (tmp_path / "RUNNING.tmp").write_bytes(orjson.dumps({"mmcache": "RUNNING"}))
    fresh.claim(IDENTITY, cluster_id=cluster)  # a whole mark left in .tmp (a kill) is ours
    assert orjson.loads((tmp_path / "RUNNING").read_bytes())["mmcache"] == "RUNNING"


def test_a_full_disk_never_leaves_a_half_written_marker(tmp_path, monkeypatch):
    """The marker is written whole or not at all, as the marks are: a refused write of its
    .tmp (a new dir on a full volume) leaves nothing the next start would refuse."""
    real_write = type(tmp_path).write_bytes

    def full_disk(self, data):
        real_write(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    datadir = DataDir(tmp_path)
    monkeypatch.setattr(type(tmp_path), "write_bytes", full_disk)
    with pytest.raises(OSError):
        datadir.check(IDENTITY, new_cluster_id())
    monkeypatch.undo()
    assert datadir.foreign() == [] and not datadir.marker.exists()
