"""`mmcache` command line: serve, broker, rebuild, state digest (CONTRACT, "Command line")."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from stream.config import Settings, load_plugin_config
from stream.kafka.embedded import EmbeddedBroker
from stream.logs import install_repeat_filter

__all__ = ["main"]

log = logging.getLogger("mmcache")

_CAPACITY_KEYS = ("cache_size_mb_per_server", "cache_size_embeddings_per_server")


def _settings(args: argparse.Namespace) -> Settings:
    """Flags win over MMCACHE_* variables, which win over the --config file."""
    values: dict[str, Any] = {}
    if args.config:
        values = {
            key: value
            for key, value in load_plugin_config(Path(args.config)).items()
            if f"MMCACHE_{key.upper()}" not in os.environ
        }
    flags = {
        key: getattr(args, key)
        for key in ("host", "port", "app_id", "data_dir", "bootstrap_servers", "topic",
                    "partitions", *_CAPACITY_KEYS, "auth_token_file", "match_auth_token_file",
                    "tls_cert", "tls_key", "produce_timeout_s", "shutdown_timeout_s")
        if getattr(args, key, None) is not None
    }
    if any(key in flags for key in _CAPACITY_KEYS):
        for key in _CAPACITY_KEYS:
            values.pop(key, None)
    try:
        return Settings(**{**values, **flags})
    except ValidationError as exc:
        raise SystemExit(f"configuration error: {exc}") from None


def _serve(args: argparse.Namespace) -> None:
    """Run a worker until SIGINT/SIGTERM, in this order: refuse a data dir that is not
    ours, find the cluster (start the embedded broker, or ask the given one for its id),
    claim the dir (lock, cluster check), start reading the local state, run Faust with
    a bound on its shutdown."""
    from stream.datadir import DataDir
    from stream.kafka.fetcher import shorten_prefetch_backoff
    from stream.kafka.tansu import apply_remedies, is_tansu_id
    from stream.kafka.topics import ensure_topics
    from stream.preload import LocalPreload
    from stream.rebuild import seed_deployment
    from stream.shutdown import guard_worker

    settings = _settings(args)
    datadir = DataDir(settings.data_dir)
    datadir.refuse_foreign()  # before a broker is started for nothing (claim checks again)
    broker = None
    bootstrap = settings.bootstrap_servers
    if bootstrap:
        cluster = _cluster_id(bootstrap, settings)
    else:
        broker = _start_broker(EmbeddedBroker())
        bootstrap, cluster = broker.bootstrap_servers, broker.cluster_id
        log.warning("no --bootstrap-servers: started an embedded Kafka-protocol broker "
                    "(Tansu, memory only) on %s for development", bootstrap)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        # The embedded broker's log lives in memory: state from an earlier run describes
        # a log that no longer exists, so that state (only ours) is cleared.
        datadir.claim(DataDir.identity(settings.app_id, settings.events_topic, settings.capacity),
                      fresh=broker is not None, cluster_id=cluster)
        # Forked before any thread runs and before Faust is imported. A seeded dir is
        # rewritten first, so it is not preloaded.
        preload = None if datadir.seed.exists() else LocalPreload(datadir, settings.capacity).start()
        from stream.worker import build_worker

        embedded = is_tansu_id(cluster)
        if embedded:
            apply_remedies()
        shorten_prefetch_backoff()
        try:
            partitions = loop.run_until_complete(ensure_topics(settings, bootstrap))
        except ValueError as exc:
            raise SystemExit(f"configuration error: {exc}") from None
        if datadir.seed.exists():
            loop.run_until_complete(
                seed_deployment(bootstrap, datadir, settings.app_id, settings.events_topic, settings)
            )
        worker = build_worker(settings, bootstrap, partitions, embedded=embedded,
                              preload=preload)
        # On the forced path the local files are kept (RUNNING released): they are written
        # only once the changelog holds their records, so they are never ahead of it.
        guard_worker(worker, settings.shutdown_timeout_s, [datadir.release])
        worker.execute_from_commandline()
    except SystemExit as exc:
        if not exc.code:
            datadir.release()
        raise
    finally:
        if broker is not None:
            broker.stop()


def _cluster_id(bootstrap: str, settings: Settings) -> str:
    """The cluster's id, asked on a loop of its own that is closed with its resolver
    threads (the local state's readers are forked afterwards)."""
    from stream.kafka.tansu import cluster_id

    try:
        return asyncio.run(cluster_id(bootstrap, settings.kafka))
    except Exception as exc:  # any failure to reach the cluster is one line, not a traceback
        raise SystemExit(f"cannot reach the Kafka cluster at {bootstrap} ({exc or type(exc).__name__}): "
                         "check --bootstrap-servers and the MMCACHE_KAFKA_* settings") from None


def _start_broker(broker: EmbeddedBroker) -> EmbeddedBroker:
    try:
        return broker.start()
    except (OSError, RuntimeError) as exc:
        raise SystemExit(f"cannot start the embedded broker on {broker.bootstrap_servers}: "
                         f"{exc}") from None


def _broker(args: argparse.Namespace) -> None:
    """Run the broker in the foreground; SIGTERM and SIGINT stop it (and the child with
    it: a child left running would hold the port and the memory)."""
    broker = _start_broker(EmbeddedBroker(port=args.port, host=args.host))
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    print(f"embedded Kafka-protocol broker listening on {broker.bootstrap_servers}", flush=True)
    try:
        code = broker.wait()
    finally:
        broker.stop()
    raise SystemExit(f"the embedded broker exited with {code}" if code else 0)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _rebuild(args: argparse.Namespace) -> None:
    from stream.rebuild import Until, rebuild

    settings = _settings(args)
    print(rebuild(settings, Until.parse(args.until), args.workers))


def _state_digest(args: argparse.Namespace) -> None:
    from stream.datadir import DataDir

    print(DataDir(args.data_dir).load_state().digest())


def _bench(args: argparse.Namespace) -> None:
    from stream.bench.run import run

    run(args.out, quick=args.quick, only=args.only, bootstrap=args.bootstrap_servers)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmcache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run a worker with its HTTP API")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--app-id")
    serve.add_argument("--data-dir", type=Path)
    serve.add_argument("--bootstrap-servers")
    serve.add_argument("--topic")
    serve.add_argument("--partitions", type=int)
    capacity = serve.add_mutually_exclusive_group()
    capacity.add_argument("--cache-size-mb-per-server", type=int)
    capacity.add_argument("--cache-size-embeddings-per-server", type=int)
    serve.add_argument("--config", help="YAML with the Go plugin's parameter names")
    serve.add_argument("--auth-token-file", type=Path,
                       help="bearer tokens, one a line, required by writes and /v1/state "
                       "(env MMCACHE_AUTH_TOKEN_FILE; default: open)")
    serve.add_argument("--match-auth-token-file", type=Path,
                       help="bearer tokens required by /v1/match "
                       "(env MMCACHE_MATCH_AUTH_TOKEN_FILE; default: open)")
    serve.add_argument("--tls-cert", type=Path,
                       help="serve HTTPS with this certificate (env MMCACHE_TLS_CERT)")
    serve.add_argument("--tls-key", type=Path,
                       help="private key of --tls-cert (env MMCACHE_TLS_KEY)")
    serve.add_argument("--produce-timeout-s", type=float,
                       help="a write not acknowledged within this gets 503 "
                       "(env MMCACHE_PRODUCE_TIMEOUT_S; default 2)")
    serve.add_argument("--shutdown-timeout-s", type=float,
                       help="exit anyway this long after SIGTERM, keeping the local state "
                       "(env MMCACHE_SHUTDOWN_TIMEOUT_S; default 5)")
    serve.set_defaults(run=_serve)

    broker = commands.add_parser("broker", help="run the embedded broker alone")
    broker.add_argument("--port", type=int, default=9092)
    broker.add_argument("--host", default="127.0.0.1")
    broker.set_defaults(run=_broker)

    rebuild = commands.add_parser("rebuild", help="rebuild the state by replaying the log")
    rebuild.add_argument("--bootstrap-servers", required=True)
    rebuild.add_argument("--data-dir", type=Path, required=True)
    rebuild.add_argument("--app-id")
    rebuild.add_argument("--topic")
    rebuild.add_argument("--config")
    capacity = rebuild.add_mutually_exclusive_group()
    capacity.add_argument("--cache-size-mb-per-server", type=int)
    capacity.add_argument("--cache-size-embeddings-per-server", type=int)
    rebuild.add_argument("--until", help="replay only up to this offset (in every partition) "
                         "or this ISO-8601 time (record timestamps)")
    rebuild.add_argument("--workers", type=int, help="replay processes (default: one per core)")
    rebuild.set_defaults(run=_rebuild)

    state = commands.add_parser("state", help="inspect a stopped worker's state")
    state_commands = state.add_subparsers(dest="state_command", required=True)
    digest = state_commands.add_parser("digest", help="print the state digest of a data dir")
    digest.add_argument("--data-dir", type=Path, required=True)
    digest.set_defaults(run=_state_digest)
    bench = commands.add_parser("bench", help="run the benchmark suite")
    bench.add_argument("--quick", action="store_true", help="reduced sizes, under 90 s")
    bench.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    bench.add_argument("--out", type=Path, default=Path("bench/results.json"))
    bench.add_argument("--bootstrap-servers", help="use this cluster instead of an embedded broker")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `mmcache` command."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_repeat_filter()
    args = _parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
