"""The on-disk layout of a worker's state, and the rules for reusing it.

``DATA_DIR/mmcache-state.json`` names the layout version, app id, event topic,
capacity and engine view bound the state was built for, and the Kafka cluster id it was
built against; a data dir built for other ones is refused (a marker of a release before
the bound was recorded holds none: it was built with the default, ``ENGINE_VIEW_ENTRIES``).
``DATA_DIR/v1/tables/lru-<partition>.db`` are the RocksDB files (Faust's layout, so the
worker, ``rebuild`` and ``state digest`` share them; Faust adds an empty ``lru-backups``).
``DATA_DIR/v1/log`` is the embedded broker's log (``stream.kafka.embedded_log``).
``RUNNING`` exists while a worker owns the dir: finding it at start means the last run
crashed, and the local table files are dropped and restored from the changelog.
``SEED`` marks a state written by ``rebuild`` that no changelog holds yet.
``DATA_DIR/v1/view.snapshot`` is the view left by a clean stop for the next start
(``stream.state.snapshot``; it begins with ``SNAPSHOT_MAGIC``).
``mmcache.lock`` is held (``flock``) by the one process that owns the dir.

mmcache never deletes a file it did not create: a dir holding anything outside this
layout, at any depth (inside a RocksDB dir only RocksDB's own file names), is refused
before anything in it is touched; ``RUNNING``, ``SEED`` and the marker hold content that
says mmcache wrote them, and one that does not is refused too; and only these names are
ever removed. (A top-level ``lost+found``, which mkfs puts on a fresh volume, is
tolerated and left alone.)
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from rocksdict import AccessType, Options, Rdict

from stream.core.cache import CacheState, Capacity
from stream.core.engine import ENGINE_VIEW_ENTRIES
from stream.kafka.embedded import EMBEDDED_CLUSTER_PREFIX
from stream.kafka.embedded_log import LOG_DIR_NAME, EmbeddedLog, is_log_entry
from stream.kafka.topics import TABLE_NAME
from stream.state.store import FAUST_OFFSET_KEY, load_partition

__all__ = ["LOCK_NAME", "SNAPSHOT_MAGIC", "STATE_FORMAT", "TABLE_NAME", "DataDir", "DataDirInUse",
           "StateMismatch", "write_whole"]

STATE_FORMAT = 1
LOCK_NAME = "mmcache.lock"
_CLUSTER_KEY = "cluster_id"
_BOUND_KEY = "engine_view_max_entries"
_IDENTITY_KEYS = frozenset({"format", "app_id", "topic", "capacity"})
_TABLE_DIR = re.compile(rf"^{TABLE_NAME}-\d+\.db$")
_TABLE_SST = re.compile(rf"^{TABLE_NAME}-\d+\.sst$")  # rebuild's bulk file, before its ingest
_BACKUPS = f"{TABLE_NAME}-backups"
# What RocksDB (and rocksdict, its config) writes inside a database dir.
_ROCKSDB_FILE = re.compile(
    r"^(?:CURRENT|IDENTITY|LOCK|LOG|LOG\.old\.\d+|MANIFEST-\d+|OPTIONS-\d+(?:\.dbtmp)?"
    r"|\d+\.(?:sst|ldb|log|blob|dbtmp)|rocksdict-config\.json)$")
# Faust's write probe in the backups dir (tempfile.TemporaryFile, gone once closed).
_PROBE_FILE = re.compile(r"^tmp[a-z0-9_]{8}$")
_SIGNED_MAX_BYTES = 4096
_MARKS = {"RUNNING", "SEED"}
_SNAPSHOT = "view.snapshot"
SNAPSHOT_MAGIC = b"mmcache view snapshot\n"

log = logging.getLogger(__name__)

# Locks this process holds, by resolved dir: a second DataDir of the same dir in the same
# process (tests, tools) shares the lock instead of refusing itself.
_held: dict[str, int] = {}


def _mark_content(name: str) -> bytes:
    """What mmcache writes into ``RUNNING`` or ``SEED``: how it knows its own file."""
    return orjson.dumps({"mmcache": name, "pid": os.getpid(),
                         "written": datetime.now(UTC).isoformat(timespec="seconds")})


def write_whole(path: Path, data: bytes) -> None:
    """Write one of mmcache's files whole or not at all (through ``<name>.tmp``): a full
    disk must not leave an empty mark or marker, which no later start could tell for ours."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
    except OSError:
        tmp.unlink(missing_ok=True)  # this process just wrote it
        raise
    tmp.replace(path)


def _is_our_mark(path: Path) -> bool:
    data = _small_json(path)
    return isinstance(data, dict) and data.get("mmcache") == path.name.removesuffix(".tmp")


def _is_our_snapshot(path: Path) -> bool:
    """A view snapshot begins with ``SNAPSHOT_MAGIC``; an empty one under that name is
    ours too (a stop killed between creating it and writing it, or a power cut before
    its data reached the disk), else the next start would refuse the whole dir."""
    try:
        with open(path, "rb") as file:
            start = file.read(len(SNAPSHOT_MAGIC))
    except OSError:
        return False
    return start in (SNAPSHOT_MAGIC, b"")


def _is_our_marker(path: Path) -> bool:
    data = _small_json(path)
    return isinstance(data, dict) and _IDENTITY_KEYS <= data.keys()


def _small_json(path: Path) -> Any:
    try:
        if path.stat().st_size > _SIGNED_MAX_BYTES:
            return None
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


def _is_ours(parts: tuple[str, ...], path: Path, is_dir: bool) -> bool:
    """Whether the entry at ``parts`` (its path below the data dir) is one mmcache or
    RocksDB writes there (entries with unknown content are not)."""
    name, depth = parts[-1], len(parts)
    if depth == 1:
        if is_dir:
            return name in ("v1", "lost+found")
        if name.removesuffix(".tmp") in _MARKS:
            return _is_our_mark(path)
        if name in ("mmcache-state.json", "mmcache-state.json.tmp"):
            return _is_our_marker(path)
        return name == LOCK_NAME
    if parts[0] != "v1":
        return False
    if depth == 2:
        if name.removesuffix(".tmp") == _SNAPSHOT:
            return not is_dir and _is_our_snapshot(path)
        return is_dir and name in ("tables", LOG_DIR_NAME)
    if parts[1] == LOG_DIR_NAME:
        return is_log_entry(depth - 3, name, is_dir)
    if depth == 3:
        return (is_dir and (bool(_TABLE_DIR.match(name)) or name == _BACKUPS)) or (
            not is_dir and bool(_TABLE_SST.match(name)))
    if depth == 4 and not is_dir:
        if parts[2] == _BACKUPS:
            return bool(_PROBE_FILE.match(name))
        return bool(_ROCKSDB_FILE.match(name))
    return False


def _recorded(marker: dict[str, Any]) -> dict[str, Any]:
    """A marker's content, the engine view bound filled in where it was not recorded yet
    (a state of an earlier release was folded with the default)."""
    return {**marker, _BOUND_KEY: marker.get(_BOUND_KEY, ENGINE_VIEW_ENTRIES)}


class StateMismatch(SystemExit):
    """The data dir is not one this worker may use (another layout, app, topic,
    capacity, engine view bound or cluster, or files mmcache did not create); nothing in
    it was changed."""


class DataDirInUse(StateMismatch):
    """Another process holds the data dir's lock."""


class DataDir:
    """One worker's state directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.marker = root / "mmcache-state.json"
        self.running = root / "RUNNING"
        self.seed = root / "SEED"
        self.tables = root / "v1" / "tables"
        self.snapshot = root / "v1" / _SNAPSHOT
        self.log_root = root / "v1" / LOG_DIR_NAME

    @staticmethod
    def identity(app_id: str, topic: str, capacity: Capacity,
                 engine_view_max_entries: int = ENGINE_VIEW_ENTRIES) -> dict[str, Any]:
        """What a state is built for; equal identities can share a data dir. The engine
        view bound is a bound of the fold, as the capacity is: a state folded with another
        one is not what this fold gives for the same log."""
        return {"format": STATE_FORMAT, "app_id": app_id, "topic": topic,
                "capacity": list(capacity), _BOUND_KEY: engine_view_max_entries}

    def claim(self, identity: dict[str, Any], *, cluster_id: str | None = None) -> None:
        """Take the dir for a worker, in this order: refuse a dir holding anything that is
        not ours (before writing anything), lock it, refuse another identity or cluster,
        drop the table files a crash may have left (they are restored from the changelog).
        Nothing is ever cleared because the cluster differs: that is refused."""
        self.refuse_foreign()
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock()
        self.check(identity, cluster_id)
        if self.running.exists() and not self.seed.exists():
            log.warning("the last worker on %s did not stop cleanly: dropping its local "
                        "table files, to be restored from the changelog", self.root)
            self._remove_ours(self.tables)
            self.drop_snapshot()
        write_whole(self.running, _mark_content(self.running.name))

    def drop_snapshot(self) -> None:
        """Remove the view snapshot (``stream.state.snapshot``), once read or outdated."""
        for path in (self.snapshot, self.snapshot.with_name(_SNAPSHOT + ".tmp")):
            if path.exists() and _is_our_snapshot(path):
                path.unlink()

    def mark_seed(self) -> None:
        """Mark a state that ``rebuild`` wrote and no changelog holds yet."""
        write_whole(self.seed, _mark_content(self.seed.name))

    def embedded_cluster(self) -> str | None:
        """The cluster id to start `serve`'s own embedded broker with: the one whose log
        this dir keeps, or None (a new one) for a dir with no state yet. A state built
        against any other cluster (a standalone `mmcache broker`, Kafka) is refused,
        naming it: a forgotten --bootstrap-servers never clears anything."""
        self.refuse_foreign()
        kept = EmbeddedLog(self.log_root).cluster_id()
        if kept is not None:
            return kept
        if not self.marker.exists():
            return None
        recorded = self.recorded_cluster()
        if recorded is None and self.seed.exists():
            raise StateMismatch(
                f"{self.root} holds a rebuilt state not yet seeded into any cluster: "
                "nothing was deleted. Start serve with the --bootstrap-servers it was "
                "rebuilt from, or use another --data-dir."
            )
        gone = ""
        if recorded is not None and recorded.startswith(EMBEDDED_CLUSTER_PREFIX):
            gone = (" (if it was an embedded broker of an earlier mmcache version, which kept "
                    "its log in memory only, that log is gone: use another --data-dir)")
        raise StateMismatch(
            f"{self.root} was built against the Kafka cluster {recorded!r}, and holds no "
            "embedded broker's log: nothing was deleted. Start serve with --bootstrap-servers "
            f"HOST:PORT of that cluster (env MMCACHE_BOOTSTRAP_SERVERS){gone}, or use another "
            "--data-dir."
        )

    def release(self) -> None:
        """The worker stopped; its local state is consistent with the changelog (the files
        are written only once the changelog holds their records, so they are never ahead
        of it). Only the process that holds the lock releases."""
        if self._key() in _held:
            self.running.unlink(missing_ok=True)

    def lock(self) -> None:
        """Hold the dir's lock for the rest of this process's life (forked children share
        it); refuse the dir when another process holds it."""
        key = self._key()
        if key in _held:
            return
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DataDirInUse(
                f"{self.root} is in use by another mmcache worker (it holds "
                f"{self.root / LOCK_NAME}): give each worker its own --data-dir."
            ) from None
        _held[key] = fd

    def unlock(self) -> None:
        """Give the lock up before this process ends (a tool done with the dir)."""
        fd = _held.pop(self._key(), None)
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the flock

    def foreign(self, limit: int = 3) -> list[str]:
        """Up to ``limit`` entries of the dir that are not mmcache's (relative paths),
        looking down every level of mmcache's own dirs."""
        found: list[str] = []
        if not self.root.exists():
            return found
        if not self.root.is_dir():
            return ["."]
        pending: list[tuple[Path, tuple[str, ...]]] = [(self.root, ())]
        while pending and len(found) < limit:
            path, parts = pending.pop()
            with os.scandir(path) as entries:
                for entry in sorted(entries, key=lambda e: e.name):
                    here = (*parts, entry.name)
                    is_dir = entry.is_dir(follow_symlinks=False)
                    if entry.is_symlink() or not _is_ours(here, Path(entry.path), is_dir):
                        if len(found) < limit:
                            found.append(os.path.join(*here))
                    elif is_dir and here != ("lost+found",):
                        pending.append((Path(entry.path), here))
        return found

    def refuse_foreign(self) -> None:
        """Refuse a dir that holds anything mmcache did not create; touch nothing."""
        foreign = self.foreign()
        if foreign:
            raise StateMismatch(
                f"{self.root} holds files mmcache did not create ({', '.join(foreign)}): "
                "nothing was deleted. Use an empty or new --data-dir, or one written by "
                "`mmcache serve` or `mmcache rebuild`."
            )

    def recorded_cluster(self) -> str | None:
        """The Kafka cluster id the state was built against (None: not recorded)."""
        if not self.marker.exists():
            return None
        found = orjson.loads(self.marker.read_bytes()).get(_CLUSTER_KEY)
        return None if found is None else str(found)

    def check(self, identity: dict[str, Any], cluster_id: str | None = None) -> None:
        """Refuse a state built for something else or against another cluster; mark an
        empty dir as ours. A state with no recorded cluster (one ``rebuild`` wrote) is
        taken as built against ``cluster_id``, which is recorded."""
        if self.marker.exists():
            found = _recorded(orjson.loads(self.marker.read_bytes()))
            recorded = found.pop(_CLUSTER_KEY, None)
            if found != identity:
                differ = ", ".join(f"{key} {found.get(key)} here, {identity.get(key)} given"
                                   for key in sorted(found.keys() | identity.keys())
                                   if found.get(key) != identity.get(key))
                raise StateMismatch(
                    f"{self.root} holds state for {found}, not {identity} ({differ}). Use "
                    "another --data-dir, or build one for these settings with `mmcache rebuild`."
                )
            if cluster_id is None or recorded == cluster_id:
                return
            if recorded is not None:
                kept = EmbeddedLog(self.log_root).cluster_id() == recorded
                raise StateMismatch(
                    f"{self.root} was built against Kafka cluster {recorded!r}, not "
                    f"{cluster_id!r}: nothing was deleted. "
                    + ("It keeps that embedded broker's log: serve it without "
                       "--bootstrap-servers, or " if kept else "")
                    + ("use" if kept else "Use") + " another --data-dir or an empty one, or "
                    "build one for this cluster with `mmcache rebuild`."
                )
        self.root.mkdir(parents=True, exist_ok=True)
        marker = {**identity, _CLUSTER_KEY: cluster_id} if cluster_id is not None else identity
        write_whole(self.marker, orjson.dumps(marker))

    def _remove_ours(self, top: Path) -> None:
        """Remove the entries under ``top`` that mmcache or RocksDB wrote, and the dirs
        left empty; anything else (none: the dir was checked) stays where it is."""
        if not top.is_dir() or top.is_symlink():
            return
        for dirpath, dirnames, filenames in os.walk(top, topdown=False):
            base = Path(dirpath)
            parts = base.relative_to(self.root).parts
            for name in filenames:
                path = base / name
                if not path.is_symlink() and _is_ours((*parts, name), path, False):
                    path.unlink()
            for name in dirnames:
                path = base / name
                if not path.is_symlink() and _is_ours((*parts, name), path, True):
                    try:
                        path.rmdir()
                    except OSError:
                        log.warning("left %s in place: it is not empty", path)
        try:
            top.rmdir()
        except OSError:
            log.warning("left %s in place: it is not empty", top)

    def _key(self) -> str:
        return os.path.realpath(self.root)

    def read_identity(self) -> dict[str, Any]:
        """The identity recorded in the dir."""
        if not self.marker.exists():
            raise StateMismatch(f"{self.root} holds no mmcache state")
        found = _recorded(orjson.loads(self.marker.read_bytes()))
        found.pop(_CLUSTER_KEY, None)
        return found

    def partition_path(self, partition: int) -> Path:
        """RocksDB file of one partition (Faust's naming)."""
        return self.tables / f"{TABLE_NAME}-{partition}.db"

    def partitions(self) -> list[int]:
        """Partitions with a RocksDB file."""
        pattern = re.compile(rf"^{TABLE_NAME}-(\d+)\.db$")
        found = (pattern.match(p.name) for p in self.tables.glob(f"{TABLE_NAME}-*.db"))
        return sorted(int(m.group(1)) for m in found if m)

    def open_partition(self, partition: int, *, read_only: bool = False) -> Rdict:
        """Open one partition's RocksDB file with raw byte keys, as Faust does."""
        self.tables.mkdir(parents=True, exist_ok=True)
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        access = AccessType.read_only() if read_only else AccessType.read_write()
        return Rdict(str(self.partition_path(partition)), options, access_type=access)

    def table_offset(self, partition: int) -> int | None:
        """The changelog offset a partition's table file holds (Faust's offset record),
        None without a file or a record; read without opening the file for writing."""
        if not self.partition_path(partition).exists():
            return None
        db = self.open_partition(partition, read_only=True)
        try:
            raw = db.get(FAUST_OFFSET_KEY)
        finally:
            db.close()
        return None if raw is None else int(raw)

    def load_state(self) -> CacheState:
        """Read the state of the partitions this stopped worker has files of (for digests
        and checks): a worker's own partitions, not the ones it followed."""
        return load_partitions([self])[0]


def load_partitions(dirs: list[DataDir]) -> tuple[CacheState, dict[int, DataDir]]:
    """The state of every partition that the stopped workers' ``dirs`` hold a file of, each
    partition from the dir whose file is furthest along the changelog (a worker keeps the
    file of a partition it lost, behind the file of the worker that took it over), and
    which dir each came from. The dirs must hold one app's state."""
    identity = dirs[0].read_identity()
    for other in dirs[1:]:
        if (found := other.read_identity()) != identity:
            raise StateMismatch(f"{other.root} holds state for {found}, {dirs[0].root} for {identity}: "
                                f"give data dirs of one app")
    chosen: dict[int, DataDir] = {}
    furthest: dict[int, int] = {}
    for datadir in dirs:
        for partition in datadir.partitions():
            offset = datadir.table_offset(partition)
            offset = -1 if offset is None else offset
            if partition not in chosen or offset > furthest[partition]:
                chosen[partition], furthest[partition] = datadir, offset
    state = CacheState(Capacity(*identity["capacity"]), identity[_BOUND_KEY])
    for partition, datadir in sorted(chosen.items()):
        db = datadir.open_partition(partition, read_only=True)
        try:
            load_partition(state, partition, db.items())
        finally:
            db.close()
    return state, chosen
