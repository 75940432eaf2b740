"""The ``simulate``, ``tune`` and ``export`` commands, added to the CLI by ``add_commands``."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from stream.core.cache import DEFAULT_CACHE_MB, MB_PER_ITEM, Capacity
from stream.sim.fleet import (
    DEFAULT_ENCODER_CACHE_SIZE,
    POLICIES,
    FleetSpec,
    PolicyResult,
    prefix_capacity,
    simulate,
)
from stream.sim.load import LOADS, format_load_table, load_table, measure_capacity
from stream.sim.tune import (
    DEFAULT_BYTES_PER_EMBEDDING,
    DEFAULT_PROCESSOR_CACHE_GB,
    LAYERS,
    MIN_REPEATS,
    HitCosts,
    Recommendation,
    TuneReport,
    TuneRow,
)
from stream.sim.workload import Request, SizeMix, WorkloadSpec, generate, requests_from_trace

__all__ = ["SimulationRun", "add_commands", "format_simulation", "format_tune", "run_simulation",
           "tune_document"]

_ENV_HELP = "Kafka security from MMCACHE_KAFKA_* as for serve"


def add_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``simulate``, ``tune`` and ``export`` to the ``mmcache`` subcommands."""
    _add_simulate(commands)
    _add_tune(commands)
    _add_export(commands)


# -- simulate ------------------------------------------------------------------------------


def _add_simulate(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    fleet, costs = FleetSpec(), FleetSpec().costs
    engine = fleet.engine
    sim = commands.add_parser(
        "simulate", help="score the affinity signal against a simulated fleet of vLLM servers",
        description="Deterministic simulation of vLLM servers (processor, encoder and prefix "
        "caches, step-by-step scheduling) behind gateway replicas; for each routing policy "
        "prints each cache layer's hit ratio, TTFT p50 and p90, load imbalance, and for the "
        "index policies precision and recall of 'predicted cached' against the true encoder "
        "caches. --load-table prints which policy wins on TTFT p90 from 20%% to 120%% of the "
        "fleet's capacity. Same seed, same output.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sim.add_argument("--servers", type=int, default=fleet.servers, help="model servers (P)")
    sim.add_argument("--replicas", type=int, default=3, help="gateway replicas (G); per-replica keeps one "
                     "index per replica, the other index policies one for all")
    sim.add_argument("--requests", type=int, default=WorkloadSpec().requests, help="requests to simulate")
    sim.add_argument("--seed", type=int, default=1, help="seed of every random draw")
    sim.add_argument("--runs", type=int, default=1,
                     help="runs with seeds --seed, --seed+1, ...; figures are then medians, the table "
                     "gives each with its spread (half the range over the runs)")
    sim.add_argument("--policies", default=",".join(POLICIES),
                     help=f"comma-separated policies, of: {', '.join(POLICIES)}")
    sim.add_argument("--load", type=float, default=0.6,
                     help="offered load as a share of the fleet's capacity (the request rate round-robin "
                     "sustains when offered more than it can serve, measured per run)")
    sim.add_argument("--rate", type=float, default=None,
                     help="requests per second over the whole fleet, instead of --load")
    sim.add_argument("--load-table", action="store_true",
                     help="print which policy wins on TTFT p90 at each of --loads, on the "
                     "tokenizer-free and the render path, instead of the policy table")
    sim.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS),
                     help="comma-separated loads (shares of capacity) of --load-table")
    # the engine (vLLM's defaults, stream/sim/engine.py)
    sim.add_argument("--max-num-batched-tokens", type=int, default=engine.max_num_batched_tokens,
                     help="tokens a step computes at most (vLLM's OpenAI-server default on GPUs of 70 GiB "
                     "and more)")
    sim.add_argument("--max-num-seqs", type=int, default=engine.max_num_seqs,
                     help="requests a step runs at most")
    sim.add_argument("--encoder-cache-size", type=int, default=engine.encoder_cache_size,
                     help="each server's encoder cache in embeddings; vLLM's default encoder_cache_size "
                     "is max_num_batched_tokens, 8192 for its OpenAI server on H100-class GPUs")
    sim.add_argument("--encoder-budget", type=int, default=None,
                     help="per-step encoder compute budget in embeddings (default: the encoder cache size)")
    sim.add_argument("--processor-cache-gb", type=float, default=engine.processor_cache_bytes / 2**30,
                     help="each server's processor cache, GiB (vLLM's mm_processor_cache_gb)")
    sim.add_argument("--kv-blocks", type=int, default=engine.kv_blocks,
                     help="each server's KV cache in blocks of --block-size tokens (the prefix cache)")
    sim.add_argument("--block-size", type=int, default=engine.block_size, help="tokens per KV block")
    # costs
    sim.add_argument("--preprocess-ms", type=float, default=costs.preprocess_ms_per_item,
                     help="CPU milliseconds to preprocess one item on a processor-cache miss")
    sim.add_argument("--encoder-ms-per-1k", type=float, default=costs.encoder_ms_per_1k_embeddings,
                     help="GPU milliseconds per 1,000 embeddings encoded")
    sim.add_argument("--prefill-ms-per-1k", type=float, default=costs.prefill_ms_per_1k_tokens,
                     help="GPU milliseconds per 1,000 prompt tokens computed")
    sim.add_argument("--decode-ms", type=float, default=costs.decode_ms_per_step,
                     help="GPU milliseconds of a step's decoding")
    sim.add_argument("--step-overhead-ms", type=float, default=costs.step_overhead_ms,
                     help="milliseconds every step costs")
    # the gateway
    sim.add_argument("--cache-size-mb-per-server", type=int, default=DEFAULT_CACHE_MB,
                     help=f"the index and per-replica capacity as the Go plugin's cacheSizeInMBPerServer "
                     f"({MB_PER_ITEM} MiB per item)")
    sim.add_argument("--index-items", type=int, default=None,
                     help="the index and per-replica capacity in items, instead of "
                     "--cache-size-mb-per-server")
    sim.add_argument("--index-embeddings", type=int, default=None,
                     help="the index-size capacity in embeddings (default: --encoder-cache-size)")
    sim.add_argument("--bounded-embeddings", type=int, default=None,
                     help="the index-bounded capacity in embeddings (default: what the prefix cache "
                     "keeps: --kv-blocks x --block-size x the share of prompt tokens that are items)")
    sim.add_argument("--scrape-ms", type=float, default=fleet.scrape_s * 1000,
                     help="how often the gateway reads the servers' load (their metrics)")
    sim.add_argument("--items-path", choices=("tokenizer-free", "render"), default=fleet.items_path,
                     help="how the index policies get a request's items: from its body (mmcache's "
                     "extraction) or from a render call (the token producer)")
    sim.add_argument("--render-replicas", type=int, default=fleet.render_replicas,
                     help="render sidecars on the render path")
    sim.add_argument("--render-rate", type=float, default=fleet.render_rate,
                     help="render calls per second one sidecar serves (the llm-d guide's knee: 9, 18 and "
                     "70 QPS with 1, 2 and 8 replicas)")
    sim.add_argument("--tie-break", choices=("first", "random"), default=fleet.tie_break,
                     help="how index, index-size and per-replica pick among equal scores (first: the "
                     "top of the list, as a sorting picker does)")
    sim.add_argument("--bound-factor", type=float, default=fleet.bound_factor,
                     help="index-bounded: a server over this times the mean load is not chosen for affinity")
    sim.add_argument("--bound-slack", type=int, default=fleet.bound_slack,
                     help="index-bounded: nor one over the least load plus this many requests, "
                     "whichever bound is higher")
    # the workload
    spec = WorkloadSpec()
    sim.add_argument("--catalogue", type=int, default=spec.catalogue, help="shared items")
    sim.add_argument("--zipf", type=float, default=spec.zipf,
                     help="Zipf exponent of shared items' popularity")
    sim.add_argument("--min-items", type=int, default=spec.min_items,
                     help="fewest items per single-shot request")
    sim.add_argument("--max-items", type=int, default=spec.max_items,
                     help="most items per single-shot request")
    sim.add_argument("--fresh-share", type=float, default=spec.fresh_share,
                     help="share of single-shot requests about items nobody sent before")
    sim.add_argument("--item-first-share", type=float, default=spec.item_first_share,
                     help="share of single-shot requests whose items come right after the system prompt")
    sim.add_argument("--conversation-share", type=float, default=spec.conversation_share,
                     help="share of sessions that are multi-turn conversations about an item of their own")
    sim.add_argument("--think-s", type=float, default=spec.think_s, help="mean seconds between turns")
    sim.add_argument("--system-tokens", type=int, default=spec.system_tokens,
                     help="tokens of the system prompt every request shares")
    sim.add_argument("--output-tokens", type=int, default=spec.output_tokens, help="mean tokens per answer")
    sim.add_argument("--burst", type=int, default=spec.burst,
                     help="sessions that all start at 0, as a benchmark client starting its users at once")
    sim.add_argument("--turns", type=_pair, default=spec.turns,
                     help="fewest,most turns of a conversation (uniform)")
    sim.add_argument("--text-tokens", type=_pair, default=spec.text_tokens,
                     help="fewest,most tokens of each user text (uniform)")
    sim.add_argument("--small-embeddings", type=int, default=spec.sizes.small,
                     help="embeddings of a small image")
    sim.add_argument("--large-embeddings", type=_pair, default=spec.sizes.large,
                     help="fewest,most embeddings of a large image (uniform)")
    sim.add_argument("--large-share", type=float, default=spec.sizes.large_share,
                     help="share of items that are large images")
    sim.add_argument("--video-share", type=float, default=spec.sizes.video_share,
                     help="share of items that are video clips (the rest: small images)")
    sim.add_argument("--trace", type=Path, default=None,
                     help="replay recorded placements (the JSON lines of 'mmcache export') instead of "
                     "the synthetic workload; their timestamps give the arrivals")
    sim.add_argument("--write-trace", type=Path, default=None,
                     help="write the placements the first policy made (first run) as 'mmcache export' "
                     "JSON lines, keyed and partitioned as the service would (8 partitions): input for "
                     "'mmcache tune --input'")
    sim.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    sim.set_defaults(run=_simulate)


def _pair(text: str) -> tuple[int, int]:
    """``LOW,HIGH`` as two integers, 1 <= LOW <= HIGH."""
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give two integers as LOW,HIGH") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LOW <= HIGH")
    return low, high


def _check(args: argparse.Namespace) -> list[str]:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"simulate: unknown policy {unknown[0]!r}; choose from {', '.join(POLICIES)}")
    for flag in ("servers", "replicas", "requests", "encoder_cache_size", "max_num_batched_tokens",
                 "max_num_seqs", "kv_blocks", "block_size", "render_replicas", "runs"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"simulate: --{flag.replace('_', '-')} must be at least 1")
    if not (0 <= args.large_share and 0 <= args.video_share and args.large_share + args.video_share <= 1):
        raise SystemExit("simulate: --large-share and --video-share must be shares, at most 1 together")
    if args.small_embeddings < 1:
        raise SystemExit("simulate: --small-embeddings must be at least 1")
    if args.rate is not None and args.rate <= 0 or args.load <= 0 or args.render_rate <= 0:
        raise SystemExit("simulate: --rate, --load and --render-rate must be positive")
    return policies


def _fleet(args: argparse.Namespace) -> FleetSpec:
    default = FleetSpec()
    engine = replace(
        default.engine, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        encoder_cache_size=args.encoder_cache_size,
        encoder_compute_budget=args.encoder_budget or args.encoder_cache_size,
        processor_cache_bytes=round(args.processor_cache_gb * 2**30), kv_blocks=args.kv_blocks,
        block_size=args.block_size)
    costs = replace(
        default.costs, preprocess_ms_per_item=args.preprocess_ms,
        encoder_ms_per_1k_embeddings=args.encoder_ms_per_1k, prefill_ms_per_1k_tokens=args.prefill_ms_per_1k,
        decode_ms_per_step=args.decode_ms, step_overhead_ms=args.step_overhead_ms)
    return replace(
        default, servers=args.servers, engine=engine, costs=costs,
        index_items=args.index_items or Capacity.from_params(args.cache_size_mb_per_server).per_endpoint,
        index_embeddings=args.index_embeddings or args.encoder_cache_size,
        bounded_embeddings=args.bounded_embeddings or 0, scrape_s=args.scrape_ms / 1000,
        items_path=args.items_path, render_replicas=args.render_replicas, render_rate=args.render_rate,
        tie_break=args.tie_break, bound_factor=args.bound_factor, bound_slack=args.bound_slack)


def _workload(args: argparse.Namespace, seed: int) -> WorkloadSpec:
    return WorkloadSpec(
        requests=args.requests, catalogue=args.catalogue, zipf=args.zipf, min_items=args.min_items,
        max_items=args.max_items, fresh_share=args.fresh_share, item_first_share=args.item_first_share,
        conversation_share=args.conversation_share, think_s=args.think_s, system_tokens=args.system_tokens,
        output_tokens=args.output_tokens, burst=args.burst, replicas=args.replicas, turns=args.turns,
        text_tokens=args.text_tokens, seed=seed,
        sizes=SizeMix(small=args.small_embeddings, large=args.large_embeddings,
                      large_share=args.large_share, video_share=args.video_share))


@dataclass(frozen=True, slots=True)
class SimulationRun:
    """One seed's results: the offered rate, the capacity it was a share of (None when
    --rate or --trace set the rate), and each policy's result."""

    seed: int
    rate: float
    capacity: float | None
    bounded_embeddings: int
    results: dict[str, PolicyResult]


def run_simulation(args: argparse.Namespace, seed: int | None = None,
                   placed: list[tuple[str, Request]] | None = None) -> SimulationRun:
    """Every asked policy over the same requests, from parsed ``simulate`` arguments (with
    ``seed`` instead of ``args.seed`` when given)."""
    seed = args.seed if seed is None else seed
    policies = _check(args)
    fleet, spec = _fleet(args), _workload(args, seed)
    capacity = None
    if args.trace is not None:
        from stream.sim.eventlog import placements, read_jsonl

        rate = args.rate or 40.0
        requests = requests_from_trace(placements(read_jsonl(args.trace)), args.replicas, rate, spec,
                                       seed)[: args.requests]
    else:
        if args.rate is None:
            capacity = measure_capacity(spec, fleet, seed)
        rate = args.rate or args.load * (capacity or 0.0)
        requests = generate(replace(spec, rate=rate))
    results = {p: simulate(requests, fleet, p, seed=seed, replicas=args.replicas,
                           placed=placed if n == 0 else None) for n, p in enumerate(policies)}
    bounded = fleet.bounded_embeddings or prefix_capacity(fleet.engine, requests)
    return SimulationRun(seed, rate, capacity, bounded, results)


# (title, figure of a result, digits)
_COLUMNS: tuple[tuple[str, Callable[[PolicyResult], float | None], int], ...] = (
    ("processor", lambda r: r.layers["processor"].hit_ratio, 3),
    ("encoder", lambda r: r.layers["encoder"].hit_ratio, 3),
    ("prefix", lambda r: r.layers["prefix"].hit_ratio, 3),
    ("TTFT p50 s", lambda r: r.ttft_p50_s, 3), ("TTFT p90 s", lambda r: r.ttft_p90_s, 3),
    ("imbalance", lambda r: r.imbalance, 2), ("cold top", lambda r: r.top_share_cold, 2),
    ("precision", lambda r: r.precision, 3), ("recall", lambda r: r.recall, 3))


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def format_simulation(runs: Sequence[SimulationRun]) -> str:
    """The terminal table: one row per policy, each figure the median over the runs, with
    its spread (half the range) when there are several. Hit ratios are per layer
    (processor and encoder: items; prefix: KV blocks); "cold top" is the busiest
    server's share of the in-flight requests after the first 4 x servers routings."""
    several = len(runs) > 1
    width = 15 if several else 11
    head = f"{'policy':<14}" + "".join(f"{title:>{width}}" for title, _, _ in _COLUMNS)
    lines = [head, "-" * len(head)]
    for name in runs[0].results:
        cells = []
        for _, figure, digits in _COLUMNS:
            values = [figure(run.results[name]) for run in runs]
            if values[0] is None:
                cells.append(f"{'-':>{width}}")
                continue
            numbers = [v for v in values if v is not None]
            text = f"{_median(numbers):,.{digits}f}"
            if several:
                text += f" ±{(max(numbers) - min(numbers)) / 2:,.{digits}f}"
            cells.append(f"{text:>{width}}")
        lines.append(f"{name:<14}" + "".join(cells))
    return "\n".join(lines)


def _median_summary(runs: Sequence[SimulationRun]) -> dict[str, object]:
    """The JSON figures, medians over the runs (null where a figure does not apply)."""
    def merge(docs: list[Any]) -> Any:
        first = docs[0]
        if isinstance(first, dict):
            return {key: merge([doc[key] for doc in docs]) for key in first}
        if first is None:
            return None
        value = _median(docs)
        return round(value) if isinstance(first, int) else value

    return {name: merge([run.results[name].summary() for run in runs]) for name in runs[0].results}


def _simulate(args: argparse.Namespace) -> None:
    _check(args)
    if args.load_table:
        _print_load_table(args)
        return
    started = time.monotonic()
    placed: list[tuple[str, Request]] | None = [] if args.write_trace is not None else None
    runs = [run_simulation(args, args.seed + n, placed if n == 0 else None) for n in range(args.runs)]
    if placed is not None:
        _write_trace(args.write_trace, placed)
    rates = [run.rate for run in runs]
    capacities = [run.capacity for run in runs if run.capacity is not None]
    if args.format == "json":
        doc = {"policies": _median_summary(runs),
               "rate_rps": _median(rates), "capacity_rps": _median(capacities) if capacities else None}
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    first = next(iter(runs[0].results.values()), None)
    requests = first.requests if first is not None else 0
    seeds = f"seed {args.seed}" if args.runs == 1 else f"seeds {args.seed}..{args.seed + args.runs - 1}"
    load = (f"{_median(rates):.1f} requests/s = {args.load:.0%} of capacity {_median(capacities):.1f}"
            if capacities else f"{_median(rates):.1f} requests/s")
    fleet = _fleet(args)
    print(f"{requests:,} requests at {load}, {args.servers} servers, {args.replicas} gateway replicas, "
          f"{seeds}; items path {args.items_path}, ties {args.tie_break}; index capacity "
          f"{fleet.index_items:,} items, index-size {fleet.index_embeddings:,} embeddings, index-bounded "
          f"{runs[0].bounded_embeddings:,} embeddings")
    print(format_simulation(runs))
    print(f"({time.monotonic() - started:.1f} s)", file=sys.stderr)


def _print_load_table(args: argparse.Namespace) -> None:
    try:
        loads = [float(part) for part in args.loads.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"simulate: --loads takes comma-separated numbers, got {args.loads!r}") from None
    if not loads or min(loads) <= 0:
        raise SystemExit("simulate: --loads must be positive")
    if args.trace is not None:
        raise SystemExit("simulate: --load-table draws its own workloads; leave out --trace")
    started = time.monotonic()
    fleet = _fleet(args)
    specs = [_workload(args, args.seed + n) for n in range(args.runs)]
    rows = load_table(specs, fleet, loads, replicas=args.replicas)
    if args.format == "json":
        doc = {"rows": [row.summary() for row in rows]}
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    seeds = f"seed {args.seed}" if args.runs == 1 else f"seeds {args.seed}..{args.seed + args.runs - 1}"
    print(f"TTFT p90 (s) by offered load, {args.requests:,} requests, {args.servers} servers, {seeds} "
          f"(medians); render path: {fleet.render_replicas} sidecars of {fleet.render_rate:g} calls/s; "
          f"naive: ties {fleet.tie_break}, scraped load; fixed: index-bounded")
    print(format_load_table(rows))
    print(f"({time.monotonic() - started:.1f} s)", file=sys.stderr)


def _write_trace(path: Path, placed: Sequence[tuple[str, Request]], partitions: int = 8) -> None:
    from stream.core.events import ItemsPlaced, Position
    from stream.core.routing import key_partition
    from stream.sim.eventlog import Recorded, write_jsonl

    offsets = [0] * partitions
    records = []
    for endpoint, request in placed:
        if not request.items:
            continue
        partition = key_partition(endpoint.encode(), partitions)
        event = ItemsPlaced(endpoint=endpoint, items=list(request.items), request_id=f"sim-{request.id}")
        stamp = round(request.arrival * 1000)
        records.append(Recorded(Position(partition, offsets[partition]), stamp, event))
        offsets[partition] += 1
    with path.open("wb") as out:
        write_jsonl(records, out)


# -- tune ----------------------------------------------------------------------------------


def _add_tune(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    tune = commands.add_parser(
        "tune", help="which capacity to configure, per cache layer, from the recorded placements",
        description="Replays the recorded events (from the event topic, or a JSON-lines file "
        "from 'mmcache export') through the service's core under a range of capacities in "
        "items mode and size mode, and reports the hit ratio each would have given: the share "
        "of placed items still in the endpoint's LRU when placed again. The same placements "
        "are replayed through a true model of each cache layer of a vLLM server that the log "
        "can speak for (the processor cache, in bytes; the encoder cache, in embeddings), and "
        "per layer it reports the false hits (index hits the layer no longer held) and missed "
        "hits, and recommends the capacity that predicts that layer best. The prefix (KV) "
        "layer cannot be predicted from placements; the output says why. The recommendation "
        "targets one layer (--layer; by default the one whose hits save the most time). "
        f"{_ENV_HELP}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_source(tune)
    tune.add_argument("--input", type=Path, default=None,
                      help="read this JSON-lines export instead of the topic")
    tune.add_argument("--layer", choices=LAYERS, default=None,
                      help="the cache layer the recommendation sizes the index for (default: the "
                      "replayed layer whose true hits on this log save the most time at the "
                      "simulator's costs; prefix: says why it cannot)")
    tune.add_argument("--encoder-cache-size", type=int, default=None,
                      help="the servers' encoder cache in embeddings (vLLM logs 'encoder_cache_size'; "
                      f"default {DEFAULT_ENCODER_CACHE_SIZE}, assumed and said: vLLM's "
                      "max_num_batched_tokens for its OpenAI server on GPUs of 70 GiB or more)")
    tune.add_argument("--processor-cache-gb", type=float, default=DEFAULT_PROCESSOR_CACHE_GB,
                      help="the servers' processor cache in GiB (vLLM's mm_processor_cache_gb; "
                      "0: disabled, not replayed)")
    tune.add_argument("--bytes-per-embedding", default=_bytes_text(DEFAULT_BYTES_PER_EMBEDDING),
                      help="bytes of processed input per encoder embedding, by modality "
                      "(modality=bytes, comma-separated; a modality not named weighs as image): "
                      "what the processor cache counts (default %(default)s: Qwen2/2.5-VL in bf16, "
                      "docs/simulation.md)")
    tune.add_argument("--items", default=None,
                      help="comma-separated items-mode capacities (default 1, 2, 4 .. 4096)")
    tune.add_argument("--embeddings", default=None,
                      help="comma-separated size-mode capacities (default 512 .. 1048576)")
    tune.add_argument("--mean-item-embeddings", type=float, default=None,
                      help="for items without sizes (chat_completions, generate: every size is 1), "
                      "the servers' mean embeddings per item: the layers' true caches take each "
                      "item at this size (the processor at this many embeddings' bytes), and items "
                      "mode sized to each layer is replayed (docs/simulation.md)")
    tune.add_argument("--min-repeats", type=int, default=MIN_REPEATS,
                      help="the least evidence for a recommendation: placed items already on their "
                      "endpoint, and per layer those its true caches held; below it the table is "
                      "printed without one, and tune exits 1 if that is the targeted layer "
                      f"(at {MIN_REPEATS} the noise of a hit count, 1/sqrt({MIN_REPEATS}) = 5%%, is the "
                      "width of the 5%% band the recommendation allows)")
    tune.add_argument("--plot", default="tune.svg",
                      help="write the plot of hit ratio against capacity (the targeted layer's false "
                      "hits) here (SVG); '' for none")
    tune.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    tune.set_defaults(run=_tune)


def _bytes_text(per: Mapping[str, int]) -> str:
    return ",".join(f"{modality}={n}" for modality, n in per.items())


def _bytes_per_embedding(text: str) -> dict[str, int]:
    per: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        modality, _, value = part.partition("=")
        try:
            per[modality.strip()] = int(value)
        except ValueError:
            per = {}
            break
        if not modality.strip() or per[modality.strip()] < 1:
            per = {}
            break
    if not per:
        raise SystemExit(f"tune: --bytes-per-embedding takes modality=bytes pairs, comma-separated, "
                         f"each at least 1 (e.g. {_bytes_text(DEFAULT_BYTES_PER_EMBEDDING)}), got {text!r}")
    return per


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
    from stream.sim.plot import tune_svg
    from stream.sim.tune import GIB, ItemModel, Truth, advise, default_capacities, survey
    from stream.state.rebuild import Progress

    records, skipped = _read_records(args, "tune")
    events = [(r.position, r.event) for r in records]
    items, embeddings = _numbers(args.items, "--items"), _numbers(args.embeddings, "--embeddings")
    per_embedding = _bytes_per_embedding(args.bytes_per_embedding)
    facts = survey(events)
    if not facts.placed:
        raise SystemExit("tune: no placements recorded: nothing to tune")
    encoder_size, mean, gib = args.encoder_cache_size, args.mean_item_embeddings, args.processor_cache_gb
    if encoder_size is not None and encoder_size < 1:
        raise SystemExit("tune: --encoder-cache-size must be at least 1 embedding")
    if gib < 0:
        raise SystemExit("tune: --processor-cache-gb must be 0 (disabled) or more")
    if mean is not None and (mean <= 0 or facts.sizes_known):
        raise SystemExit("tune: --mean-item-embeddings must be positive" if mean <= 0 else
                         "tune: --mean-item-embeddings is for items without sizes; "
                         f"{facts.placed - facts.unsized:,} of these {facts.placed:,} placed items "
                         "carry theirs: leave it out")
    if encoder_size is not None and mean is None and not facts.sizes_known:
        raise SystemExit(
            f"tune: {facts.unsized:,} of {facts.placed:,} placed items carry no size (size 1: the "
            "chat_completions and generate sources), so a true cache of --encoder-cache-size "
            "embeddings cannot be replayed with them: give --mean-item-embeddings N (the servers' "
            "mean embeddings per item), or leave out --encoder-cache-size for an upper bound")
    model = ItemModel(mean, per_embedding)
    truths: list[Truth] = []
    not_replayed: dict[str, str] = {}
    if not facts.sizes_known and mean is None:
        unsized = (f"not replayed: {facts.unsized:,} of {facts.placed:,} placed items carry no size "
                   "(size 1: the chat_completions and generate sources); give --mean-item-embeddings N "
                   "(the servers' mean embeddings per item) to replay it")
        not_replayed = {"processor": unsized, "encoder": unsized}
    else:
        if gib > 0:
            truths.append(Truth("processor", round(gib * GIB), model))
        else:
            not_replayed["processor"] = ("not replayed: --processor-cache-gb 0 (vLLM then keeps no "
                                         "processor cache)")
        truths.append(Truth("encoder", encoder_size or DEFAULT_ENCODER_CACHE_SIZE, model,
                            assumed=encoder_size is None))
    capacities = default_capacities()
    if items is not None:
        capacities = [c for c in capacities if c.mode != "items"] + [Capacity("items", n) for n in items]
    if embeddings is not None:
        capacities = [c for c in capacities if c.mode != "size"] + [Capacity("size", n) for n in embeddings]
    progress = Progress(len(events) * (len(capacities) + 2 * len(truths)))
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        progress.update(done)

    report = advise(events, capacities, truths, _hit_costs(), facts=facts, not_replayed=not_replayed,
                    layer=args.layer, min_repeats=args.min_repeats, on_progress=advance)
    progress.update(done, final=True)
    if args.plot and report.choice is not None:
        against = "" if report.target is None else f", false hits against the {report.target} layer"
        title = f"hit ratio against capacity over {facts.placed:,} placed items{against}"
        Path(args.plot).write_text(tune_svg(report.rows, report.choice, title))
    if args.format == "json":
        sys.stdout.write(orjson.dumps(tune_document(report, skipped),
                                      option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(format_tune(report, skipped))
        if args.plot and report.choice is not None:
            print(f"plot: {args.plot}")
    if report.refused is not None:
        sys.stdout.flush()
        raise SystemExit(f"tune: {report.refused}")


def _hit_costs() -> HitCosts:
    """What a hit saves per layer: the simulated fleet's engine costs."""
    return FleetSpec().costs


def _flag(capacity: Capacity) -> str:
    """The serve flag and value that configure ``capacity``."""
    if capacity.mode == "size":
        return f"--cache-size-embeddings-per-server {capacity.per_endpoint}"
    return f"--cache-size-mb-per-server {capacity.per_endpoint * MB_PER_ITEM}"


def _row_doc(row: TuneRow) -> dict[str, object]:
    return {"mode": row.capacity.mode, "capacity": row.capacity.per_endpoint, "placed": row.placed,
            "hits": row.hits, "hit_ratio": row.hit_ratio, "false_hits": row.false_hits,
            "false_hit_rate": row.false_hit_rate, "missed_hits": row.missed_hits, "layer": row.layer}


def _choice_doc(choice: Recommendation | None) -> dict[str, object] | None:
    if choice is None:
        return None
    return {"mode": choice.row.capacity.mode, "capacity": choice.row.capacity.per_endpoint,
            "flag": _flag(choice.row.capacity), "reason": choice.reason}


def tune_document(report: TuneReport, skipped: dict[str, int]) -> dict[str, object]:
    """``tune --format json``: the target layer's rows and recommendation at the top (as
    before layers), every layer under ``layers``."""
    facts = report.facts
    layers: dict[str, object] = {}
    for advice in report.layers:
        if advice.replay is None:
            layers[advice.layer] = {"replayed": False, "reason": advice.refused}
            continue
        truth = advice.replay.truth
        layers[advice.layer] = {
            "replayed": True, "truth": truth.describe(), "capacity": truth.capacity,
            "unit": "bytes" if truth.layer == "processor" else "embeddings",
            "assumed": truth.assumed, "true_hits": advice.replay.hits, "saved_ms": advice.saved_ms,
            "rows": [_row_doc(r) for r in advice.rows], "recommended": _choice_doc(advice.choice),
            "refused": advice.refused}
        if truth.layer == "processor":
            layers[advice.layer]["bytes_per_embedding"] = dict(truth.items.bytes_per_embedding)  # type: ignore[index]
    doc: dict[str, object] = {
        "rows": [_row_doc(r) for r in report.rows],
        "log": {"events": facts.events, "placed": facts.placed, "repeats": facts.repeats,
                "unsized": facts.unsized},
        "target": {"layer": report.target, "reason": report.target_reason},
        "recommended": _choice_doc(report.choice),
        "layers": layers,
        "skipped": skipped}
    if report.refused is not None:
        doc["refused"] = report.refused
    return doc


def format_tune(report: TuneReport, skipped: dict[str, int]) -> str:
    """The terminal report: a table per replayed layer with its best capacity (or why
    none), why the others are not replayed, then the target layer and its recommendation
    (none when ``report.choice`` is None)."""
    lines: list[str] = []
    if all(advice.replay is None for advice in report.layers):  # hit ratios alone
        lines.extend(_table(report.rows, report.choice, "  <- recommended"))
    for advice in report.layers:
        if lines:
            lines.append("")
        if advice.replay is None:
            lines.append(f"{advice.layer} layer: {advice.refused}")
            continue
        guess = (" (assumed: vLLM's default on GPUs of 70 GiB or more, 2,048 on others; give the "
                 "servers' own with --encoder-cache-size)" if advice.replay.truth.assumed else "")
        lines.append(f"{advice.layer} layer: {advice.replay.truth.describe()} per server{guess}; its "
                     f"true caches held {advice.replay.hits:,} of the {report.facts.repeats:,} repeat "
                     "placements")
        mark = "  <- recommended" if advice.layer == report.target else "  <- best for this layer"
        lines.extend(_table(advice.rows, advice.choice, mark))
        if advice.choice is not None:
            lines.append(f"{advice.layer}: {_flag(advice.choice.row.capacity)} ({_capacity(advice.choice)}): "
                         f"{advice.choice.reason}")
        else:
            lines.append(f"{advice.layer}: {advice.refused}")
    facts = report.facts
    lines.append("")
    lines.append(f"log: {facts.events:,} events, {facts.placed:,} placed items, {facts.repeats:,} "
                 f"repeats (placed again on an endpoint that had them), {facts.unsized:,} without a size")
    if report.target is not None:
        lines.append(f"target: the {report.target} layer, {report.target_reason} (--layer to choose)")
    if report.choice is not None:
        layer = "" if report.target is None else f" for the {report.target} layer"
        lines.append(f"recommended{layer}: {_flag(report.choice.row.capacity)} ({_capacity(report.choice)}): "
                     f"{report.choice.reason}")
    if skipped:
        lines.append(f"skipped records (as the worker skips them): {skipped}")
    return "\n".join(lines)


def _capacity(choice: Recommendation) -> str:
    return f"{choice.row.capacity.mode} mode, {choice.row.capacity.per_endpoint:,} per endpoint"


def _table(rows: Sequence[TuneRow], choice: Recommendation | None, mark: str) -> list[str]:
    truth = any(r.false_hits is not None for r in rows)
    head = f"{'mode':<6}{'capacity':>10}{'hit ratio':>11}" + (
        f"{'false-hit rate':>16}{'missed hits':>13}" if truth else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r.capacity.mode:<6}{r.capacity.per_endpoint:>10,}{r.hit_ratio:>11.3f}"
        if truth:
            line += f"{r.false_hit_rate:>16.3f}{r.missed_hits:>13,}"
        lines.append(line + (mark if choice is not None and r is choice.row else ""))
    return lines


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
