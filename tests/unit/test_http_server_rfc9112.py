"""The corners of HTTP/1.1 answered as RFC 9112 (and RFC 9110) say: an absolute-form
target is routed (9112 section 3.2.2), a transfer coding other than ``chunked`` is 501
(9112 section 6.1), a second ``Host`` is 400 (9112 section 3.2), an expectation other than
``100-continue`` is 417 (9110 section 10.1.1), a major version other than 1 is 505 (9110
section 15.6.6). Each refusal is CONTRACT's JSON error and ends the connection (what
follows cannot be framed, or was not meant to be sent)."""

from __future__ import annotations

import orjson
import pytest

from tests.unit.test_http_server import MATCH, answers_on_one_connection, post, statuses

LAST = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def error_code(answer: bytes) -> str:
    return orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"]


@pytest.mark.parametrize("target", [b"http://mmcache.example/healthz", b"HTTP://h:8080/healthz?x=1",
                                    b"https://h/healthz"])
def test_an_absolute_form_target_is_routed_by_its_path(target):
    answer = answers_on_one_connection(b"GET %s HTTP/1.1\r\nHost: h\r\n\r\n" % target + LAST)
    assert statuses(answer) == [200, 200] and answer.count(b'{"status":"ok"}') == 2


def test_an_absolute_form_post_reads_its_body():
    raw = post("/v1/match", MATCH).replace(b"POST /v1/match", b"POST http://h/v1/match")
    answer = answers_on_one_connection(raw + LAST)
    assert statuses(answer) == [200, 200] and b'"request_items"' in answer


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"gzip", b"deflate,chunked", b"identity"])
def test_a_transfer_coding_other_than_chunked_is_501(coding):
    raw = (b"POST /v1/match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: %s\r\n\r\n2\r\n{}\r\n0\r\n\r\n" % coding) + LAST
    answer = answers_on_one_connection(raw)
    assert statuses(answer) == [501] and error_code(answer) == "not_implemented"
    assert b"Connection: close" in answer


def test_transfer_codings_over_two_header_lines_are_read_together():
    raw = (b"POST /v1/match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"2\r\n{}\r\n0\r\n\r\n") + LAST
    answer = answers_on_one_connection(raw)
    assert statuses(answer) == [501]


def test_chunked_is_still_read_whatever_its_case():
    raw = (b"POST /v1/match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
           % (len(MATCH), MATCH)) + LAST
    assert statuses(answers_on_one_connection(raw)) == [200, 200]


@pytest.mark.parametrize("hosts", [b"Host: a\r\nHost: b\r\n", b"Host: a\r\nhost: a\r\n"])
def test_a_second_host_is_400(hosts):
    answer = answers_on_one_connection(b"GET /healthz HTTP/1.1\r\n%s\r\n" % hosts + LAST)
    assert statuses(answer) == [400] and error_code(answer) == "bad_request" and b"Host" in answer


@pytest.mark.parametrize("expect", [b"gzip", b"100-continue-please", b"200-ok"])
def test_an_unknown_expectation_is_417_before_the_body_is_read(expect):
    raw = post("/v1/match", MATCH, b"Expect: " + expect) + LAST
    answer = answers_on_one_connection(raw)
    assert statuses(answer) == [417] and error_code(answer) == "expectation_failed"
    assert b"Connection: close" in answer


def test_100_continue_in_any_case_is_still_met():
    answer = answers_on_one_connection(post("/v1/match", MATCH, b"Expect: 100-Continue") + LAST)
    assert statuses(answer) == [100, 200, 200]


@pytest.mark.parametrize("version", [b"HTTP/2.0", b"HTTP/0.9"])
def test_a_major_version_other_than_1_is_505(version):
    answer = answers_on_one_connection(b"GET /healthz %s\r\nHost: x\r\n\r\n" % version + LAST)
    assert statuses(answer) == [505] and error_code(answer) == "http_version_not_supported"
    assert answer.startswith(b"HTTP/1.1 505 ")


def test_http_1_0_is_still_served():
    answer = answers_on_one_connection(b"GET /healthz HTTP/1.0\r\n\r\n")
    assert statuses(answer) == [200]
