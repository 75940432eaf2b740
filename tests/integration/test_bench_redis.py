"""The Redis controls of the match bench (issue 12) against a real redis-server: the same
index, the same answers as the service, a rate from redis-benchmark, and a clear error
when Redis is not installed."""

from __future__ import annotations

import asyncio
import shutil

import aiohttp
import orjson
import pytest

from stream.bench import redis_control
from stream.bench.match import full_state, request_bodies
from stream.bench.redis_control import (
    RedisRoutes,
    RedisServer,
    index_keys,
    load_index,
    redis_benchmark_rate,
)
from stream.config import Limits
from stream.core.cache import CacheState, Capacity
from stream.core.items import extract_items
from stream.core.render import render_match
from stream.http.models import read_match
from stream.http.server import HttpServer

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server (Debian package) is not installed")


@pytest.fixture
def loaded():
    state = full_state(CacheState(Capacity.from_params(8)), 3000)
    bodies = request_bodies(state, 30)
    keys, lookups = index_keys(bodies, state.index.holders)
    server = RedisServer("0").start()
    try:
        load_index(server, state.index.holders, keys)
        yield state, bodies, keys, lookups, server
    finally:
        server.stop()


def test_the_bodies_hashes_come_first_and_every_held_hash_has_a_set_name():
    state = full_state(CacheState(Capacity.from_params(8)), 3000)
    bodies = request_bodies(state, 5)
    keys, lookups = index_keys(bodies, state.index.holders)
    named = [item.hash for raw in bodies for item in extract_items(read_match(raw, Limits())[1])]
    assert lookups == len(set(named)) and set(state.index.holders) <= keys.keys()
    assert {keys[h] for h in named} == {f"h:{n:012d}" for n in range(lookups)}
    assert len(set(keys.values())) == len(keys)


@needs_redis
def test_redis_holds_the_reverse_index_and_the_backed_handler_answers_as_the_service(loaded):
    state, bodies, keys, _, server = loaded
    with server.client() as client:
        digest, names = next(iter(state.index.holders.items()))
        assert {n.decode() for n in client.smembers(keys[digest])} == names

    async def answers() -> int:
        matched = 0
        routes = RedisRoutes(server.port, keys)
        assert routes.parser == "hiredis"  # the dev extra installs it: the fair control
        http_server = HttpServer(routes, on_close=routes.close)
        port = await http_server.start("127.0.0.1", 0)
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as http:
            for raw in bodies:
                response = await http.post("/v1/match", data=raw)
                assert response.status == 200
                endpoints, body = read_match(raw, Limits())
                items = extract_items(body)
                requested, found = state.index.hits(items, endpoints)
                assert orjson.loads(await response.read()) == orjson.loads(render_match(items, requested, found))
                matched += bool(found)
            assert (await http.post("/v1/match", data=b"{}")).status == 400
        await http_server.close()
        return matched

    assert asyncio.run(answers()) > 0  # some answers do name endpoints that hold items


@needs_redis
def test_redis_benchmark_gives_pipelines_per_second_and_how_busy_redis_was(loaded):
    _, _, _, lookups, server = loaded
    run = redis_benchmark_rate(server, lookups, 1, "1")
    assert run.pipelines_per_s > 0 and 0 < run.redis_busy < 1.5 and 0 < run.load_busy < 1.5


def test_a_missing_redis_server_says_which_package_to_install(monkeypatch):
    monkeypatch.setattr(redis_control.shutil, "which", lambda name: None)
    server = RedisServer("0")
    with pytest.raises(RuntimeError, match=r"redis-server is missing: install the Debian package "
                                           r"'redis-server' \(apt-get install redis-server\)"):
        server.start()
    server.stop()


def test_the_python_parser_control_runs_without_hiredis(tmp_path):
    """The control 'as it was measured before': a child whose redis-py cannot import
    hiredis, so it parses Redis's answers in Python."""
    import os
    import subprocess
    import sys

    env = redis_control.without_hiredis(os.environ, tmp_path)
    probe = "import redis.utils; print(redis.utils.HIREDIS_AVAILABLE)"
    hidden = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert (hidden.stdout.strip(), shown.stdout.strip()) == ("False", "True")
