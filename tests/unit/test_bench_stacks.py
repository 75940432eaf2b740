"""The stacks benchmark compares like with like: every bare server answers the bench's
body with the same bytes, from a loop already running, and wrk's latencies are read in
milliseconds whatever unit wrk printed."""

from __future__ import annotations

import re
import urllib.request

import orjson
import pytest

from stream.bench.stacks import STACKS, StackServer, bench_inputs, wrk_ms


def test_wrk_latencies_are_read_in_milliseconds():
    found = [wrk_ms(re.search(r"([\d.]+)(us|ms|s)\b", text)) for text in ("812.00us", "1.20ms", "2.00s")]
    assert found == pytest.approx([0.812, 1.2, 2000.0])


def test_every_stack_answers_the_bench_body_with_the_services_answer(tmp_path):
    bodies, answer = bench_inputs(tmp_path, events=3000, count=5)
    first = bodies.read_bytes().split(b"\n", 1)[0]
    assert orjson.loads(answer.read_bytes())["endpoints"]  # a real answer, 64 entries
    servers = [StackServer(kind, answer) for kind in STACKS]
    try:
        for server in servers:
            got = urllib.request.urlopen(urllib.request.Request(server.wait(first).url, data=first)).read()
            assert orjson.loads(got) == orjson.loads(answer.read_bytes()), server.kind
    finally:
        for server in servers:
            server.stop()
