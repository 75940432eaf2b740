"""docs/ is what users read (issue 10, item 1): these tests keep it true. Every route it
names is a route of the app and the other way round; every JSON body in it is one the
models accept (and the match answer is the one the service computes); every flag of every
command is in docs/cli.md and every flag there exists; nothing points outside the repo."""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import TypeAdapter

from stream.cli import _parser
from stream.core.cache import CacheState, Capacity
from stream.core.codec import decode_event
from stream.core.events import ItemsPlaced, Position
from stream.core.items import extract_items
from stream.http.api import render_match
from stream.http.models import (
    EndpointEventRequest,
    EngineEventsRequest,
    ErrorBody,
    EventsAccepted,
    MatchRequest,
    MatchResponse,
    PlacementRequest,
    ReadinessBody,
    StateResponse,
)
from tests.unit.test_http_api import make_api

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def text(name: str) -> str:
    return (DOCS / name).read_text()


def json_blocks(name: str) -> list[dict]:
    return [orjson.loads(block) for block in re.findall(r"```json\n(.*?)```", text(name), re.S)]


def test_every_documented_route_exists_and_every_route_is_documented():
    documented = set(re.findall(r"`(GET|POST) (/[a-z0-9/._-]+)`", text("http-api.md")))
    routes = make_api().routes().routes()
    assert documented == routes


def test_every_http_body_in_the_docs_is_accepted_by_its_model():
    shapes = [MatchRequest, PlacementRequest, TypeAdapter(EndpointEventRequest), EngineEventsRequest,
              MatchResponse, EventsAccepted, StateResponse, ReadinessBody, ErrorBody]
    for body in json_blocks("http-api.md"):
        raw = orjson.dumps(body)
        fits = []
        for shape in shapes:
            try:
                (shape.validate_json(raw, strict=True) if isinstance(shape, TypeAdapter)
                 else shape.model_validate_json(raw, strict=True))
                fits.append(shape)
            except ValueError:
                pass
        assert fits, body


def test_the_documented_match_answer_is_the_one_the_service_computes():
    request, answer = json_blocks("http-api.md")[:2]
    items = extract_items(request["body"])
    state = CacheState(Capacity.from_params())
    state.apply(ItemsPlaced(endpoint="default/pod-a", items=items), Position(0, 0))
    requested, found = state.hits(items, request["endpoints"])
    assert orjson.loads(render_match(items, requested, found)) == answer


def test_every_documented_event_is_one_the_log_accepts():
    blocks = json_blocks("events.md")
    assert {decode_event(orjson.dumps(b)).type for b in blocks} == {
        "items_placed", "endpoint_deleted", "endpoints_synced", "engine_events_reported"}


def test_the_documented_hash_example_is_right():
    from stream.core.items import media_hash

    digest = media_hash("image_url", "https://example.com/cat.png")
    assert digest in text("rules.md") and digest in text("http-api.md")


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, set[str]]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                flags = {o for a in sub._actions for o in a.option_strings
                         if o.startswith("--") and o != "--help"}
                nested = _commands(sub, f"{prefix}{name} ")
                if nested:
                    found.update(nested)
                else:
                    found[f"{prefix}{name}"] = flags
    return found


def test_every_flag_of_every_command_is_in_the_cli_page_and_the_other_way_round():
    page = text("cli.md")
    sections = dict(re.findall(r"^## `mmcache ([a-z ]+)`\n(.*?)(?=^## |\Z)", page, re.M | re.S))
    commands = _commands(_parser())
    assert set(sections) == set(commands)
    for name, flags in commands.items():
        table = "\n".join(line for line in sections[name].splitlines() if line.startswith("| `--"))
        documented = set(re.findall(r"`(--[a-z0-9-]+)`", table))
        assert documented == flags, name


@pytest.mark.parametrize("path", ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))])
def test_nothing_points_outside_the_repository(path):
    content = (ROOT / path).read_text()
    assert "../shared" not in content and "CONTRACT.md" not in content
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", content):
        if "://" not in target:
            assert ((ROOT / path).parent / target).exists(), (path, target)


def _answers(api: Any, calls: list[tuple[str, str, bytes | None]]) -> list[tuple[int, Any, Any]]:
    """(status, JSON answer, headers) of each call against ``api``'s real application."""
    from tests.unit.served import served

    async def run() -> list[tuple[int, Any, Any]]:
        answers = []
        async with served(api) as client:
            for method, path, data in calls:
                response = await client.request(method, path, data=data)
                answers.append((response.status, orjson.loads(await response.read()), response.headers))
        return answers

    return asyncio.run(run())


def _gateway_errors() -> list[tuple[str, str, str, int, str]]:
    """The "Real answers" of docs/gateway.md's Errors: (method, path, body, status, rest)."""
    block = re.search(r"^Real answers:\n\n```\n(.*?)```", text("gateway.md"), re.S | re.M).group(1)
    calls = re.findall(r"^(GET|POST) (/\S+)  (.*)\n(\d{3}) (.*(?:\n\{.*)?)", block, re.M)
    assert len(calls) == block.count("\nPOST ") + block.startswith("POST ")
    return [(m, p, b, int(s), rest) for m, p, b, s, rest in calls]


def test_the_documented_error_answers_are_the_services_own(tmp_path):
    from stream.http.auth import TokenFile

    tokens = tmp_path / "tokens"
    tokens.write_text("a-write-token\n")
    documented = _gateway_errors()
    assert len(documented) >= 5
    for method, path, body, status, rest in documented:
        api = make_api()
        if body.startswith("(no Authorization"):
            api.write_tokens = TokenFile(tokens)
            body = '{"endpoints": ["default/vllm-0"], "items": [{"hash": "h", "size": 1, "modality": "image"}]}'
        ((got, answer, headers),) = _answers(api, [(method, path, body.encode())])
        header, _, json_text = rest.rpartition("{\"error\"")
        assert (got, answer) == (status, orjson.loads('{"error"' + json_text)), (path, body)
        for name, value in re.findall(r"([A-Za-z-]+): (.+?)$", header.strip(), re.M):
            assert headers[name] == value


def test_the_documented_error_messages_of_the_http_page_are_real():
    items = [{"hash": f"h{i}", "size": 1, "modality": "image"} for i in range(1025)]
    produced = {
        "items[0].size: Input should be a valid integer":
            {"endpoints": ["a"], "items": [{"hash": "h", "size": "1", "modality": "image"}]},
        "items: at most 1024 items (max_items)": {"endpoints": ["a"], "items": items},
        "items[0].modality: at most 64 characters (max_modality_chars)":
            {"endpoints": ["a"], "items": [{"hash": "h", "size": 1, "modality": "m" * 65}]},
    }
    documented = [b for b in json_blocks("http-api.md") if set(b) == {"error"}]
    assert {b["error"]["message"] for b in documented} == set(produced)
    answers = _answers(make_api(), [("POST", "/v1/placements", orjson.dumps(produced[b["error"]["message"]]))
                                    for b in documented])
    assert [(status, answer) for status, answer, _ in answers] == [(400, b) for b in documented]


def test_every_documented_state_answer_has_the_real_fields_and_a_full_digest():
    ((status, real, _),) = _answers(make_api(), [("GET", "/v1/state", None)])
    assert status == 200
    documented = [b for b in json_blocks("http-api.md") if "digest" in b]
    gateway = re.search(r"What is left .*?```\nGET /v1/state\?limit=3\n.*?\n\n200\n(\{.*?\})\n```", text("gateway.md"), re.S).group(1)
    documented.append(orjson.loads(gateway))
    engine = {"engine_views", "total_engine_views"}  # there once some endpoint reports its cache
    for body in documented:
        assert set(body) - engine == set(real) and set(body) & engine in (set(), engine), body
        assert re.fullmatch(r"[0-9a-f]{64}", body["digest"]) and len(real["digest"]) == 64
    for name in ("README.md", "docs/http-api.md", "docs/gateway.md"):
        for digest in re.findall(r'"digest": ?"([^"]*)"', (ROOT / name).read_text()):
            assert re.fullmatch(r"[0-9a-f]{64}", digest) or digest == "<hex>", (name, digest)


def test_the_gateway_pages_sequence_leaves_the_state_it_shows():
    """docs/gateway.md's "Real bodies", replayed through the core: the state it shows at
    the end (digest included) is the one those calls leave."""
    from stream.core.events import EndpointDeleted, EndpointsSynced
    from stream.core.items import Item

    page = text("gateway.md")
    chat = re.search(r'"body": (\{"chat_completions": .*?\]\}\]\}\})\}', page, re.S).group(1)
    state = CacheState(Capacity.from_params())
    events = [ItemsPlaced(endpoint="default/vllm-1", items=extract_items(orjson.loads(chat))),
              ItemsPlaced(endpoint="default/vllm-0", items=[Item("9f2c1a", 576, "image"),
                                                            Item("77be03", 144, "image")]),
              EndpointDeleted(endpoint="default/vllm-1"),
              EndpointsSynced(live=["default/vllm-0", "default/vllm-2"])]
    for offset, event in enumerate(events):
        state.apply(event, Position(0, offset))
    api = make_api()
    api.state = state
    ((status, answer, _),) = _answers(api, [("GET", "/v1/state?limit=3", None)])
    shown = re.search(r"What is left .*?```\nGET /v1/state\?limit=3\n.*?\n\n200\n(\{.*?\})\n```", page, re.S).group(1)
    assert status == 200 and answer == orjson.loads(shown)


def test_the_top_help_and_the_readme_name_every_command():
    import stream.cli

    names = set(_commands(_parser())) | {name.split()[0] for name in _commands(_parser())}
    top = {name for name in names if " " not in name}
    described = stream.cli.__doc__ or ""
    for name in top:
        assert f"`{name}" in described, name
    block = re.search(r"^## Command line\n\n```\n(.*?)```", (ROOT / "README.md").read_text(), re.S | re.M)
    usage = set(re.findall(r"^mmcache ([a-z]+(?: digest)?)", block.group(1), re.M))
    assert {name for name in _commands(_parser())} <= usage


def test_sub_command_help_gives_each_default_once_and_never_none():
    for command in ("simulate", "tune", "export"):
        parser = _subparser(command)
        help_text = " ".join(parser.format_help().split())
        assert "(default: None)" not in help_text, command
        for action in parser._actions:
            if action.option_strings and action.help and action.help != argparse.SUPPRESS:
                shown = parser._get_formatter()._expand_help(action) if action.help else ""
                assert shown.lower().count("default") <= 1, (command, shown)


def _subparser(name: str) -> argparse.ArgumentParser:
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise LookupError(name)


def test_no_user_page_names_an_issue_number():
    for path in [ROOT / "README.md", *DOCS.glob("*.md")]:
        assert not re.search(r"\bissue #?\d+", path.read_text(), re.I), path


def test_every_flag_in_the_readmes_command_line_exists():
    block = re.search(r"^## Command line\n\n```\n(.*?)```", (ROOT / "README.md").read_text(), re.S | re.M)
    commands = _commands(_parser())
    usage: dict[str, str] = {}
    name = ""
    for line in block.group(1).splitlines():
        started = re.match(r"^mmcache (?:([a-z]+(?: digest)?)\b)?(.*)", line)
        if started:
            name, line = started.group(1) or "", started.group(2)
        usage[name] = usage.get(name, "") + " " + line
    for name, line in usage.items():
        if name in commands:
            flags = set(re.findall(r"(?<![\w-])(--[a-z0-9-]+)", line)) - {"--help"}
            assert flags <= commands[name], (name, flags - commands[name])


def test_every_environment_only_setting_is_on_the_cli_page():
    from stream.config import FLAGS, KafkaSecurity, Limits, Settings

    paragraph = re.search(r"^Environment only: (.*?)\n\n", text("cli.md"), re.S | re.M).group(1)
    documented = set(re.findall(r"`(MMCACHE_[A-Z0-9_]+)`", paragraph))
    names = {f"MMCACHE_{name.upper()}" for name in Limits.model_fields}
    names |= {f"MMCACHE_KAFKA_{name.upper()}" for name in KafkaSecurity.model_fields}
    names |= {f"MMCACHE_{name.upper()}" for name in Settings.model_fields
              if name not in FLAGS and name not in ("limits", "kafka")}
    assert names <= documented, names - documented


def test_every_limit_is_in_the_http_pages_limits_table_with_its_default():
    from stream.config import Limits

    table = re.search(r"^## Limits\n(.*?)(?=^## |\Z)", text("http-api.md"), re.S | re.M).group(1)
    rows = dict(re.findall(r"^\| `(MMCACHE_[A-Z_]+)` \| (.*?) \|$", table, re.M))
    for name, info in Limits.model_fields.items():
        row = rows[f"MMCACHE_{name.upper()}"]
        shown = {"max_body_bytes": "16 MiB", "body_budget_bytes": "64 MiB"}.get(name) or f"{info.default:,}"
        assert row.startswith(shown), (name, row)


def test_the_readmes_serve_synopsis_names_every_serve_flag():
    block = re.search(r"^## Command line\n\n```\n(.*?)```", (ROOT / "README.md").read_text(), re.S | re.M)
    serve = re.search(r"^mmcache serve (.*?)(?=^mmcache )", block.group(1), re.S | re.M).group(1)
    named = set(re.findall(r"(?<![\w-])(--[a-z0-9-]+)", serve))
    assert _commands(_parser())["serve"] <= named, _commands(_parser())["serve"] - named


def test_the_cli_page_names_every_bench_scenario():
    from stream.bench.run import SCENARIOS

    row = re.search(r"^\| `--only` \|.*$", text("cli.md").split("## `mmcache bench`")[1], re.M).group(0)
    assert set(re.findall(r"`([a-z0-9_]+)`", row)) - {"all"} == set(SCENARIOS)
