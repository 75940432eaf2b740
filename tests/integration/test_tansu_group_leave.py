"""A consumer group on the embedded Tansu broker forms again after its members stopped
in the middle of a rebalance (stream.kafka.tansu, remedy 3).

The scene of two fenced `serve` workers: a member frozen past its session timeout
(SIGSTOP) loses its partitions to the other; resumed, it finds itself dropped and
rejoins, and both stop cleanly while the group forms again. Tansu 0.6 then kept the
leader's id of a leader that had left, and two new members waited for their partitions
with no end (10 of 12 tries before the remedy, with a 30 s bound). Every wait here is on
a condition: the takeover, the rejoin, the new members' assignments.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from stream.kafka.embedded import EmbeddedBroker
from tests.integration.conftest import eventually

pytestmark = pytest.mark.integration

PARTITIONS = 8
EVERYTHING = set(range(PARTITIONS))


class Member:
    """A member process (tests.integration.group_member) and what it printed."""

    def __init__(self, bootstrap: str, group: str, output: Path) -> None:
        self.output = output
        with output.open("w") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.group_member", bootstrap, group, f"{group}-t"],
                stdout=sink, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])

    def lines(self) -> list[str]:
        """The lines it finished printing (one read while it prints may end half-way)."""
        return self.output.read_text().split("\n")[:-1]

    def partitions(self) -> set[int]:
        """Its partitions now (none once a rebalance took them)."""
        last = [line for line in self.lines() if line.startswith(("assigned", "revoked"))][-1:]
        if not last or last[0] == "revoked":
            return set()
        return {int(p) for p in last[0].split(" ", 1)[1].split(",") if p}

    def stop(self) -> None:
        """A clean stop (SIGTERM), as a fenced worker's; killed if it does not end."""
        self.process.send_signal(signal.SIGCONT)  # a frozen member cannot act on SIGTERM
        self.process.terminate()
        try:
            code = self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"a member did not stop on SIGTERM: {self.output.read_text()[-2000:]}") from None
        assert code == 0, self.output.read_text()[-2000:]

    def kill(self) -> None:
        """End it whatever it is doing (after a failure)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _topic(bootstrap: str, name: str) -> None:
    async def create() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(name, PARTITIONS, 1)])
        finally:
            await admin.close()

    asyncio.run(create())


def _split(members: list[Member]) -> bool:
    owned = [member.partitions() for member in members]
    return all(owned) and sum(map(len, owned)) == PARTITIONS and set().union(*owned) == EVERYTHING


def _one_try(bootstrap: str, tmp_path: Path, attempt: int) -> None:
    group = f"leave-{uuid.uuid4().hex[:8]}"
    _topic(bootstrap, f"{group}-t")
    zombie, successor = (Member(bootstrap, group, tmp_path / f"{group}-{n}.out")
                         for n in ("zombie", "successor"))
    after: list[Member] = []
    try:
        eventually(lambda: _split([zombie, successor]), timeout=60, interval=0.05)
        zombie.process.send_signal(signal.SIGSTOP)
        eventually(lambda: successor.partitions() == EVERYTHING, timeout=60, interval=0.05)
        revoked = zombie.lines().count("revoked")
        zombie.process.send_signal(signal.SIGCONT)
        # dropped from the group, it rejoins: the group forms again
        eventually(lambda: zombie.lines().count("revoked") > revoked, timeout=60, interval=0.01)
        zombie.stop()
        successor.stop()
        after = [Member(bootstrap, group, tmp_path / f"{group}-new{n}.out") for n in range(2)]
        started = time.monotonic()
        try:
            eventually(lambda: _split(after), timeout=60, interval=0.05)
        except AssertionError:
            raise AssertionError(f"attempt {attempt}: the new members were given "
                                 f"{[m.partitions() for m in after]} in 60 s") from None
        print(f"attempt {attempt}: the new members shared every partition "
              f"{time.monotonic() - started:.1f} s after they started")
    finally:
        for member in (zombie, successor, *after):
            member.kill()  # those stopped already are left alone; the others are killed


def test_new_members_get_every_partition_after_a_resumed_zombie_and_its_successor_stopped(tmp_path):
    with EmbeddedBroker(log_file=tmp_path / "tansu.log") as broker:
        for attempt in range(3):
            _one_try(broker.bootstrap_servers, tmp_path, attempt)
