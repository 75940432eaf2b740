"""serve and rebuild run on uvloop (stream.event_loop)."""

from __future__ import annotations

import asyncio

import uvloop

from stream import event_loop


def test_run_and_new_event_loop_are_uvloop_and_so_are_thread_loops() -> None:
    before = asyncio.get_event_loop_policy()
    try:
        async def loop_type() -> type:
            return type(asyncio.get_running_loop())

        assert event_loop.run(loop_type()) is uvloop.Loop
        loop = event_loop.new_event_loop()
        try:
            assert isinstance(loop, uvloop.Loop) and asyncio.get_event_loop() is loop
            # a loop a library makes in its own thread (Faust's consumer) is uvloop too
            assert isinstance(asyncio.new_event_loop(), uvloop.Loop)
        finally:
            loop.close()
    finally:
        asyncio.set_event_loop_policy(before)
