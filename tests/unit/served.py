"""The HTTP API served for a test: the real server on a free port of the running loop,
and an aiohttp client session (relative paths) as the client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from stream.http.api import HttpApi


@asynccontextmanager
async def listening(api: HttpApi) -> AsyncIterator[int]:
    """``api``'s server on 127.0.0.1: its port, until the block ends (then closed)."""
    server = api.server()
    port = await server.start("127.0.0.1", 0)
    try:
        yield port
    finally:
        await server.close()


@asynccontextmanager
async def served(api: HttpApi) -> AsyncIterator[aiohttp.ClientSession]:
    """A client of ``api``'s server, which runs until the block ends."""
    async with listening(api) as port, aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
        yield client
