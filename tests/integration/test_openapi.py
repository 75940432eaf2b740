"""A bounded schemathesis run against a live `serve` (auth on, small body limit): no 5xx,
every response as /openapi.json documents it, and every rejected request leaves the
event log untouched.

"State unchanged" is checked where a write would first land: the event topic's end
offsets are read before and after each call, and a response >= 400 must leave them
where they were (the view only ever changes by applying the log). Accepted writes may
move them; they are what the schema allows. Fixed seed, derandomized, few examples per
operation, so the run is the same every time and takes seconds.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest

schemathesis = pytest.importorskip("schemathesis")
from aiokafka import AIOKafkaConsumer  # noqa: E402
from aiokafka.structs import TopicPartition  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.integration.conftest import Service  # noqa: E402

pytestmark = pytest.mark.integration

TOKEN = "schemathesis-" + uuid.uuid4().hex
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance, negative_data_rejection]


class EndOffsets:
    """End offsets of a topic, read by one consumer on its own loop thread."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.topic = topic
        self.consumer = self._run(self._start(bootstrap))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self, bootstrap: str) -> AIOKafkaConsumer:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        await consumer.start()
        return consumer

    def read(self) -> dict[int, int]:
        async def read() -> dict[int, int]:
            partitions = self.consumer.partitions_for_topic(self.topic)
            if not partitions:
                await self.consumer._client.force_metadata_update()
                partitions = self.consumer.partitions_for_topic(self.topic) or set()
            ends = await self.consumer.end_offsets([TopicPartition(self.topic, p) for p in partitions])
            return {tp.partition: offset for tp, offset in ends.items()}
        return self._run(read())

    def close(self) -> None:
        self._run(self.consumer.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def live(bootstrap, tmp_path_factory):
    root = tmp_path_factory.mktemp("openapi")
    tokens = root / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    service = Service(bootstrap, root / "data", f"it-{uuid.uuid4().hex[:10]}", [],
                      {"MMCACHE_AUTH_TOKEN_FILE": str(tokens), "MMCACHE_MAX_BODY_BYTES": "65536"})
    service.start()
    offsets = EndOffsets(bootstrap, f"{service.app_id}-events")
    yield service, offsets
    offsets.close()
    service.stop()


def test_the_api_is_as_documented_and_rejections_change_nothing(live):
    """Each operation, positive and negative cases, through hypothesis (schemathesis's
    pytest plugin does not run under this pytest, so its strategies are driven here)."""
    service, offsets = live
    schema = schemathesis.openapi.from_url(service.url + "/openapi.json")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/match", "POST /v1/placements",
                                               "POST /v1/endpoint-events", "GET /v1/state"}
    seen: dict[str, set[int]] = {}

    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @seed(8)
            @settings(max_examples=12, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.generate])
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                before = offsets.read()
                response = case.call_and_validate(base_url=service.url, headers=headers,
                                                  checks=CHECKS, timeout=10)
                seen.setdefault(f"{case.method} {case.path}", set()).add(response.status_code)
                if response.status_code >= 400:
                    assert offsets.read() == before, (
                        f"{case.method} {case.path} got {response.status_code} and wrote")

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (no body, no parameters)
                assert mode is GenerationMode.NEGATIVE and operation.method == "get"
    print(sorted(seen.items()))
    assert {400, 202} <= seen["POST /v1/placements"]
