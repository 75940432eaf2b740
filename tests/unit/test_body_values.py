"""A body's JSON values are bounded, not only its bytes: 16 MiB of tiny objects took a body
reader process to ~1 GiB (``mmcache bench --only reader_memory``), since a parse costs up to
~80 bytes a value. Every route's reader refuses, before it parses anything, a body of more
than ``max_body_values`` values (counted from their separators) with a 413 naming the
limit; the pool's child process refuses it the same way, and its memory stays bounded."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from stream.config import Limits
from stream.http.bodies import READERS, ApiError, check_values
from stream.http.body_reader import BodyReader

LIMITS = Limits(max_body_values=1000)
_SHAPES = {  # each route's body with one unbounded list, the values put in ``padding``
    "match_query": (b'{"endpoints":["default/pod-a"],"body":{"messages":[],"padding":[', b"]}}"),
    "placement": (b'{"endpoints":["default/pod-a"],"body":{"messages":[],"padding":[', b"]}}"),
    "endpoint_event": (b'{"type":"sync","padding":[', b'],"live":["default/pod-a"]}'),
    "engine_events": (b'{"endpoint":"default/pod-a","engine":"vllm","events":[', b"]}"),
}


def _values(raw: bytes) -> int:
    return sum(raw.count(c) for c in (b",", b":", b"[", b"{"))


def _body(route: str, values: int) -> bytes:
    """The route's body holding exactly ``values`` counted values."""
    head, tail = _SHAPES[route]
    count = values - _values(head + tail) + 1  # n zeros add n - 1 commas
    return head + b",".join([b"0"] * count) + tail


@pytest.mark.parametrize("route", sorted(READERS))
def test_every_route_refuses_a_body_over_max_body_values_with_a_413_naming_it(route: str) -> None:
    raw = _body(route, 1001)
    assert _values(raw) == 1001
    with pytest.raises(ApiError) as refused:
        READERS[route](raw, LIMITS)
    assert (refused.value.status, refused.value.code) == (413, "body_too_large")
    assert "more than 1,000 JSON values (max_body_values)" in refused.value.message


@pytest.mark.parametrize("route", sorted(READERS))
def test_a_body_of_max_body_values_is_not_refused_for_its_values(route: str) -> None:
    raw = _body(route, 1000)
    try:
        READERS[route](raw, LIMITS)
    except ApiError as exc:  # the body may be refused for its shape, never for its values
        assert exc.code != "body_too_large", exc.message


def test_separators_inside_strings_are_no_values() -> None:
    """A long prompt (a pasted CSV: a separator every few bytes) is one value."""
    text = "a,b:c[d{e, " * 2000 + 'quoted \\"x, y\\" and a backslash \\\\'
    body = ('{"endpoints":["default/pod-a"],"body":{"chat_completions":{"messages":[{"role":"user",'
            '"content":"' + text + '"}]}}}').encode()
    assert body.count(b",") > 1000
    query = READERS["match_query"](body, LIMITS)
    assert query.endpoints == ["default/pod-a"]


def test_more_strings_than_the_limit_are_refused_without_taking_them_out() -> None:
    raw = b"[" + b",".join([b'""'] * 1001) + b"]"
    with pytest.raises(ApiError) as refused:
        check_values(raw, LIMITS)
    assert refused.value.code == "body_too_large"


def test_an_unterminated_string_full_of_escapes_is_counted_in_one_pass() -> None:
    """Each escaped quote would start a string again if the pattern could fail: 200,000 of
    them would then be ~10^10 steps. Not refused for its values (it is one string); its
    parse refuses it."""
    raw = b'["' + b'\\",' * 200_000
    check_values(raw, Limits(max_body_values=1000))
    with pytest.raises(ApiError) as refused:
        READERS["placement"](raw, Limits(max_body_values=1000))
    assert refused.value.code == "invalid_json"


def test_the_values_are_refused_before_any_parse() -> None:
    broken = b"[" + b"0," * 2000 + b"not json"
    with pytest.raises(ApiError) as refused:
        check_values(broken, LIMITS)
    assert refused.value.code == "body_too_large"  # not invalid_json: nothing was parsed


def test_the_pools_child_refuses_a_big_body_of_tiny_values_with_the_same_413() -> None:
    limits = Limits()
    raw = b'{"endpoints":["default/pod-a"],"body":{"padding":[' + b",".join([b"{}"] * 2_000_000) + b"]}}"
    assert len(raw) < limits.max_body_bytes

    async def run() -> ApiError:
        reader = BodyReader(limits, inline_bytes=0, readers=1)
        try:
            with pytest.raises(ApiError) as refused:
                await reader.read(READERS["match_query"], [raw], "client")
            return refused.value
        finally:
            await reader.close()

    refused = asyncio.run(run())
    assert (refused.status, refused.code) == (413, "body_too_large")


_READ_ONE = """
import resource, sys
from stream.bench.reader_memory import _SHAPES
from stream.config import Limits
from stream.http.bodies import READERS, ApiError
limits, (head, tail) = Limits(), _SHAPES[sys.argv[1]]
raw = head + b",".join([b'{"a":1}'] * ((limits.max_body_bytes - len(head) - len(tail)) // 8)) + tail
built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the body and its making
try:
    READERS[sys.argv[1]](raw, limits)
except ApiError:
    pass
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - built)
"""


def _peak_kib(*command: str) -> int:
    out = subprocess.run([sys.executable, *command], capture_output=True, text=True, check=True,
                         timeout=600).stdout
    return int(out.split()[-1])


def test_a_readers_memory_for_a_body_at_the_bytes_limit_is_bounded_by_the_values_limit() -> None:
    """Per route, in a fresh process: reading a body at ``max_body_bytes`` of the smallest
    objects, and the worst body within both limits (``stream.bench.reader_memory``), each
    adds at most 4x the bytes limit to the process's peak RSS (with only the bytes bounded
    a reader took ~40-60x: 611-1,017 MiB for 16 MiB)."""
    limits = Limits()
    baseline = _peak_kib("-c", "import resource, stream.bench.reader_memory; "
                               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    for route in READERS:
        added = _peak_kib("-c", _READ_ONE, route)
        assert added * 1024 <= 4 * limits.max_body_bytes, (route, "at the bytes limit", added)
        added = _peak_kib("-m", "stream.bench.reader_memory", route) - baseline
        assert added * 1024 <= 4 * limits.max_body_bytes, (route, "the worst within both", added)
