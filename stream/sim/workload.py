"""Requests for the simulator: prompts with structure, drawn from a seed, or a recorded trace.

A prompt is a run of segments as the engine sees it (``stream.sim.engine.Segment``): a
system prompt every request shares, the user's text, and multimodal items, each item at
its position in the prompt. Two kinds of session arrive:

- *single-shot* requests about shared items (Zipf popularity over a catalogue: the
  product photo everyone asks about) or about a fresh item nobody sent before; the item
  comes right after the system prompt (``item_first_share``: the system prompt and the
  item then form a prefix other users can reuse) or after the user's own text (then only
  the processor and encoder caches can reuse it);
- *multi-turn conversations* about one fresh item of their own: each turn's prompt is the
  previous turns (the user's texts, the item, the answers) followed by new text, so the
  same item is sent again every turn at the same place.

Turns arrive open-loop: a turn comes ``think`` seconds (exponential) after the previous
turn arrived, whatever its answer's latency (an assumption: a closed loop would need the
fleet's latencies inside the workload).

Everything random is drawn here, once, from ``random.Random(seed)``, before any policy
runs: every policy then sees exactly the same requests (arrival times, prompts, output
lengths and the gateway replica each arrives at), so differences between policies are
the policies' alone.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from stream.core.items import Item
from stream.sim.engine import Segment
from stream.sim.processor import DEFAULT_BYTES_PER_EMBEDDING, processed_bytes

__all__ = ["Request", "SizeMix", "WorkloadSpec", "generate", "item_segment", "requests_from_trace"]


def item_segment(item: Item, bytes_per_embedding: Mapping[str, int] = DEFAULT_BYTES_PER_EMBEDDING) -> Segment:
    """An item in a prompt: one placeholder token per embedding (Qwen-VL's rule), its
    processed input weighed as the processor cache weighs it."""
    return Segment(item.hash, item.size, item.size, item.modality,
                   processed_bytes(item.size, item.modality, bytes_per_embedding))


@dataclass(frozen=True, slots=True)
class Request:
    """One request: when it arrives (seconds from the start), at which gateway replica,
    its prompt, its distinct items in prompt order (what the gateway extracts), and how
    many tokens it generates. ``conversation`` is -1 for a single-shot request."""

    id: int
    arrival: float
    replica: int
    items: tuple[Item, ...]
    segments: tuple[Segment, ...]
    output_tokens: int
    conversation: int = -1
    turn: int = 0

    @property
    def embeddings(self) -> int:
        """Encoder embeddings of all its items."""
        return sum(item.size for item in self.items)

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the whole prompt."""
        return sum(segment.tokens for segment in self.segments)


@dataclass(frozen=True, slots=True)
class SizeMix:
    """Item sizes in encoder embeddings: shares of small images (``small`` each), large
    images (uniform in ``large``) and video clips (uniform in ``video``); the rest of the
    share is small images. Defaults: a 512x512 image is ~256 embeddings for a
    14-pixel-patch ViT with 2x2 merging; a 1-2 megapixel image 1,200-2,500; a short clip
    several thousand."""

    small: int = 256
    large: tuple[int, int] = (1200, 2500)
    video: tuple[int, int] = (3000, 6000)
    large_share: float = 0.35
    video_share: float = 0.15

    def draw(self, rng: random.Random) -> tuple[int, str]:
        """One item's size and modality."""
        u = rng.random()
        if u < self.video_share:
            return rng.randint(*self.video), "video"
        if u < self.video_share + self.large_share:
            return rng.randint(*self.large), "image"
        return self.small, "image"


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A synthetic workload: Poisson session starts such that requests (turns included)
    arrive at ``rate`` per second in all, until ``requests`` requests.

    A session is a conversation with probability ``conversation_share`` (``turns`` turns,
    uniform, ``think_s`` mean seconds apart), else one single-shot request with
    ``min_items``..``max_items`` distinct items: fresh with probability ``fresh_share``,
    else drawn by Zipf popularity (exponent ``zipf``) from ``catalogue`` shared items.
    Prompts open with the ``system_tokens``-token system prompt; each user text is
    uniform in ``text_tokens``; each answer's length is geometric of mean
    ``output_tokens`` (and is the next turn's history). The first ``burst`` sessions
    all start at 0, as a benchmark client starting its users at once does. Replicas are
    chosen uniformly. An item's processed input weighs ``bytes_per_embedding`` of its
    modality per embedding (``stream.sim.processor.DEFAULT_BYTES_PER_EMBEDDING``).
    The defaults are assumptions (no public trace gives this mix); the guide's output
    rate, 6,390 tokens/s at 120 QPS, is ~53 tokens per request.
    """

    requests: int = 600
    rate: float = 40.0
    catalogue: int = 2000
    zipf: float = 1.0
    min_items: int = 1
    max_items: int = 2
    fresh_share: float = 0.3
    item_first_share: float = 0.5
    conversation_share: float = 0.3
    turns: tuple[int, int] = (2, 6)
    think_s: float = 5.0
    system_tokens: int = 1024
    text_tokens: tuple[int, int] = (20, 200)
    output_tokens: int = 64
    burst: int = 0
    replicas: int = 3
    sizes: SizeMix = SizeMix()
    bytes_per_embedding: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_BYTES_PER_EMBEDDING))
    seed: int = 1


_SYSTEM = "system"


def generate(spec: WorkloadSpec) -> list[Request]:
    """Draw the whole workload (deterministic for ``spec``, ``spec.seed`` included)."""
    if spec.min_items < 1 or spec.max_items < spec.min_items:
        raise ValueError("need 1 <= min_items <= max_items")
    if spec.max_items > spec.catalogue:
        raise ValueError("max_items exceeds the catalogue")
    if not 1 <= spec.turns[0] <= spec.turns[1]:
        raise ValueError("need 1 <= turns[0] <= turns[1]")
    rng = random.Random(spec.seed)
    catalogue = []
    for index in range(spec.catalogue):
        size, modality = spec.sizes.draw(rng)
        catalogue.append(Item(f"item-{index}", size, modality))
    cumulative = list(itertools.accumulate((rank + 1) ** -spec.zipf for rank in range(spec.catalogue)))
    total = cumulative[-1]
    mean_turns = (spec.turns[0] + spec.turns[1]) / 2
    session_rate = spec.rate / (1 - spec.conversation_share + spec.conversation_share * mean_turns)
    system = Segment(_SYSTEM, spec.system_tokens) if spec.system_tokens > 0 else None
    fresh = itertools.count()

    def fresh_item() -> Item:
        size, modality = spec.sizes.draw(rng)
        return Item(f"fresh-{next(fresh)}", size, modality)

    def text(key: str) -> Segment:
        return Segment(key, rng.randint(*spec.text_tokens))

    def answer() -> int:  # geometric, mean output_tokens, at least 1
        p = 1.0 / max(spec.output_tokens, 1)
        return 1 if p >= 1.0 else 1 + int(rng.expovariate(1.0) / -math.log1p(-p))

    drafts: list[tuple[float, int, tuple[Item, ...], tuple[Segment, ...], int, int, int]] = []
    # Sessions start in time order and every turn comes at or after its session's start,
    # so once ``requests`` drafted arrivals precede a new start, the first ``requests``
    # are final.
    # Sessions start from -warm-up, so that at 0 conversations are under way and requests
    # arrive at ``rate`` from the start; what arrives before 0 is dropped.
    upcoming: list[float] = []  # a heap of drafted arrivals not yet before a start
    settled = 0
    now = -spec.think_s * spec.turns[1] if spec.conversation_share > 0 else 0.0
    session = 0
    while True:
        start = 0.0 if session < spec.burst else now + rng.expovariate(session_rate)
        if session >= spec.burst:
            now = start
        while upcoming and upcoming[0] < now:
            settled += heapq.heappop(upcoming) >= 0
        if settled >= spec.requests:
            break
        head = (system,) if system is not None else ()
        if rng.random() < spec.conversation_share:
            item = fresh_item()
            history = head + (text(f"s{session}/t0"), item_segment(item, spec.bytes_per_embedding))
            at = start
            for turn in range(rng.randint(*spec.turns)):
                prompt = history + (text(f"s{session}/q{turn}"),)
                out = answer()
                drafts.append((at, rng.randrange(spec.replicas), (item,), prompt, out, session, turn))
                heapq.heappush(upcoming, at)
                history = prompt + (Segment(f"s{session}/a{turn}", out),)
                at += rng.expovariate(1.0 / spec.think_s)
        else:
            want = rng.randint(spec.min_items, spec.max_items)
            if rng.random() < spec.fresh_share:
                items = tuple(fresh_item() for _ in range(want))
            else:
                chosen: dict[int, None] = {}
                while len(chosen) < want:
                    chosen[bisect.bisect_left(cumulative, rng.random() * total)] = None
                items = tuple(catalogue[index] for index in chosen)
            media = tuple(item_segment(item, spec.bytes_per_embedding) for item in items)
            question = text(f"s{session}/q0")
            prompt = (head + media + (question,) if rng.random() < spec.item_first_share
                      else head + (question,) + media)
            drafts.append((start, rng.randrange(spec.replicas), items, prompt, answer(), -1, 0))
            heapq.heappush(upcoming, start)
        session += 1
    drafts = sorted((draft for draft in drafts if draft[0] >= 0), key=lambda draft: draft[0])
    return [Request(n, at, replica, items, prompt, out, conversation, turn)
            for n, (at, replica, items, prompt, out, conversation, turn)
            in enumerate(drafts[: spec.requests])]


def requests_from_trace(placements: Iterable[tuple[str | None, tuple[Item, ...], float | None]],
                        replicas: int, rate: float, spec: WorkloadSpec, seed: int) -> list[Request]:
    """Requests from recorded placements ``(request_id, items, timestamp_s)`` in log order.

    Consecutive placements with the same request id are one request (a placement to k
    endpoints is k events). Recorded timestamps give the arrival times (relative to the
    first); where there are none, arrivals are drawn as a Poisson process at ``rate``.
    The log holds no prompt: each is ``spec``'s system prompt, the items, then a user
    text of its own; replica and output length are drawn from ``seed``.
    """
    rng = random.Random(seed)
    requests: list[Request] = []
    previous: str | None = None
    start: float | None = None
    now = 0.0
    head = (Segment(_SYSTEM, spec.system_tokens),) if spec.system_tokens > 0 else ()
    for request_id, items, timestamp in placements:
        if request_id is not None and request_id == previous:
            continue
        previous = request_id
        if timestamp is not None:
            start = timestamp if start is None else start
            now = max(now, timestamp - start)
        else:
            now += rng.expovariate(rate)
        distinct = tuple({item.hash: item for item in items}.values())
        prompt = head + tuple(item_segment(item, spec.bytes_per_embedding) for item in distinct) + (
            Segment(f"trace/{len(requests)}", rng.randint(*spec.text_tokens)),)
        requests.append(Request(len(requests), now, rng.randrange(replicas), distinct, prompt,
                                1 + int(rng.expovariate(1.0 / max(spec.output_tokens, 1)))))
    return requests
