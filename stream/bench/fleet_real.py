"""A real fleet against the simulator's prediction: two vLLM servers (the tiny model, the
mmcache-vllm plugin reporting each server's encoder cache), `mmcache serve`, and the
reference gateway (``stream.gateway``), one seeded trace, each gateway policy in turn.

Per policy, the real figures:

- encoder: the share of the trace's (request, distinct item) pairs that were not encoded:
  1 - the entries vLLM's encoder cache manager allocated (the plugin reports each as
  ``stored``; a tap between the plugin and mmcache counts them, :class:`EngineEventTap`)
  / the pairs. An item inside a prefix hit needs no encoder, so it counts as saved too;
  the simulator's figure is put in the same terms (:func:`_layers`);
- processor: ``vllm:mm_cache_queries``/``vllm:mm_cache_hits`` (items), prefix:
  ``vllm:prefix_cache_queries``/``vllm:prefix_cache_hits`` (tokens), from each server's
  ``/metrics``, summed, as differences over the policy's run;
- TTFT: the first streamed chunk through the gateway, less the request's send time;
- the closed loop: ``mmcache_estimate_checks_total`` of a serve started afresh for the
  policy (routing on its estimate, ``--match-source estimate``, while the engine views
  are kept): precision = true_hit / (true_hit + false_hit), recall = true_hit /
  (true_hit + missed_hit).

The simulator runs as ``mmcache simulate`` with the arguments of :func:`simulate_argv`
(the run's document carries the command): the same requests (checked equal), a fleet of
the same shape (servers, max_num_seqs, max_num_batched_tokens = the encoder cache size,
KV blocks and block size as the servers report them), one gateway replica. Between
policies every server's caches are reset (prefix, processor, encoder: vLLM's dev routes)
and serve starts on a new data dir, so each policy starts cold, as in the simulator.

The trace's text is words drawn from the segment's key (one word is about one token of
the tiny model's tokenizer), its images PNGs of exactly the item's embeddings (28 x 28
pixels an embedding for Qwen2-VL), every other item with a ``uuid`` of its own, the rest
named by the gateway.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from stream.bench.figures import Figure
from stream.bench.service import Worker
from stream.gateway.gateway import GATEWAY_POLICIES, Gateway
from stream.sim.engine import Costs, Segment
from stream.sim.fleet import PolicyResult, percentile
from stream.sim.workload import Request, SizeMix, WorkloadSpec, generate

__all__ = ["FleetTrace", "RealResult", "chat_body", "fleet_real_figures", "png_data_url", "run_fleet"]

REPO = Path(__file__).resolve().parents[2]
_WORDS = ("the", "of", "and", "a", "to", "is", "in", "it", "that", "for", "on", "as", "an", "are",
          "with", "by", "be", "not", "or", "its", "one", "from", "at", "each", "this", "what", "item",
          "cache", "request", "server", "image", "event", "log", "state", "time", "score")
_ANSWER = re.compile(r"/a\d+$")


@dataclass(frozen=True, slots=True)
class FleetTrace:
    """The trace and the fleet's shape: what both the real run and the simulator take."""

    requests: int = 150
    rate: float = 2.0
    seed: int = 1
    catalogue: int = 40
    conversation_share: float = 0.3
    turns: tuple[int, int] = (2, 4)
    think_s: float = 4.0
    fresh_share: float = 0.3
    system_tokens: int = 300
    text_tokens: tuple[int, int] = (10, 60)
    output_tokens: int = 8
    sizes: SizeMix = SizeMix(small=16, large=(30, 64), video=(1, 1), large_share=0.5, video_share=0.0)
    servers: int = 2
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 1024  # also vLLM's encoder cache size (embeddings)
    max_model_len: int = 2048
    scrape_s: float = 0.5

    def workload(self) -> WorkloadSpec:
        """The simulator's spec of this trace (one gateway replica)."""
        return WorkloadSpec(requests=self.requests, rate=self.rate, catalogue=self.catalogue,
                            conversation_share=self.conversation_share, turns=self.turns,
                            think_s=self.think_s,
                            fresh_share=self.fresh_share, system_tokens=self.system_tokens,
                            text_tokens=self.text_tokens, output_tokens=self.output_tokens, replicas=1,
                            sizes=self.sizes, seed=self.seed)


def _png(width: int, height: int, seed: bytes) -> bytes:
    """An RGB PNG whose pixels come from ``seed`` (distinct seeds, distinct images)."""
    pattern = hashlib.sha256(seed).digest() * 3  # 96 bytes: 32 pixels
    row = (pattern * (width * 3 // len(pattern) + 1))[: width * 3]
    raw = b"".join(b"\x00" + row[i % 3:] + row[: i % 3] for i in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def png_data_url(key: str, embeddings: int) -> str:
    """A ``data:`` URL of a PNG that Qwen2-VL encodes into exactly ``embeddings``
    embeddings (28 x 28 pixels each, at most 64: the tiny model's 224 x 224 cap)."""
    if not 1 <= embeddings <= 64:
        raise ValueError(f"an image of {embeddings} embeddings: 1 to 64")
    rows = max(d for d in range(1, int(embeddings ** 0.5) + 1) if embeddings % d == 0)
    data = _png(28 * (embeddings // rows), 28 * rows, key.encode())
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _text(segment: Segment) -> str:
    rng = random.Random(segment.key)
    return " ".join(rng.choice(_WORDS) for _ in range(segment.tokens))


def chat_body(request: Request, model: str) -> dict[str, Any]:
    """The chat-completions body of a simulated request: the system prompt, user text and
    images in prompt order, earlier answers as assistant messages; it generates exactly
    ``output_tokens`` tokens, streamed. Items whose number is even carry a ``uuid``."""
    messages: list[dict[str, Any]] = []
    user: list[dict[str, Any]] = []
    for segment in request.segments:
        if segment.embeddings:
            part: dict[str, Any] = {"type": "image_url",
                                    "image_url": {"url": png_data_url(segment.key, segment.embeddings)}}
            if int(segment.key.rsplit("-", 1)[1]) % 2 == 0:
                part["uuid"] = f"trace-{segment.key}"
            user.append(part)
        elif segment.key == "system":
            messages.append({"role": "system", "content": _text(segment)})
        elif _ANSWER.search(segment.key):
            if user:
                messages.append({"role": "user", "content": user})
                user = []
            messages.append({"role": "assistant", "content": _text(segment)})
        else:
            user.append({"type": "text", "text": _text(segment)})
    if user:
        messages.append({"role": "user", "content": user})
    return {"model": model, "messages": messages, "max_tokens": request.output_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True}


class EngineEventTap:
    """Between the plugins and mmcache: counts the entries each server's encoder cache
    manager allocated (``stored`` items) and forwards every report to the serve of the
    moment (``target``); with none, it answers 202 itself, so the plugin never backs off
    and never resyncs (a resync would report held entries as stored again)."""

    def __init__(self) -> None:
        self.target: str | None = None
        self.stored: dict[str, int] = {}
        self.forward_failures = 0
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
        report = orjson.loads(raw)
        endpoint = report["endpoint"]
        for event in report["events"]:
            if event["type"] == "stored":
                self.stored[endpoint] = self.stored.get(endpoint, 0) + len(event["items"])
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
                "ttft_p50_s": percentile(self.ttft_s, 0.5), "ttft_p90_s": percentile(self.ttft_s, 0.9),
                "precision": self.precision, "recall": self.recall, "requests": self.requests,
                "failed": self.failed, "routed": self.routed, "match_failures": self.match_failures,
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


async def run_policy(policy: str, requests: Sequence[Request], bodies: Sequence[dict[str, Any]],
                     servers: Mapping[str, str], tap: EngineEventTap, work: Path,
                     trace: FleetTrace) -> RealResult:
    """One policy over the trace, cold: fresh serve, caches reset, requests sent at their
    arrival times (open loop)."""
    result = RealResult(policy, encoder_lookups=sum(len(r.items) for r in requests))
    data_dir = work / f"serve-{policy}" / "data"
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    worker = Worker(None, f"fleet-{policy}", data_dir, env={"MMCACHE_MATCH_SOURCE": "estimate"})
    try:
        await asyncio.to_thread(worker.wait_ready)
        mmcache = f"http://127.0.0.1:{worker.port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            tap.target = mmcache
            await _reset(session, servers)
            before = await _counters(session, servers)
            stored_before = sum(tap.stored.values())
            gateway = Gateway(servers, mmcache, policy, scrape_s=trace.scrape_s, match_timeout_s=1.0,
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
            await asyncio.sleep(1.0)  # the plugins send every 0.2 s: their last reports land
            after = await _counters(session, servers)
            result.counters = {name: after[name] - before[name] for name in _COUNTERS}
            result.encoder_misses = sum(tap.stored.values()) - stored_before
            result.checks = _checks(await _get(session, f"{mmcache}/metrics"))
    finally:
        tap.target = None
        worker.process.terminate()
        worker.process.wait(60)
    return result


def simulate_argv(trace: FleetTrace, kv_blocks: int, block_size: int, policies: Sequence[str]) -> list[str]:
    """The ``mmcache simulate`` arguments of this trace and fleet: the same requests (the
    workload's flags and seed, the rate), the servers' shape as they report it, the
    gateway's scrape interval, CPU costs (:data:`CPU_COSTS`)."""
    costs, sizes = CPU_COSTS, trace.sizes
    return ["simulate", "--servers", str(trace.servers), "--replicas", "1",
            "--requests", str(trace.requests),
            "--rate", f"{trace.rate:g}", "--seed", str(trace.seed), "--policies", ",".join(policies),
            "--max-num-seqs", str(trace.max_num_seqs),
            "--max-num-batched-tokens", str(trace.max_num_batched_tokens),
            "--encoder-cache-size", str(trace.max_num_batched_tokens),
            "--kv-blocks", str(kv_blocks), "--block-size", str(block_size),
            "--scrape-ms", f"{trace.scrape_s * 1000:g}",
            "--preprocess-ms", f"{costs.preprocess_ms_per_item:g}",
            "--encoder-ms-per-1k", f"{costs.encoder_ms_per_1k_embeddings:g}",
            "--prefill-ms-per-1k", f"{costs.prefill_ms_per_1k_tokens:g}",
            "--decode-ms", f"{costs.decode_ms_per_step:g}",
            "--step-overhead-ms", f"{costs.step_overhead_ms:g}",
            "--catalogue", str(trace.catalogue), "--conversation-share", f"{trace.conversation_share:g}",
            "--turns", f"{trace.turns[0]},{trace.turns[1]}", "--think-s", f"{trace.think_s:g}",
            "--fresh-share", f"{trace.fresh_share:g}", "--system-tokens", str(trace.system_tokens),
            "--text-tokens", f"{trace.text_tokens[0]},{trace.text_tokens[1]}",
            "--output-tokens", str(trace.output_tokens), "--small-embeddings", str(sizes.small),
            "--large-embeddings", f"{sizes.large[0]},{sizes.large[1]}",
            "--large-share", f"{sizes.large_share:g}",
            "--video-share", f"{sizes.video_share:g}", "--format", "json"]


def predicted(argv: Sequence[str]) -> tuple[dict[str, PolicyResult], list[Request]]:
    """The simulator's results for ``mmcache simulate`` arguments, and its requests."""
    import argparse

    from stream.sim.commands import add_commands, run_simulation

    parser = argparse.ArgumentParser(prog="mmcache")
    add_commands(parser.add_subparsers(dest="command", required=True))
    placed: list[tuple[str, Request]] = []
    run = run_simulation(parser.parse_args(list(argv)), placed=placed)
    return run.results, sorted((request for _, request in placed), key=lambda r: r.id)


# The tiny model on one loaded CPU core: rough, and only the ratios between policies are
# read (the simulator's TTFT is not a measurement of this machine).
CPU_COSTS = Costs(preprocess_ms_per_item=20.0, encoder_ms_per_1k_embeddings=400.0,
                  prefill_ms_per_1k_tokens=200.0, decode_ms_per_step=15.0, step_overhead_ms=5.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServers:
    """``count`` real vLLM servers of the tiny model with the mmcache-vllm plugin
    reporting to ``report_url``, each on one core of its own where there are enough."""

    def __init__(self, count: int, python: Path, model: Path, report_url: str, trace: FleetTrace,
                 logs: Path) -> None:
        self.servers: dict[str, str] = {}
        self.processes: list[subprocess.Popen[bytes]] = []
        for i in range(count):
            port = _free_port()
            name = f"fleet/vllm-{i}"
            config = {"encoder_cache_manager_cls": "mmcache_vllm.MmcacheEncoderCacheManager",
                      "manager_config": {"url": report_url, "endpoint": name}}
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "OMP_NUM_THREADS": "1",
                   "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1)),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "clients" / "vllm"),
                                                               os.environ.get("MMCACHE_VLLM_PYTHONPATH")]))}
            command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                       "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                       "--load-format", "dummy", "--max-model-len", str(trace.max_model_len),
                       "--max-num-seqs", str(trace.max_num_seqs),
                       "--max-num-batched-tokens", str(trace.max_num_batched_tokens), "--enforce-eager",
                       "--dtype", "bfloat16", "--ec-manager-config", orjson.dumps(config).decode()]
            log = open(logs / f"vllm-{i}.log", "ab")  # noqa: SIM115 - closed with the process
            self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                   start_new_session=True))
            self.servers[name] = f"http://127.0.0.1:{port}"

    async def wait_ready(self) -> None:
        """Until every server answers /health (no time bound: a loaded machine starts slowly;
        a server that exits fails at once)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            for (name, url), process in zip(self.servers.items(), self.processes, strict=True):
                while True:
                    if process.poll() is not None:
                        raise RuntimeError(f"vLLM server {name} exited with {process.returncode}; "
                                           "see its log")
                    try:
                        async with session.get(f"{url}/health") as response:
                            if response.status == 200:
                                break
                    except (aiohttp.ClientError, TimeoutError):
                        pass
                    await asyncio.sleep(1.0)

    def stop(self) -> None:
        """Ends the servers (their process groups)."""
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, 15)
        for process in self.processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()


def kv_shape(metrics: str) -> tuple[int, int]:
    """(KV blocks, block size) from a vLLM server's ``vllm:cache_config_info``."""
    tokens = re.search(r'kv_cache_size_tokens="(\d+)"', metrics)
    size = re.search(r'[{,]block_size="(\d+)"', metrics)
    if tokens is None or size is None:
        raise RuntimeError("vLLM's /metrics does not say its KV cache size and block size")
    block = int(size[1])
    return int(tokens[1]) // block, block


async def run_fleet(trace: FleetTrace, policies: Sequence[str], servers: Mapping[str, str] | None = None,
                    tap_port: int = 0, python: Path | None = None, model: Path | None = None,
                    work: Path | None = None, kv: tuple[int, int] | None = None) -> dict[str, Any]:
    """The real run of every policy and the simulator's prediction on the same trace.
    With ``servers``, those (started with their plugin reporting to 127.0.0.1:``tap_port``)
    are used; else two are started from ``python`` and ``model``."""
    requests = generate(trace.workload())
    bodies = [chat_body(request, "tiny") for request in requests]
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="fleet-real-")) if work is None else work
    tap = EngineEventTap()
    await tap.start(tap_port)
    started: VllmServers | None = None
    try:
        if servers is None:
            if python is None or model is None:
                raise ValueError("give servers, or python and model to start them")
            started = VllmServers(trace.servers, python, model, f"http://127.0.0.1:{tap.port}", trace, work)
            await started.wait_ready()
            servers = started.servers
        if kv is None:
            async with aiohttp.ClientSession() as session:
                kv = kv_shape(await _get(session, f"{next(iter(servers.values()))}/metrics"))
        real = {}
        for policy in policies:
            real[policy] = await run_policy(policy, requests, bodies, servers, tap, work, trace)
    finally:
        await tap.stop()
        if started is not None:
            started.stop()
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    blocks, block_size = kv
    argv = simulate_argv(trace, blocks, block_size, policies)
    sim, simulated_requests = predicted(argv)
    if simulated_requests != requests:
        raise AssertionError("the simulator's requests are not the real run's")
    items = sum(len(r.items) for r in requests)
    return {"command": "mmcache " + " ".join(argv),
            "trace": {"requests": len(requests), "items": items,
                      "distinct_items": len({i.hash for r in requests for i in r.items}),
                      "conversations": len({r.conversation for r in requests if r.conversation >= 0}),
                      "kv_blocks": blocks, "block_size": block_size},
            "real": {p: r.summary() for p, r in real.items()},
            "simulated": {p: {**r.summary(), "layers": _layers(r, requests, block_size)}
                          for p, r in sim.items()}}


def _layers(result: PolicyResult, requests: Sequence[Request], block_size: int) -> dict[str, float]:
    """The simulator's hit ratios in the real run's terms. Its encoder layer counts only
    the items whose tokens were computed (an item inside a prefix hit is never looked up),
    the real one every item of every request (1 - encodings / items). Its prefix layer
    counts whole blocks (a prompt's last, partial block is never looked up), vLLM's
    counters tokens of the whole prompt (hit blocks x block size / prompt tokens here)."""
    ratios = {name: layer.hit_ratio for name, layer in result.layers.items()}
    items = sum(len(r.items) for r in requests)
    encoder = result.layers["encoder"]
    ratios["encoder"] = 1 - (encoder.lookups - encoder.hits) / items if items else 0.0
    ratios["encoder_computed_only"] = encoder.hit_ratio
    prompt = sum(r.prompt_tokens for r in requests)
    ratios["prefix"] = result.layers["prefix"].hits * block_size / prompt if prompt else 0.0
    ratios["prefix_blocks"] = result.layers["prefix"].hit_ratio
    return ratios


def _default_python() -> Path:
    return Path(os.environ.get("MMCACHE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


def _default_model() -> Path:
    return Path(os.environ.get("MMCACHE_TINY_MODEL", REPO / ".e2e" / "tiny-qwen2-vl"))


def fleet_real_figures(quick: bool, scale: float | None) -> list[Figure]:
    """The bench rows: per policy and layer the real hit ratio with the simulator's
    prediction as its control, TTFT relative to round-robin's, the estimate's precision
    and recall beside the simulator's."""
    trace = FleetTrace(requests=40 if scale else 80 if quick else 150)
    doc = asyncio.run(run_fleet(trace, GATEWAY_POLICIES, python=_default_python(), model=_default_model()))
    if scale is None:  # the whole document beside the rows: docs/simulation.md's tables
        out = REPO / "bench" / ("fleet_real_quick.json" if quick else "fleet_real.json")
        out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return figures_of(doc, trace)


def figures_of(doc: Mapping[str, Any], trace: FleetTrace) -> list[Figure]:
    """Rows of a :func:`run_fleet` document."""
    shape = doc["trace"]
    note = (f"{shape['requests']} requests ({shape['items']} items, {shape['distinct_items']} distinct, "
            f"{shape['conversations']} conversations) at {trace.rate:g}/s, seed {trace.seed}, "
            f"{trace.servers} vLLM CPU servers (tiny Qwen2-VL, max_num_seqs {trace.max_num_seqs}, "
            f"encoder cache {trace.max_num_batched_tokens} embeddings); control: the simulator on the same "
            "requests (bench/fleet_real.json has the command)")
    rows: list[Figure] = []
    base_real = doc["real"].get("round-robin", {})
    base_sim = doc["simulated"].get("round-robin", {})
    for policy, real in doc["real"].items():
        sim = doc["simulated"][policy]
        slug = policy.replace("-", "_")
        for layer in ("encoder", "processor", "prefix"):
            value, control = real["layers"][layer], sim["layers"][layer]
            rows.append(Figure(f"fleet_real_{layer}_hit_ratio_{slug}", round(value, 3), "ratio",
                               "reported beside the simulator's prediction", True, round(control, 3),
                               round(value / control, 2) if control else None, note))
        for key in ("ttft_p50_s", "ttft_p90_s"):
            if base_real.get(key) and policy != "round-robin":
                rel = real[key] / base_real[key]
                sim_rel = sim[key] / base_sim[key] if base_sim.get(key) else None
                name = f"fleet_real_{key.removesuffix('_s')}_vs_round_robin_{slug}"
                rows.append(Figure(name, round(rel, 2), "x", "relative only (CPU)", True,
                                   None if sim_rel is None else round(sim_rel, 2), None,
                                   note + f"; real {real[key]:.3f} s vs round-robin {base_real[key]:.3f} s"))
        for key in ("precision", "recall"):
            if real[key] is not None:
                rows.append(Figure(f"fleet_real_estimate_{key}_{slug}", round(real[key], 3), "ratio",
                                   "beside the simulator's", True,
                                   None if sim[key] is None else round(sim[key], 3), None,
                                   note + f"; checks {real['checks']}"))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m stream.bench.fleet_real``: the run's JSON document on stdout (the e2e
    test's short run; the bench rows come from ``mmcache bench --only fleet_real``).
    ``MMCACHE_FLEET_SERVERS`` (``name=url,...``) uses servers already running, whose plugin
    reports to 127.0.0.1:``MMCACHE_FLEET_TAP_PORT``; else two are started."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m stream.bench.fleet_real")
    parser.add_argument("--requests", type=int, default=FleetTrace().requests)
    parser.add_argument("--rate", type=float, default=FleetTrace().rate)
    parser.add_argument("--seed", type=int, default=FleetTrace().seed)
    parser.add_argument("--policies", default=",".join(GATEWAY_POLICIES))
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in GATEWAY_POLICIES]
    if unknown:
        raise SystemExit(f"unknown policy {unknown[0]!r}: one of {', '.join(GATEWAY_POLICIES)}")
    servers_env = os.environ.get("MMCACHE_FLEET_SERVERS")
    given = dict(pair.split("=", 1) for pair in servers_env.split(",")) if servers_env else None
    trace = FleetTrace(requests=args.requests, rate=args.rate, seed=args.seed)
    document = asyncio.run(run_fleet(trace, policies, servers=given,
                                     tap_port=int(os.environ.get("MMCACHE_FLEET_TAP_PORT", "0")),
                                     python=_default_python(), model=_default_model()))
    sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")


if __name__ == "__main__":
    main()
