"""Redis as two controls of the match benchmark, over the service's own reverse index.

The index is loaded as one Redis set per item hash whose members are the endpoints
holding it (``Index.holders``). Sets are named ``h:`` plus a 12-digit number, the
form ``redis-benchmark -r`` draws keys in: the hashes named by the benchmark's request
bodies take the numbers from 0 in order of first appearance, the other held hashes
follow, so drawing from ``0..lookups-1`` asks for the bodies' hashes, held and absent
in the bodies' mix (absent ones are keys that do not exist).
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import redis
import redis.asyncio
import redis.utils

from stream.config import Limits
from stream.core.items import Item, extract_items
from stream.core.render import render_match
from stream.http.models import read_match
from stream.kafka.embedded import free_port

__all__ = ["LOOKUPS_PER_REQUEST", "DirectRate", "RedisServer", "index_keys", "load_index", "pinned",
           "RedisRoutes", "redis_benchmark_rate", "without_hiredis"]

LOOKUPS_PER_REQUEST = 8  # the items of one benchmark match request
_LOAD_BATCH = 5_000  # SADD commands per pipeline while loading


def pinned(core: str, command: list[str]) -> list[str]:
    """``command`` run on one core by taskset (as it is, where taskset is missing)."""
    return ["taskset", "-c", core, *command] if shutil.which("taskset") else command


def _tool(name: str) -> str:
    """The path of a Redis program, or a one-line error naming the package to install."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is missing: install the Debian package 'redis-server' "
                           "(apt-get install redis-server)")
    return path


class RedisServer:
    """A redis-server on a free port, without persistence, in a temporary directory,
    pinned to one core; it holds nothing but what the benchmark loads."""

    def __init__(self, core: str) -> None:
        self.core = core
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="mmcache-bench-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        """Start it and wait until it answers PING."""
        command = [_tool("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                   "--save", "", "--appendonly", "no", "--dir", self._dir.name]
        self.process = subprocess.Popen(pinned(self.core, command), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        client, deadline = self.client(), time.monotonic() + 30
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.1)
            finally:
                client.close()

    def client(self) -> redis.Redis:
        """A synchronous client of this server."""
        return redis.Redis(host="127.0.0.1", port=self.port)

    def cpu_seconds(self) -> float:
        """CPU time the server has used so far (user + system); taskset execs it, so the
        child's pid is the server's."""
        assert self.process is not None
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """Stop the server (SIGTERM; with no persistence it writes nothing) and remove its
        directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self._dir.cleanup()


def index_keys(bodies: Iterable[bytes], held: Iterable[str]) -> tuple[dict[str, str], int]:
    """The set name of every hash the bodies name or the index holds, and how many the
    bodies name (the range ``redis-benchmark`` draws from)."""
    order = dict.fromkeys(item.hash for items in map(_body_items, bodies) for item in items)
    lookups = len(order)
    order.update(dict.fromkeys(held))
    return {digest: _key(number) for number, digest in enumerate(order)}, lookups


def _key(number: int) -> str:
    """A set's name in the form ``redis-benchmark`` writes for ``__rand_int__``."""
    return f"h:{number:012d}"


def _body_items(raw: bytes) -> list[Item]:
    """The items of a match body, read as the service reads them."""
    query = read_match(raw, Limits())
    if query is None:
        raise ValueError(f"not a valid match body: {raw[:80]!r}")
    return extract_items(query[1])


def load_index(server: RedisServer, holders: Mapping[str, Iterable[str]], keys: Mapping[str, str]) -> None:
    """Write the reverse index (hash -> endpoints) as one set per hash, in pipelines."""
    with server.client() as client:
        pipe = client.pipeline(transaction=False)
        for number, (digest, names) in enumerate(holders.items(), 1):
            pipe.sadd(keys[digest], *names)
            if number % _LOAD_BATCH == 0:
                pipe.execute()
        pipe.execute()
        if client.dbsize() != len(holders):
            raise RuntimeError(f"Redis holds {client.dbsize()} sets, not the {len(holders)} loaded")


class DirectRate(NamedTuple):
    """One redis-benchmark run: its rate, and the share of a core each side used."""

    pipelines_per_s: float
    redis_busy: float
    load_busy: float


def redis_benchmark_rate(server: RedisServer, lookups: int, seconds: int, core: str,
                         connections: int = 32) -> DirectRate:
    """Pipelines of ``LOOKUPS_PER_REQUEST`` SMEMBERS per second that ``redis-benchmark``
    (on ``core``) gets from the server, each key drawn from the bodies' ``lookups``
    hashes. The server busy near all of its core while the tool is not says the server,
    not the load generator, set the rate.

    A short run sizes the measured one to last about ``seconds`` (the tool stops after a
    number of requests, not a time).
    """
    sizing = _redis_benchmark(server, lookups, 20_000 * LOOKUPS_PER_REQUEST, core, connections)
    requests = max(1, round(sizing.pipelines_per_s * seconds)) * LOOKUPS_PER_REQUEST
    return _redis_benchmark(server, lookups, requests, core, connections)


def _redis_benchmark(server: RedisServer, lookups: int, requests: int, core: str,
                     connections: int) -> DirectRate:
    command = [_tool("redis-benchmark"), "-h", "127.0.0.1", "-p", str(server.port),
               "-c", str(connections), "-n", str(requests), "-P", str(LOOKUPS_PER_REQUEST),
               "-r", str(lookups), "--csv", "SMEMBERS", "h:__rand_int__"]
    cpu, load, started = server.cpu_seconds(), _children_cpu_seconds(), time.monotonic()
    out = subprocess.run(pinned(core, command), capture_output=True, text=True, check=True).stdout
    wall = time.monotonic() - started
    found = re.search(r'^"SMEMBERS[^"]*","([\d.]+)"', out, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"redis-benchmark printed no rate:\n{out}")
    return DirectRate(float(found[1]) / LOOKUPS_PER_REQUEST, (server.cpu_seconds() - cpu) / wall,
                      (_children_cpu_seconds() - load) / wall)


def _children_cpu_seconds() -> float:
    """CPU time of this process's finished children (the last one: the load generator)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class RedisRoutes:
    """The bare handler's shape with Redis as the index, on the service's own server
    (``stream.http.server``, so that only the index differs): the body read as the
    service reads it, one pipeline of SMEMBERS for its items, the holders intersected
    with the requested endpoints, the answer rendered as the service renders it.

    ``keys`` names each hash's set; a hash it lacks is held by nobody and is asked for
    under a name that no set has, so every item costs one lookup. redis-py parses the
    answers with hiredis when it is installed, else in Python (``parser``).
    """

    max_body = 1 << 24

    def __init__(self, redis_port: int, keys: Mapping[str, str]) -> None:
        from stream.http.server import Endpoint, Response

        limits = Limits()
        self.client: redis.asyncio.Redis | None = None
        self.parser = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "python"

        async def handle(request: Any) -> Any:
            query = read_match(b"".join(request.chunks), limits)
            if query is None:
                return Response(b'{"error":{"code":"invalid_request","message":"bad body"}}', 400)
            if self.client is None:  # made in the server's running loop
                self.client = redis.asyncio.Redis(host="127.0.0.1", port=redis_port, decode_responses=True)
            endpoints, body = query
            items = extract_items(body)
            pipe = self.client.pipeline(transaction=False)
            for item in items:
                pipe.smembers(keys.get(item.hash, f"h:{item.hash}"))
            held = await pipe.execute()
            requested = dict.fromkeys(endpoints)
            found: dict[str, list[Item]] = {}
            for item, holders in zip(items, held, strict=True):
                for name in requested.keys() & holders:
                    found.setdefault(name, []).append(item)
            return Response(render_match(items, list(requested), found))

        self.endpoint = Endpoint(handle, lambda request: Response(b"{}", 413))

    def resolve(self, method: str, path: str) -> Any:
        """The Redis-backed match, whatever the path."""
        return self.endpoint

    async def close(self) -> None:
        """Close the Redis client, if one was made."""
        if self.client is not None:
            await self.client.aclose()


def without_hiredis(env: Mapping[str, str], root: Path) -> dict[str, str]:
    """``env`` for a child process whose ``import hiredis`` fails (a package of that name
    under ``root``, first on its path, that raises ImportError), so that redis-py there
    parses in Python: the control as it was before hiredis was installed."""
    hidden = root / "hiredis"
    hidden.mkdir(parents=True, exist_ok=True)
    (hidden / "__init__.py").write_text("raise ImportError('hiredis is hidden from this control')\n")
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": str(root) + (os.pathsep + path if path else "")}
