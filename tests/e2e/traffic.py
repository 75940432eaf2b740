"""Seeded chat traffic for the real vLLM of the e2e suite: requests with ``data:`` URL
images (each seed its own PNG), 4 at a time."""

from __future__ import annotations

import base64
import io
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from PIL import Image

from tests.e2e.conftest import Vllm, http

__all__ = ["chat", "image_url", "traffic"]

SIDES = [28 * k for k in range(2, 9)]  # 56 to 224: k x m embeddings for a (28k, 28m) image


def image_url(seed: int) -> str:
    """A PNG of its own for each seed (the same seed, the same bytes)."""
    rng = random.Random(seed)
    image = Image.new("RGB", (rng.choice(SIDES), rng.choice(SIDES)), tuple(rng.randrange(256) for _ in range(3)))
    image.putpixel((0, 0), (seed % 256, seed // 256 % 256, 7))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def chat(vllm: Vllm, images: list[int], uuids: bool = True) -> dict[str, Any]:
    """One chat completion of 2 tokens about ``images`` (by seed), each part with the
    ``uuid`` ``img-<seed>`` unless ``uuids`` is false."""
    parts: list[dict[str, Any]] = []
    for seed in images:
        part: dict[str, Any] = {"type": "image_url", "image_url": {"url": image_url(seed)}}
        if uuids:
            part["uuid"] = f"img-{seed}"
        parts.append(part)
    parts.append({"type": "text", "text": "what is in the pictures?"})
    status, answer = http("POST", vllm.url + "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 2, "temperature": 0})
    assert status == 200, answer
    return answer


def traffic(vllm: Vllm, seed: int, requests: int, pool: int, concurrency: int = 4) -> None:
    """``requests`` chats of 1 to 3 images drawn from ``pool`` distinct ones."""
    rng = random.Random(seed)
    batches = [[rng.randrange(pool) + seed * 10_000 for _ in range(rng.randint(1, 3))] for _ in range(requests)]
    with ThreadPoolExecutor(concurrency) as workers:
        list(workers.map(lambda images: chat(vllm, images), batches))
