"""What the vLLM plugin's sender costs per batch (its thread's CPU, the GIL it holds in
vLLM's scheduler process, and its wall time), over one kept-alive connection
(``clients/vllm/mmcache_vllm/transport.py``) against the control: a new connection per
batch through ``urllib``, as the plugin sent before. Both POST the same batch (64 stored
items) to the same HTTP/1.1 server answering 202, over plain HTTP and over TLS, in
alternating runs; the server runs in a thread of its own, so the sender's thread CPU is its
own."""

from __future__ import annotations

import importlib.util
import json
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

from stream.bench.figures import Figure, span

__all__ = ["vllm_transport_figures"]

REPO = Path(__file__).resolve().parents[2]
ITEMS = 64


def _transport() -> ModuleType:
    """The plugin's transport module, loaded from its file (the plugin's package needs vLLM)."""
    path = REPO / "clients" / "vllm" / "mmcache_vllm" / "transport.py"
    spec = importlib.util.spec_from_file_location("mmcache_vllm_transport", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wbufsize = 1 << 16  # the answer in one write, as mmcache's server writes it

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(202)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


def _server(context: ssl.SSLContext | None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


def _body() -> bytes:
    items = [{"hash": f"{n:064x}", "size": 1024, "modality": "image"} for n in range(ITEMS)]
    return json.dumps({"endpoint": "ns/vllm-0", "engine": "vllm",
                       "events": [{"type": "stored", "items": items}]}, separators=(",", ":")).encode()


def _per_batch(post: Callable[[], int], batches: int) -> tuple[float, float]:
    """(thread CPU us, wall us) per batch of ``batches`` POSTs, each answered 202."""
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(batches):
        assert post() == 202
    return ((time.thread_time() - cpu) / batches * 1e6, (time.perf_counter() - wall) / batches * 1e6)


def _kept(transport: ModuleType, url: str, context: ssl.SSLContext | None) -> Callable[[], int]:
    connection = transport.EventsConnection(url, 3.0, context)
    body, headers = _body(), {"Content-Type": "application/json"}
    return lambda: int(connection.post(body, headers, 4096).status)


def _new_each_time(url: str, context: ssl.SSLContext | None) -> Callable[[], int]:
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))
    body, headers = _body(), {"Content-Type": "application/json"}

    def post() -> int:
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        with opener.open(request, timeout=3.0) as answer:
            answer.read(4096)
            return int(answer.status)

    return post


def vllm_transport_figures(runs: int, batches: int) -> list[Figure]:
    """Per scheme, the sender's CPU per batch on the kept connection, the control's beside."""
    transport = _transport()
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        serving.load_cert_chain(str(cert), str(key))
        for scheme, server_context in (("http", None), ("https", serving)):
            server = _server(server_context)
            client = ssl.create_default_context(cafile=str(cert)) if scheme == "https" else None
            url = f"{scheme}://127.0.0.1:{server.server_address[1]}/v1/engine-events"
            kept, control = [], []
            try:
                for _ in range(runs):  # alternating runs: the machine's drift is shared
                    kept.append(_per_batch(_kept(transport, url, client), batches))
                    control.append(_per_batch(_new_each_time(url, client), batches))
            finally:
                server.shutdown()
                server.server_close()
            cpu, control_cpu = (statistics.median(run[0] for run in side) for side in (kept, control))
            wall, control_wall = (statistics.median(run[1] for run in side) for side in (kept, control))
            figures.append(Figure(
                f"vllm_plugin_sender_cpu_per_batch_{scheme}", round(cpu, 1), "us/batch",
                "<= a new connection per batch", cpu <= control_cpu, round(control_cpu, 1),
                round(cpu / control_cpu, 3),
                f"the plugin's sender thread CPU per POST of {ITEMS} stored items to a local HTTP/1.1 "
                f"server answering 202 ({scheme}), over one kept-alive connection; control: a new "
                f"connection per POST through urllib, as before; median of {runs} alternating runs of "
                f"{batches} POSTs (kept {span([r[0] for r in kept], 1)}, control "
                f"{span([r[0] for r in control], 1)} us); wall per POST {wall:.0f} us against "
                f"{control_wall:.0f} us"))
    return figures
