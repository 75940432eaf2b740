"""One identity: a media block's ``uuid`` is its item hash (CONTRACT, "Engine truth").

vLLM reads a content part's ``uuid`` (``part.get("uuid")`` in its chat parser) and, when
the request has no per-request processor options, uses it as the item's hash in place
of its own content hash (``multi_modal_uuids``). Extraction names the item the same way,
so a gateway that sets the uuid, mmcache and the engine's own cache reports agree.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import orjson
import pytest

from stream.core.items import InvalidField, Item, extract_items, media_hash
from tests.unit.openai_bodies import sdk_body


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def chat(*blocks: object) -> dict:
    return {"chat_completions": {"messages": [{"role": "user", "content": list(blocks)}]}}


def image(url: str, **extra: object) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


# -- bodies as the openai SDK sends them -----------------------------------------------


def test_the_sdk_sends_the_uuid_of_a_chat_part_as_given_and_it_is_the_item_hash():
    path, body = sdk_body(lambda client: client.chat.completions.create(model="m", messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "What is in these?"},
            {"type": "image_url", "image_url": {"url": "https://x/cat.png"}, "uuid": "img-cat"},
            {"type": "image_url", "image_url": {"url": "https://x/dog.png"}}]}]))
    assert path == "/v1/chat/completions"
    assert body["messages"][0]["content"][1]["uuid"] == "img-cat"
    assert extract_items(body) == extract_items({"chat_completions": body}) == [
        Item("img-cat", 1, "image"), Item(sha("image_url\x00https://x/dog.png"), 1, "image")]


def test_every_chat_media_block_type_takes_its_uuid_with_its_own_modality():
    path, body = sdk_body(lambda client: client.chat.completions.create(model="m", messages=[
        {"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}, "uuid": "a-1"},
            {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}, "uuid": "v-1"},
            {"type": "audio_url", "audio_url": {"url": "https://x/s.mp3"}, "uuid": "a-2"},
            {"type": "image_url", "image_url": "https://x/bare.png", "uuid": "i-1"}]}]))
    assert path == "/v1/chat/completions"
    assert extract_items(body) == [Item("a-1", 1, "audio"), Item("v-1", 1, "video"),
                                   Item("a-2", 1, "audio"), Item("i-1", 1, "image")]


# -- the rule ---------------------------------------------------------------------------


def test_a_null_uuid_is_no_uuid():
    assert extract_items(chat(image("u", uuid=None))) == [Item(sha("image_url\x00u"), 1, "image")]


@pytest.mark.parametrize("uuid", ["", 123, 1.5, True, ["u"], {"id": "u"}])
def test_an_empty_or_non_string_uuid_is_refused_naming_the_field(uuid):
    # vLLM would hash str(uuid), or name every empty-uuid item "" (one cache entry for
    # different images): a caller's bug, said as a 400 rather than a silent disagreement
    with pytest.raises(InvalidField) as info:
        extract_items(chat({"type": "text", "text": "t"}, image("u", uuid=uuid)))
    assert info.value.field == "body.chat_completions.messages[0].content[1].uuid"
    assert "non-empty string" in info.value.message


def test_the_same_uuid_twice_is_one_item_and_the_first_wins():
    body = chat(image("https://x/a.png", uuid="same"),
                {"type": "video_url", "video_url": {"url": "https://x/b.mp4"}, "uuid": "same"},
                image("https://x/c.png", uuid="other"))
    assert extract_items(body) == [Item("same", 1, "image"), Item("other", 1, "image")]


def test_a_url_with_and_without_a_uuid_is_two_items_as_in_the_engine():
    body = chat(image("https://x/a.png", uuid="u-a"), image("https://x/a.png"))
    assert extract_items(body) == [Item("u-a", 1, "image"), Item(sha("image_url\x00https://x/a.png"), 1, "image")]


@pytest.mark.parametrize("block", [
    {"type": "image_url", "uuid": "cached"},
    {"type": "image_url", "image_url": None, "uuid": "cached"},
    {"type": "input_audio", "input_audio": None, "uuid": "cached"},
])
def test_with_a_uuid_the_media_may_be_left_out_as_vllm_allows(block):
    # vLLM then takes the item from its cache by that uuid
    assert [item.hash for item in extract_items(chat(block))] == ["cached"]


@pytest.mark.parametrize("block, field", [
    ({"type": "image_url", "image_url": 7, "uuid": "u"}, "image_url"),
    ({"type": "image_url", "image_url": {"url": 5}, "uuid": "u"}, "image_url.url"),
    ({"type": "input_audio", "input_audio": {"data": "d"}, "uuid": "u"}, "input_audio.format"),
])
def test_with_a_uuid_media_that_is_given_must_still_be_well_formed(block, field):
    with pytest.raises(InvalidField) as info:
        extract_items(chat(block))
    assert info.value.field == f"body.chat_completions.messages[0].content[0].{field}"


def test_a_uuid_on_a_part_that_is_no_item_is_ignored():
    body = chat({"type": "text", "text": "t", "uuid": 5}, {"type": "file", "uuid": ""},
                image("u", uuid="i"))
    assert extract_items(body) == [Item("i", 1, "image")]


def test_a_block_with_a_uuid_is_a_media_reference():
    body = chat(image("a", uuid="1"), image("b", uuid="2"))
    assert len(extract_items(body, max_references=2)) == 2
    with pytest.raises(InvalidField, match="max_references"):
        extract_items(body, max_references=1)


def test_tokenized_and_generate_already_carry_hashes_and_ignore_a_uuid():
    feature = {"hash": "h1", "modality": "image", "uuid": "ignored"}
    assert extract_items({"tokenized": {"prompts": [{"mm_features": [feature]}]}}) == [Item("h1", 1, "image")]
    body = {"generate": {"features": {"mm_hashes": {"image": ["h2"]}, "uuid": "ignored"}}}
    assert extract_items(body) == [Item("h2", 1, "image")]


def test_the_gateway_guides_uuid_examples_give_the_items_they_show():
    page = (Path(__file__).resolve().parents[2] / "docs" / "gateway.md").read_text()
    section = page[page.index("## One identity"):page.index("## Tokens and TLS")]
    blocks = re.findall(r"```\nPOST (\S+)\n(\{.*?\})\n\n(\d{3})\n(\{.*?\})\n```", section, re.S)
    assert [(path, status) for path, _, status, _ in blocks] == [("/v1/match", "200"), ("/v1/placements", "202")]
    (_, match, _, answer), (_, placement, _, accepted) = blocks
    shown = orjson.loads(answer)["request_items"]
    cat = media_hash("image_url", "https://example.com/cat.png")
    assert [Item(**item) for item in shown] == [Item(cat, 1, "image")]
    assert extract_items(orjson.loads(match)["body"]) == extract_items(orjson.loads(placement)["body"]) == \
        [Item(cat, 1, "image")]
    assert orjson.loads(accepted) == {"events": 1}
