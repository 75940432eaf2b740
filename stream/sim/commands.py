"""The ``simulate``, ``tune`` and ``export`` commands, added to the CLI by ``add_commands``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import orjson

from stream.core.cache import DEFAULT_CACHE_MB, MB_PER_ITEM, Capacity
from stream.sim.fleet import DEFAULT_ENCODER_CACHE_SIZE, POLICIES, FleetSpec, PolicyResult, simulate
from stream.sim.tune import MIN_REPEATS
from stream.sim.workload import Request, WorkloadSpec, generate, requests_from_trace

__all__ = ["add_commands", "format_simulation", "format_tune", "run_simulation"]

_ENV_HELP = "Kafka security from MMCACHE_KAFKA_* as for serve"


def add_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``simulate``, ``tune`` and ``export`` to the ``mmcache`` subcommands."""
    _add_simulate(commands)
    _add_tune(commands)
    _add_export(commands)


# -- simulate ------------------------------------------------------------------------------


def _add_simulate(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sim = commands.add_parser(
        "simulate", help="score the affinity signal against a simulated fleet's true encoder caches",
        description="Trace-driven, deterministic simulation of model servers with vLLM-like "
        "encoder caches behind gateway replicas; for each routing policy prints the true "
        "encoder-cache hit ratio (by items and by embeddings), embeddings saved, load "
        "imbalance (max/mean queue) and, for the index policies, precision and recall of "
        "'predicted cached' against the true caches. Same seed, same output.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sim.add_argument("--servers", type=int, default=16, help="model servers (P)")
    sim.add_argument("--replicas", type=int, default=3, help="gateway replicas (G); per-replica keeps one "
                     "index per replica, the shared index (index, index-size) is one for all")
    sim.add_argument("--requests", type=int, default=100_000, help="requests to simulate")
    sim.add_argument("--seed", type=int, default=1, help="seed of every random draw")
    sim.add_argument("--runs", type=int, default=1,
                     help="runs with seeds --seed, --seed+1, ...; figures are then means, the table "
                     "gives each with its spread (half the range over the runs)")
    sim.add_argument("--policies", default=",".join(POLICIES),
                     help=f"comma-separated policies, of: {', '.join(POLICIES)}")
    sim.add_argument("--encoder-cache-size", type=int, default=DEFAULT_ENCODER_CACHE_SIZE,
                     help="each server's encoder cache in embeddings; vLLM's default encoder_cache_size "
                     "is max_num_batched_tokens, 8192 for its OpenAI server on H100-class GPUs")
    sim.add_argument("--encoder-budget", type=int, default=None,
                     help="per-step encoder compute budget in embeddings; an item over it can never "
                     "be scheduled (default: the encoder cache size)")
    sim.add_argument("--cache-size-mb-per-server", type=int, default=DEFAULT_CACHE_MB,
                     help=f"the index policy's capacity as the Go plugin's cacheSizeInMBPerServer "
                     f"({MB_PER_ITEM} MiB per item)")
    sim.add_argument("--index-items", type=int, default=None,
                     help="the index and per-replica capacity in items, instead of "
                     "--cache-size-mb-per-server")
    sim.add_argument("--index-embeddings", type=int, default=None,
                     help="the index-size capacity in embeddings (default: --encoder-cache-size)")
    sim.add_argument("--slots", type=int, default=16, help="requests a server runs at once")
    sim.add_argument("--rate", type=float, default=6.0,
                     help="arrivals per second per server (Poisson); with the defaults a "
                     "least-loaded fleet is about 80%% busy")
    sim.add_argument("--decode-s", type=float, default=2.0, help="mean decode time (exponential), seconds")
    sim.add_argument("--encode-ms-per-1k", type=float, default=40.0,
                     help="encoder time per 1,000 embeddings not found in the cache, milliseconds")
    sim.add_argument("--prefill-ms-per-1k", type=float, default=20.0,
                     help="prefill time per 1,000 embeddings, milliseconds (references are held "
                     "for encode plus prefill, then dropped)")
    sim.add_argument("--catalogue", type=int, default=10_000, help="distinct items")
    sim.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of item popularity")
    sim.add_argument("--min-items", type=int, default=1, help="fewest items per request")
    sim.add_argument("--max-items", type=int, default=4, help="most items per request")
    sim.add_argument("--trace", type=Path, default=None,
                     help="replay recorded placements (the JSON lines of 'mmcache export') instead of "
                     "the synthetic workload; their timestamps give the arrivals")
    sim.add_argument("--write-trace", type=Path, default=None,
                     help="write the placements the first policy made (first run) as 'mmcache export' "
                     "JSON lines, keyed and partitioned as the service would (8 partitions): input for "
                     "'mmcache tune --input'")
    sim.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    sim.set_defaults(run=_simulate)


def run_simulation(args: argparse.Namespace, seed: int | None = None,
                   placed: list[tuple[str, Request]] | None = None) -> dict[str, PolicyResult]:
    """Every asked policy over the same requests, from parsed ``simulate`` arguments (with
    ``seed`` instead of ``args.seed`` when given)."""
    seed = args.seed if seed is None else seed
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"simulate: unknown policy {unknown[0]!r}; choose from {', '.join(POLICIES)}")
    for flag in ("servers", "replicas", "requests", "encoder_cache_size", "slots"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"simulate: --{flag.replace('_', '-')} must be at least 1")
    if args.trace is not None:
        from stream.sim.eventlog import placements, read_jsonl

        records = read_jsonl(args.trace)
        requests = requests_from_trace(placements(records), args.replicas, args.rate * args.servers,
                                       args.decode_s, seed)[: args.requests]
    else:
        requests = generate(WorkloadSpec(
            requests=args.requests, rate=args.rate * args.servers, catalogue=args.catalogue,
            zipf=args.zipf, min_items=args.min_items, max_items=args.max_items,
            decode_s=args.decode_s, replicas=args.replicas, seed=seed))
    items = args.index_items or Capacity.from_params(args.cache_size_mb_per_server).per_endpoint
    fleet = FleetSpec(
        servers=args.servers, slots=args.slots, encoder_cache_size=args.encoder_cache_size,
        budget=args.encoder_budget or 0, encode_s=args.encode_ms_per_1k / 1e6,
        prefill_s=args.prefill_ms_per_1k / 1e6, index_items=items,
        index_embeddings=args.index_embeddings or args.encoder_cache_size)
    return {p: simulate(requests, fleet, p, seed=seed, replicas=args.replicas,
                        placed=placed if n == 0 else None) for n, p in enumerate(policies)}


# (title, attribute, digits, extra width for big numbers)
_COLUMNS = (("hit items", "hit_ratio", 3, 0), ("hit emb", "hit_ratio_embeddings", 3, 0),
            ("emb saved", "embeddings_hit", 0, 4), ("imbalance", "imbalance", 3, 0),
            ("latency s", "mean_latency_s", 2, 0), ("precision", "precision", 3, 0),
            ("recall", "recall", 3, 0))


def format_simulation(runs: Sequence[dict[str, PolicyResult]]) -> str:
    """The terminal table: one row per policy, each figure the mean over the runs, with
    its spread (half the range) when there are several."""
    several = len(runs) > 1
    width = 15 if several else 11
    head = f"{'policy':<13}" + "".join(f"{title:>{width + extra * (1 + several)}}"
                                       for title, _, _, extra in _COLUMNS)
    lines = [head, "-" * len(head)]
    for name in runs[0]:
        cells = []
        for _, attribute, digits, extra in _COLUMNS:
            cell = width + extra * (1 + several)
            values = [getattr(run[name], attribute) for run in runs]
            if values[0] is None:
                cells.append(f"{'-':>{cell}}")
                continue
            mean = sum(values) / len(values)
            text = f"{mean:,.{digits}f}"
            if several:
                text += f" ±{(max(values) - min(values)) / 2:,.{digits}f}"
            cells.append(f"{text:>{cell}}")
        lines.append(f"{name:<13}" + "".join(cells))
    refused = sum(r.refused for run in runs for r in run.values())
    if refused:
        lines.append(f"({refused} requests refused in all: an item over the per-step encoder budget)")
    return "\n".join(lines)


def _mean_summary(runs: Sequence[dict[str, PolicyResult]]) -> dict[str, dict[str, float | int | None]]:
    """The JSON figures, means over the runs (null where a figure does not apply)."""
    out: dict[str, dict[str, float | int | None]] = {}
    for name in runs[0]:
        summaries = [run[name].summary() for run in runs]
        figures: dict[str, float | int | None] = {}
        for key, first in summaries[0].items():
            if first is None:
                figures[key] = None
            else:
                mean = sum(s[key] for s in summaries) / len(summaries)  # type: ignore[misc]
                figures[key] = round(mean) if isinstance(first, int) else mean
        out[name] = figures
    return out


def _simulate(args: argparse.Namespace) -> None:
    if args.runs < 1:
        raise SystemExit("simulate: --runs must be at least 1")
    started = time.monotonic()
    placed: list[tuple[str, Request]] | None = [] if args.write_trace is not None else None
    runs = [run_simulation(args, args.seed + n, placed if n == 0 else None) for n in range(args.runs)]
    if placed is not None:
        _write_trace(args.write_trace, placed)
    if args.format == "json":
        doc = {"policies": _mean_summary(runs)}
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    requests = next(iter(runs[0].values())).requests if runs[0] else 0
    seeds = f"seed {args.seed}" if args.runs == 1 else f"seeds {args.seed}..{args.seed + args.runs - 1}"
    print(f"{requests:,} requests, {args.servers} servers (encoder cache {args.encoder_cache_size:,} "
          f"embeddings), {args.replicas} gateway replicas, {seeds}; index capacity "
          f"{args.index_items or Capacity.from_params(args.cache_size_mb_per_server).per_endpoint:,} items, "
          f"index-size {args.index_embeddings or args.encoder_cache_size:,} embeddings")
    print(format_simulation(runs))
    print(f"({time.monotonic() - started:.1f} s)", file=sys.stderr)


def _write_trace(path: Path, placed: Sequence[tuple[str, Request]], partitions: int = 8) -> None:
    from stream.core.events import ItemsPlaced, Position
    from stream.core.routing import key_partition
    from stream.sim.eventlog import Recorded, write_jsonl

    offsets = [0] * partitions
    records = []
    for endpoint, request in placed:
        partition = key_partition(endpoint.encode(), partitions)
        event = ItemsPlaced(endpoint=endpoint, items=list(request.items), request_id=f"sim-{request.id}")
        stamp = round(request.arrival * 1000)
        records.append(Recorded(Position(partition, offsets[partition]), stamp, event))
        offsets[partition] += 1
    with path.open("wb") as out:
        write_jsonl(records, out)


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


# -- tune ----------------------------------------------------------------------------------


def _add_tune(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    tune = commands.add_parser(
        "tune", help="which capacity to configure, from the recorded placements",
        description="Replays the recorded events (from the event topic, or a JSON-lines file "
        "from 'mmcache export') through the service's core under a range of capacities in "
        "items mode and size mode, and reports the hit ratio each would have given: the share "
        "of placed items still in the endpoint's LRU when placed again. With "
        "--encoder-cache-size it also reports the false-hit rate: the share of those hits the "
        f"servers' true encoder caches no longer held. {_ENV_HELP}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_source(tune)
    tune.add_argument("--input", type=Path, default=None,
                      help="read this JSON-lines export instead of the topic")
    tune.add_argument("--encoder-cache-size", type=int, default=None,
                      help="the servers' true encoder cache in embeddings (vLLM logs 'encoder_cache_size'); "
                      "enables the false-hit rate and a recommendation against it")
    tune.add_argument("--items", default=None,
                      help="comma-separated items-mode capacities (default 1, 2, 4 .. 4096)")
    tune.add_argument("--embeddings", default=None,
                      help="comma-separated size-mode capacities (default 512 .. 262144 and "
                      "--encoder-cache-size)")
    tune.add_argument("--mean-item-embeddings", type=float, default=None,
                      help="for items without sizes (chat_completions, generate: every size is 1), "
                      "the servers' mean embeddings per item: with --encoder-cache-size the true "
                      "caches take each item at this size, and items mode of encoder cache size / "
                      "this is replayed (docs/simulation.md)")
    tune.add_argument("--min-repeats", type=int, default=MIN_REPEATS,
                      help="the least evidence for a recommendation: placed items already on their "
                      "endpoint; below it the table is printed and tune exits 1 without one "
                      f"(at {MIN_REPEATS} the noise of a hit count, 1/sqrt({MIN_REPEATS}) = 5%%, is the "
                      "width of the 5%% band the recommendation allows)")
    tune.add_argument("--plot", default="tune.svg",
                      help="write the plot of hit ratio against capacity here (SVG); '' for none")
    tune.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    tune.set_defaults(run=_tune)


def _add_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap-servers", default=None,
                        help="Kafka cluster to read (env MMCACHE_BOOTSTRAP_SERVERS)")
    parser.add_argument("--app-id", default=None,
                        help="the service's app id (env MMCACHE_APP_ID; default mmcache)")
    parser.add_argument("--topic", default=None,
                        help="event topic (env MMCACHE_TOPIC; default <app-id>-events)")


def _topic_source(args: argparse.Namespace, command: str) -> tuple[str, str]:
    bootstrap = args.bootstrap_servers or os.environ.get("MMCACHE_BOOTSTRAP_SERVERS")
    if not bootstrap:
        hint = " or --input FILE" if command == "tune" else ""
        raise SystemExit(
            f"{command}: give --bootstrap-servers HOST:PORT (or MMCACHE_BOOTSTRAP_SERVERS){hint}")
    app_id = args.app_id or os.environ.get("MMCACHE_APP_ID") or "mmcache"
    topic = args.topic or os.environ.get("MMCACHE_TOPIC") or f"{app_id}-events"
    return bootstrap, topic


def _security():  # type: ignore[no-untyped-def]
    from pydantic import ValidationError

    from stream.config import KafkaSecurity

    try:
        return KafkaSecurity()
    except ValidationError as exc:
        raise SystemExit(f"configuration error: {exc.errors()[0]['msg']}") from None


def _read_records(args: argparse.Namespace, command: str) -> tuple[list, dict[str, int]]:  # type: ignore[type-arg]
    from stream.sim.eventlog import read_jsonl, read_topic_sync

    skipped: dict[str, int] = {}
    if getattr(args, "input", None) is not None:
        if not args.input.is_file():
            raise SystemExit(f"{command}: no such file {args.input}")
        return read_jsonl(args.input, skipped), skipped
    bootstrap, topic = _topic_source(args, command)
    try:
        return read_topic_sync(bootstrap, topic, _security(), skipped=skipped), skipped
    except LookupError as exc:
        raise SystemExit(f"{command}: {exc}") from None


def _numbers(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"tune: {flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"tune: {flag} capacities must be at least 1")
    return values


def _tune(args: argparse.Namespace) -> None:
    from stream.core.capacity import capacity_for_encoder_cache
    from stream.rebuild import Progress
    from stream.sim.plot import tune_svg
    from stream.sim.tune import NoRecommendation, default_capacities, recommend, survey, sweep

    records, skipped = _read_records(args, "tune")
    events = [(r.position, r.event) for r in records]
    items, embeddings = _numbers(args.items, "--items"), _numbers(args.embeddings, "--embeddings")
    facts = survey(events)
    if not facts.placed:
        raise SystemExit("tune: no placements recorded: nothing to tune")
    truth, mean = args.encoder_cache_size, args.mean_item_embeddings
    if mean is not None and (mean <= 0 or truth is None or facts.sizes_known):
        raise SystemExit("tune: --mean-item-embeddings must be positive" if mean <= 0 else
                         "tune: --mean-item-embeddings goes with --encoder-cache-size" if truth is None else
                         "tune: --mean-item-embeddings is for items without sizes; "
                         f"{facts.placed - facts.unsized:,} of these {facts.placed:,} placed items "
                         "carry theirs: leave it out")
    if truth is not None and mean is None and not facts.sizes_known:
        raise SystemExit(
            f"tune: {facts.unsized:,} of {facts.placed:,} placed items carry no size (size 1: the "
            "chat_completions and generate sources), so a true cache of --encoder-cache-size "
            "embeddings cannot be replayed with them: give --mean-item-embeddings N (the servers' "
            "mean embeddings per item), or leave out --encoder-cache-size for an upper bound")
    capacities = default_capacities(truth)
    if items is not None:
        capacities = [c for c in capacities if c.mode != "items"] + [Capacity("items", n) for n in items]
    if embeddings is not None:
        capacities = [c for c in capacities if c.mode != "size"] + [Capacity("size", n) for n in embeddings]
    if mean is not None and truth is not None:  # what docs/simulation.md says to configure
        sized_to_cache = capacity_for_encoder_cache(truth, mean)
        if sized_to_cache not in capacities:
            capacities.append(sized_to_cache)
    progress = Progress(len(events) * len(capacities))
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        progress.update(done)

    rows = sweep(events, capacities, truth, on_progress=advance,
                 truth_item_size=None if mean is None else max(1, round(mean)))
    progress.update(done, final=True)
    try:
        choice, refused = recommend(rows, truth, facts=facts, min_repeats=args.min_repeats), None
    except NoRecommendation as exc:
        choice, refused = None, str(exc)
    if args.plot and choice is not None:
        title = f"hit ratio against capacity over {rows[0].placed:,} placed items"
        Path(args.plot).write_text(tune_svg(rows, choice, title))
    if args.format == "json":
        doc = {"rows": [{"mode": r.capacity.mode, "capacity": r.capacity.per_endpoint, "placed": r.placed,
                         "hits": r.hits, "hit_ratio": r.hit_ratio, "false_hits": r.false_hits,
                         "false_hit_rate": r.false_hit_rate, "missed_hits": r.missed_hits} for r in rows],
               "log": {"events": facts.events, "placed": facts.placed, "repeats": facts.repeats,
                       "unsized": facts.unsized},
               "recommended": None if choice is None else {
                   "mode": choice.row.capacity.mode, "capacity": choice.row.capacity.per_endpoint,
                   "reason": choice.reason},
               "skipped": skipped}
        if refused is not None:
            doc["refused"] = refused
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(format_tune(rows, choice, skipped, facts))
        if args.plot and choice is not None:
            print(f"plot: {args.plot}")
    if refused is not None:
        sys.stdout.flush()
        raise SystemExit(f"tune: {refused}")


def format_tune(rows: Sequence, choice, skipped: dict[str, int], facts=None) -> str:  # type: ignore[no-untyped-def,type-arg]
    """The terminal table and the recommendation (none when ``choice`` is None)."""
    truth = any(r.false_hits is not None for r in rows)
    head = f"{'mode':<6}{'capacity':>10}{'hit ratio':>11}" + (
        f"{'false-hit rate':>16}{'missed hits':>13}" if truth else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r.capacity.mode:<6}{r.capacity.per_endpoint:>10,}{r.hit_ratio:>11.3f}"
        if truth:
            line += f"{r.false_hit_rate:>16.3f}{r.missed_hits:>13,}"
        mark = "  <- recommended" if choice is not None and r is choice.row else ""
        lines.append(line + mark)
    if facts is not None:
        lines.append(f"log: {facts.events:,} events, {facts.placed:,} placed items, {facts.repeats:,} "
                     f"repeats (placed again on an endpoint that had them), {facts.unsized:,} without a size")
    if choice is not None:
        flag = ("--cache-size-embeddings-per-server" if choice.row.capacity.mode == "size"
                else "--cache-size-mb-per-server")
        value = choice.row.capacity.per_endpoint * (MB_PER_ITEM if choice.row.capacity.mode == "items" else 1)
        lines.append(f"recommended: {flag} {value} ({choice.row.capacity.mode} mode, "
                     f"{choice.row.capacity.per_endpoint:,} per endpoint): {choice.reason}")
    if skipped:
        lines.append(f"skipped records (as the worker skips them): {skipped}")
    return "\n".join(lines)


# -- export --------------------------------------------------------------------------------


def _add_export(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    export = commands.add_parser(
        "export", help="write the recorded events as JSON lines (for tune --input, simulate --trace)",
        description="Reads the event topic from its first offset to its end and writes one JSON "
        'line per applied event: {"partition", "offset", "timestamp_ms", "event"}, partitions '
        "merged by timestamp. Records the worker would skip (dead letters) are skipped. "
        f"{_ENV_HELP}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_source(export)
    export.add_argument("--output", "-o", default="-", help="file to write ('-': standard output)")
    export.set_defaults(run=_export)


def _export(args: argparse.Namespace) -> None:
    from stream.sim.eventlog import write_jsonl

    records, skipped = _read_records(args, "export")
    if args.output == "-":
        count = write_jsonl(records, sys.stdout.buffer)
        sys.stdout.flush()
    else:
        with open(args.output, "wb") as out:
            count = write_jsonl(records, out)
    extra = f", skipped {skipped}" if skipped else ""
    print(f"exported {count} events{extra}", file=sys.stderr)
