"""The reference gateway's pure parts: naming media parts by their item hash (what vLLM,
its engine reports and mmcache must agree on) and reading a server's load from vLLM's
metrics text; and the fleet bench's trace: its bodies carry exactly the simulator's
items, its images exactly their embeddings."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import orjson
import pytest
from aiohttp import web

from stream.bench.fleet_real import predicted
from stream.bench.fleet_trace import FleetTrace, chat_body, png_data_url, simulate_argv
from stream.core.items import extract_items, media_hash
from stream.gateway.gateway import Gateway, name_items, scraped_load
from stream.sim.workload import generate

CAT = "https://example.com/cat.png"


def test_a_part_without_uuid_is_named_by_its_item_hash() -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": CAT}},
        {"type": "image_url", "image_url": {"url": CAT}, "uuid": "mine"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}
    named = name_items(body)
    parts = named["messages"][0]["content"]
    assert "uuid" not in parts[0]
    assert parts[1]["uuid"] == media_hash("image_url", CAT)
    assert parts[2]["uuid"] == "mine"
    assert parts[3]["uuid"] == media_hash("input_audio", "wav:AAAA")
    assert "uuid" not in body["messages"][0]["content"][1]  # the caller's body is not changed


def test_naming_leaves_every_item_hash_as_it_was() -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": CAT}, {"type": "video_url", "video_url": {"url": "v.mp4"}},
        {"type": "audio_url", "audio_url": {"url": "a.wav"}, "uuid": "given"}]},
        {"role": "assistant", "content": "plain text"}]}
    assert extract_items(name_items(body)) == extract_items(body)


def test_load_is_running_plus_waiting() -> None:
    metrics = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0',
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 7.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 100.0'])
    assert scraped_load(metrics) == 5


@pytest.mark.parametrize(("line", "load"), [
    ("vllm:num_requests_running", 0),  # no value
    ("vllm:num_requests_running +Inf", 0),
    ("vllm:num_requests_running NaN", 0),
    ("vllm:num_requests_running three", 0),
    ("vllm:num_requests_running 2 1700000000000", 2),  # a timestamp after the value
    ('vllm:num_requests_running{engine="0",model_name="a b"} 4 1700000000000', 4),
])
def test_a_line_the_reader_cannot_use_is_skipped(line: str, load: int) -> None:
    assert scraped_load(f"{line}\nvllm:num_requests_waiting 1.0\n") == load + 1


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]



async def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Until ``condition`` holds (a scrape every 0.02 s here), failing after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not within the timeout"
        await asyncio.sleep(0.01)

@asynccontextmanager
async def _server(routes: dict[str, Handler]) -> AsyncIterator[str]:
    """An aiohttp server on a free port answering ``routes`` (path -> handler): its base URL."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_route("GET" if path == "/metrics" else "POST", path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _metrics(answers: dict[str, tuple[int, str]]) -> Handler:
    async def metrics(_: web.Request) -> web.Response:
        status, text = answers["now"]
        return web.Response(status=status, text=text)
    return metrics


def test_a_metrics_answer_that_is_not_200_is_a_failure_and_keeps_the_last_load() -> None:
    async def scene() -> None:
        answers = {"now": (200, "vllm:num_requests_running 6\n")}
        async with _server({"/metrics": _metrics(answers)}) as url:
            gateway = Gateway({"a": url}, "http://127.0.0.1:1", "index", scrape_s=3600)
            await gateway.start()
            try:
                assert gateway._loads() == [6]
                answers["now"] = (503, "<html>503 upstream</html>")
                await gateway._scrape()
                assert gateway._loads() == [6]  # unhealthy is not idle
                assert gateway.counters.scrape_failures == 1
            finally:
                await gateway.stop()
    asyncio.run(scene())


def test_a_metrics_page_without_a_load_line_is_a_failure() -> None:
    with pytest.raises(ValueError, match="no vllm:num_requests_running"):
        scraped_load("<html>login</html>")

    async def scene() -> None:
        answers = {"now": (200, "vllm:num_requests_waiting 3\n")}
        async with _server({"/metrics": _metrics(answers)}) as url:
            gateway = Gateway({"a": url}, "http://127.0.0.1:1", "index", scrape_s=3600)
            await gateway.start()
            try:
                answers["now"] = (200, "<html>a proxy's page</html>")
                await gateway._scrape()
                assert gateway._loads() == [3]
                assert gateway.counters.scrape_failures == 1
            finally:
                await gateway.stop()
    asyncio.run(scene())


def test_the_scraper_outlives_an_answer_it_cannot_read_and_stop_closes_the_session(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scene() -> None:
        answers = {"now": (200, "vllm:num_requests_running 7\n")}
        async with _server({"/metrics": _metrics(answers)}) as url:
            gateway = Gateway({"a": url}, "http://127.0.0.1:1", "index", scrape_s=0.02)
            await gateway.start()
            assert gateway._loads() == [7]
            monkeypatch.setattr("stream.gateway.gateway.scraped_load", _raises)
            await _until(lambda: gateway.counters.scrape_failures > 0)
            assert gateway._scraper is not None and not gateway._scraper.done()
            monkeypatch.undo()
            answers["now"] = (200, "vllm:num_requests_running 1\n")
            await _until(lambda: gateway._loads() == [1])
            sessions = (gateway._session, gateway._forwarding)
            await gateway.stop()
            assert all(session is not None and session.closed for session in sessions)
    asyncio.run(scene())


def test_stop_closes_the_session_though_the_scraper_ended_with_an_error() -> None:
    async def scene() -> None:
        answers = {"now": (200, "vllm:num_requests_running 7\n")}
        async with _server({"/metrics": _metrics(answers)}) as url:
            gateway = Gateway({"a": url}, "http://127.0.0.1:1", "index", scrape_s=3600)
            await gateway.start()
            assert gateway._scraper is not None
            gateway._scraper.cancel()

            async def ended() -> None:
                raise RuntimeError("ended")
            gateway._scraper = asyncio.create_task(ended())
            await asyncio.sleep(0)
            sessions = (gateway._session, gateway._forwarding)
            await gateway.stop()
            assert all(session is not None and session.closed for session in sessions)
    asyncio.run(scene())


def _raises(_: str) -> int:
    raise RuntimeError("a reader's bug")


def test_one_hung_server_does_not_hold_the_others_loads() -> None:
    async def scene() -> None:
        release = asyncio.Event()

        async def hung(_: web.Request) -> web.Response:
            await release.wait()
            return web.Response(text="vllm:num_requests_running 2\n")
        answers = {"now": (200, "vllm:num_requests_running 7\n")}
        async with _server({"/metrics": hung}) as slow, _server({"/metrics": _metrics(answers)}) as fast:
            gateway = Gateway({"a": slow, "b": fast}, "http://127.0.0.1:1", "index", scrape_s=3600)
            scrape = asyncio.create_task(gateway.start())
            try:
                await asyncio.sleep(0.3)
                assert gateway._loads() == [0, 7]
            finally:
                release.set()
                await scrape
                await gateway.stop()
            assert gateway._loads() == [2, 7]
    asyncio.run(scene())


_MATCHED = {"endpoints": [{"endpoint": "a", "score": 1.0}],
            "request_items": [{"hash": "x", "size": 1, "modality": "image"}]}
_IMAGE_BODY = {"model": "m", "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "http://x/1.png"}}]}]}


def test_completions_in_flight_past_aiohttps_default_pool_hold_neither_match_nor_scrape() -> None:
    """aiohttp's default pool is 100 connections: 101 completions in flight must all reach
    the server, and the next match and scrape must not wait behind them."""
    in_flight = 101

    async def scene() -> None:
        arrived, release = 0, asyncio.Event()
        all_arrived = asyncio.Event()

        async def chat(_: web.Request) -> web.Response:
            nonlocal arrived
            arrived += 1
            if arrived == in_flight:
                all_arrived.set()
            await release.wait()
            return web.json_response({"ok": True})

        async def match(_: web.Request) -> web.Response:
            return web.json_response(_MATCHED)

        async def placements(_: web.Request) -> web.Response:
            return web.json_response({}, status=202)
        answers = {"now": (200, "vllm:num_requests_running 0\n")}
        async with (_server({"/metrics": _metrics(answers), "/v1/chat/completions": chat}) as vllm,
                    _server({"/v1/match": match, "/v1/placements": placements}) as mmcache):
            gateway = Gateway({"a": vllm}, mmcache, "index", scrape_s=3600, match_timeout_s=2.0)
            runner = web.AppRunner(gateway.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
            try:
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
                    async def one() -> int:
                        async with client.post(url, json=_IMAGE_BODY) as response:
                            await response.read()
                            return response.status
                    requests = [asyncio.create_task(one()) for _ in range(in_flight)]
                    try:
                        await asyncio.wait_for(all_arrived.wait(), 10)
                        failures = gateway.counters.match_failures
                        assert await gateway._match(orjson.dumps(_IMAGE_BODY)) == ([1.0], _MATCHED["request_items"])
                        assert gateway.counters.match_failures == failures == 0
                        answers["now"] = (200, "vllm:num_requests_running 101\n")
                        await asyncio.wait_for(gateway._scrape(), 2)
                        assert gateway._loads() == [101]
                    finally:
                        release.set()
                        assert await asyncio.gather(*requests) == [200] * in_flight
            finally:
                await runner.cleanup()
    asyncio.run(scene())


def _nested(depth: int) -> bytes:
    """A chat body with an image and a value ``depth`` lists deep."""
    image = b'{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/1.png"}}]}'
    return b'{"model":"m","messages":[' + image + b'],"x":' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(("depth", "status"), [(253, 200), (254, 400), (1000, 400)])
def test_a_body_too_deep_to_forward_is_refused_as_a_bad_request(depth: int, status: int) -> None:
    """orjson reads 1024 levels but writes 254: a body between is the client's error."""
    async def scene() -> None:
        forwarded: list[bytes] = []

        async def chat(request: web.Request) -> web.Response:
            forwarded.append(await request.read())
            return web.json_response({"ok": True})

        async def match(_: web.Request) -> web.Response:
            return web.json_response(_MATCHED)

        async def placements(_: web.Request) -> web.Response:
            return web.json_response({}, status=202)
        answers = {"now": (200, "vllm:num_requests_running 0\n")}
        async with (_server({"/metrics": _metrics(answers), "/v1/chat/completions": chat}) as vllm,
                    _server({"/v1/match": match, "/v1/placements": placements}) as mmcache):
            gateway = Gateway({"a": vllm}, mmcache, "index", scrape_s=3600, match_timeout_s=2.0)
            runner = web.AppRunner(gateway.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
            try:
                async with aiohttp.ClientSession() as client, client.post(url, data=_nested(depth)) as response:
                    answer = await response.json()
                    assert response.status == status, answer
                if status == 400:
                    assert answer["error"]["code"] == "invalid_request"
                    assert forwarded == [] and gateway.counters.routed == {"a": 0}
                else:
                    assert len(forwarded) == 1 and gateway.counters.match_failures == 0
            finally:
                await runner.cleanup()
    asyncio.run(scene())


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        Gateway({"a": "http://127.0.0.1:1"}, "http://127.0.0.1:2", "random")


def _png_size(url: str) -> tuple[int, int]:
    data = base64.b64decode(url.split(",", 1)[1])
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.parametrize("embeddings", [1, 16, 31, 36, 61, 64])
def test_an_image_has_exactly_its_embeddings(embeddings: int) -> None:
    width, height = _png_size(png_data_url("item-1", embeddings))
    assert width % 28 == 0 and height % 28 == 0
    assert (width // 28) * (height // 28) == embeddings
    assert width * height <= 224 * 224  # within the tiny model's processor cap: no resize


def test_every_body_carries_the_simulated_requests_items_one_to_one() -> None:
    requests = generate(FleetTrace(requests=60).workload())
    names: dict[str, str] = {}
    for request in requests:
        items = extract_items(chat_body(request, "tiny"))
        assert len(items) == len(request.items)
        for real, simulated in zip(items, request.items, strict=True):
            assert names.setdefault(simulated.hash, real.hash) == real.hash
    assert len(set(names.values())) == len(names)  # distinct items stay distinct
    uuids = [h for h in names.values() if h.startswith("trace-")]
    assert 0 < len(uuids) < len(names)  # some parts carry a uuid of their own, some do not


def test_answers_are_assistant_turns_of_the_conversation() -> None:
    requests = generate(FleetTrace(requests=60).workload())
    later = next(r for r in requests if r.turn >= 1)
    roles = [m["role"] for m in chat_body(later, "tiny")["messages"]]
    assert roles[0] == "system"
    assert roles.count("assistant") == later.turn
    assert roles[-1] == "user"


def test_the_simulate_command_of_the_fleet_bench_draws_the_real_runs_requests() -> None:
    trace = FleetTrace(requests=50)
    results, requests = predicted(simulate_argv(trace, 8192, 128, ["round-robin", "index-bounded"]))
    assert requests == generate(trace.workload())
    assert set(results) == {"round-robin", "index-bounded"}
