"""The docs against a real serve: every documented mmcache metric is exported and every
exported one documented (docs/metrics.md); the gateway guide's real bodies are what a serve
answers (docs/gateway.md)."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.integration.conftest import eventually, http

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented_metrics(embedded_only: bool = False) -> set[str]:
    """The metrics docs/metrics.md lists: all of them, or those it says are exported only on
    the embedded default (tests/integration/test_idle_fetch.py holds those to a real one)."""
    rows = re.findall(r"^\| `((?:mmcache|encoder_cache)_[a-z_]+)` \|[^|]*\|[^|]*\| (.*)$", DOCS.read_text(), re.M)
    return {name for name, meaning in rows
            if not embedded_only or meaning.startswith("only on the embedded default")}


def test_documented_metrics_are_the_exported_ones(service):
    """The fixture's serve uses the test broker (--bootstrap-servers): not the embedded default."""
    documented = documented_metrics() - documented_metrics(embedded_only=True)
    def exported() -> set[str] | None:
        status, text = http("GET", service.url + "/metrics")
        types = re.findall(r"^# TYPE ((?:mmcache|encoder_cache)_[a-z_]+) (\w+)$", text, re.M)
        # counters' TYPE lines carry _total; their _created gauges are not metrics of ours
        ours = {name for name, _ in types if not name.endswith("_created")}
        return ours if ours >= documented else None

    ours = eventually(exported, timeout=20, interval=0.5)
    assert ours == documented
    _, text = http("GET", service.url + "/metrics")
    assert "process_resident_memory_bytes" in text and "process_open_fds" in text
    assert "mmcache_ready 1.0" in text


GATEWAY = DOCS.parent / "gateway.md"


def gateway_calls() -> list[tuple[str, str, dict[str, str], bytes | None, int, Any]]:
    """The calls of docs/gateway.md's "Real bodies" and "One identity", in page order:
    (method, path, headers, body, status, answer). The one-line "Real answers" of its
    Errors are held to the service by tests/unit/test_docs.py."""
    page = GATEWAY.read_text()
    page = page[page.index("## Real bodies"):page.index("## Running a vLLM fleet")]
    calls = []
    for language, block in re.findall(r"^```(\w*)\n(.*?)^```$", page, re.S | re.M):
        if language:
            continue
        for chunk in re.split(r"\n\n(?=(?:GET|POST) /)", block.strip()):
            head, _, rest = chunk.partition("\n")
            call = re.fullmatch(r"(GET|POST) (/\S+)", head)
            if call is None:
                break
            status = re.search(r"^(\d{3})$", rest, re.M)
            assert status is not None, chunk
            before = rest[:status.start()]
            headers = dict(re.findall(r"^([A-Za-z-]+): (.*)$", before, re.M))
            body = re.sub(r"^[A-Za-z-]+: .*$", "", before, flags=re.M).strip()
            calls.append((call[1], call[2], headers, orjson.dumps(orjson.loads(body)) if body else None,
                          int(status[1]), orjson.loads(rest[status.end():])))
    return calls


def test_the_gateway_pages_real_bodies_are_what_a_serve_answers(make_service, tmp_path):
    """Every call of the gateway guide's real bodies, made in order against a fresh serve
    started with both token files: each answer is the one the page shows (a read is asked
    again until the writes before it are visible, the view being eventual)."""
    tokens = {"<write token>": "doc-write-token", "<match token>": "doc-match-token"}
    (tmp_path / "write").write_text("doc-write-token\n")
    (tmp_path / "match").write_text("doc-match-token\n")
    service = make_service(extra=["--auth-token-file", str(tmp_path / "write"),
                                  "--match-auth-token-file", str(tmp_path / "match")])
    calls = gateway_calls()
    assert len(calls) >= 10 and {path for _, path, *_ in calls} >= {
        "/v1/match", "/v1/placements", "/v1/endpoint-events", "/v1/state?limit=3"}
    for method, path, headers, body, status, answer in calls:
        shown = headers.get("Authorization", "Bearer <match token>" if path == "/v1/match"
                            else "Bearer <write token>")
        for placeholder, token in tokens.items():
            shown = shown.replace(placeholder, token)
        auth = {"Authorization": shown}

        def answered(method: str = method, path: str = path, body: bytes | None = body,
                     auth: dict[str, str] = auth) -> tuple[int, Any]:
            request = urllib.request.Request(service.url + path, data=body, method=method,
                                             headers={**auth, "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status, orjson.loads(response.read())
            except urllib.error.HTTPError as exc:
                return exc.code, orjson.loads(exc.read())

        expected = (status, answer)
        got = answered()
        if method == "GET" or path == "/v1/match":  # a read: until the writes before it show
            deadline = time.monotonic() + 20
            while got != expected and time.monotonic() < deadline:
                time.sleep(0.1)
                got = answered()
        assert got == expected, (method, path, body)
