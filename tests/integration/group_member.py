"""One member of a consumer group in a process of its own, for
``test_tansu_group_leave``: ``python -m tests.integration.group_member BOOTSTRAP GROUP
TOPIC``. It applies the Tansu remedies as `serve` does, prints ``assigned <partitions>``
and ``revoked`` as its rebalance listener is called, polls until SIGTERM, then stops
cleanly (where aiokafka would leave the group)."""

from __future__ import annotations

import asyncio
import signal
import sys

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

from stream.kafka.tansu import apply_remedies


class Printed(ConsumerRebalanceListener):
    def on_partitions_revoked(self, revoked: object) -> None:
        print("revoked", flush=True)

    def on_partitions_assigned(self, assigned: set) -> None:  # type: ignore[type-arg]
        print("assigned", ",".join(str(tp.partition) for tp in sorted(assigned)), flush=True)


async def member(bootstrap: str, group: str, topic: str) -> None:
    # the embedded broker's group timings, as serve sets them (stream.worker.app)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, session_timeout_ms=2000,
                                heartbeat_interval_ms=500, rebalance_timeout_ms=20000)
    consumer.subscribe([topic], listener=Printed())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await consumer.start()
    try:
        while not stop.is_set():
            await consumer.getmany(timeout_ms=100)
    finally:
        await consumer.stop()
    print("stopped", flush=True)


if __name__ == "__main__":
    apply_remedies()
    asyncio.run(member(*sys.argv[1:4]))
