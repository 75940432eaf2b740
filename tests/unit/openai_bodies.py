"""Request bodies exactly as the openai Python SDK sends them.

The SDK posts to a real HTTP server on 127.0.0.1 that records the one request it gets
and answers 400 (which the SDK raises, no retry); the body is the recorded JSON. No
model server, no mock of the SDK's own transport: whatever the SDK adds, drops or
reorders is in the body the tests feed to extraction.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import openai

__all__ = ["sdk_body"]

_ANSWER = b'{"error": {"message": "recorded by the test", "type": "invalid_request_error"}}'


def sdk_body(call: Callable[[openai.OpenAI], Any]) -> tuple[str, dict[str, Any]]:
    """``(path, body)`` of the request that ``call(client)`` made, e.g.
    ``("/v1/responses", {"model": ..., "input": [...]})``."""
    recorded: list[tuple[str, dict[str, Any]]] = []

    class Recorder(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            recorded.append((self.path, json.loads(raw)))
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(_ANSWER)))
            self.end_headers()
            self.wfile.write(_ANSWER)

        def log_message(self, *args: Any) -> None:
            pass

    with HTTPServer(("127.0.0.1", 0), Recorder) as server:
        server.timeout = 10  # handle_request gives up after this if the SDK never connects
        serving = threading.Thread(target=server.handle_request, daemon=True)
        serving.start()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="x",
                               max_retries=0, timeout=10)
        try:
            call(client)
        except openai.BadRequestError:
            pass
        finally:
            client.close()
        serving.join(timeout=10)
    assert len(recorded) == 1, f"the SDK sent {len(recorded)} requests"
    return recorded[0]
