"""The reference gateway: OpenAI chat-completions in, one vLLM server chosen, the request
forwarded there and its answer streamed back.

Per request, as docs/gateway.md recommends:

1. name every media part that has no ``uuid`` by its item hash (``name_items``), so vLLM,
   its engine reports and mmcache's estimate call the item alike;
2. ``round-robin``: the next server; the index policies: ``POST /v1/match`` with the
   candidates and the body, then the pick of ``stream.core.picking`` (the rules the
   simulator runs): ``index`` on the scraped load, first of the tied best;
   ``index-bounded`` on the scraped load plus what this gateway routed since the scrape,
   the load bound, ties at random. A match that fails or times out scores every server 0;
   a request without items goes to the least loaded;
3. ``POST /v1/placements`` with the items the match answered, off the request's path;
4. forward the named body to the chosen server.

The load of a server is ``vllm:num_requests_running`` + ``vllm:num_requests_waiting``
from its ``/metrics``, scraped every ``scrape_s``.

Two client sessions: the forwarded completions on a pool without a limit (the gateway's own
clients bound them; a limit would queue requests unseen, in front of the servers), and
mmcache's calls and the scrapes on another, ``mmcache_connections`` per host, so neither a
match (50 ms to answer, connecting included) nor a scrape ever waits behind completions in
flight. A request makes one match and at most one placement, so that bound must stay above
the requests that arrive at once: at 32, a burst of 100 failed 59 of its matches.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from stream.core.items import media_hash
from stream.core.picking import PickRule, least_loaded, pick, totals

__all__ = ["GATEWAY_POLICIES", "Gateway", "GatewayCounters", "name_items", "scraped_load"]

log = logging.getLogger(__name__)

GATEWAY_POLICIES = ("round-robin", "index", "index-bounded")
_MEDIA = ("image_url", "video_url", "audio_url", "input_audio")
_LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_PROFILE = PickRule()


def name_items(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with a ``uuid`` on each media part that has none: its item hash (the sha256
    rule), which leaves the part's hash unchanged. Parts with a uuid keep it; ``body``
    itself is not changed."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    named = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            named.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA and part.get("uuid") is None:
                reference = _reference(kind, part.get(kind))
                if reference is not None:
                    part = {**part, "uuid": media_hash(kind, reference)}
            parts.append(part)
        named.append({**message, "content": parts})
    return {**body, "messages": named}


def _reference(kind: str, value: Any) -> str | None:
    if kind == "input_audio":
        if not isinstance(value, dict):
            return None
        data, fmt = value.get("data"), value.get("format")
        return f"{fmt}:{data}" if isinstance(data, str) and isinstance(fmt, str) else None
    if kind == "image_url" and isinstance(value, str):
        return value
    url = value.get("url") if isinstance(value, dict) else None
    return url if isinstance(url, str) else None


def scraped_load(metrics: str) -> int:
    """Requests running plus waiting, summed over the lines of vLLM's ``/metrics``.

    A load line the reader cannot use (no value, a value that is not a finite number) is
    skipped; a timestamp after the value is ignored. Raises ``ValueError`` when the text has
    no load line at all: a page that is not vLLM's metrics, which must not read as idle."""
    total, seen = 0.0, False
    for line in metrics.splitlines():
        sample = _load_sample(line)
        if sample is not None:
            seen = True
            total += sample
    if not seen:
        raise ValueError("no vllm:num_requests_running or vllm:num_requests_waiting line")
    return round(total)


def _load_sample(line: str) -> float | None:
    """The value of a load line (the field after the name and labels), or None."""
    if "{" in line:
        name, _, rest = line.partition("{")
        labels_end = rest.rfind("}")
        if labels_end < 0:
            return None
        fields = rest[labels_end + 1:].split()
    else:
        name, *fields = line.split() or [""]
    if name.strip() not in _LOAD_METRICS or not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(slots=True)
class GatewayCounters:
    """What the gateway did: requests per server, matches that failed (scored 0),
    placements that failed, scrapes that failed."""

    routed: dict[str, int]
    match_failures: int = 0
    placement_failures: int = 0
    scrape_failures: int = 0


class Gateway:
    """Routes chat-completions requests over ``servers`` (endpoint name -> base URL) under
    ``policy``; ``mmcache`` is the service's base URL (unused by ``round-robin``);
    ``mmcache_connections`` bounds the connections to mmcache and to each server's metrics."""

    def __init__(self, servers: Mapping[str, str], mmcache: str, policy: str, *, token: str | None = None,
                 scrape_s: float = 0.5, match_timeout_s: float = 0.05, placement_timeout_s: float = 3.0,
                 rule: PickRule = _PROFILE, bound_factor: float = 1.25, seed: int = 1,
                 mmcache_connections: int = 256) -> None:
        if policy not in GATEWAY_POLICIES:
            raise ValueError(f"unknown policy {policy!r}: one of {', '.join(GATEWAY_POLICIES)}")
        if not servers:
            raise ValueError("need at least one server")
        self.names = list(servers)
        self.urls = dict(servers)
        self.mmcache = mmcache.rstrip("/")
        self.policy = policy
        self.rule = PickRule(rule.cache_weight, rule.load_weight,
                             bound_factor if policy == "index-bounded" else None, rule.bound_slack)
        self.scrape_s = scrape_s
        self.match_timeout = aiohttp.ClientTimeout(total=match_timeout_s)
        self.placement_timeout = aiohttp.ClientTimeout(total=placement_timeout_s)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.rng = random.Random(seed)
        self.counters = GatewayCounters({name: 0 for name in self.names})
        self._scraped = [0] * len(self.names)
        self._since = [0] * len(self.names)  # routed since the last scrape
        self._turn = 0
        self.mmcache_connections = mmcache_connections
        self._session: aiohttp.ClientSession | None = None  # mmcache's calls and the scrapes
        self._forwarding: aiohttp.ClientSession | None = None  # the completions
        self._scraper: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Opens the HTTP sessions and starts the scraper (after one scrape)."""
        self._forwarding = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                 timeout=aiohttp.ClientTimeout(total=None))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=self.mmcache_connections),
            timeout=aiohttp.ClientTimeout(total=None))
        await self._scrape()
        self._scraper = asyncio.create_task(self._scrape_forever())

    async def stop(self) -> None:
        """Stops the scraper, waits for placements in flight, closes the sessions; they are
        closed whatever the scraper or the placements ended with."""
        try:
            if self._scraper is not None:
                self._scraper.cancel()
                try:
                    await self._scraper
                except asyncio.CancelledError:
                    pass
                except Exception:
                    log.exception("the gateway's scraper had ended")
            if self._writes:
                await asyncio.gather(*self._writes, return_exceptions=True)
        finally:
            for session in (self._session, self._forwarding):
                if session is not None:
                    await session.close()

    async def _scrape(self) -> None:
        """Scrapes every server at once, so one slow or hung server holds no other's load."""
        await asyncio.gather(*(self._scrape_one(i) for i in range(len(self.names))))

    async def _scrape_one(self, i: int) -> None:
        """Server ``i``'s load, set as soon as it answers; on any failure (no answer, a status
        other than 200, text that is not vLLM's metrics) the last load stays and the failure
        is counted, and the scraper goes on."""
        assert self._session is not None
        name = self.names[i]
        try:
            async with self._session.get(f"{self.urls[name]}/metrics",
                                         timeout=aiohttp.ClientTimeout(total=5)) as response:
                if response.status != 200:
                    raise ValueError(f"/metrics answered {response.status}")
                load = scraped_load(await response.text())
        except Exception as error:  # the scraper must outlive any one answer
            self.counters.scrape_failures += 1
            log.debug("scraping %s failed: %r", name, error)
            return
        self._scraped[i] = load
        self._since[i] = 0

    async def _scrape_forever(self) -> None:
        while True:
            await asyncio.sleep(self.scrape_s)
            await self._scrape()

    def _loads(self) -> list[int]:
        if self.policy == "index-bounded":
            return [s + r for s, r in zip(self._scraped, self._since, strict=True)]
        return list(self._scraped)

    async def _match(self, body: bytes) -> tuple[list[float], list[dict[str, Any]]]:
        """Scores in ``names`` order and the request's items; zeros and no items on failure.
        ``body`` is the encoded body, put in the match as it is (encoding it again inside the
        match would add a level orjson may refuse)."""
        assert self._session is not None
        match = b'{"endpoints":' + orjson.dumps(self.names) + b',"body":' + body + b"}"
        try:
            async with self._session.post(f"{self.mmcache}/v1/match", headers=self.headers, data=match,
                                          timeout=self.match_timeout) as response:
                if response.status != 200:
                    raise ValueError(f"match answered {response.status}")
                answer = orjson.loads(await response.read())
            by_name = {entry["endpoint"]: float(entry["score"]) for entry in answer["endpoints"]}
            return [by_name.get(name, 0.0) for name in self.names], list(answer["request_items"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            self.counters.match_failures += 1
            return [0.0] * len(self.names), []

    async def _place(self, name: str, items: list[dict[str, Any]]) -> None:
        assert self._session is not None
        try:
            async with self._session.post(f"{self.mmcache}/v1/placements", headers=self.headers,
                                          data=orjson.dumps({"endpoints": [name], "items": items}),
                                          timeout=self.placement_timeout) as response:
                if response.status != 202:
                    raise ValueError(f"placement answered {response.status}")
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.counters.placement_failures += 1

    async def choose(self, body: bytes) -> str:
        """The server for ``body`` (already named, encoded); records the placement off the path."""
        if self.policy == "round-robin":
            chosen = self._turn % len(self.names)
            self._turn += 1
        else:
            scores, items = await self._match(body)
            loads = self._loads()
            if items:
                chosen = pick(totals(self.rule, scores, loads),
                              self.rng if self.policy == "index-bounded" else None)
                task = asyncio.create_task(self._place(self.names[chosen], items))
                self._writes.add(task)
                task.add_done_callback(self._writes.discard)
            else:
                chosen = least_loaded(loads, self.rng)
        self._since[chosen] += 1
        name = self.names[chosen]
        self.counters.routed[name] += 1
        return name

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``: pick, forward, stream the server's answer back."""
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.json_response({"error": {"code": "invalid_json", "message": "body: not JSON"}},
                                     status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"code": "invalid_request", "message": "body: not an object"}},
                                     status=400)
        try:
            named = orjson.dumps(name_items(body))
        except TypeError:  # orjson reads 1024 levels deep but writes no more than 254
            return web.json_response(
                {"error": {"code": "invalid_request", "message": "body: nested too deep"}}, status=400)
        name = await self.choose(named)
        assert self._forwarding is not None
        async with self._forwarding.post(f"{self.urls[name]}/v1/chat/completions", data=named,
                                      headers={"Content-Type": "application/json"}) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                "X-Mmcache-Endpoint": name})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    def app(self) -> web.Application:
        """The aiohttp application: the gateway's one route, started and stopped with it."""
        application = web.Application(client_max_size=64 * 2**20)
        application.router.add_post("/v1/chat/completions", self.handle)

        async def lifecycle(_: web.Application):  # type: ignore[no-untyped-def]
            await self.start()
            yield
            await self.stop()

        application.cleanup_ctx.append(lifecycle)
        return application
