"""mmcache: a shared, durable, replayable encoder-cache affinity index for multimodal
LLM inference gateways.

Commands: `serve` runs a worker with its HTTP API, `broker` runs the embedded
Kafka-protocol broker alone, `rebuild` replays the event log into a new data dir,
`state digest` prints the digest of a stopped worker's state, `bench` runs the
benchmarks, `simulate` scores the affinity signal against a simulated fleet, `tune`
recommends a capacity from the recorded placements, `export` writes the event log as
JSON lines. `mmcache COMMAND --help` lists every flag with its default and its
environment variable; docs/cli.md in the repository says more.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from stream.config import (
    ConfigError,
    KafkaSecurity,
    Limits,
    Resolved,
    Settings,
    describe_validation_error,
    load_plugin_config,
)
from stream.logs import FORMAT, apply_log_level, install_repeat_filter

__all__ = ["main"]

log = logging.getLogger("mmcache")

_CAPACITY_KEYS = ("cache_size_mb_per_server", "cache_size_embeddings_per_server")
_SERVE_FLAGS = ("host", "port", "app_id", "data_dir", "bootstrap_servers", "topic", "partitions",
                *_CAPACITY_KEYS, "auth_token_file", "match_auth_token_file",
                "allow_unauthenticated_writes", "tls_cert", "tls_key", "produce_timeout_s",
                "shutdown_timeout_s", "idle_poll_s", "max_lag_events", "match_source", "log_level",
                "checkpoint_topic", "from_checkpoint")


def _config_path(args: argparse.Namespace) -> Path | None:
    value = getattr(args, "config", None) or os.environ.get("MMCACHE_CONFIG")
    return Path(value) if value else None


def _settings(args: argparse.Namespace) -> Resolved:
    """Flags win over MMCACHE_* variables, which win over the --config file."""
    values: dict[str, Any] = {}
    plugin = None
    config = _config_path(args)
    if config is not None:
        try:
            plugin = load_plugin_config(config)
        except ConfigError as exc:
            text = str(exc)
            if not getattr(args, "config", None):  # from the variable: name it, not the flag
                text = text.replace(f"--config {config}:", f"MMCACHE_CONFIG={config}:", 1)
            raise SystemExit(f"configuration error: {text}") from None
        values = {key: value for key, value in plugin.values.items()
                  if f"MMCACHE_{key.upper()}" not in os.environ}
    flags = {key: getattr(args, key) for key in _SERVE_FLAGS if getattr(args, key, None) is not None}
    source = "default"
    if any(key in flags for key in _CAPACITY_KEYS):
        for key in _CAPACITY_KEYS:
            values.pop(key, None)
        source = "flag --" + next(k for k in _CAPACITY_KEYS if k in flags).replace("_", "-")
    elif any(f"MMCACHE_{key.upper()}" in os.environ for key in _CAPACITY_KEYS):
        for key in _CAPACITY_KEYS:
            values.pop(key, None)
        source = "environment " + next(f"MMCACHE_{k.upper()}" for k in _CAPACITY_KEYS
                                       if f"MMCACHE_{k.upper()}" in os.environ)
    elif plugin is not None and values:
        source = f"--config {plugin.source}"
    try:
        return Resolved(Settings(**{**values, **flags}), source, plugin)
    except ValidationError as exc:
        raise SystemExit(f"configuration error: {describe_validation_error(exc)}") from None
    except ValueError as exc:  # raised by a validator outside pydantic's wrapping
        raise SystemExit(f"configuration error: {exc}") from None


def _until(text: str | None) -> Any:
    from stream.state.rebuild import Until

    try:
        return Until.parse(text)
    except ValueError:
        raise SystemExit(f"--until {text!r}: give an offset (a non-negative integer, applied to every "
                         "partition) or an ISO-8601 time such as 2025-01-31T12:00:00Z") from None


async def _topic_names(bootstrap: str, security: KafkaSecurity) -> set[str]:
    from aiokafka.admin import AIOKafkaAdminClient

    from stream.kafka.clients import client_options

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **client_options(security))
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


def _serve(args: argparse.Namespace) -> None:
    from stream.serve import serve

    serve(_settings(args))


def _broker(args: argparse.Namespace) -> None:
    from stream.serve import run_broker

    run_broker(args.host, args.port)


def _rebuild(args: argparse.Namespace) -> None:
    from stream.serve import reach_cluster, refuse_file_as_data_dir
    from stream.state.rebuild import rebuild

    until = _until(args.until)
    settings = _settings(args).settings
    refuse_file_as_data_dir(settings.data_dir)
    bootstrap = settings.bootstrap_servers or ""
    reach_cluster(bootstrap, settings)
    topics = asyncio.run(_topic_names(bootstrap, settings.kafka))
    if settings.events_topic not in topics:
        ours = sorted(name for name in topics if name.endswith("-events"))
        raise SystemExit(f"topic {settings.events_topic} does not exist on {bootstrap}: check --topic "
                         f"and --app-id (event topics there: {', '.join(ours) or 'none'})")
    print(rebuild(settings, until, args.workers))


def _state_digest(args: argparse.Namespace) -> None:
    from stream.state.datadir import DataDir

    if not args.data_dir.is_dir():
        raise SystemExit(f"--data-dir {args.data_dir}: no such directory")
    print(DataDir(args.data_dir).load_state().digest())


def _bench(args: argparse.Namespace) -> None:
    from stream.bench.run import run

    out = args.out or Path("bench/quick.json" if args.quick else "bench/results.json")
    run(out, quick=args.quick, only=args.only, bootstrap=args.bootstrap_servers)


def _version() -> str:
    try:
        return metadata.version("mmcache")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _default(model: type[Any], name: str) -> Any:
    return model.model_fields[name].default


def _flag(parser: argparse.ArgumentParser | Any, name: str, text: str, *, env: bool = True,
          default: Any = None, model: type[Any] = Settings, **kwargs: Any) -> None:
    """A flag whose help ends with its default and its environment variable."""
    field = name.lstrip("-").replace("-", "_")
    if default is None and field in model.model_fields:
        default = _default(model, field)
    notes = []
    if default is not None:
        notes.append(f"default: {default}")
    if env:
        notes.append(f"env MMCACHE_{field.upper()}")
    parser.add_argument(name, help=f"{text} ({'; '.join(notes)})" if notes else text, **kwargs)


def _environment_only() -> str:
    """The settings that are environment variables only, with their defaults."""
    lines = ["settings from the environment only:"]
    for field, info in Limits.model_fields.items():
        if field == "body_budget_bytes":
            lines.append(f"  MMCACHE_{field.upper()} (default 4 x MMCACHE_MAX_BODY_BYTES)")
            continue
        lines.append(f"  MMCACHE_{field.upper()} (default {info.default})")
    for name in ("replication_factor", "min_insync_replicas"):
        lines.append(f"  MMCACHE_{name.upper()} (default: 3 and 2 on 3 or more brokers, else 1 and 1)")
    lines.append(f"  MMCACHE_MAX_WRITES_IN_FLIGHT (default {_default(Settings, 'max_writes_in_flight')})")
    lines.append("  MMCACHE_BODY_READERS (default: the usable cores, os.sched_getaffinity)")
    lines.append(f"  MMCACHE_BODY_READ_TIMEOUT_S (default {_default(Settings, 'body_read_timeout_s')})")
    bound = _default(Settings, "engine_view_max_entries")
    lines.append(f"  MMCACHE_ENGINE_VIEW_MAX_ENTRIES (default {bound}; give rebuild the same)")
    for field, info in KafkaSecurity.model_fields.items():
        lines.append(f"  MMCACHE_KAFKA_{field.upper()} (default {info.default or 'unset'})")
    lines.append("Flags win over the environment, which wins over --config.")
    return "\n".join(lines)


def _add_capacity(parser: argparse.ArgumentParser) -> None:
    capacity = parser.add_mutually_exclusive_group()
    _flag(capacity, "--cache-size-mb-per-server", "per-endpoint LRU budget in MiB, 2 MiB an item "
          "(the plugin's cacheSizeInMBPerServer; <= 0 means the default)", default="2048 -> 1024 "
          "entries", type=int, metavar="N")
    _flag(capacity, "--cache-size-embeddings-per-server", "size mode instead: the sum of item sizes "
          "an endpoint holds (the plugin's cacheSizeInEmbeddingsPerServer)", default="off",
          type=int, metavar="N")


def _add_config(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "--config", "YAML with the Go plugin's parameters: at top level, under "
          "parameters:, or a whole gateway configuration whose plugins: list has an entry of type "
          "mm-embeddings-cache-producer (the rest is ignored)", default="none", metavar="FILE")


def _add_debug(parser: argparse.ArgumentParser, top: bool = False) -> None:
    parser.add_argument("--debug", action="store_true",
                        default=False if top else argparse.SUPPRESS,
                        help="show the traceback of an unexpected failure (env MMCACHE_DEBUG=1)")


#: The commands whose parsers need neither the simulator nor the bench: their runs build
#: only their own (``_parser``), and `serve` starts without importing either (~0.25 s).
_SERVICE_COMMANDS = frozenset({"serve", "broker", "rebuild", "state"})


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `mmcache` parser; for one of ``_SERVICE_COMMANDS`` without the subcommands
    that need the simulator or the bench (every one otherwise, as ``--help`` lists them)."""
    parser = argparse.ArgumentParser(
        prog="mmcache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"mmcache {_version()}")
    _add_debug(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run a worker with its HTTP API", epilog=_environment_only(),
        description="Run a worker (Faust consumer of the event topic, RocksDB state, HTTP API) in "
        "the foreground until SIGINT or SIGTERM.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _flag(serve, "--host", "address the HTTP API listens on; any address but loopback "
          "(127.0.0.0/8, ::1, localhost) needs --auth-token-file or --allow-unauthenticated-writes")
    _flag(serve, "--port", "HTTP port", type=int)
    _flag(serve, "--app-id", "workers with the same app id on the same cluster share the work and "
          "one view; names the topics")
    _flag(serve, "--data-dir", "where the local state lives", type=Path, metavar="DIR")
    _flag(serve, "--bootstrap-servers", "Kafka cluster to use", default="none: start an embedded "
          "broker for development, its log kept in the data dir", metavar="HOST:PORT")
    _flag(serve, "--topic", "event topic", default="<app-id>-events", metavar="NAME")
    _flag(serve, "--partitions", "partitions of the event topic when mmcache creates it", type=int)
    _add_capacity(serve)
    _add_config(serve)
    _flag(serve, "--auth-token-file", "bearer tokens, one a line, required by writes and /v1/state",
          type=Path, default="open", metavar="FILE")
    _flag(serve, "--match-auth-token-file", "bearer tokens required by /v1/match", type=Path,
          default="open", metavar="FILE")
    _flag(serve, "--allow-unauthenticated-writes", "serve writes and /v1/state without tokens on "
          "an address other than loopback, on purpose (refused otherwise)", default="off",
          action="store_const", const=True)  # None when absent: the variable still counts
    _flag(serve, "--tls-cert", "serve HTTPS with this certificate (with --tls-key)", type=Path,
          default="plain HTTP", metavar="FILE")
    _flag(serve, "--tls-key", "private key of --tls-cert", type=Path, default="none", metavar="FILE")
    _flag(serve, "--produce-timeout-s", "a write not acknowledged within this many seconds gets 503",
          type=float, metavar="S")
    _flag(serve, "--shutdown-timeout-s", "exit anyway this long after SIGTERM, keeping the local "
          "state (exit code 3)", type=float, metavar="S")
    _flag(serve, "--idle-poll-s", "on the embedded broker: how often idle consumers look for writes "
          "made by other processes (serve's own writes are seen at once)", type=float, metavar="S")
    _flag(serve, "--max-lag-events", "/readyz answers 503 while the view lags the log by more "
          "than N events", type=int, default="off", metavar="N")
    _flag(serve, "--match-source", "what /v1/match answers each endpoint from: auto (its engine "
          "view where it reports its own cache, else its estimate LRU), estimate (always the LRU), "
          "engine (always the engine view: an endpoint that never reported matches nothing)",
          choices=["auto", "estimate", "engine"])
    _flag(serve, "--log-level", "debug shows the libraries' own lines too",
          choices=["debug", "info", "warning", "error"])
    _add_debug(serve)
    serve.set_defaults(run=_serve)

    broker = commands.add_parser("broker", help="run the embedded broker alone",
                                 description="Run the embedded Kafka-protocol broker (memory only) "
                                 "in the foreground, for several serve processes or tools.")
    broker.add_argument("--port", type=int, default=9092, help="port to listen on (default: 9092)")
    broker.add_argument("--host", default="127.0.0.1", help="address (default: 127.0.0.1)")
    _add_debug(broker)
    broker.set_defaults(run=_broker)

    rebuild = commands.add_parser(
        "rebuild", help="rebuild the state by replaying the log",
        description="Replay the event topic from its start into a new data dir, then print the "
        "state digest (equal to the live service's for the same events). A partition whose "
        "oldest events were trimmed starts from the checkpoint in the changelog.")
    _flag(rebuild, "--bootstrap-servers", "Kafka cluster holding the event topic",
          required="MMCACHE_BOOTSTRAP_SERVERS" not in os.environ, default="required",
          metavar="HOST:PORT")
    _flag(rebuild, "--data-dir", "the new (missing or empty) data dir to write", type=Path,
          required="MMCACHE_DATA_DIR" not in os.environ, default="required", metavar="DIR")
    _flag(rebuild, "--app-id", "app id of the live service")
    _flag(rebuild, "--topic", "event topic", default="<app-id>-events", metavar="NAME")
    _add_config(rebuild)
    _add_capacity(rebuild)
    rebuild.add_argument("--until", metavar="OFFSET|TIME",
                         help="replay only up to this offset (in every partition) or this ISO-8601 "
                         "time (record timestamps) (default: the end)")
    rebuild.add_argument("--workers", type=int, metavar="N",
                         help="replay processes (default: one per core)")
    _flag(rebuild, "--checkpoint-topic", "changelog holding the checkpoint a partition starts "
          "from when the topic's oldest events were trimmed (the state at the changelog's last "
          "applied offset, then the events after it)", default="<app-id>-lru-changelog",
          metavar="NAME")
    _flag(rebuild, "--from-checkpoint", "start every partition from its checkpoint, trimmed or "
          "not: replays only the events after it", default="off: only trimmed partitions",
          action="store_const", const=True)
    _add_debug(rebuild)
    rebuild.set_defaults(run=_rebuild)

    state = commands.add_parser("state", help="inspect a stopped worker's state")
    state_commands = state.add_subparsers(dest="state_command", required=True, metavar="COMMAND")
    digest = state_commands.add_parser("digest", help="print the state digest of a data dir",
                                       description="Print the state digest of a stopped worker's "
                                       "data dir (as GET /v1/state reports it).")
    digest.add_argument("--data-dir", type=Path, required=True, metavar="DIR",
                        help="the data dir (required)")
    _add_debug(digest)
    digest.set_defaults(run=_state_digest)
    if command in _SERVICE_COMMANDS:
        return parser

    from stream.bench.run import ON_REQUEST, SCENARIOS
    from stream.sim.commands import add_commands as add_sim_commands

    bench = commands.add_parser("bench", help="run the benchmark suite",
                                description="Run the benchmarks on an embedded broker; write JSON "
                                "and a Markdown table.")
    bench.add_argument("--quick", action="store_true",
                       help="reduced sizes, under 90 s; written to bench/quick.json unless --out")
    bench.add_argument("--only", action="append", choices=list(SCENARIOS), metavar="SCENARIO",
                       help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}; "
                       f"{', '.join(sorted(ON_REQUEST))} only when named (it needs `make e2e`'s "
                       "environment)")
    bench.add_argument("--out", type=Path, default=None, metavar="FILE",
                       help="JSON results (default: bench/results.json, bench/quick.json with "
                       "--quick); the table goes beside it as .md")
    bench.add_argument("--bootstrap-servers", metavar="HOST:PORT",
                       help="use this cluster instead of an embedded broker (default: embedded)")
    _add_debug(bench)
    bench.set_defaults(run=_bench)
    add_sim_commands(commands)  # simulate, tune, export
    for name in ("simulate", "tune", "export"):
        commands.choices[name].formatter_class = _DefaultOnce
    return parser


class _DefaultOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help only where the help does not already say its
    default: never twice, and "none" rather than Python's None."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.default is None:
            return f"{text} (default: none)"
        return super()._get_help_string(action)


def _debug_wanted(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("MMCACHE_DEBUG", "") not in (
        "", "0", "false", "no")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `mmcache` command: any failure is one line on stderr and a
    non-zero exit; ``--debug`` (or MMCACHE_DEBUG=1) shows the traceback instead."""
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    install_repeat_filter()
    given = sys.argv[1:] if argv is None else argv
    args = _parser(next((word for word in given if not word.startswith("-")), None)).parse_args(argv)
    apply_log_level("info")
    debug = _debug_wanted(args)
    try:
        args.run(args)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except BaseException as exc:  # CancelledError is a BaseException too
        if debug:
            raise
        what = str(exc).splitlines()[0] if str(exc) else ""
        name = " ".join(filter(None, [args.command, getattr(args, "state_command", None)]))
        print(f"mmcache {name}: {type(exc).__name__}{': ' + what if what else ''} "
              "(run again with --debug for the traceback)", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
