"""The ingest control of the performance issue: a naive Faust agent that decodes each
event and writes one table entry per item through Faust's table API.

Run as ``python -m stream.bench.naive_agent BOOTSTRAP TOPIC APP_ID DATA_DIR SECONDS OUT``:
it consumes ``TOPIC`` from its start, counts the events it applies during ``SECONDS``
after the first one, writes the rate (events/s) to ``OUT`` and stops.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import faust

from stream.config import KafkaSecurity, Settings
from stream.core.codec import decode_event
from stream.core.events import ItemsPlaced
from stream.kafka.tansu import apply_remedies, is_tansu
from stream.state.store import entry_key
from stream.worker.app import faust_settings

__all__ = ["main"]


def main(bootstrap: str, topic: str, app_id: str, data_dir: Path, seconds: float, out: Path) -> None:
    """Run the naive agent until it has been measured for ``seconds``."""
    embedded = asyncio.run(is_tansu(bootstrap, KafkaSecurity()))
    if embedded:
        apply_remedies()
    settings = Settings(bootstrap_servers=bootstrap, app_id=app_id, data_dir=data_dir)
    app = faust.App(app_id, **faust_settings(settings, bootstrap, embedded))
    source = app.topic(topic, key_type=bytes, value_type=bytes)
    table = app.Table("naive", key_type=bytes, value_type=bytes)
    applied = 0

    @app.agent(source)
    async def apply_naively(stream: faust.StreamT[bytes]) -> None:
        nonlocal applied
        async for value in stream:
            event = decode_event(value)
            if isinstance(event, ItemsPlaced):
                for item in event.items:
                    table[entry_key(event.endpoint, item.hash)] = str(item.size).encode()
            applied += 1

    @app.task
    async def measure() -> None:
        while applied == 0:
            await asyncio.sleep(0.05)
        first, started = applied, time.monotonic()
        await asyncio.sleep(seconds)
        out.write_text(str((applied - first) / (time.monotonic() - started)))
        os.kill(os.getpid(), signal.SIGTERM)

    faust.Worker(app, loglevel="WARNING", quiet=True).execute_from_commandline()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), float(sys.argv[5]),
         Path(sys.argv[6]))
