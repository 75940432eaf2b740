"""The trace of the real-fleet bench, and the ``mmcache simulate`` command of it: pure, so
that the e2e environment (which runs the real fleet, ``tests/e2e/fleet.py``) and the
project's (which runs the simulator, ``stream.bench.fleet_real``) draw the same requests.

The requests are ``stream.sim.workload.generate``'s (a seeded mix of single-shot requests
about shared and fresh images and multi-turn conversations); each becomes a chat-completions
body (:func:`chat_body`): its text words drawn from the segment's key (one word is about one
token of the tiny model's tokenizer), its images PNGs of exactly the item's embeddings (28 x
28 pixels an embedding for Qwen2-VL), every other item with a ``uuid`` of its own, the rest
left for the gateway to name.
"""

from __future__ import annotations

import base64
import hashlib
import random
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from stream.sim.engine import Costs, Segment
from stream.sim.workload import Request, SizeMix, WorkloadSpec, generate

__all__ = ["CPU_COSTS", "FleetTrace", "chat_body", "png_data_url", "requests_of", "simulate_argv",
           "trace_digest"]

_WORDS = ("the", "of", "and", "a", "to", "is", "in", "it", "that", "for", "on", "as", "an", "are",
          "with", "by", "be", "not", "or", "its", "one", "from", "at", "each", "this", "what", "item",
          "cache", "request", "server", "image", "event", "log", "state", "time", "score")
_ANSWER = re.compile(r"/a\d+$")


@dataclass(frozen=True, slots=True)
class FleetTrace:
    """The trace and the fleet's shape: what both the real run and the simulator take.
    The fleet's shape is the e2e suite's vLLM (``tests/e2e/conftest.py``: max_num_seqs 4,
    max_num_batched_tokens 2048, which is also its encoder cache size in embeddings); the
    images (16 to 64 embeddings, most of them large) make a server's share of the distinct
    images overflow that cache under round-robin, and nearly fit it under affinity."""

    requests: int = 150
    rate: float = 2.0
    seed: int = 1
    catalogue: int = 80
    conversation_share: float = 0.3
    turns: tuple[int, int] = (2, 4)
    think_s: float = 4.0
    fresh_share: float = 0.3
    system_tokens: int = 300
    text_tokens: tuple[int, int] = (10, 60)
    output_tokens: int = 8
    sizes: SizeMix = SizeMix(small=16, large=(48, 64), video=(1, 1), large_share=0.8, video_share=0.0)
    servers: int = 2
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 2048
    scrape_s: float = 0.5

    def workload(self) -> WorkloadSpec:
        """The simulator's spec of this trace (one gateway replica)."""
        return WorkloadSpec(requests=self.requests, rate=self.rate, catalogue=self.catalogue,
                            conversation_share=self.conversation_share, turns=self.turns,
                            think_s=self.think_s,
                            fresh_share=self.fresh_share, system_tokens=self.system_tokens,
                            text_tokens=self.text_tokens, output_tokens=self.output_tokens, replicas=1,
                            sizes=self.sizes, seed=self.seed)


def _png(width: int, height: int, seed: bytes) -> bytes:
    """An RGB PNG whose pixels come from ``seed`` (distinct seeds, distinct images)."""
    pattern = hashlib.sha256(seed).digest() * 3  # 96 bytes: 32 pixels
    row = (pattern * (width * 3 // len(pattern) + 1))[: width * 3]
    raw = b"".join(b"\x00" + row[i % 3:] + row[: i % 3] for i in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b""))


def png_data_url(key: str, embeddings: int) -> str:
    """A ``data:`` URL of a PNG that Qwen2-VL encodes into exactly ``embeddings``
    embeddings (28 x 28 pixels each, at most 64: the tiny model's 224 x 224 cap)."""
    if not 1 <= embeddings <= 64:
        raise ValueError(f"an image of {embeddings} embeddings: 1 to 64")
    rows = max(d for d in range(1, int(embeddings ** 0.5) + 1) if embeddings % d == 0)
    data = _png(28 * (embeddings // rows), 28 * rows, key.encode())
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _text(segment: Segment) -> str:
    rng = random.Random(segment.key)
    return " ".join(rng.choice(_WORDS) for _ in range(segment.tokens))


def chat_body(request: Request, model: str) -> dict[str, Any]:
    """The chat-completions body of a simulated request: the system prompt, user text and
    images in prompt order, earlier answers as assistant messages; it generates exactly
    ``output_tokens`` tokens, streamed. Items whose number is even carry a ``uuid``."""
    messages: list[dict[str, Any]] = []
    user: list[dict[str, Any]] = []
    for segment in request.segments:
        if segment.embeddings:
            part: dict[str, Any] = {"type": "image_url",
                                    "image_url": {"url": png_data_url(segment.key, segment.embeddings)}}
            if int(segment.key.rsplit("-", 1)[1]) % 2 == 0:
                part["uuid"] = f"trace-{segment.key}"
            user.append(part)
        elif segment.key == "system":
            messages.append({"role": "system", "content": _text(segment)})
        elif _ANSWER.search(segment.key):
            if user:
                messages.append({"role": "user", "content": user})
                user = []
            messages.append({"role": "assistant", "content": _text(segment)})
        else:
            user.append({"type": "text", "text": _text(segment)})
    if user:
        messages.append({"role": "user", "content": user})
    return {"model": model, "messages": messages, "max_tokens": request.output_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True}


# The tiny model on one loaded CPU core: rough, and only the ratios between policies are
# read (the simulator's TTFT is not a measurement of this machine).
CPU_COSTS = Costs(preprocess_ms_per_item=20.0, encoder_ms_per_1k_embeddings=400.0,
                  prefill_ms_per_1k_tokens=200.0, decode_ms_per_step=15.0, step_overhead_ms=5.0)


def simulate_argv(trace: FleetTrace, kv_blocks: int, block_size: int, policies: Sequence[str]) -> list[str]:
    """The ``mmcache simulate`` arguments of this trace and fleet: the same requests (the
    workload's flags and seed, the rate), the servers' shape as they report it, the
    gateway's scrape interval, CPU costs (:data:`CPU_COSTS`)."""
    costs, sizes = CPU_COSTS, trace.sizes
    return ["simulate", "--servers", str(trace.servers), "--replicas", "1",
            "--requests", str(trace.requests),
            "--rate", f"{trace.rate:g}", "--seed", str(trace.seed), "--policies", ",".join(policies),
            "--max-num-seqs", str(trace.max_num_seqs),
            "--max-num-batched-tokens", str(trace.max_num_batched_tokens),
            "--encoder-cache-size", str(trace.max_num_batched_tokens),
            "--kv-blocks", str(kv_blocks), "--block-size", str(block_size),
            "--scrape-ms", f"{trace.scrape_s * 1000:g}",
            "--preprocess-ms", f"{costs.preprocess_ms_per_item:g}",
            "--encoder-ms-per-1k", f"{costs.encoder_ms_per_1k_embeddings:g}",
            "--prefill-ms-per-1k", f"{costs.prefill_ms_per_1k_tokens:g}",
            "--decode-ms", f"{costs.decode_ms_per_step:g}",
            "--step-overhead-ms", f"{costs.step_overhead_ms:g}",
            "--catalogue", str(trace.catalogue), "--conversation-share", f"{trace.conversation_share:g}",
            "--turns", f"{trace.turns[0]},{trace.turns[1]}", "--think-s", f"{trace.think_s:g}",
            "--fresh-share", f"{trace.fresh_share:g}", "--system-tokens", str(trace.system_tokens),
            "--text-tokens", f"{trace.text_tokens[0]},{trace.text_tokens[1]}",
            "--output-tokens", str(trace.output_tokens), "--small-embeddings", str(sizes.small),
            "--large-embeddings", f"{sizes.large[0]},{sizes.large[1]}",
            "--large-share", f"{sizes.large_share:g}",
            "--video-share", f"{sizes.video_share:g}", "--format", "json"]


def trace_digest(requests: Sequence[Request]) -> str:
    """A digest of the requests (arrivals, prompts, items, outputs): the two environments
    check they drew the same ones."""
    rows = [[r.id, r.arrival, r.output_tokens, [[s.key, s.tokens, s.embeddings] for s in r.segments]]
            for r in requests]
    return hashlib.sha256(orjson.dumps(rows)).hexdigest()


def requests_of(trace: FleetTrace) -> list[Request]:
    """The trace's requests."""
    return generate(trace.workload())
