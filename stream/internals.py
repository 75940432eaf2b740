"""Every internal of faust-streaming, mode-streaming and aiokafka that mmcache uses, in one
list, with the releases it was read from.

"Internal" means a private name (``_x``) of their classes or modules, or a public-looking
name that their documentation does not promise: an attribute of an internal class (the
consumer thread, the RocksDB store, aiokafka's fetcher and group coordinator), a method
mmcache replaces, a module-level helper. Each entry says where it is defined, how mmcache
reaches it and which of mmcache's modules uses it.

Kept true by ``tests/unit/test_internals.py``: the installed releases are the pinned ones
(and pyproject.toml pins them exactly); every entry exists on the real class or module of
those releases; every entry is still used; and no private name of these libraries is used
anywhere under ``stream/`` unless it is listed here. To upgrade a pin, re-read the code of
each entry of that library in the new release, then change :data:`PINNED` and pyproject.

At run time ``stream.worker.faust_batches.install`` refuses other releases (``check_versions``)
and a consumer that lacks one of its names (``check_consumer``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

__all__ = ["INTERNALS", "PINNED", "Internal", "check_versions", "names", "wrong_versions"]

#: The releases whose internals are listed, pinned exactly in pyproject.toml.
PINNED = {"faust-streaming": "0.15.3", "mode-streaming": "0.7.1", "aiokafka": "0.14.0"}

# Where the entries live (classes are named where the instance mmcache reaches is made).
CONSUMER = "faust.transport.drivers.aiokafka.Consumer"            # app.consumer
CONSUMER_THREAD = "faust.transport.drivers.aiokafka.AIOKafkaConsumerThread"  # app.consumer._thread
PRODUCER = "faust.transport.drivers.aiokafka.Producer"            # app.producer
APP = "faust.app.base.App"                                        # app
STORE = "faust.stores.rocksdb.Store"                              # table.data
RECOVERY = "faust.tables.recovery.Recovery"                       # app.tables.recovery
TABLE_MANAGER = "faust.tables.manager.TableManager"               # app.tables (subclassed)
AIOKAFKA_CONSUMER = "aiokafka.consumer.consumer.AIOKafkaConsumer"
GROUP_COORDINATOR = "aiokafka.consumer.group_coordinator.GroupCoordinator"
FETCHER = "aiokafka.consumer.fetcher.Fetcher"
CLIENT = "aiokafka.client.AIOKafkaClient"


@dataclass(frozen=True, slots=True)
class Internal:
    """One name of one library that mmcache relies on."""

    library: str  # the distribution whose code defines it (a key of PINNED)
    owner: str    # the class (or module) it is reached on, by import path
    name: str
    used_by: str  # mmcache's module(s) that use it
    how: str      # what mmcache does with it

    @property
    def is_module(self) -> bool:
        """Whether ``owner`` is a module (a module-level name), not a class."""
        return self.owner.rpartition(".")[2][:1].islower()

    @property
    def private(self) -> bool:
        """A name its library marks as private."""
        return self.name.startswith("_")


def _faust(owner: str, name: str, used_by: str, how: str) -> Internal:
    return Internal("faust-streaming", owner, name, used_by, how)


def _mode(owner: str, name: str, used_by: str, how: str) -> Internal:
    return Internal("mode-streaming", owner, name, used_by, how)


def _aiokafka(owner: str, name: str, used_by: str, how: str) -> Internal:
    return Internal("aiokafka", owner, name, used_by, how)


_BATCHES = "stream.worker.faust_batches"

INTERNALS: tuple[Internal, ...] = (
    # -- faust-streaming: the consumer, whose drain loop stream.worker.faust_batches replaces --
    _faust(CONSUMER, "_drain_messages", _BATCHES, "replaced, the original kept for other apps"),
    _faust(CONSUMER, "_wait_next_records", _BATCHES, "the fetch of one drain turn"),
    _faust(CONSUMER, "_to_message", _BATCHES, "records of other topics, for Faust's per-message path"),
    _faust(CONSUMER, "_add_gap", _BATCHES, "offsets absent between records"),
    _faust(CONSUMER, "_read_offset", _BATCHES, "per-TP last offset read (committed after a seek)"),
    _faust(CONSUMER, "_committed_offset", _BATCHES, "per-TP committed offset"),
    _faust(CONSUMER, "_acked", _BATCHES, "per-TP acked offsets, committed by commit"),
    _faust(CONSUMER, "_acked_index", _BATCHES, "per-TP set of those offsets"),
    _faust(CONSUMER, "_n_acked", _BATCHES, "acks since the last broker_commit_every commit"),
    _faust(CONSUMER, "_commit_every", _BATCHES, "broker_commit_every"),
    _faust(CONSUMER, "_buffered_partitions", _BATCHES, "TPs Faust still delivers while their flow is paused"),
    _faust(CONSUMER, "_unacked_messages", _BATCHES, "what wait_empty waits for on a revocation or stop"),
    _faust(CONSUMER, "_waiting_for_ack", _BATCHES, "the future wait_empty sleeps on; notify-ed on acks"),
    _faust(CONSUMER, "_thread", _BATCHES, "the consumer thread owning aiokafka's consumer"),
    _faust(CONSUMER, "suspend_flow", _BATCHES, "the event a drain turn races the handler against"),
    _faust(CONSUMER, "flow_active", _BATCHES, "whether Faust would deliver now"),
    _faust(CONSUMER, "can_resume_flow", _BATCHES, "the event resume_flow sets, waited for before a fetch"),
    _faust(CONSUMER, "_get_active_partitions", _BATCHES, "the TPs not paused, polled before a fetch"),
    _mode(CONSUMER, "diag", _BATCHES, "mode Service: the fetching flag (CONSUMER_FETCHING) of the drain"),
    _faust(CONSUMER, "perform_seek", _BATCHES, "seeks pending after a rebalance"),
    _faust(CONSUMER, "highwater", _BATCHES, "end offset for the monitor"),
    _faust(CONSUMER, "scheduler", _BATCHES, "the order Faust delivers records of several TPs in"),
    _faust(CONSUMER, "callback", _BATCHES, "Faust's per-message delivery"),
    _faust(CONSUMER, "commit", _BATCHES, "broker_commit_every honoured between batches"),
    _faust(CONSUMER, "consumer_stopped_errors", _BATCHES, "errors that end the drain"),
    _mode(CONSUMER, "_stopped", _BATCHES, "mode Service: the drain ends when it is set"),
    _mode(CONSUMER, "should_stop", _BATCHES, "mode Service: stop requested"),
    _mode(CONSUMER, "wait_first", _BATCHES, "mode Service: the race of handler and suspend_flow"),
    _mode(CONSUMER, "wait", _BATCHES, "mode Service: an event, or the consumer's stop"),
    _mode(CONSUMER, "sleep", _BATCHES, "mode Service: the yield of the per-message path"),
    _faust(APP, "consumer_generation_id", _BATCHES, "the generation a batch was fetched in"),
    _faust(APP, "flow_control", _BATCHES, "the app's flow control, waited for as the conductor does"),
    _faust(APP, "monitor", _BATCHES, "end offsets tracked as Faust does"),
    _faust(APP, "topics", _BATCHES, "the conductor, for the per-message path"),
    _faust("faust.transport.consumer", "CONSUMER_FETCHING", _BATCHES, "the diag flag of a fetch"),
    _faust("faust.types.tuples", "ack_lock", _BATCHES, "the lock Consumer.ack takes"),
    _mode("mode.utils.futures", "notify", _BATCHES, "wakes wait_empty after acks"),
    # -- the consumer thread, where aiokafka's consumer lives --
    _faust(CONSUMER_THREAD, "_ensure_consumer", _BATCHES, "aiokafka's consumer, for the ownership check"),
    _mode(CONSUMER_THREAD, "call_thread", _BATCHES, "runs the ownership check and seeks on that thread"),
    _faust(CONSUMER_THREAD, "seek", _BATCHES, "aiokafka's seek, called on its own thread"),
    # -- the table manager, subclassed without its 1 s start sleep --
    _faust(TABLE_MANAGER, "on_start", _BATCHES, "overridden (PromptTableManager), the rest kept as pinned"),
    _faust(TABLE_MANAGER, "_update_channels", _BATCHES, "the start of the table manager, as Faust's"),
    _faust(TABLE_MANAGER, "recovery", f"{_BATCHES}, stream.worker.table_mirror",
           "started as Faust's on_start does; its offsets wrapped (table_mirror)"),
    # -- the RocksDB store of the table (table.data) --
    _faust(STORE, "_dbs", "stream.worker.table_mirror, stream.worker.app", "each partition's open RocksDB"),
    _faust(STORE, "_db_for_partition", "stream.worker.table_mirror", "opens a partition's RocksDB"),
    _faust(STORE, "apply_changelog_batch", "stream.worker.table_mirror", "wrapped per store: restore gate"),
    _faust(STORE, "set_persisted_offset", "stream.worker.table_mirror",
           "Faust's offset record, written with a batch's rows (stopped before a held removal)"),
    _faust(STORE, "persisted_offset", "stream.worker.app",
           "the changelog offset a live table file holds (tombstones a rebase must keep)"),
    _faust(PRODUCER, "flush", "stream.worker.app", "the changelog flushed before a rebase"),
    _faust(STORE, "partition_path", "stream.worker.table_mirror",
           "a partition file's path (room checks, reopen)"),
    _faust(STORE, "rocksdb_options", "stream.worker.table_mirror", "reopens a partition file as Faust does"),
    _faust(RECOVERY, "_build_offsets", "stream.worker.table_mirror",
           "wrapped per app: the restore gates made anew, the files behind their "
           "changelog caught up in bulk first"),
    _faust(RECOVERY, "_build_highwaters", "stream.worker.table_mirror",
           "asks the active changelog ends again while the log is being restored"),
    _faust(RECOVERY, "active_highwaters", "stream.worker.table_mirror",
           "each active changelog partition's last offset, built just before"),
    # -- the producer --
    _faust(PRODUCER, "_ensure_producer", "stream.worker.table_mirror", "aiokafka's producer, whole batches"),
    # -- aiokafka: the group coordinator (stream.kafka.coordinator) --
    _aiokafka(AIOKAFKA_CONSUMER, "_coordinator", "stream.kafka.coordinator", "its group coordinator"),
    _aiokafka(GROUP_COORDINATOR, "_send_req", "stream.kafka.coordinator", "sends the membership heartbeat"),
    _aiokafka(GROUP_COORDINATOR, "generation", "stream.kafka.coordinator", "the member's generation"),
    _aiokafka(GROUP_COORDINATOR, "member_id", "stream.kafka.coordinator",
              "the member's id (new after a rebase of the embedded broker: stream.kafka.rebase)"),
    _aiokafka(GROUP_COORDINATOR, "group_id", "stream.kafka.coordinator", "the group"),
    _aiokafka("aiokafka.protocol.group", "HeartbeatRequest", "stream.kafka.coordinator",
              "the request that asks for membership"),
    # -- aiokafka: the fetcher (stream.kafka.fetcher, stream.kafka.tansu) --
    _aiokafka(FETCHER, "__init__", "stream.kafka.fetcher", "wrapped: caps a keyword setting"),
    _aiokafka(FETCHER, "end_offsets", "stream.kafka.tansu", "replaced on Tansu: end offsets from a fetch"),
    _aiokafka(FETCHER, "_get_actions_per_node", "stream.kafka.fetch_gate",
              "wrapped on serve's own broker: a repeated empty fetch held until a wake"),
    _aiokafka(FETCHER, "_proc_fetch_request", "stream.kafka.fetch_gate",
              "wrapped on serve's own broker: whether a fetch came back empty"),
    _aiokafka(GROUP_COORDINATOR, "_maybe_leave_group", "stream.kafka.tansu",
              "replaced on Tansu: a stopping member expires instead of leaving"),
    _aiokafka(GROUP_COORDINATOR, "reset_generation", "stream.kafka.tansu",
              "what the replacement keeps of the original"),
    _aiokafka(FETCHER, "_client", "stream.kafka.tansu", "the fetcher's client, in the replacement"),
    _aiokafka(FETCHER, "_isolation_level", "stream.kafka.tansu", "the fetch's isolation level"),
    _aiokafka(FETCHER, "_retry_backoff", "stream.kafka.tansu", "the wait between attempts"),
    _aiokafka(CLIENT, "_maybe_wait_metadata", "stream.kafka.tansu", "waits for metadata as end_offsets does"),
    _aiokafka(CLIENT, "cluster", "stream.kafka.tansu, stream.kafka.batches", "partition leaders"),
    _aiokafka(CLIENT, "add_topic", "stream.kafka.tansu, stream.kafka.batches", "asks metadata for a topic"),
    _aiokafka(CLIENT, "force_metadata_update", "stream.kafka.tansu, stream.kafka.batches",
              "refreshes metadata"),
    _aiokafka(CLIENT, "send", "stream.kafka.tansu, stream.kafka.batches",
              "sends a protocol request to a node"),
    _aiokafka("aiokafka.protocol.fetch", "FetchRequest", "stream.kafka.tansu", "the one-byte fetch"),
    _aiokafka("aiokafka.protocol.metadata", "MetadataRequest", "stream.kafka.tansu", "asks the cluster's id"),
    _aiokafka("aiokafka.client", "MetadataRequest", "stream.kafka.tansu",
              "replaced for serve's own broker: metadata requests that create no topic"),
    # -- aiokafka: a connection on uvloop (stream.event_loop) --
    _aiokafka("aiokafka.conn.AIOKafkaConnection", "send", "stream.event_loop",
              "wrapped: uvloop's RuntimeError for a closed transport made a broken connection"),
    _aiokafka("aiokafka.conn", "CloseReason", "stream.event_loop", "why that connection is closed"),
    # -- aiokafka: a kept log given back at its own offsets (stream.kafka.batches) --
    _aiokafka("aiokafka.record.default_records", "DefaultRecordBatchBuilder", "stream.kafka.batches",
              "builds record batches whose offset deltas keep the gaps compaction left"),
    _aiokafka("aiokafka.protocol.produce", "ProduceRequest", "stream.kafka.batches",
              "sends those batches (the producer numbers records one after another)"),
    _aiokafka(CLIENT, "bootstrap", "stream.kafka.batches", "connects the client"),
    _aiokafka(CLIENT, "close", "stream.kafka.batches", "closes it"),
)


def names(owner: str, *, private: bool | None = None) -> tuple[str, ...]:
    """The listed names reached on ``owner`` (only the private or public ones if told)."""
    return tuple(entry.name for entry in INTERNALS
                 if entry.owner == owner and (private is None or entry.private == private))


def wrong_versions(installed: Callable[[str], str] | None = None,
                   libraries: tuple[str, ...] = tuple(PINNED)) -> dict[str, str]:
    """``{library: installed release}`` for each of ``libraries`` not at its pin."""
    def found(name: str) -> str:
        try:
            return (installed or version)(name)
        except PackageNotFoundError:
            return "not installed"

    return {name: got for name in libraries if (got := found(name)) != PINNED[name]}


def check_versions(installed: Callable[[str], str] | None = None, user: str = "mmcache",
                   libraries: tuple[str, ...] = tuple(PINNED)) -> None:
    """Refuse to run on internals of releases other than the pinned ones."""
    wrong = wrong_versions(installed, libraries)
    if wrong:
        described = ", ".join(f"{name} {got} (needs {PINNED[name]})" for name, got in wrong.items())
        raise RuntimeError(f"{user} uses internals of "
                           f"{', '.join(f'{n}=={PINNED[n]}' for n in libraries)} (stream.internals); "
                           f"installed: {described}. Install the pinned releases, or re-read "
                           f"those internals before changing the pins.")
