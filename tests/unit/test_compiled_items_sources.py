"""The compiled extraction answers as its source for the uuid rule and the ``responses``
source too (tests/unit/test_compiled.py draws chat, generate and tokenized bodies)."""

from __future__ import annotations

import importlib

from hypothesis import given
from hypothesis import strategies as st

from stream.bench.stages import reference_module
from tests.unit.test_compiled import SETTINGS, items_as_tuples, junk, outcome, record, shaped, texts

# mostly absent or valid; sometimes empty or not a string
uuids = st.integers(0, 9).flatmap(lambda n: st.just("") if n == 0 else junk if n == 1 else
                                  st.sampled_from([None, "u1", "u2"]))
url = st.one_of(texts, record({"url": shaped(texts)}, {}))
chat_block = shaped(st.one_of(
    st.sampled_from(["image_url", "video_url", "audio_url"]).flatmap(
        lambda kind: record({"type": st.just(kind), kind: shaped(url)}, {"uuid": uuids})),
    record({"type": st.just("input_audio"),
            "input_audio": record({"data": shaped(texts), "format": shaped(texts)}, {})}, {"uuid": uuids}),
    record({"type": st.just("image_url")}, {"uuid": uuids}),  # the media left out
    record({"type": shaped(texts)}, {"uuid": uuids}),
))
responses_part = shaped(st.one_of(
    record({"type": st.just("input_image")},
           {"image_url": shaped(texts), "file_id": shaped(texts), "uuid": uuids, "detail": texts}),
    record({"type": st.just("input_audio")},
           {"input_audio": record({"data": shaped(texts), "format": shaped(texts)}, {}), "uuid": uuids}),
    record({"type": st.sampled_from(["input_text", "input_file", "output_text"])}, {"uuid": uuids}),
))


def messages(part: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return shaped(st.lists(record({"content": shaped(st.lists(part, min_size=1, max_size=4))},
                                  {"role": texts, "type": texts}), min_size=1, max_size=3))


chat = record({"messages": messages(chat_block)}, {})
responses = record({"input": st.one_of(messages(responses_part), texts)}, {})
bodies = st.one_of(
    record({"responses": responses}, {"chat_completions": chat}),
    record({"chat_completions": chat}, {"responses": responses}),
    record({"input": messages(responses_part)}, {"model": texts, "messages": messages(chat_block)}),
    record({"messages": messages(chat_block)}, {"model": texts}),
)


@SETTINGS
@given(bodies)
def test_extract_items_gives_the_same_items_and_errors_for_uuids_and_responses(body):
    compiled, reference = importlib.import_module("stream.core.items"), reference_module("stream.core.items")
    got, want = outcome(compiled.extract_items, body), outcome(reference.extract_items, body)
    if got[0] == want[0] == "value":
        got, want = items_as_tuples(got[1]), items_as_tuples(want[1])
    assert got == want
