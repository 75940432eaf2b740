"""aiohttp's answer to a request it cannot parse, without the request in it.

aiohttp 3 answers a request its parser refuses (a header over 8,190 bytes, a malformed
request line, a character a header may not hold, a bad chunk size...) from
``RequestHandler.handle_error``, which logs ``ERROR aiohttp.server`` with the parser's
exception and answers a text/plain 400 with that exception's text: both hold the bytes
the parser refused, so an ``Authorization`` header's token was in the log and in the
answer. For the applications given ``handler_args()`` (the HTTP API's), this module
answers CONTRACT's JSON error instead, naming what was wrong by the exception's class
only, and logs one line without the request; servers of other applications keep
aiohttp's behaviour.

Every aiohttp name this relies on beyond its documented API is here, checked by
``install`` against the installed release: ``RequestHandler.handle_error`` (replaced on the
class, the original kept for other applications, its parameters checked), the handler's
``logger`` (the ``logger`` handler argument, which marks a guarded server) and
``max_field_size``, and the request's ``writer.output_size``.
"""

from __future__ import annotations

import inspect
import logging
import sys
from http import HTTPStatus
from typing import Any

import aiohttp
import orjson
from aiohttp import http_exceptions, web, web_protocol

__all__ = ["PINNED", "describe", "handler_args", "install"]

log = logging.getLogger(__name__)

#: The aiohttp releases whose ``RequestHandler.handle_error`` this module replaces (the
#: pin of pyproject.toml); re-read ``aiohttp/web_protocol.py`` before widening it.
PINNED = (3, 9), (4, 0)
_PARAMETERS = ("self", "request", "status", "exc", "message")

_original = web_protocol.RequestHandler.handle_error


class _RequestLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger for a guarded application: its own messages, without the
    text of any exception (a parser's holds the bytes it refused); also the mark that
    tells the replaced ``handle_error`` which servers are guarded."""

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None,
            **kwargs: Any) -> None:
        if exc_info:
            error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
            msg = f"{msg} ({type(error).__name__}; its text is not logged)"
        kwargs.pop("stack_info", None)
        self.logger.log(level, msg, *args, **kwargs)


_LOGGER = _RequestLogger(logging.getLogger("stream.http.server"), {})


def handler_args() -> dict[str, Any]:
    """What ``web.Application(handler_args=...)`` takes to be guarded (``install`` first)."""
    return {"logger": _LOGGER}


def install() -> None:
    """Replace ``RequestHandler.handle_error`` once, after checking the aiohttp release."""
    version = tuple(int(part) for part in aiohttp.__version__.split(".")[:2])
    low, high = PINNED
    if not low <= version < high:
        raise RuntimeError(f"stream.http.aiohttp_guard replaces RequestHandler.handle_error of aiohttp "
                           f">={low[0]}.{low[1]},<{high[0]}; installed: aiohttp {aiohttp.__version__}. "
                           "Install a release in that range, or re-read aiohttp/web_protocol.py")
    handler = web_protocol.RequestHandler
    if handler.handle_error is _handle_error:
        return
    parameters = tuple(inspect.signature(_original).parameters)
    if parameters != _PARAMETERS:
        raise RuntimeError(f"aiohttp {aiohttp.__version__}: RequestHandler.handle_error takes "
                           f"{parameters}, not {_PARAMETERS}: re-read aiohttp/web_protocol.py")
    handler.handle_error = _handle_error  # type: ignore[method-assign]


# What was wrong, by the parser's exception class, most specific first: never its text.
_WHAT = (
    (http_exceptions.LineTooLong, "a request line or header is over {limit} bytes"),
    (http_exceptions.BadHttpMethod, "the request line has no valid method"),
    (http_exceptions.BadStatusLine, "the request line is malformed"),
    (http_exceptions.InvalidURLError, "the URL is malformed"),
    (http_exceptions.InvalidHeader, "a header is malformed"),
    (http_exceptions.PayloadEncodingError, "the body's framing or encoding is malformed"),
    (http_exceptions.HttpProcessingError, "the request is malformed"),
)


def describe(exc: BaseException | None, limit: int = 8190) -> str:
    """What was wrong with a request aiohttp refused, without anything it held."""
    for kind, what in _WHAT:
        if isinstance(exc, kind):
            return what.format(limit=limit)
    return "the request could not be handled"


def _handle_error(self: web_protocol.RequestHandler, request: web.BaseRequest, status: int = 500,
                  exc: BaseException | None = None, message: str | None = None) -> web.StreamResponse:
    """Aiohttp's ``handle_error`` for guarded servers: the same status, a JSON body
    naming the exception's class, one log line; for others, aiohttp's own."""
    logger = self.logger
    if logger is not _LOGGER:
        return _original(self, request, status, exc, message)
    kind = type(exc).__name__ if exc is not None else "no exception"
    if status >= 500:
        log.error("answered %d to a request from %s: %s (its text is not logged)", status,
                  request.remote, kind)
        text = "the request failed inside the service; nothing was written"
    else:
        log.warning("refused a malformed HTTP request from %s with %d: %s (the request is not "
                    "logged)", request.remote, status, kind)
        text = f"{describe(exc, getattr(self, 'max_field_size', 8190))} ({kind}); nothing was read"
    if request.writer.output_size > 0:  # as aiohttp: an answer was begun, the connection is lost
        raise ConnectionError("Response is sent already, cannot send another response "
                              "with the error message")
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "error"
    body = {"error": {"code": phrase.lower().replace(" ", "_"), "message": text}}
    response = web.Response(status=status, body=orjson.dumps(body), content_type="application/json")
    response.force_close()
    return response
