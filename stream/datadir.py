"""The on-disk layout of a worker's state, and the rules for reusing it.

``DATA_DIR/mmcache-state.json`` names the layout version, app id, event topic and
capacity the state was built for, and the Kafka cluster id it was built against; a data
dir built for other ones is refused.
``DATA_DIR/v1/tables/lru-<partition>.db`` are the RocksDB files (Faust's layout, so the
worker, ``rebuild`` and ``state digest`` share them; Faust adds ``lru-backups``).
``RUNNING`` exists while a worker owns the dir: finding it at start means the last run
crashed, and the local files are dropped and restored from the changelog.
``SEED`` marks a state written by ``rebuild`` that no changelog holds yet.
``mmcache.lock`` is held (``flock``) by the one process that owns the dir.

mmcache never deletes a file it did not create: a dir holding anything outside this
layout is refused before anything in it is touched, and only these names are ever
removed. (A top-level ``lost+found``, which mkfs puts on a fresh volume, is tolerated
and left alone.)
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import orjson
from rocksdict import AccessType, Options, Rdict

from stream.core.cache import CacheState, Capacity
from stream.kafka.embedded import EMBEDDED_CLUSTER_PREFIX
from stream.store import load_partition

__all__ = ["LOCK_NAME", "STATE_FORMAT", "TABLE_NAME", "DataDir", "DataDirInUse", "StateMismatch"]

STATE_FORMAT = 1
TABLE_NAME = "lru"
LOCK_NAME = "mmcache.lock"
_CLUSTER_KEY = "cluster_id"
_TABLE_ENTRY = re.compile(rf"^(?:{TABLE_NAME}-\d+\.(?:db|sst)|{TABLE_NAME}-backups)$")

log = logging.getLogger(__name__)

# Locks this process holds, by resolved dir: a second DataDir of the same dir in the same
# process (tests, tools) shares the lock instead of refusing itself.
_held: dict[str, int] = {}


class StateMismatch(SystemExit):
    """The data dir is not one this worker may use (another layout, app, topic,
    capacity or cluster, or files mmcache did not create); nothing in it was changed."""


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

    @staticmethod
    def identity(app_id: str, topic: str, capacity: Capacity) -> dict[str, Any]:
        """What a state is built for; equal identities can share a data dir."""
        return {"format": STATE_FORMAT, "app_id": app_id, "topic": topic,
                "capacity": list(capacity)}

    def claim(self, identity: dict[str, Any], *, fresh: bool = False,
              cluster_id: str | None = None) -> None:
        """Take the dir for a worker, in this order: refuse a dir holding anything that is
        not ours (before writing anything), lock it, clear a state from an earlier
        embedded broker (``fresh``: the broker is new, so the log that state described is
        gone), refuse another identity or cluster, drop what a crash may have left.
        """
        self.refuse_foreign()
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock()
        if fresh and self.marker.exists():
            recorded = self.recorded_cluster()
            if recorded is None and self.seed.exists():
                raise StateMismatch(
                    f"{self.root} holds a rebuilt state not yet seeded into any cluster: "
                    "nothing was deleted. Start serve with the --bootstrap-servers it was "
                    "rebuilt from, or use another --data-dir."
                )
            if recorded is None or recorded.startswith(EMBEDDED_CLUSTER_PREFIX):
                log.warning("%s holds the state of an earlier embedded broker, whose log is "
                            "gone: clearing mmcache's files in it", self.root)
                self._clear()
        self.check(identity, cluster_id)
        if self.running.exists() and not self.seed.exists():
            log.warning("the last worker on %s did not stop cleanly: dropping its local "
                        "state, to be restored from the changelog", self.root)
            shutil.rmtree(self.tables, ignore_errors=True)
        self.running.touch()

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
        """Up to ``limit`` entries of the dir that are not mmcache's (relative paths)."""
        found: list[str] = []
        if not self.root.exists():
            return found
        if not self.root.is_dir():
            return ["."]
        own_files = {self.marker.name, self.marker.name + ".tmp", self.running.name,
                     self.seed.name, LOCK_NAME}

        def scan(path: Path, is_ours: Any) -> list[Path]:
            dirs = []
            with os.scandir(path) as entries:
                for entry in entries:
                    kind = is_ours(entry.name, entry.is_dir(follow_symlinks=False),
                                   entry.is_symlink())
                    if kind == "dir":
                        dirs.append(Path(entry.path))
                    elif not kind and len(found) < limit:
                        found.append(str(Path(entry.path).relative_to(self.root)))
            return dirs

        def top(name: str, is_dir: bool, link: bool) -> Any:
            if link:
                return False
            if is_dir:
                if name == "lost+found":  # made by mkfs on a fresh volume; never touched
                    return "file"
                return "dir" if name == "v1" else False
            return "file" if name in own_files else False

        def version(name: str, is_dir: bool, link: bool) -> Any:
            return "dir" if name == "tables" and is_dir and not link else False

        def tables(name: str, is_dir: bool, link: bool) -> Any:
            # the inside of a RocksDB dir (and Faust's backups dir) is RocksDB's
            return "file" if _TABLE_ENTRY.match(name) and not link else False

        for v1 in scan(self.root, top):
            for table_dir in scan(v1, version):
                scan(table_dir, tables)
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
            found = orjson.loads(self.marker.read_bytes())
            recorded = found.pop(_CLUSTER_KEY, None)
            if found != identity:
                raise StateMismatch(
                    f"{self.root} holds state for {found}, not {identity}. Use another "
                    "--data-dir, or build one for these settings with `mmcache rebuild`."
                )
            if cluster_id is None or recorded == cluster_id:
                return
            if recorded is not None:
                raise StateMismatch(
                    f"{self.root} was built against Kafka cluster {recorded!r}, not "
                    f"{cluster_id!r}: nothing was deleted. Use another --data-dir or an "
                    "empty one, or build one for this cluster with `mmcache rebuild`."
                )
        self.root.mkdir(parents=True, exist_ok=True)
        marker = {**identity, _CLUSTER_KEY: cluster_id} if cluster_id is not None else identity
        tmp = self.marker.with_name(self.marker.name + ".tmp")
        tmp.write_bytes(orjson.dumps(marker))
        tmp.replace(self.marker)

    def _clear(self) -> None:
        """Remove mmcache's files (the caller checked that there is nothing else), but
        the lock this process holds."""
        shutil.rmtree(self.root / "v1", ignore_errors=True)
        for path in (self.marker, self.running, self.seed):
            path.unlink(missing_ok=True)

    def _key(self) -> str:
        return os.path.realpath(self.root)

    def read_identity(self) -> dict[str, Any]:
        """The identity recorded in the dir."""
        if not self.marker.exists():
            raise StateMismatch(f"{self.root} holds no mmcache state")
        found = dict(orjson.loads(self.marker.read_bytes()))
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

    def load_state(self) -> CacheState:
        """Read a stopped worker's whole state (for digests and checks)."""
        identity = self.read_identity()
        state = CacheState(Capacity(*identity["capacity"]))
        for partition in self.partitions():
            db = self.open_partition(partition, read_only=True)
            try:
                load_partition(state, partition, db.items())
            finally:
                db.close()
        return state
