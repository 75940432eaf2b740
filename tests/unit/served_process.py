"""The API's HTTP server in a process of its own, so that its memory is its own to
measure: ``python -m tests.unit.served_process '{"knob": value}'`` prints the port it
listens on and serves (on uvloop, as ``serve`` does) until its stdin closes."""

from __future__ import annotations

import asyncio
import sys

import orjson

from stream.event_loop import new_event_loop
from stream.http import server as http_server
from tests.unit.test_http_api import make_api


async def _serve(knobs: dict) -> None:
    api = make_api()
    server = http_server.HttpServer(api.routes(), on_close=api.bodies.close, **knobs)
    api.metrics.http_server = server  # read by /metrics where the metrics know it
    port = await server.start("127.0.0.1", 0)
    print(port, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)
    await server.close()


if __name__ == "__main__":
    loop = new_event_loop()
    try:
        loop.run_until_complete(_serve(orjson.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
    finally:
        loop.close()
