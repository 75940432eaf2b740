"""The on-disk layout of a worker's state, and the rules for reusing it.

``DATA_DIR/mmcache-state.json`` names the layout version, app id, event topic and
capacity the state was built for; a data dir built for other ones is refused.
``DATA_DIR/v1/tables/lru-<partition>.db`` are the RocksDB files (Faust's layout, so the
worker, ``rebuild`` and ``state digest`` share them). ``RUNNING`` exists while a worker
owns the dir: finding it at start means the last run crashed, and since the local
files may then be ahead of the changelog, they are dropped and restored from it.
``SEED`` marks a state written by ``rebuild`` that no changelog holds yet.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import orjson
from rocksdict import AccessType, Options, Rdict

from stream.core.cache import CacheState, Capacity
from stream.store import load_partition

__all__ = ["STATE_FORMAT", "TABLE_NAME", "DataDir", "StateMismatch"]

STATE_FORMAT = 1
TABLE_NAME = "lru"

log = logging.getLogger(__name__)


class StateMismatch(SystemExit):
    """The data dir holds state for another layout, app, topic or capacity."""


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

    def claim(self, identity: dict[str, Any], *, fresh: bool = False) -> None:
        """Take the dir for a worker: check it, drop state a crash may have left inconsistent."""
        if fresh and self.root.exists():
            log.warning("starting from an empty state in %s", self.root)
            shutil.rmtree(self.root)
        self.check(identity)
        if self.running.exists() and not self.seed.exists():
            log.warning("the last worker on %s did not stop cleanly: dropping its local "
                        "state, to be restored from the changelog", self.root)
            shutil.rmtree(self.tables, ignore_errors=True)
        self.running.touch()

    def release(self) -> None:
        """The worker stopped cleanly; its local state is consistent with the changelog."""
        self.running.unlink(missing_ok=True)

    def check(self, identity: dict[str, Any]) -> None:
        """Refuse a state built for something else; mark an empty dir as ours."""
        if self.marker.exists():
            found = orjson.loads(self.marker.read_bytes())
            if found != identity:
                raise StateMismatch(
                    f"{self.root} holds state for {found}, not {identity}. Use another "
                    "--data-dir, or build one for these settings with `mmcache rebuild`."
                )
            return
        self.root.mkdir(parents=True, exist_ok=True)
        self.marker.write_bytes(orjson.dumps(identity))

    def read_identity(self) -> dict[str, Any]:
        """The identity recorded in the dir."""
        if not self.marker.exists():
            raise StateMismatch(f"{self.root} holds no mmcache state")
        return dict(orjson.loads(self.marker.read_bytes()))

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
