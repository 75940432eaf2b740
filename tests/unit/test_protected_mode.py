"""Protected by default, as Redis's protected mode: `serve` listens on loopback unless told
otherwise, and any other address without write tokens is refused at start unless
``--allow-unauthenticated-writes`` says it on purpose."""

from __future__ import annotations

import logging

import pytest

from stream.cli import _parser, _settings
from stream.config import Settings
from stream.http.auth import is_loopback, refuse_open_writes


def test_the_default_host_is_loopback():
    assert Settings().host == "127.0.0.1"
    assert _settings(_parser().parse_args(["serve"])).settings.host == "127.0.0.1"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "127.255.255.254", "::1", "[::1]",
                                  "localhost", "LOCALHOST", "localhost.", "::ffff:127.0.0.1"])
def test_loopback_addresses(host):
    assert is_loopback(host)
    refuse_open_writes(Settings(host=host))  # no token needed


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.7", "192.168.1.2", "::ffff:10.0.0.1",
                                  "fe80::1", "example.com", "localhost.example.com", "128.0.0.1"])
def test_every_other_address_without_tokens_is_refused_with_one_line_naming_what_to_give(host):
    with pytest.raises(SystemExit) as refused:
        refuse_open_writes(Settings(host=host))
    line = str(refused.value.code)
    assert "\n" not in line
    for needed in ("--auth-token-file", "MMCACHE_AUTH_TOKEN_FILE", "--allow-unauthenticated-writes",
                   "MMCACHE_ALLOW_UNAUTHENTICATED_WRITES=1", "127.0.0.1"):
        assert needed in line, line


def test_tokens_allow_any_address(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("a-write-token\n")
    refuse_open_writes(Settings(host="0.0.0.0", auth_token_file=tokens))


def test_a_token_file_that_cannot_be_used_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(SystemExit) as refused:
        refuse_open_writes(Settings(host="0.0.0.0", auth_token_file=tmp_path / "missing"))
    assert "--auth-token-file" in str(refused.value.code)
    (tmp_path / "empty").write_text("# nothing yet\n")
    with pytest.raises(SystemExit) as refused:
        refuse_open_writes(Settings(host="127.0.0.1", auth_token_file=tmp_path / "empty"))
    assert "holds no token" in str(refused.value.code)


def test_open_writes_on_purpose_are_allowed_with_a_warning(caplog, monkeypatch):
    with caplog.at_level(logging.WARNING):
        refuse_open_writes(Settings(host="0.0.0.0", allow_unauthenticated_writes=True))
    assert "--allow-unauthenticated-writes" in caplog.text and "0.0.0.0" in caplog.text
    monkeypatch.setenv("MMCACHE_ALLOW_UNAUTHENTICATED_WRITES", "1")
    monkeypatch.setenv("MMCACHE_HOST", "0.0.0.0")
    settings = _settings(_parser().parse_args(["serve"])).settings
    assert settings.allow_unauthenticated_writes and settings.host == "0.0.0.0"
    refuse_open_writes(settings)
    monkeypatch.setenv("MMCACHE_ALLOW_UNAUTHENTICATED_WRITES", "0")
    with pytest.raises(SystemExit):
        refuse_open_writes(_settings(_parser().parse_args(["serve"])).settings)
    flagged = _settings(_parser().parse_args(["serve", "--allow-unauthenticated-writes"])).settings
    assert flagged.allow_unauthenticated_writes
    refuse_open_writes(flagged)
