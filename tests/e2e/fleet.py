"""The real fleet of the fleet bench, in the e2e environment: two vLLM servers of the tiny
model with the mmcache-vllm plugin (``conftest.Vllm``), the reference gateway
(``stream.gateway``), and per policy a fresh ``mmcache serve`` (``conftest.Serve``), on the
trace of ``stream.bench.fleet_trace``.

Per policy, cold (every server's prefix, processor and encoder caches reset through
vLLM's dev routes, serve on a new data dir), the requests are sent through the gateway at
their arrival times (open loop) and these are measured:

- encoder: the share of the trace's (request, distinct item) pairs that were not encoded:
  1 - the entries vLLM's encoder cache manager allocated / the pairs. The plugin reports
  each allocation as ``stored``; a tap between the plugins and serve counts them
  (:class:`EngineEventTap`). An item inside a prefix hit needs no encoder, so it counts as
  saved too;
- processor: ``vllm:mm_cache_hits`` / ``vllm:mm_cache_queries`` (items), prefix:
  ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` (tokens), summed over the
  servers, as differences over the policy's run;
- TTFT: the first streamed chunk through the gateway, less the request's send time;
- the closed loop: serve's ``mmcache_estimate_checks_total`` (serve routes on its estimate,
  ``--match-source estimate``, and keeps the engine views the plugins report): precision
  = true_hit / (true_hit + false_hit), recall = true_hit / (true_hit + missed_hit).

``python -m tests.e2e.fleet [--requests N] [--policies a,b]`` (in ``.venv-vllm``) prints the
JSON of every policy's figures; ``mmcache bench --only fleet_real`` runs it and sets the
simulator's prediction beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from stream.bench.fleet_trace import FleetTrace, chat_body, requests_of, trace_digest
from stream.gateway.gateway import GATEWAY_POLICIES, Gateway
from stream.sim.workload import Request
from tests.e2e.conftest import Serve, Vllm

__all__ = ["EngineEventTap", "RealResult", "run_real"]


def _percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by the nearest rank, as the simulator takes it (0.0 for none)."""
    from stream.sim.fleet import percentile

    return percentile(values, q)


class EngineEventTap:
    """Between the plugins and mmcache: counts the entries each server's encoder cache
    manager allocated (``stored`` items) and forwards every report to the serve of the
    moment (``target``); with none, it answers 202 itself, so the plugin never backs off
    and never resyncs (a resync would report held entries as stored again)."""

    def __init__(self) -> None:
        self.target: str | None = None
        self.stored: dict[str, int] = {}
        self.forward_failures = 0
        self.last_report = 0.0  # time.monotonic() of the last report
        self.cleared: dict[str, int] = {}  # cleared events per server (a reset, a start, a resync)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        """Listens on 127.0.0.1:``port`` (0: a free one; ``self.port`` says which)."""
        self._session = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/engine-events", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # noqa: SLF001

    async def stop(self) -> None:
        """Stops listening."""
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.last_report = time.monotonic()
        report = orjson.loads(raw)
        endpoint = report["endpoint"]
        for event in report["events"]:
            if event["type"] == "stored":
                self.stored[endpoint] = self.stored.get(endpoint, 0) + len(event["items"])
            elif event["type"] == "cleared":
                self.cleared[endpoint] = self.cleared.get(endpoint, 0) + 1
        if self.target is None:
            return web.json_response({"events": len(report["events"])}, status=202)
        assert self._session is not None
        headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        try:
            async with self._session.post(f"{self.target}/v1/engine-events", data=raw,
                                          headers=headers) as answer:
                return web.Response(status=answer.status, body=await answer.read(),
                                    content_type="application/json")
        except aiohttp.ClientError:
            self.forward_failures += 1
            return web.json_response({"events": len(report["events"])}, status=202)


@dataclass(slots=True)
class RealResult:
    """One policy's real figures."""

    policy: str
    requests: int = 0
    failed: int = 0
    ttft_s: list[float] = field(default_factory=list, repr=False)
    encoder_lookups: int = 0
    encoder_misses: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    checks: dict[str, float] = field(default_factory=dict)
    routed: dict[str, int] = field(default_factory=dict)
    match_failures: int = 0
    resyncs: int = 0

    def ratio(self, layer: str) -> float:
        """The layer's real hit ratio."""
        if layer == "encoder":
            return 1 - self.encoder_misses / self.encoder_lookups if self.encoder_lookups else 0.0
        name = {"processor": "mm_cache", "prefix": "prefix_cache"}[layer]
        queries = self.counters.get(f"vllm:{name}_queries_total", 0.0)
        return self.counters.get(f"vllm:{name}_hits_total", 0.0) / queries if queries else 0.0

    @property
    def precision(self) -> float | None:
        """The estimate's precision against the engines' reports (None: no checks)."""
        predicted = self.checks.get("true_hit", 0.0) + self.checks.get("false_hit", 0.0)
        return self.checks.get("true_hit", 0.0) / predicted if predicted else None

    @property
    def recall(self) -> float | None:
        """The estimate's recall against the engines' reports (None: nothing held)."""
        held = self.checks.get("true_hit", 0.0) + self.checks.get("missed_hit", 0.0)
        return self.checks.get("true_hit", 0.0) / held if held else None

    def summary(self) -> dict[str, Any]:
        """The figures as JSON."""
        return {"layers": {layer: self.ratio(layer) for layer in ("processor", "encoder", "prefix")},
                "ttft_p50_s": _percentile(self.ttft_s, 0.5), "ttft_p90_s": _percentile(self.ttft_s, 0.9),
                "precision": self.precision, "recall": self.recall, "requests": self.requests,
                "failed": self.failed, "routed": self.routed, "match_failures": self.match_failures,
                "resyncs": self.resyncs,
                "checks": self.checks,
                "encoder": {"lookups": self.encoder_lookups, "misses": self.encoder_misses}}


_COUNTERS = ("vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total", "vllm:prefix_cache_queries_total",
             "vllm:prefix_cache_hits_total")


def _metric_sums(text: str, names: Sequence[str]) -> dict[str, float]:
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for name in names:
            if line.startswith((name + "{", name + " ")):
                sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


def _checks(text: str) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        match = re.match(r'mmcache_estimate_checks_total\{outcome="(\w+)"\} (\S+)', line)
        if match:
            found[match[1]] = float(match[2])
    return found


async def _get(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as response:
        return await response.text()


async def _counters(session: aiohttp.ClientSession, servers: Mapping[str, str]) -> dict[str, float]:
    total = dict.fromkeys(_COUNTERS, 0.0)
    for url in servers.values():
        for name, value in _metric_sums(await _get(session, f"{url}/metrics"), _COUNTERS).items():
            total[name] += value
    return total


async def _reset(session: aiohttp.ClientSession, servers: Mapping[str, str]) -> None:
    """Every cache of every server emptied (vLLM's dev routes: VLLM_SERVER_DEV_MODE=1)."""
    for url in servers.values():
        for route in ("/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache"):
            async with session.post(f"{url}{route}") as response:
                if response.status != 200:
                    raise RuntimeError(f"{url}{route} answered {response.status}: {await response.text()}")


async def _send(session: aiohttp.ClientSession, gateway: str, body: dict[str, Any]) -> float | None:
    """TTFT of one request through the gateway (None: it failed)."""
    started = time.monotonic()
    async with session.post(f"{gateway}/v1/chat/completions", data=orjson.dumps(body),
                            headers={"Content-Type": "application/json"}) as response:
        if response.status != 200:
            await response.read()
            return None
        first: float | None = None
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - started
        return first


def kv_shape(metrics: str) -> tuple[int, int]:
    """(KV blocks, block size) from a vLLM server's ``vllm:cache_config_info``."""
    tokens = re.search(r'kv_cache_size_tokens="(\d+)"', metrics)
    size = re.search(r'[{,]block_size="(\d+)"', metrics)
    if tokens is None or size is None:
        raise RuntimeError("vLLM's /metrics does not say its KV cache size and block size")
    block = int(size[1])
    return int(tokens[1]) // block, block


async def run_policy(policy: str, requests: Sequence[Request], bodies: Sequence[dict[str, Any]],
                     servers: Mapping[str, str], tap: EngineEventTap, root: Path,
                     trace: FleetTrace) -> RealResult:
    """One policy over the trace, cold: a fresh serve, every cache reset, the requests sent
    at their arrival times (open loop)."""
    result = RealResult(policy, encoder_lookups=sum(len(r.items) for r in requests))
    (root / policy).mkdir()
    serve = await asyncio.to_thread(Serve(root / policy, ["--match-source", "estimate"]).start)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            tap.target = serve.url
            cleared = dict(tap.cleared)
            await _reset(session, servers)
            # each plugin reports its reset (cleared) to this serve before any request
            await _until(lambda: all(tap.cleared.get(name, 0) > cleared.get(name, 0) for name in servers))
            cleared = dict(tap.cleared)
            before = await _counters(session, servers)
            stored_before = sum(tap.stored.values())
            gateway = Gateway(servers, serve.url, policy, scrape_s=trace.scrape_s, match_timeout_s=1.0,
                              seed=trace.seed)
            runner = web.AppRunner(gateway.app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]  # noqa: SLF001
            try:
                start = time.monotonic()

                async def one(request: Request, body: dict[str, Any]) -> float | None:
                    await asyncio.sleep(max(0.0, start + request.arrival - time.monotonic()))
                    return await _send(session, url, body)

                ttfts = await asyncio.gather(*(one(r, b) for r, b in zip(requests, bodies, strict=True)))
            finally:
                await runner.cleanup()
            result.requests = len(ttfts)
            result.ttft_s = [t for t in ttfts if t is not None]
            result.failed = len(ttfts) - len(result.ttft_s)
            result.routed = dict(gateway.counters.routed)
            result.match_failures = gateway.counters.match_failures
            # the plugins send every 0.2 s: wait until their reports of this run have landed
            await _settled(tap)
            after = await _counters(session, servers)
            result.counters = {name: after[name] - before[name] for name in _COUNTERS}
            result.encoder_misses = sum(tap.stored.values()) - stored_before
            # a resync (after a report was lost) sends cleared and then everything held
            # as stored again: the misses above would count it
            result.resyncs = sum(tap.cleared.values()) - sum(cleared.values())
            result.checks = _checks(await _get(session, f"{serve.url}/metrics"))
    finally:
        tap.target = None
        await asyncio.to_thread(serve.stop)
    return result


async def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Polls ``condition`` (a bound on what it is about: a plugin reports every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s")
        await asyncio.sleep(0.1)


async def _settled(tap: EngineEventTap) -> None:
    """Until no report reached the tap for a second (the plugins send what they queued every
    0.2 s; once the servers are idle nothing more comes)."""
    while time.monotonic() - tap.last_report < 1.0:
        await asyncio.sleep(0.2)


class FleetVllm(Vllm):
    """The e2e suite's vLLM, on a core of its own where there are enough (two engines on
    one core would each run at half speed)."""

    def __init__(self, root: Path, report_url: str, name: str, core: int) -> None:
        super().__init__(root, report_url, manager_cls="mmcache_vllm.MmcacheEncoderCacheManager",
                         manager_config={"endpoint": name, "interval_s": 0.2})
        self.core = core

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "VLLM_CPU_OMP_THREADS_BIND": str(self.core % (os.cpu_count() or 1))}


async def run_real(trace: FleetTrace, policies: Sequence[str], root: Path) -> dict[str, Any]:
    """Every policy in turn on one fleet; the figures, the fleet's KV shape and the trace's
    digest."""
    requests = requests_of(trace)
    bodies = [chat_body(request, "tiny") for request in requests]
    tap = EngineEventTap()
    await tap.start()
    servers: list[FleetVllm] = []
    try:
        for i in range(trace.servers):
            (root / f"vllm-{i}").mkdir()
            servers.append(FleetVllm(root / f"vllm-{i}", f"http://127.0.0.1:{tap.port}", f"fleet/vllm-{i}", i))
        # started together (each start waits in a thread): their start-ups overlap
        await asyncio.gather(*(asyncio.to_thread(server.start) for server in servers))
        urls = {f"fleet/vllm-{i}": server.url for i, server in enumerate(servers)}
        async with aiohttp.ClientSession() as session:
            blocks, block_size = kv_shape(await _get(session, f"{servers[0].url}/metrics"))
        real = {policy: await run_policy(policy, requests, bodies, urls, tap, root, trace) for policy in policies}
    finally:
        await tap.stop()
        for server in servers:
            if server.process is not None:
                await asyncio.to_thread(server.stop)
    return {"trace": {"requests": len(requests), "items": sum(len(r.items) for r in requests),
                      "distinct_items": len({i.hash for r in requests for i in r.items}),
                      "conversations": len({r.conversation for r in requests if r.conversation >= 0}),
                      "kv_blocks": blocks, "block_size": block_size, "digest": trace_digest(requests)},
            "real": {policy: result.summary() for policy, result in real.items()}}


def main(argv: Sequence[str] | None = None) -> None:
    """The command: the figures of a run as one JSON document on stdout."""
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.fleet")
    parser.add_argument("--requests", type=int, default=FleetTrace().requests)
    parser.add_argument("--rate", type=float, default=FleetTrace().rate)
    parser.add_argument("--seed", type=int, default=FleetTrace().seed)
    parser.add_argument("--policies", default=",".join(GATEWAY_POLICIES))
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in GATEWAY_POLICIES]
    if unknown:
        raise SystemExit(f"unknown policy {unknown[0]!r}: one of {', '.join(GATEWAY_POLICIES)}")
    trace = FleetTrace(requests=args.requests, rate=args.rate, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="mmcache-fleet-") as root:
        document = asyncio.run(run_real(trace, policies, Path(root)))
    sys.stdout.write(orjson.dumps(document).decode() + "\n")


if __name__ == "__main__":
    main()
