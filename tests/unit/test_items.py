"""Item extraction from a request body (CONTRACT, "Extracting items from a request body")."""

from __future__ import annotations

import hashlib

import pytest

from stream.core.items import InvalidField, Item, extract_items, media_hash


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def chat(*blocks: object, role: str = "user") -> dict:
    return {"chat_completions": {"messages": [{"role": role, "content": list(blocks)}]}}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# -- hashes of chat-completions media blocks -------------------------------------------


def test_image_url_object_hash_is_sha256_of_type_nul_url():
    items = extract_items(chat(image("https://x/a.png")))
    expected = hashlib.sha256(b"image_url\x00https://x/a.png").hexdigest()
    assert items == [Item(expected, 1, "image")]


def test_image_url_bare_string_hashes_like_the_object_form():
    items = extract_items(chat({"type": "image_url", "image_url": "https://x/a.png"}))
    expected = hashlib.sha256(b"image_url\x00https://x/a.png").hexdigest()
    assert items == [Item(expected, 1, "image")]


def test_video_url_hash_and_modality():
    body = chat({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}})
    expected = hashlib.sha256(b"video_url\x00https://x/v.mp4").hexdigest()
    assert extract_items(body) == [Item(expected, 1, "video")]


def test_audio_url_hash_and_modality():
    body = chat({"type": "audio_url", "audio_url": {"url": "https://x/s.wav"}})
    expected = hashlib.sha256(b"audio_url\x00https://x/s.wav").hexdigest()
    assert extract_items(body) == [Item(expected, 1, "audio")]


def test_input_audio_hash_is_format_colon_data():
    body = chat({"type": "input_audio", "input_audio": {"data": "QUJD", "format": "wav"}})
    expected = hashlib.sha256(b"input_audio\x00wav:QUJD").hexdigest()
    assert extract_items(body) == [Item(expected, 1, "audio")]


def test_hash_is_lower_case_hex_of_utf8_bytes():
    url = "https://x/ünïcode/画像.png"
    [item] = extract_items(chat(image(url)))
    assert item.hash == hashlib.sha256(("image_url\x00" + url).encode("utf-8")).hexdigest()
    assert item.hash == item.hash.lower() and len(item.hash) == 64


def test_media_hash_matches_contract_formula():
    assert media_hash("image_url", "u") == hashlib.sha256(b"image_url\x00u").hexdigest()
    assert (
        media_hash("input_audio", "mp3:AA") == hashlib.sha256(b"input_audio\x00mp3:AA").hexdigest()
    )


def test_same_url_under_different_block_types_gives_different_hashes():
    body = chat(
        image("https://x/m"),
        {"type": "video_url", "video_url": {"url": "https://x/m"}},
        {"type": "audio_url", "audio_url": {"url": "https://x/m"}},
    )
    items = extract_items(body)
    assert [i.modality for i in items] == ["image", "video", "audio"]
    assert len({i.hash for i in items}) == 3


def test_text_blocks_and_string_content_contribute_nothing():
    body = {
        "chat_completions": {
            "messages": [
                {"role": "system", "content": "you are helpful"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}]},
                {"role": "assistant", "content": None},
            ]
        }
    }
    assert extract_items(body) == []


def test_text_blocks_between_media_are_ignored():
    body = chat({"type": "text", "text": "look"}, image("u1"), {"type": "text", "text": "and"})
    assert extract_items(body) == [Item(sha("image_url\x00u1"), 1, "image")]


def test_chat_items_across_messages_keep_order_of_first_occurrence():
    body = {
        "chat_completions": {
            "messages": [
                {"role": "user", "content": [image("u2"), image("u1")]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [image("u1"), image("u3"), image("u2")]},
            ]
        }
    }
    hashes = [i.hash for i in extract_items(body)]
    assert hashes == [sha("image_url\x00u2"), sha("image_url\x00u1"), sha("image_url\x00u3")]


def test_image_url_object_and_bare_string_for_same_url_dedupe():
    body = chat(image("u"), {"type": "image_url", "image_url": "u"})
    assert extract_items(body) == [Item(sha("image_url\x00u"), 1, "image")]


# -- tokenized --------------------------------------------------------------------------


def tokenized(*features: dict) -> dict:
    return {"tokenized": {"prompts": [{"mm_features": list(features)}]}}


def test_tokenized_size_is_length_when_at_least_one():
    body = tokenized({"hash": "h", "modality": "image", "offset": 3, "length": 576})
    assert extract_items(body) == [Item("h", 576, "image")]


@pytest.mark.parametrize("length", [0, -5])
def test_tokenized_size_is_one_when_length_below_one(length):
    body = tokenized({"hash": "h", "modality": "video", "length": length})
    assert extract_items(body) == [Item("h", 1, "video")]


def test_tokenized_size_is_one_when_length_missing():
    assert extract_items(tokenized({"hash": "h", "modality": "audio"})) == [Item("h", 1, "audio")]


def test_tokenized_size_is_one_when_length_null():
    body = tokenized({"hash": "h", "modality": "audio", "length": None})
    assert extract_items(body) == [Item("h", 1, "audio")]


def test_tokenized_unknown_modality_kept_as_given():
    assert extract_items(tokenized({"hash": "h", "modality": "point_cloud"})) == [
        Item("h", 1, "point_cloud")
    ]


def test_tokenized_empty_or_missing_hash_is_skipped():
    body = tokenized(
        {"hash": "", "modality": "image", "length": 9},
        {"modality": "image", "length": 9},
        {"hash": "h", "modality": "image", "length": 2},
    )
    assert extract_items(body) == [Item("h", 2, "image")]


def test_tokenized_dedupe_first_occurrence_wins_with_its_size_and_modality():
    body = {
        "tokenized": {
            "prompts": [
                {
                    "mm_features": [
                        {"hash": "b", "modality": "image", "length": 4},
                        {"hash": "a", "modality": "image", "length": 7},
                        {"hash": "b", "modality": "video", "length": 99},
                    ]
                },
                {"mm_features": [{"hash": "a", "modality": "audio", "length": 1}, {"hash": "c"}]},
            ]
        }
    }
    assert extract_items(body) == [
        Item("b", 4, "image"),
        Item("a", 7, "image"),
        Item("c", 1, ""),
    ]


def test_tokenized_prompts_without_features_yield_nothing():
    body = {"tokenized": {"prompts": [{}, {"mm_features": None}, {"mm_features": []}]}}
    assert extract_items(body) == []


def test_tokenized_length_above_max_is_invalid():
    body = tokenized({"hash": "h", "modality": "image", "length": 2**31})
    with pytest.raises(InvalidField) as info:
        extract_items(body)
    assert info.value.field == "body.tokenized.prompts[0].mm_features[0].length"


def test_tokenized_length_at_max_is_accepted():
    body = tokenized({"hash": "h", "modality": "image", "length": 2**31 - 1})
    assert extract_items(body) == [Item("h", 2**31 - 1, "image")]


# -- generate ---------------------------------------------------------------------------


def test_generate_items_have_size_one_and_map_key_modality_in_order():
    body = {
        "generate": {
            "features": {"mm_hashes": {"image": ["i1", "i2"], "video": ["v1"], "audio": ["a1"]}}
        }
    }
    assert extract_items(body) == [
        Item("i1", 1, "image"),
        Item("i2", 1, "image"),
        Item("v1", 1, "video"),
        Item("a1", 1, "audio"),
    ]


def test_generate_dedupe_first_occurrence_wins_and_empty_hash_skipped():
    body = {"generate": {"features": {"mm_hashes": {"video": ["x", "", "y"], "image": ["x", "z"]}}}}
    assert extract_items(body) == [
        Item("x", 1, "video"),
        Item("y", 1, "video"),
        Item("z", 1, "image"),
    ]


def test_generate_without_hashes_yields_nothing():
    assert extract_items({"generate": {}}) == []
    assert extract_items({"generate": {"features": {}}}) == []
    assert extract_items({"generate": {"features": {"mm_hashes": {"image": []}}}}) == []


# -- precedence -------------------------------------------------------------------------


TOK = tokenized({"hash": "t", "modality": "image", "length": 3})
GEN = {"generate": {"features": {"mm_hashes": {"image": ["g"]}}}}
CHAT = chat(image("c"))
CHAT_ITEM = Item(sha("image_url\x00c"), 1, "image")


def test_tokenized_wins_over_generate_and_chat():
    body = {**CHAT, **GEN, **TOK}
    assert extract_items(body) == [Item("t", 3, "image")]


def test_generate_wins_over_chat():
    assert extract_items({**CHAT, **GEN}) == [Item("g", 1, "image")]


def test_chat_used_alone():
    assert extract_items(CHAT) == [CHAT_ITEM]


def test_precedence_does_not_depend_on_key_order_in_body():
    body = {"chat_completions": CHAT["chat_completions"], "generate": GEN["generate"]}
    body["tokenized"] = TOK["tokenized"]
    assert extract_items(body) == [Item("t", 3, "image")]


def test_empty_tokenized_falls_through_to_generate():
    body = {"tokenized": {"prompts": [{"mm_features": []}]}, **GEN, **CHAT}
    assert extract_items(body) == [Item("g", 1, "image")]


def test_tokenized_with_only_empty_hashes_falls_through():
    body = {**tokenized({"hash": "", "modality": "image"}), **CHAT}
    assert extract_items(body) == [CHAT_ITEM]


def test_empty_tokenized_and_generate_fall_through_to_chat():
    body = {
        "tokenized": {"prompts": []},
        "generate": {"features": {"mm_hashes": {"image": [""]}}},
        **CHAT,
    }
    assert extract_items(body) == [CHAT_ITEM]


def test_null_sources_are_absent():
    body = {"tokenized": None, "generate": None, **CHAT}
    assert extract_items(body) == [CHAT_ITEM]


def test_sources_are_not_merged():
    body = {**TOK, **GEN, **CHAT}
    assert [i.hash for i in extract_items(body)] == ["t"]


def test_no_source_yields_nothing():
    assert extract_items({}) == []
    assert extract_items({"model": "m", "prompt": "hi"}) == []
    assert extract_items({"chat_completions": {"messages": []}}) == []


# -- malformed input --------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, field",
    [
        (
            chat({"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": 5}}),
            "body.chat_completions.messages[0].content[1].image_url.url",
        ),
        (
            chat({"type": "image_url", "image_url": {}}),
            "body.chat_completions.messages[0].content[0].image_url.url",
        ),
        (
            chat({"type": "image_url"}),
            "body.chat_completions.messages[0].content[0].image_url",
        ),
        (
            chat({"type": "image_url", "image_url": 7}),
            "body.chat_completions.messages[0].content[0].image_url",
        ),
        (
            chat({"type": "video_url", "video_url": "https://x/v"}),
            "body.chat_completions.messages[0].content[0].video_url",
        ),
        (
            chat({"type": "audio_url", "audio_url": {"url": None}}),
            "body.chat_completions.messages[0].content[0].audio_url.url",
        ),
        (
            chat({"type": "input_audio", "input_audio": {"format": "wav"}}),
            "body.chat_completions.messages[0].content[0].input_audio.data",
        ),
        (
            chat({"type": "input_audio", "input_audio": {"data": "AA", "format": 3}}),
            "body.chat_completions.messages[0].content[0].input_audio.format",
        ),
        (
            chat({"type": "input_audio", "input_audio": "AA"}),
            "body.chat_completions.messages[0].content[0].input_audio",
        ),
        (chat("not a block"), "body.chat_completions.messages[0].content[0]"),
        ({"chat_completions": {"messages": ["hi"]}}, "body.chat_completions.messages[0]"),
        ({"chat_completions": {"messages": {}}}, "body.chat_completions.messages"),
        ({"chat_completions": []}, "body.chat_completions"),
        ({"tokenized": "x"}, "body.tokenized"),
        ({"tokenized": {"prompts": {}}}, "body.tokenized.prompts"),
        ({"tokenized": {"prompts": [3]}}, "body.tokenized.prompts[0]"),
        (
            {"tokenized": {"prompts": [{"mm_features": {"hash": "h"}}]}},
            "body.tokenized.prompts[0].mm_features",
        ),
        (tokenized("f"), "body.tokenized.prompts[0].mm_features[0]"),
        (tokenized({"hash": 1}), "body.tokenized.prompts[0].mm_features[0].hash"),
        (
            tokenized({"hash": "h", "modality": 2}),
            "body.tokenized.prompts[0].mm_features[0].modality",
        ),
        (
            tokenized({"hash": "h", "modality": "image", "length": "3"}),
            "body.tokenized.prompts[0].mm_features[0].length",
        ),
        (
            tokenized({"hash": "h", "modality": "image", "length": 2.5}),
            "body.tokenized.prompts[0].mm_features[0].length",
        ),
        (
            tokenized({"hash": "h", "modality": "image", "length": True}),
            "body.tokenized.prompts[0].mm_features[0].length",
        ),
        ({"generate": []}, "body.generate"),
        ({"generate": {"features": []}}, "body.generate.features"),
        (
            {"generate": {"features": {"mm_hashes": ["h"]}}},
            "body.generate.features.mm_hashes",
        ),
        (
            {"generate": {"features": {"mm_hashes": {"image": "h"}}}},
            "body.generate.features.mm_hashes.image",
        ),
        (
            {"generate": {"features": {"mm_hashes": {"image": ["ok", 4]}}}},
            "body.generate.features.mm_hashes.image[1]",
        ),
    ],
)
def test_malformed_input_raises_invalid_field_naming_the_path(body, field):
    with pytest.raises(InvalidField) as info:
        extract_items(body)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(field + ": ")


@pytest.mark.parametrize("body", [[], "x", 3, None])
def test_body_not_an_object_raises_invalid_field(body):
    with pytest.raises(InvalidField) as info:
        extract_items(body)
    assert info.value.field == "body"


def test_custom_path_prefix_is_used_in_field():
    with pytest.raises(InvalidField) as info:
        extract_items({"tokenized": 1}, path="request.body")
    assert info.value.field == "request.body.tokenized"


def test_malformed_later_source_is_rejected_even_when_earlier_source_wins():
    body = {
        **TOK,
        "chat_completions": {"messages": [{"content": [image("ok"), {"type": "image_url"}]}]},
    }
    with pytest.raises(InvalidField) as info:
        extract_items(body)
    assert info.value.field == "body.chat_completions.messages[0].content[1].image_url"


def test_unknown_block_types_are_ignored_not_rejected():
    body = chat({"type": "file", "file": {"id": "f"}}, {"no_type": True}, image("u"))
    assert extract_items(body) == [Item(sha("image_url\x00u"), 1, "image")]


# A wrong-typed value is rejected even when it is empty ({} / [] / "" / 0); only JSON
# null counts as absent.
@pytest.mark.parametrize(
    "body, field",
    [
        (
            {"tokenized": {"prompts": [{"mm_features": {}}]}},
            "body.tokenized.prompts[0].mm_features",
        ),
        (
            {"tokenized": {"prompts": [{"mm_features": ""}]}},
            "body.tokenized.prompts[0].mm_features",
        ),
        ({"generate": {"features": {"mm_hashes": []}}}, "body.generate.features.mm_hashes"),
        (
            {"generate": {"features": {"mm_hashes": {"image": ""}}}},
            "body.generate.features.mm_hashes.image",
        ),
        (
            {"generate": {"features": {"mm_hashes": {"image": 0}}}},
            "body.generate.features.mm_hashes.image",
        ),
    ],
)
def test_empty_value_of_wrong_type_is_rejected(body, field):
    with pytest.raises(InvalidField) as info:
        extract_items(body)
    assert info.value.field == field


def test_null_feature_lists_count_as_absent():
    assert extract_items({"generate": {"features": {"mm_hashes": None}}}) == []
    assert extract_items({"generate": {"features": {"mm_hashes": {"image": None}}}}) == []
    body = {"generate": {"features": {"mm_hashes": {"image": None, "video": ["v"]}}}}
    assert extract_items(body) == [Item("v", 1, "video")]


def test_plain_openai_request_is_read_as_chat_completions():
    blocks = [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]
    plain = {"model": "m", "messages": [{"role": "user", "content": blocks}]}
    assert extract_items(plain) == extract_items(chat(*blocks))
    assert extract_items(plain)[0].modality == "image"


def test_plain_openai_request_errors_name_the_field():
    plain = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    with pytest.raises(InvalidField) as error:
        extract_items(plain)
    assert error.value.field.startswith("body.messages[0].content[0].image_url")


def test_a_wrapped_source_wins_over_top_level_messages():
    body = {"generate": {"features": {"mm_hashes": {"image": ["h1"]}}},
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}
    assert [item.hash for item in extract_items(body)] == ["h1"]


@pytest.mark.parametrize("kind", [["image_url"], {"image_url": 1}, 3, True])
def test_a_chat_block_type_that_is_not_a_string_is_an_invalid_field_not_a_crash(kind):
    body = {"chat_completions": {"messages": [{"role": "user", "content": [
        {"type": kind, "image_url": {"url": "https://x/a.png"}}]}]}}
    with pytest.raises(InvalidField) as err:
        extract_items(body)
    assert err.value.field == "body.chat_completions.messages[0].content[0].type"
    assert "must be a string" in str(err.value)


# -- limits: reading stops at the first item or reference over them ---------------------


def test_reading_stops_at_the_item_past_max_items():
    # a malformed block after the limit is never reached: the error is the limit's
    blocks = [image(f"u{i}") for i in range(5)] + [{"type": "image_url", "image_url": 7}]
    with pytest.raises(InvalidField) as info:
        extract_items(chat(*blocks), max_items=3)
    assert (info.value.field, info.value.message) == ("body items", "at most 3 items (max_items)")
    assert len(extract_items(chat(*blocks[:3]), max_items=3)) == 3


def test_the_item_limit_counts_unique_items_and_names_the_given_field():
    body = chat(*[image("same") for _ in range(10)], image("other"))
    assert len(extract_items(body, max_items=2)) == 2
    with pytest.raises(InvalidField) as info:
        extract_items(tokenized(*[{"hash": f"h{i}"} for i in range(3)]), max_items=2, items_field="items")
    assert info.value.field == "items"


def test_repeated_references_count_against_max_references():
    # 300,000 blocks repeating one URL are one item, but each is read: the reference
    # limit stops them (repeats are counted, not hashed)
    body = chat(*[image("one") for _ in range(5)], {"type": "image_url", "image_url": 7})
    with pytest.raises(InvalidField) as info:
        extract_items(body, max_items=3, max_references=4)
    assert info.value.field == "body"
    assert info.value.message.endswith("(max_references)") and "at most 4 media references" in info.value.message
    assert extract_items(chat(*[image("one")] * 4), max_references=4) == [Item(sha("image_url\x00one"), 1, "image")]


@pytest.mark.parametrize("body", [
    tokenized(*[{"hash": "h"}] * 3),
    {"generate": {"features": {"mm_hashes": {"image": ["h", "h"], "video": ["h"]}}}},
    chat(image("u"), {"type": "input_audio", "input_audio": {"data": "d", "format": "wav"}},
         {"type": "video_url", "video_url": {"url": "u"}}),
    {"tokenized": {"prompts": [{"mm_features": [{"hash": ""}, {"hash": "h"}]}]},
     "chat_completions": {"messages": [{"role": "user", "content": [image("u")]}]}},
])
def test_every_feature_hash_and_media_block_is_a_reference_over_all_sources(body):
    assert extract_items(body, max_references=3) is not None
    with pytest.raises(InvalidField, match="max_references"):
        extract_items(body, max_references=2)


def test_text_blocks_are_not_references():
    body = chat(*[{"type": "text", "text": "t"}] * 10, image("u"))
    assert len(extract_items(body, max_references=1)) == 1


def test_a_repeated_reference_keeps_its_first_place_and_hash():
    audio = {"type": "input_audio", "input_audio": {"data": "QUJD", "format": "wav"}}
    body = chat(image("b"), audio, image("a"), image("b"), audio, {"type": "image_url", "image_url": "a"})
    assert extract_items(body) == [Item(sha("image_url\x00b"), 1, "image"),
                                   Item(sha("input_audio\x00wav:QUJD"), 1, "audio"),
                                   Item(sha("image_url\x00a"), 1, "image")]
