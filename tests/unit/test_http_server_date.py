"""Every answer of the API's server carries a ``Date`` (RFC 9110 section 6.6.1: an origin
server with a clock sends it on its 2xx to 4xx answers), in the IMF-fixdate form, the
second it was sent; the value is made once a second, not once an answer."""

from __future__ import annotations

import email.utils
import re
import time

from stream.http import server as http_server
from tests.unit.test_http_server import MATCH, answers_on_one_connection, post

_IMF_FIXDATE = re.compile(rb"^Date: ([A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT)\r$",
                          re.MULTILINE)


def _dates(raw: bytes) -> list[float]:
    return [email.utils.parsedate_to_datetime(found.decode()).timestamp()
            for found in _IMF_FIXDATE.findall(raw)]


def test_every_answer_200_to_4xx_and_refusals_carries_the_date_it_was_sent():
    before = int(time.time())
    raw = (post("/v1/match", MATCH) + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
           + b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n" + b"POST /v1/match HTTP/1.1\r\nHost: x\r\n"
           b"Content-Length: 2\r\n\r\n{]" + b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
           + b"GET /healthz HTTP/1.1\r\nHost: x\r\nExpect: nonsense\r\n\r\n")
    answer = answers_on_one_connection(raw)
    after = time.time()
    statuses = [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer)]
    assert statuses == [200, 200, 404, 400, 200, 417]
    dates = _dates(answer)
    assert len(dates) == len(statuses)
    assert all(before <= date <= after for date in dates)


def test_a_request_the_parser_refuses_gets_a_date_too():
    answer = answers_on_one_connection(b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n")
    assert re.match(rb"HTTP/1\.[01] 400 ", answer)
    assert len(_dates(answer)) == 1


def test_the_date_is_made_once_a_second():
    first = http_server.date_header()
    assert http_server.date_header() is first  # the same bytes object: not formatted again
    assert _dates(first.rstrip(b"\n")) and first.endswith(b"\r\n")
