"""Memory freed between live objects goes back to the system (stream.allocator).

Each case runs in a process of its own: its RSS is the measure.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from stream import allocator

pytestmark = pytest.mark.skipif(not allocator.available(), reason="glibc's malloc_trim")

# Objects of 600-5,000 bytes (glibc's, not Python's small-object allocator), one kept in
# ten: the nine freed are interleaved with live ones, as serve's fetched records and bodies
# are with its state.
SCRIPT = """
import os, random, sys
from stream import allocator

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

rng = random.Random(1)
kept, freed = [], []
for n in range(60_000):
    (kept if n % 10 == 0 else freed).append(b"x" * rng.randint(600, 5000))
freed_bytes = sum(map(len, freed))
freed.clear()
before = rss()
if sys.argv[1] == "give back":
    allocator.give_back()
print(before - rss(), freed_bytes)
"""


def _returned(how: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[0]), int(out[1])


def test_memory_freed_between_live_objects_is_given_back() -> None:
    returned, freed = _returned("give back")
    assert returned >= freed // 2, f"{returned / 2**20:.0f} of {freed / 2**20:.0f} MiB freed given back"


def test_without_it_the_freed_memory_stays_in_the_process() -> None:
    """The finding, kept: freeing alone does not shrink the RSS."""
    returned, freed = _returned("keep")
    assert returned < freed // 10, f"{returned / 2**20:.0f} of {freed / 2**20:.0f} MiB freed given back"


def test_serve_gives_back_periodically_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(allocator, "give_back", lambda: calls.append(threading.get_ident()) or True)

    async def run() -> int:
        task = asyncio.ensure_future(allocator.give_back_periodically(every_s=0.01))
        async with asyncio.timeout(60):  # a bound on the condition, not on a start
            while len(calls) < 3:
                await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert len(calls) >= 3 and loop_thread not in calls
