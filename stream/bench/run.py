"""Run the benchmark scenarios on an embedded broker; write JSON and a readable table."""

from __future__ import annotations

import asyncio
import logging
import platform
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import orjson

from stream.bench.figures import Figure, render_table
from stream.config import KafkaSecurity
from stream.kafka.embedded import EmbeddedBroker
from stream.kafka.tansu import apply_remedies, is_tansu

__all__ = ["SCENARIOS", "VLLM_SCENARIOS", "refuse_quick_over_full", "run", "write_results"]

log = logging.getLogger(__name__)


def _sized(full: float, quick: float, scale: float | None) -> int:
    """A size for the full run, the quick run, or a test's tiny ``scale`` of the full one."""
    return max(1, round(full * scale)) if scale is not None else round(quick or full)


def _replay(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.replay import replay_figures

    runs = 1 if quick or scale else 3
    return replay_figures(bootstrap, _sized(1_000_000, 120_000 if quick else 0, scale), runs)


def _vllm_transport(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.vllm_transport import vllm_transport_figures

    # the plugin's sender against a local server: no broker
    return vllm_transport_figures(1 if quick or scale else 5, 20 if scale else 100 if quick else 500)


def _http_date(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.http_date import http_date_figures

    return http_date_figures(3 if quick or scale else 15, 10_000 if scale else 100_000)


def _match(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.match import match_figures

    seconds = 1 if scale else 3 if quick else 10  # a test's run only checks the figures are whole
    return match_figures(_sized(600_000, 300_000 if quick else 0, scale), seconds,
                         1 if quick or scale else 3, latency_seconds=seconds if scale else max(seconds, 5))


def _freshness(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.service import freshness_figures

    return freshness_figures(bootstrap, _sized(500, 100 if quick else 0, scale))


def _idle(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.idle import idle_figures

    # serve on its own embedded broker: the scenario's broker (``bootstrap``) is not used
    if scale is not None:
        return idle_figures(1, 4.0, 1.0, 5)
    return idle_figures(1 if quick else 3, 60.0, 10.0, 30 if quick else 200)


def _match_embedded(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.idle import match_embedded_figures

    seconds = 1 if scale else 3 if quick else 10
    return match_embedded_figures(_sized(600_000, 300_000 if quick else 0, scale), seconds,
                                  1 if quick or scale else 3)


def _ingest(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.service import INGEST_HEADROOM_EVENTS_PER_S, ingest_figures

    # a test's run (``scale``) fills the topic for a slow worker only: its figures are whole,
    # not a measure
    return ingest_figures(bootstrap, _sized(60, 4 if quick else 0, scale), 1 if quick or scale else 3,
                          headroom_events_per_s=10_000 if scale else INGEST_HEADROOM_EVENTS_PER_S)


def _restart(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.service import restart_and_footprint

    return restart_and_footprint(bootstrap, _sized(600_000, 60_000 if quick else 0, scale),
                                 1 if quick or scale else 5)


def _state_poll(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.state_poll import state_poll_figures

    return state_poll_figures(_sized(600_000, 300_000 if quick else 0, scale),
                              3 if scale else 4 if quick else 10, 1 if scale or quick else 5)


def _body_attack(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.body_attack import body_attack_figures

    # a test's run (``scale``) sends a share of the bytes: its figures are whole, not a measure
    return body_attack_figures(1 if quick or scale else 5, wire=_sized(15_600_000, 0, scale))


def _failover(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.failover import failover_figures

    return failover_figures(bootstrap, 1 if quick or scale else 5)


def _scale3(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.scale import scale_figures

    return scale_figures(bootstrap, _sized(600_000, 60_000 if quick else 0, scale),
                         1 if quick or scale else 3)


def _big_bodies(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.big_bodies import big_body_figures

    return big_body_figures(bootstrap, 2 if scale else 5 if quick else 15, 1 if quick or scale else 3)


def _reader_memory(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.reader_memory import reader_memory_figures

    return reader_memory_figures()  # no broker: one body reader's work in a process of its own


def _soak(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.soak import soak_figures

    return soak_figures(quick, scale)  # on serve's own embedded broker, whatever ``bootstrap``


def _fleet_real(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.fleet_real import fleet_real_figures

    return fleet_real_figures(quick, scale)  # real vLLM servers and serves of its own


def _vllm_plugin(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.vllm_plugin import vllm_plugin_figures

    # a real vLLM of the e2e environment, with serve on its own embedded broker
    return vllm_plugin_figures(1 if quick or scale else 3, 20 if quick or scale else 200)


def _scheduler_differential(bootstrap: str, quick: bool, scale: float | None) -> list[Figure]:
    from stream.bench.scheduler_differential import figures

    # vLLM's Scheduler beside the simulator's; needs torch and vLLM importable, no broker
    return figures()


SCENARIOS: dict[str, Callable[[str, bool, float | None], list[Figure]]] = {
    "match": _match,
    "freshness": _freshness,
    "ingest": _ingest,
    "replay": _replay,
    "restart": _restart,
    "vllm_transport": _vllm_transport,
    "http_date": _http_date,
    "state_poll": _state_poll,
    "body_attack": _body_attack,
    "failover": _failover,
    "scale3": _scale3,
    "big_bodies": _big_bodies,
    "soak": _soak,
    "reader_memory": _reader_memory,
    "idle": _idle,
    "match_embedded": _match_embedded,
    "vllm_plugin": _vllm_plugin,
    "scheduler_differential": _scheduler_differential,
    "fleet_real": _fleet_real,
}
#: Scenarios that need `make e2e`'s environment (torch and a real vLLM), not the project's
#: own: they run only when named with ``--only``; they start no broker of the bench's (the
#: plugin's serve has its own embedded one, the scheduler differential needs none, the real
#: fleet starts its own serves).
VLLM_SCENARIOS = frozenset({"vllm_plugin", "scheduler_differential", "fleet_real"})


def _merged(out: Path, rows: list[dict[str, object]], meta: dict[str, object], only: list[str],
            now: str) -> tuple[list[dict[str, object]], dict[str, object]]:
    """The figures of ``out`` with those of this partial run in place of their old values
    (by name), and the file's date kept, with what this run updated and when."""
    try:
        previous = orjson.loads(out.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return rows, meta
    if not isinstance(previous, dict) or previous.get("quick") != meta["quick"]:
        return rows, meta
    fresh = {row["name"] for row in rows}
    kept = [row for row in previous.get("figures", []) if row.get("name") not in fresh]
    updated = dict(previous.get("updated", {}))
    updated.update({name: now for name in only})
    return kept + rows, {**meta, "date": previous.get("date", now), "updated": updated}


def write_results(out: Path, rows: list[dict[str, object]], meta: dict[str, object], only: list[str],
                  now: str) -> str:
    """Write ``out`` (JSON) and its ``.md`` table, both of every figure: a partial run
    (``only``) merged into the file's other figures, never in place of them. The table."""
    if only:
        rows, meta = _merged(out, rows, meta, only, now)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps({**meta, "figures": rows}, option=orjson.OPT_INDENT_2))
    table = render_table([Figure(**{("passed" if k == "pass" else k): v for k, v in row.items()})
                          for row in rows])
    updated = meta.get("updated")
    since = "".join(f"; {name} run again on {stamp}" for name, stamp in sorted(updated.items())) \
        if isinstance(updated, dict) else ""
    kind = "quick" if meta["quick"] else "full"
    out.with_suffix(".md").write_text(f"{meta['date']} ({kind}{since})\n\n{table}\n")
    return table


def refuse_quick_over_full(out: Path) -> None:
    """A ``--quick`` run never replaces the results of a full run."""
    if out.exists():
        try:
            previous = orjson.loads(out.read_bytes())
        except orjson.JSONDecodeError:
            return
        if isinstance(previous, dict) and previous.get("quick") is False:
            raise SystemExit(f"--quick would overwrite the full results in {out}: give another "
                             "--out (the default for --quick is bench/quick.json)")


def run(out: Path, quick: bool = False, only: list[str] | None = None,
        bootstrap: str | None = None, scale: float | None = None) -> list[Figure]:
    """Run the selected scenarios; write ``out`` (JSON) and ``out`` with ``.md`` (table).

    ``scale`` shrinks every size to that share of the full run (for the bench's own test).
    """
    if quick:
        refuse_quick_over_full(out)
    names = only or [name for name in SCENARIOS if name not in VLLM_SCENARIOS]
    figures: list[Figure] = []
    needs_broker = not bootstrap and not VLLM_SCENARIOS.issuperset(names)
    broker = EmbeddedBroker().start() if needs_broker else None
    try:
        servers = bootstrap or (broker.bootstrap_servers if broker else "")
        if servers and asyncio.run(is_tansu(servers, KafkaSecurity())):
            apply_remedies()
        for name in names:
            log.info("bench scenario %s%s", name, " (quick)" if quick else "")
            figures += SCENARIOS[name](servers, quick, scale)
    finally:
        if broker is not None:
            broker.stop()
    now = datetime.now(UTC).isoformat(timespec="seconds")
    meta: dict[str, object] = {"date": now, "quick": quick,
                               "machine": f"{platform.machine()}, {platform.python_implementation()} "
                                          f"{platform.python_version()}"}
    table = write_results(out, [f.as_json() for f in figures], meta, only or [], now)
    print(table)
    return figures
