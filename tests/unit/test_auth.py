"""Bearer tokens from a file: several valid at once, re-read on change, compared in
constant time, never echoed; and the HTTP guard on exactly the routes CONTRACT names."""

from __future__ import annotations

import asyncio
import logging
import os

import orjson
import pytest

from stream.config import Limits
from stream.core.cache import CacheState, Capacity
from stream.http.api import HttpApi
from stream.http.auth import TokenFile, TokenFileError, open_token_file, read_tokens
from stream.kafka.publisher import EventPublisher
from stream.metrics import Metrics
from tests.unit.served import served
from tests.unit.test_write_safety import StandInProducer

SECRET = "s3cret-token-A"


def write(path, text: str, bump: int = 0) -> None:
    path.write_text(text)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + bump))


def test_tokens_are_lines_without_blanks_comments_or_duplicates():
    tokens = read_tokens("# rotate monthly\n\n  tok-1  \ntok-2\n  # old: tok-0\ntok-1\n")
    assert [t.get_secret_value() for t in tokens] == ["tok-1", "tok-2"]
    assert "tok-1" not in repr(tokens)


def test_every_listed_token_is_valid_and_nothing_else(tmp_path):
    path = tmp_path / "tokens"
    write(path, f"{SECRET}\nother-token\n")
    tokens = TokenFile(path)
    assert len(tokens) == 2
    assert tokens.allows(f"Bearer {SECRET}") and tokens.allows("bearer other-token")
    for header in [None, "", "Bearer", "Bearer ", f"Basic {SECRET}", f"Bearer {SECRET}x",
                   f"Bearer {SECRET[:-1]}", SECRET, "Bearer ünïcode"]:
        assert not tokens.allows(header), header


def test_a_changed_file_is_read_again_and_rotation_keeps_both(tmp_path):
    path = tmp_path / "tokens"
    write(path, "old-token\n")
    tokens = TokenFile(path, recheck_s=0.0)
    write(path, "old-token\nnew-token\n", bump=10**9)
    assert tokens.allows("Bearer new-token") and tokens.allows("Bearer old-token")
    write(path, "new-token\n", bump=2 * 10**9)
    assert tokens.allows("Bearer new-token") and not tokens.allows("Bearer old-token")


def test_a_file_that_breaks_keeps_the_tokens_read_before(tmp_path, caplog):
    path = tmp_path / "tokens"
    write(path, f"{SECRET}\n")
    tokens = TokenFile(path, recheck_s=0.0)
    write(path, "# emptied by mistake\n", bump=10**9)
    with caplog.at_level(logging.INFO):
        assert tokens.allows(f"Bearer {SECRET}")
        path.unlink()
        assert tokens.allows(f"Bearer {SECRET}")
    assert SECRET not in caplog.text


def test_the_file_is_not_read_again_before_recheck(tmp_path):
    path = tmp_path / "tokens"
    write(path, "first\n")
    tokens = TokenFile(path, recheck_s=3600)
    write(path, "second\n", bump=10**9)
    assert tokens.allows("Bearer first") and not tokens.allows("Bearer second")


def test_an_unusable_file_stops_the_start_naming_the_flag(tmp_path):
    with pytest.raises(TokenFileError):
        TokenFile(tmp_path / "missing")
    path = tmp_path / "empty"
    write(path, "# nothing yet\n\n")
    with pytest.raises(SystemExit, match="--auth-token-file: token file .* holds no token"):
        open_token_file(path, "--auth-token-file")
    assert open_token_file(None, "--auth-token-file") is None


# the HTTP guard

def guarded_api(tmp_path, writes: bool = True, match: bool = False) -> tuple[HttpApi, StandInProducer]:
    path = tmp_path / "tokens"
    write(path, f"{SECRET}\n")
    state = CacheState(Capacity.from_params(6))
    producer = StandInProducer()
    publisher = EventPublisher("127.0.0.1:1", "unused", 1.0)
    publisher._producer = producer  # type: ignore[assignment]
    api = HttpApi(state, publisher, Metrics(state, dict), Limits(), lambda: True,
                  write_tokens=TokenFile(path) if writes else None,
                  match_tokens=TokenFile(path) if match else None)
    return api, producer


PLACEMENT = orjson.dumps({"endpoints": ["ns/a"], "items": [{"hash": "h", "size": 1, "modality": "image"}]})
SYNC = orjson.dumps({"type": "sync", "live": ["x"]})
MATCH = orjson.dumps({"endpoints": ["ns/a"], "body": {}})


def send(api: HttpApi, calls: list[tuple[str, str, bytes | None, str | None]]) -> list[tuple[int, dict, dict]]:
    async def run():
        out = []
        async with served(api) as client:
            for method, path, data, token in calls:
                headers = {} if token is None else {"Authorization": token}
                response = await client.request(method, path, data=data, headers=headers)
                raw = await response.read()
                body = orjson.loads(raw) if response.content_type == "application/json" else raw
                out.append((response.status, body, dict(response.headers)))
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("token", [None, "Bearer wrong", "Bearer " + SECRET[:-1], "Basic " + SECRET])
def test_writes_and_state_without_a_valid_token_get_401_and_change_nothing(tmp_path, token):
    api, producer = guarded_api(tmp_path)
    answers = send(api, [("POST", "/v1/placements", PLACEMENT, token),
                         ("POST", "/v1/endpoint-events", SYNC, token),
                         ("GET", "/v1/state", None, token),
                         ("POST", "/v1/placements", b"x" * (20 * 1024 * 1024), token)])
    for status, body, headers in answers:
        assert status == 401
        assert body["error"]["code"] == "unauthorized"
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert SECRET not in orjson.dumps(body).decode() and "wrong" not in body["error"]["message"]
    assert producer.sent == []


def test_a_valid_token_writes_and_reads(tmp_path):
    api, producer = guarded_api(tmp_path)
    answers = send(api, [("POST", "/v1/placements", PLACEMENT, f"Bearer {SECRET}"),
                         ("POST", "/v1/endpoint-events", SYNC, f"Bearer {SECRET}"),
                         ("GET", "/v1/state", None, f"Bearer {SECRET}")])
    assert [status for status, _, _ in answers] == [202, 202, 200]
    assert len(producer.sent) == 1 + 3


def test_probes_metrics_openapi_and_open_match_need_no_token(tmp_path):
    api, _ = guarded_api(tmp_path)
    answers = send(api, [("GET", "/healthz", None, None), ("GET", "/readyz", None, None),
                         ("GET", "/metrics", None, None), ("GET", "/openapi.json", None, None),
                         ("POST", "/v1/match", MATCH, None)])
    assert [status for status, _, _ in answers] == [200, 200, 200, 200, 200]


def test_match_has_its_own_token_file(tmp_path):
    api, _ = guarded_api(tmp_path, writes=False, match=True)
    answers = send(api, [("POST", "/v1/match", MATCH, None), ("POST", "/v1/match", MATCH, f"Bearer {SECRET}"),
                         ("POST", "/v1/placements", PLACEMENT, None)])
    assert [status for status, _, _ in answers] == [401, 200, 202]
    assert answers[0][1]["error"]["code"] == "unauthorized"


def test_open_match_is_built_without_the_guard(tmp_path):
    api, _ = guarded_api(tmp_path, writes=True, match=False)
    api.write_tokens.allows = None  # any call to the guard would fail the match
    [(status, _, _)] = send(api, [("POST", "/v1/match", MATCH, None)])
    assert status == 200
