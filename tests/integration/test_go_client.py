"""The Go client (clients/go) against a real `mmcache serve`: `go test ./...` with
MMCACHE_URL and bearer tokens set, so its live tests run instead of skipping.

The service is protected by both token files (writes and /v1/state; match), so the
client's token handling is exercised end to end and its 401 test runs too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CLIENT_DIR = Path(__file__).resolve().parents[2] / "clients" / "go"
GO_TEST_TIMEOUT_S = 300


def go_binary() -> str:
    """The `go` command, from PATH or where Debian's golang-go puts it."""
    found = shutil.which("go") or next(
        (str(p) for p in (Path("/usr/lib/go/bin/go"), Path("/usr/local/go/bin/go")) if p.exists()), None)
    if found is None:
        pytest.fail("go is not installed: run `make test` (as root it installs Debian's golang-go), "
                    "or apt-get install golang-go, then run this test again")
    return found


def go_env(tmp_path: Path) -> dict[str, str]:
    """The environment for `go`: no module download (standard library only), and a
    build cache under tmp_path when HOME cannot hold one."""
    env = {**os.environ, "GOPROXY": "off", "GOTOOLCHAIN": "local"}
    home = os.environ.get("HOME")
    if not (home and os.access(home, os.W_OK)):
        env.setdefault("GOCACHE", str(tmp_path / "go-cache"))
        env.setdefault("GOPATH", str(tmp_path / "go-path"))
    return env


def go_test_names() -> set[str]:
    """Every Go test function of the client."""
    names: set[str] = set()
    for source in CLIENT_DIR.rglob("*_test.go"):
        names |= set(re.findall(r"^func (Test\w+)\(t \*testing\.T\)", source.read_text(), re.MULTILINE))
    return names


def test_go_client_passes_its_tests_against_a_live_serve(make_service, tmp_path):
    go = go_binary()
    tokens = tmp_path / "tokens"
    tokens.write_text("go-write-token\n")
    match_tokens = tmp_path / "match-tokens"
    match_tokens.write_text("go-match-token\n")
    service = make_service(env={"MMCACHE_AUTH_TOKEN_FILE": str(tokens),
                                "MMCACHE_MATCH_AUTH_TOKEN_FILE": str(match_tokens)})
    env = {**go_env(tmp_path), "MMCACHE_URL": service.url,
           "MMCACHE_TOKEN": "go-write-token", "MMCACHE_MATCH_TOKEN": "go-match-token"}

    result = subprocess.run([go, "test", "-count=1", "-v", "./..."], cwd=CLIENT_DIR, env=env,
                            capture_output=True, text=True, timeout=GO_TEST_TIMEOUT_S)

    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:] + "\n--- service log ---\n" + service.tail()
    names = go_test_names()
    live = {name for name in names if name.startswith("TestLive")}
    assert len(live) >= 9, live
    passed = set(re.findall(r"^--- PASS: (Test\w+)", output, re.MULTILINE))
    assert names <= passed, f"not passed: {sorted(names - passed)}\n{output[-4000:]}"
    assert "--- SKIP" not in output, output[-4000:]


EXAMPLE = CLIENT_DIR / "examples" / "placeandmatch" / "main.go"
GATEWAY_DOC = CLIENT_DIR.parents[1] / "docs" / "gateway.md"


def _documented_example() -> tuple[str, list[str], list[str]]:
    """docs/gateway.md's "The Go client": its go block, the shell lines that make a fresh
    module, and the output it shows for `go run .`."""
    section = GATEWAY_DOC.read_text().split("## The Go client\n", 1)[1]
    setup = re.search(r"```sh\n(mkdir mygateway.*?)```", section, re.S).group(1)
    code = re.search(r"```go\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"```sh\n\$ MMCACHE_URL=\S+ go run \.\n(.*?)```", section, re.S).group(1)
    commands = [" ".join(line.rstrip("\\").split()) for line in setup.replace("\\\n", " ").splitlines()]
    return code, commands, shown.splitlines()


def test_the_docs_show_the_example_program_as_it_is():
    code, _, _ = _documented_example()
    assert code == EXAMPLE.read_text()


def test_the_go_example_runs_from_a_fresh_module_as_the_docs_say_against_a_live_serve(make_service, tmp_path):
    go = go_binary()
    tokens = tmp_path / "tokens"
    tokens.write_text("example-write-token\n")
    service = make_service(env={"MMCACHE_AUTH_TOKEN_FILE": str(tokens)})
    env = {**go_env(tmp_path), "MMCACHE_URL": service.url, "MMCACHE_TOKEN": "example-write-token"}
    _, commands, shown = _documented_example()
    assert commands[:2] == ["mkdir mygateway && cd mygateway", "go mod init example.com/mygateway"]
    module = tmp_path / "mygateway"
    module.mkdir()
    for command in commands[1:]:  # the docs' own commands, with this checkout for /path/to/mmcache
        args = command.replace("/path/to/mmcache/clients/go", str(CLIENT_DIR)).split()
        subprocess.run([go, *args[1:]], cwd=module, env=env, check=True, timeout=GO_TEST_TIMEOUT_S)
    (module / "main.go").write_text(EXAMPLE.read_text())

    result = subprocess.run([go, "run", "."], cwd=module, env=env, capture_output=True, text=True,
                            timeout=GO_TEST_TIMEOUT_S)

    assert result.returncode == 0, result.stderr[-4000:] + "\n--- service log ---\n" + service.tail()
    assert result.stdout.splitlines() == shown
