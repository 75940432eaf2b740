"""Issue 8 against a real `serve`: bearer tokens and HTTPS on the real HTTP port, and
writes to a frozen (SIGSTOP) broker answering 503 within produce_timeout_s.

The frozen broker is this test's own ``EmbeddedBroker``, never the session's."""

from __future__ import annotations

import http.client as http_client
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest

from stream.kafka.embedded import EmbeddedBroker
from tests.integration.conftest import Service, eventually, http

pytestmark = pytest.mark.integration

TOKEN = "it-token-" + uuid.uuid4().hex
PLACEMENT = {"endpoints": ["ns/a"], "items": [{"hash": "h1", "size": 1, "modality": "image"}]}


def request(url: str, method: str = "GET", body=None, token: str | None = None,
            context: ssl.SSLContext | None = None) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def self_signed(tmp_path) -> tuple[str, str]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return str(cert), str(key)


@pytest.mark.skipif(not any(os.access(os.path.join(p, "openssl"), os.X_OK)
                            for p in os.environ.get("PATH", "").split(os.pathsep)), reason="needs openssl")
def test_https_with_bearer_tokens(bootstrap, tmp_path):
    cert, key = self_signed(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# writers\n{TOKEN}\n")
    service = Service(bootstrap, tmp_path / "data", f"it-{uuid.uuid4().hex[:10]}", [],
                      {"MMCACHE_TLS_CERT": cert, "MMCACHE_TLS_KEY": key,
                       "MMCACHE_AUTH_TOKEN_FILE": str(tokens)})
    service.start(wait_ready=False)
    base = f"https://127.0.0.1:{service.port}"
    trusted = ssl.create_default_context(cafile=cert)
    try:
        def ready() -> bool:
            assert service.process.poll() is None, service.tail()
            try:
                return request(base + "/readyz", context=trusted)[0] == 200
            except OSError:
                return False

        eventually(ready, timeout=60, interval=0.2)
        # probes are open, the state needs the token
        assert request(base + "/healthz", context=trusted)[0] == 200
        status, body, headers = request(base + "/v1/state?limit=0", context=trusted)
        assert (status, body["error"]["code"]) == (401, "unauthorized")
        assert headers["WWW-Authenticate"].startswith("Bearer")
        digest = request(base + "/v1/state?limit=0", token=TOKEN, context=trusted)[1]["digest"]
        # a stranger's sync and placement change nothing
        for path, body in [("/v1/endpoint-events", {"type": "sync", "live": ["x"]}), ("/v1/placements", PLACEMENT)]:
            status, answer, _ = request(base + path, "POST", body, token="not-" + TOKEN, context=trusted)
            assert (status, answer["error"]["code"]) == (401, "unauthorized")
            assert TOKEN not in json.dumps(answer)
        # with the token the write is taken and applied
        assert request(base + "/v1/placements", "POST", PLACEMENT, token=TOKEN, context=trusted)[:2] == (202, {"events": 1})
        eventually(lambda: request(base + "/v1/state?limit=0", token=TOKEN, context=trusted)[1]["digest"] != digest)
        state = request(base + "/v1/state", token=TOKEN, context=trusted)[1]
        assert state["endpoints"] == [{"endpoint": "ns/a", "items": 1, "weight": 1}]
        # an untrusted client refuses the certificate, plain HTTP gets no answer
        with pytest.raises(urllib.error.URLError):
            request(base + "/healthz")
        with pytest.raises((OSError, http_client.HTTPException)):
            http("GET", f"http://127.0.0.1:{service.port}/healthz")
        log = service.log_path.read_text()
        assert "auth for writes and /v1/state: on (1 tokens)" in log and TOKEN not in log
    finally:
        service.stop()


def test_writes_to_a_frozen_broker_get_503_within_the_produce_timeout(tmp_path):
    broker = EmbeddedBroker(log_file=tmp_path / "tansu.log").start()
    pid = broker._process.pid  # this test's own broker
    service = Service(broker.bootstrap_servers, tmp_path / "data", f"it-{uuid.uuid4().hex[:10]}", [],
                      {"MMCACHE_PRODUCE_TIMEOUT_S": "1"})
    frozen = False
    try:
        service.start()
        assert service.post("/v1/placements", PLACEMENT) == (202, {"events": 1})
        os.kill(pid, signal.SIGSTOP)
        frozen = True
        timings = []
        for body, path in [(PLACEMENT, "/v1/placements"),
                           ({"type": "sync", "live": ["ns/a"]}, "/v1/endpoint-events"),
                           ({"type": "deleted", "endpoint": "ns/a"}, "/v1/endpoint-events")]:
            started = time.monotonic()
            status, answer = service.post(path, body)
            timings.append(time.monotonic() - started)
            assert status == 503, (path, answer)
            assert answer["error"]["code"] == "log_unavailable"
            assert "may still be written" in answer["error"]["message"]
        print(f"503 after {', '.join(f'{t:.2f}' for t in timings)} s with the broker frozen")
        assert max(timings) < 1.0 + 2.0, timings  # produce_timeout_s + margin (was 10 s)
        assert service.get("/healthz")[0] == 200
        os.kill(pid, signal.SIGCONT)
        frozen = False
        eventually(lambda: service.post("/v1/placements", PLACEMENT)[0] == 202, timeout=20, interval=0.5)
    finally:
        if frozen:
            os.kill(pid, signal.SIGCONT)
        if service.process is not None:
            service.stop(signal.SIGKILL)
        broker.stop()
