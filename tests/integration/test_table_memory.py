"""RocksDB's memory for the LRU table is bounded by design, not by the writes between
flushes: each partition file Faust opens for serve holds at most two 8 MiB write buffers
and an 8 MiB block cache (``stream.worker.app.TABLE_FILE_OPTIONS``). With Faust's own
defaults a file held 64 MiB buffers, up to 3, and a 2 GiB cache, and serve's RSS climbed
by hundreds of MiB between the soak's restarts."""

from __future__ import annotations

import os
from pathlib import Path

import faust

from stream.worker.app import TABLE_FILE_OPTIONS, lru_table
from stream.worker.table_mirror import TableMemory

MEMTABLES = "rocksdb.cur-size-all-mem-tables"
BLOCK_CACHE = "rocksdb.block-cache-capacity"


def test_a_partition_files_write_buffers_and_cache_stay_within_their_bound(tmp_path: Path) -> None:
    app = faust.App("table-memory", store="rocksdb://", datadir=str(tmp_path), autodiscover=False)
    store = lru_table(app, partitions=8).data  # Faust's own RocksDB store for the table
    db = store.rocksdb_options.open(tmp_path / "lru-0.db")  # as Faust opens a partition file
    try:
        value = os.urandom(16)
        written = 0
        for batch in range(40):  # ~34 MiB of records: 4x one write buffer
            for i in range(10_000):
                key = b"\x01soak/pod-%d\x00%060x" % (i % 64, batch * 10_000 + i)
                db.put(key, value)
                written += len(key) + len(value)
        bound = TABLE_FILE_OPTIONS["write_buffer_size"] * TABLE_FILE_OPTIONS["max_write_buffer_number"]
        assert written > 2 * bound  # at least one flush was due
        assert db.property_int_value(MEMTABLES) <= bound
        assert db.property_int_value(BLOCK_CACHE) == TABLE_FILE_OPTIONS["block_cache_size"]
    finally:
        db.close()


def test_rocksdbs_memory_is_in_the_metrics_by_kind(tmp_path: Path) -> None:
    """``mmcache_table_rocksdb_bytes{kind}`` sums RocksDB's own figures over the files Faust
    holds open: after writes, the write buffers hold them; a file closed counts nothing."""
    app = faust.App("table-metrics", store="rocksdb://", datadir=str(tmp_path), autodiscover=False)
    store = lru_table(app, partitions=2).data
    memory = TableMemory(store)
    assert memory.bytes() == {"memtables": 0, "block_cache": 0, "table_readers": 0}
    db = store._dbs[0] = store.rocksdb_options.open(tmp_path / "lru-0.db")
    try:
        for i in range(20_000):
            db.put(b"\x01soak/pod-%d\x00%060x" % (i % 64, i), b"v" * 16)
        held = memory.bytes()
        assert held["memtables"] >= 20_000 * 76  # the records written, not yet flushed
        [family] = memory.collect()
        assert {s.labels["kind"]: s.value for s in family.samples} == held
    finally:
        db.close()
        del store._dbs[0]
