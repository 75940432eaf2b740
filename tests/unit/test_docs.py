"""docs/ is what users read (issue 10, item 1): these tests keep it true. Every route it
names is a route of the app and the other way round; every JSON body in it is one the
models accept (and the match answer is the one the service computes); every flag of every
command is in docs/cli.md and every flag there exists; nothing points outside the repo."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import orjson
import pytest
from pydantic import TypeAdapter

from stream.api_models import (
    EndpointEventRequest,
    ErrorBody,
    EventsAccepted,
    MatchRequest,
    MatchResponse,
    PlacementRequest,
    ReadinessBody,
    StateResponse,
)
from stream.cli import _parser
from stream.codec import decode_event
from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import extract_items
from stream.http_api import render_match
from tests.unit.test_http_api import make_api

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def text(name: str) -> str:
    return (DOCS / name).read_text()


def json_blocks(name: str) -> list[dict]:
    return [orjson.loads(block) for block in re.findall(r"```json\n(.*?)```", text(name), re.S)]


def test_every_documented_route_exists_and_every_route_is_documented():
    documented = set(re.findall(r"`(GET|POST) (/[a-z0-9/._-]+)`", text("http-api.md")))
    app = make_api().application()
    routes = {(route.method, route.resource.canonical) for route in app.router.routes()
              if route.method in ("GET", "POST") and "{" not in route.resource.canonical}
    assert documented == routes


def test_every_http_body_in_the_docs_is_accepted_by_its_model():
    shapes = [MatchRequest, PlacementRequest, TypeAdapter(EndpointEventRequest), MatchResponse,
              EventsAccepted, StateResponse, ReadinessBody, ErrorBody]
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
        "items_placed", "endpoint_deleted", "endpoints_synced"}


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
