from pathlib import Path

import pytest

from stream.core.codec import decode_event
from stream.http.schemas import EXAMPLES, render

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


@pytest.mark.parametrize("name", sorted(render()))
def test_committed_schema_files_match_the_models(name: str) -> None:
    assert (SCHEMAS / name).read_bytes() == render()[name], "run `make schemas`"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_is_a_valid_event_of_its_type(name: str) -> None:
    event = decode_event((SCHEMAS / name).read_bytes())
    assert event == EXAMPLES[name]
    assert name.endswith(f"{event.type}.json")
