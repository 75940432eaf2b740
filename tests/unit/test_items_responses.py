"""Items of an OpenAI Responses request body: the fourth source, ``responses``.

Bodies are built by the openai SDK itself (``client.responses.create``) and recorded as
sent. An image given by URL hashes as the chat rule does, whichever API carried it; a
``file_id`` has its own rule; a part's ``uuid`` is the item hash, as vLLM's
``/v1/responses`` (which hands the message to its chat parser) takes it.
"""

from __future__ import annotations

import asyncio
import hashlib

import orjson
import pytest

from stream.core.events import ItemsPlaced
from stream.core.items import InvalidField, Item, extract_items
from stream.http.body_reader import BodyReader
from tests.unit.openai_bodies import sdk_body
from tests.unit.served import served
from tests.unit.test_http_api import make_api

CAT = "https://example.com/cat.png"
DATA_URL = "data:image/png;base64,iVBORw0KGgo="


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def responses_body(*parts: dict, **create: object) -> dict:
    """The body ``client.responses.create`` sends for one user message of ``parts``."""
    path, body = sdk_body(lambda client: client.responses.create(
        model="Qwen/Qwen2.5-VL-7B-Instruct",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, *parts]}],
        **create))
    assert path == "/v1/responses"
    return body


def input_image(**fields: object) -> dict:
    return {"type": "input_image", "detail": "auto", **fields}


# -- bodies as the openai SDK sends them -----------------------------------------------


def test_an_image_url_hashes_as_the_chat_rule_whichever_api_carried_it():
    body = responses_body(input_image(image_url=CAT))
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": CAT}}]}]}
    assert extract_items(body) == [Item(sha("image_url\x00" + CAT), 1, "image")]
    assert extract_items(body) == extract_items(chat)
    assert sha("image_url\x00" + CAT) == "d50305b9b95c0802394f12dc4272f0ec02cff6be30df6ff1a9de0768010548c9"


def test_a_data_url_is_an_image_url_too():
    assert extract_items(responses_body(input_image(image_url=DATA_URL))) == [
        Item(sha("image_url\x00" + DATA_URL), 1, "image")]


def test_a_file_id_has_its_own_rule():
    assert extract_items(responses_body(input_image(file_id="file-abc123"))) == [
        Item(sha("file_id\x00file-abc123"), 1, "image")]


def test_a_uuid_on_an_input_image_is_its_hash():
    body = responses_body(input_image(image_url=CAT, uuid="img-cat"), input_image(image_url=DATA_URL))
    assert body["input"][0]["content"][1]["uuid"] == "img-cat"  # the SDK lets it through
    assert extract_items(body) == [Item("img-cat", 1, "image"), Item(sha("image_url\x00" + DATA_URL), 1, "image")]


def test_the_plain_body_and_the_wrapped_one_give_the_same_items():
    body = responses_body(input_image(image_url=CAT), instructions="Be brief.", max_output_tokens=64)
    assert extract_items(body) == extract_items({"responses": body}) != []


def test_text_files_and_string_input_are_no_items():
    # vLLM encodes no input_file (it refuses the part): it is no encoder-cache item
    body = responses_body({"type": "input_file", "file_id": "file-pdf"},
                          {"type": "input_file", "file_url": "https://x/a.pdf"})
    assert extract_items(body) == []
    path, text_only = sdk_body(lambda client: client.responses.create(model="m", input="Hello"))
    assert text_only["input"] == "Hello"
    assert extract_items(text_only) == extract_items({"responses": text_only}) == []


def test_a_conversation_with_earlier_turns_and_tool_calls_reads_every_message():
    path, body = sdk_body(lambda client: client.responses.create(model="m", input=[
        {"role": "user", "content": [input_image(image_url=CAT)]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "A cat.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
        {"type": "item_reference", "id": "msg_0"},
        {"type": "message", "role": "user", "content": [
            input_image(image_url="https://x/dog.png"), input_image(image_url=CAT)]},
    ]))
    assert extract_items(body) == [Item(sha("image_url\x00" + CAT), 1, "image"),
                                   Item(sha("image_url\x00https://x/dog.png"), 1, "image")]


def test_input_audio_hashes_as_in_chat():
    body = {"input": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]}
    assert extract_items(body) == [Item(sha("input_audio\x00wav:UklGRg=="), 1, "audio")]


# -- which source ------------------------------------------------------------------------


def test_responses_comes_after_chat_completions():
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "https://x/chat.png"}]}]}
    responses = {"input": [{"role": "user", "content": [input_image(image_url=CAT)]}]}
    assert extract_items({"responses": responses, "chat_completions": chat}) == extract_items(chat)
    empty_chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert extract_items({"responses": responses, "chat_completions": empty_chat}) == extract_items(responses)
    assert extract_items({"responses": responses, "generate": {"features": {"mm_hashes": {"image": ["g"]}}}}) \
        == [Item("g", 1, "image")]


def test_a_wrapped_source_wins_over_a_top_level_input_and_messages_over_input():
    responses = {"input": [{"role": "user", "content": [input_image(image_url=CAT)]}]}
    assert extract_items({**responses, "tokenized": {"prompts": []}}) == []
    both = {**responses, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}
    assert extract_items(both) == [Item(sha("image_url\x00u"), 1, "image")]


@pytest.mark.parametrize("body", [
    {"model": "e5", "input": ["embed this", "and this"]},  # /v1/embeddings
    {"model": "e5", "input": [[101, 2023, 102]]},           # token ids
    {"model": "omni-moderation-latest", "input": [{"type": "image_url", "image_url": {"url": CAT}}]},
])
def test_a_plain_body_of_another_api_with_an_input_list_gives_no_items_not_an_error(body):
    assert extract_items(body) == []


# -- malformed input ----------------------------------------------------------------------


def content(*parts: object) -> dict:
    return {"responses": {"input": [{"role": "user", "content": list(parts)}]}}


@pytest.mark.parametrize("body, field", [
    ({"responses": []}, "body.responses"),
    ({"responses": {"input": {"role": "user"}}}, "body.responses.input"),
    (content("a string part"), "body.responses.input[0].content[0]"),
    (content({"type": 3, "image_url": CAT}), "body.responses.input[0].content[0].type"),
    (content(input_image(image_url={"url": CAT})), "body.responses.input[0].content[0].image_url"),
    (content(input_image(file_id=5)), "body.responses.input[0].content[0].file_id"),
    (content(input_image()), "body.responses.input[0].content[0].image_url"),
    (content(input_image(image_url=CAT, uuid="")), "body.responses.input[0].content[0].uuid"),
    (content(input_image(image_url=CAT, uuid=7)), "body.responses.input[0].content[0].uuid"),
    (content({"type": "input_audio", "input_audio": {"data": "d"}}),
     "body.responses.input[0].content[0].input_audio.format"),
    ({"input": [{"role": "user", "content": [input_image(file_id=[])]}]}, "body.input[0].content[0].file_id"),
])
def test_malformed_responses_input_names_the_field(body, field):
    with pytest.raises(InvalidField) as info:
        extract_items(body)
    assert info.value.field == field


def test_with_a_uuid_an_input_image_needs_no_url():
    assert extract_items(content(input_image(uuid="cached"))) == [Item("cached", 1, "image")]


def test_repeats_count_once_and_every_image_part_is_a_reference():
    body = content(*[input_image(image_url=CAT)] * 3, {"type": "input_text", "text": "t"})
    assert extract_items(body, max_references=3) == [Item(sha("image_url\x00" + CAT), 1, "image")]
    with pytest.raises(InvalidField, match="max_references"):
        extract_items(body, max_references=2)


# -- over HTTP: /v1/match and /v1/placements take the SDK's body ------------------------


class RecordingPublisher:
    """Stands in for the event log: keeps what a placement would write."""

    def __init__(self) -> None:
        self.events: list[ItemsPlaced] = []

    async def publish(self, events: list[ItemsPlaced]) -> int:
        self.events.extend(events)
        return len(events)


def answers(api: object, calls: list[tuple[str, dict]]) -> list[tuple[int, dict]]:
    async def run() -> list[tuple[int, dict]]:
        got = []
        async with served(api) as client:  # type: ignore[attr-defined]
            for path, request in calls:
                response = await client.post(path, data=orjson.dumps(request))
                got.append((response.status, orjson.loads(await response.read())))
        return got

    return asyncio.run(run())


@pytest.mark.parametrize("where", ["inline", "child"])
def test_match_and_placements_accept_a_responses_body_as_the_sdk_sends_it(where):
    body = responses_body(input_image(image_url=CAT), input_image(file_id="file-abc123", uuid="img-2"))
    api = make_api()
    api.publisher = RecordingPublisher()  # type: ignore[assignment]
    if where == "child":  # as a big body is: read by the body reader's child process
        api.bodies = BodyReader(api.limits, inline_bytes=0)
    want = [{"hash": sha("image_url\x00" + CAT), "size": 1, "modality": "image"},
            {"hash": "img-2", "size": 1, "modality": "image"}]
    bad = {"input": [{"role": "user", "content": [input_image(image_url=CAT, uuid=7)]}]}

    (match_status, plain), (wrapped_status, wrapped), (placed_status, placed), refused = answers(api, [
        ("/v1/match", {"endpoints": ["ns/a"], "body": body}),
        ("/v1/match", {"endpoints": ["ns/a"], "body": {"responses": body}}),
        ("/v1/placements", {"request_id": "r-1", "endpoints": ["ns/b"], "body": body}),
        ("/v1/match", {"endpoints": ["ns/a"], "body": bad}),
    ])
    assert (match_status, wrapped_status, placed_status) == (200, 200, 202)
    assert plain["request_items"] == wrapped["request_items"] == want
    assert [entry["endpoint"] for entry in plain["endpoints"]] == ["ns/a"]
    assert placed == {"events": 1}
    [event] = api.publisher.events
    assert (event.endpoint, [(i.hash, i.size, i.modality) for i in event.items]) == (
        "ns/b", [(w["hash"], w["size"], w["modality"]) for w in want])
    assert refused == (400, {"error": {"code": "invalid_request", "message":
                                       "body.input[0].content[0].uuid: must be a non-empty string "
                                       "(the item's hash, as vLLM's multi_modal_uuids) or null"}})
