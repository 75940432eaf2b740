"""One model server as vLLM v1 runs it: the scheduler's steps and its three caches.

The scheduler (``Scheduler``) follows ``schedule()`` and ``update_from_output()`` of
vLLM's ``vllm/v1/core/sched/scheduler.py`` with its defaults (FCFS, chunked prefill on,
no speculative decoding, no KV connector, decoder-only model). Each step:

1. A token budget of ``max_num_batched_tokens`` and an encoder compute budget of
   ``encoder_compute_budget`` embeddings.
2. The running requests first, in order: each gets the tokens it has left (one when
   decoding), up to the budget left. A request whose KV blocks cannot be had preempts the
   last running request (its blocks and encoder references dropped, its computed tokens
   reset, back to the head of the waiting queue) until it fits or is itself preempted.
3. Then, unless a request was preempted, the waiting requests in FCFS order while
   fewer than ``max_num_seqs`` run: a new request first takes its prefix-cache hit
   (whole leading blocks, never its last token), so the items inside the hit are never
   encoded. A request that can get no token this step is skipped (put back in order at
   the head afterwards) and the next one is tried; one whose KV blocks cannot be had
   stops the loop, and so does one whose whole sequence would not fit in the free blocks
   (``scheduler_reserve_full_isl``, on by default: admission reserves the whole prompt,
   not its first chunk). vLLM also skips a preempted request while output of a step
   scheduled before its preemption is in flight; with a batch queue of at most 2 that
   output is always back before the next ``schedule()`` (preemption stops the waiting
   loop of its own step), so the rule never binds here and is left out.
4. Encoder inputs are scheduled item by item inside the request's token window
   ``[computed, computed + new)`` (``schedule_encoder_inputs``, after
   ``_try_schedule_encoder_inputs``): an item already resident is referenced (a hit),
   one already scheduled by the same request in this step is a duplicate, else it must
   fit the encoder cache and the compute budget left. The first item that does not fit
   ends the window at its start; a request already past that start (a prefix hit ended
   inside the item) gets no token this step.
5. After the step, each request's inputs wholly inside its computed tokens are freed; a
   request that has computed all its tokens samples one; the first is its first token
   (with async scheduling the full blocks of its known tokens are cached then, as
   ``AsyncScheduler`` does); a request with all its output tokens finishes and frees its
   blocks and references.

``tests/e2e/test_scheduler_differential.py`` drives this class and vLLM 0.33.0's own
``Scheduler`` step by step on the same seeded traces (``stream/bench/scheduler_differential.py``):
every step agrees.

``Engine`` puts time around it: the processor cache at arrival (each missed item costs
``preprocess_ms_per_item`` of the server's one preprocessing lane before the request
can be scheduled), and a step's duration from ``Costs``. Times are seconds; costs are
milliseconds, as named.

With ``async_scheduling`` (vLLM's default) two steps are queued: the next is planned
while the current one runs, before its results are in (``Engine``); tokens in flight
are placeholders, as in vLLM's ``AsyncScheduler``.

What is left out on purpose: speculative decoding, KV connectors, LoRA, priorities,
pipeline parallelism, ``long_prefill_token_threshold`` (0 by default),
``max_model_len`` (a request the KV cache cannot hold is refused at ``submit``), the KV
watermark (0 by default), sub-block prefix hits (vLLM has them for Mamba layers only),
the check that one identifier always has one size, and stop strings or EOS (a request
generates exactly ``output_tokens``). An item's placeholder tokens that carry no
embedding are taken to be its last ones (vLLM marks them with ``is_embed``). The
processor cache is one LRU per server (vLLM mirrors it in the front end and the engine
core, in step); a request whose items all hit does not wait for the preprocessing lane.

Pure and deterministic: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

from stream.sim.encoder import EncoderCache
from stream.sim.prefix import DEFAULT_BLOCK_SIZE, BlockPool, PrefixCache, Run, chain_hashes
from stream.sim.processor import DEFAULT_PROCESSOR_CACHE_BYTES, ProcessorCache

__all__ = [
    "Costs",
    "EncoderCacheOps",
    "Engine",
    "EngineConfig",
    "LayerCounts",
    "PromptRequest",
    "Scheduler",
    "Segment",
    "StepPlan",
    "schedule_encoder_inputs",
]


@dataclass(frozen=True, slots=True)
class Segment:
    """One run of prompt tokens: text (equal keys = equal tokens) or one multimodal item."""

    key: str              # text: a content id; item: the item's hash (vLLM's mm identifier)
    tokens: int           # prompt tokens it occupies (an item: its placeholder tokens)
    embeddings: int = 0   # item only: encoder embeddings it needs (0 = text)
    modality: str = ""    # item only
    nbytes: int = 0       # item only: bytes of its processed input (the processor cache counts these)


@dataclass(frozen=True, slots=True)
class PromptRequest:
    """A request: its prompt as segments in order, and how many tokens it generates."""

    request_id: str
    segments: tuple[Segment, ...]
    output_tokens: int = 1


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One server's settings; each default is vLLM's (0.33.0), from the file named.

    - ``max_num_batched_tokens`` 8192 and ``max_num_seqs`` 1024: what ``vllm serve``
      picks on GPUs of 70 GiB or more other than the A100 (H100, H200):
      ``EngineArgs.get_batch_defaults`` in ``vllm/engine/arg_utils.py`` (2048 and 256 on
      smaller GPUs; the bare ``SchedulerConfig`` defaults in ``vllm/config/scheduler.py``
      are 2048 and 128, "mainly for convenience when testing").
    - ``encoder_cache_size`` and ``encoder_compute_budget`` (embeddings): both equal
      ``max_num_batched_tokens`` (``SchedulerConfig.__post_init__``,
      ``vllm/config/scheduler.py``), raised to the model's largest item
      (``compute_mm_encoder_budget``, ``vllm/v1/core/encoder_cache_manager.py``).
    - ``processor_cache_bytes``: ``mm_processor_cache_gb`` = 4 GiB
      (``vllm/config/multimodal.py``).
    - ``kv_blocks``: vLLM sizes it from free GPU memory (``gpu_memory_utilization`` 0.9,
      ``vllm/config/cache.py``), so it has no fixed default; 56,000 blocks (~900k tokens)
      is what Qwen2.5-VL-7B leaves on one 80 GB GPU (57,344 bytes of KV per token).
    - ``block_size`` 16 and ``enable_prefix_caching`` True: ``CacheConfig``,
      ``vllm/config/cache.py``.
    - ``async_scheduling`` True: ``VllmConfig`` turns it on where nothing forbids it
      (``vllm/config/vllm.py``; ``SchedulerConfig.async_scheduling`` is None, "auto", in
      ``vllm/config/scheduler.py``), and the engine core then keeps a batch queue of 2
      (``step_with_batch_queue``, ``vllm/v1/engine/core.py``).
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    encoder_cache_size: int = 8192
    encoder_compute_budget: int = 8192
    processor_cache_bytes: int = DEFAULT_PROCESSOR_CACHE_BYTES
    kv_blocks: int = 56_000
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "encoder_cache_size",
                     "encoder_compute_budget", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.kv_blocks < 2:
            raise ValueError(f"kv_blocks must be at least 2 (one is vLLM's null block), not {self.kv_blocks}")
        if self.processor_cache_bytes < 0:
            raise ValueError("processor_cache_bytes must be 0 (no cache) or more")


@dataclass(frozen=True, slots=True)
class Costs:
    """What each unit of work takes, in milliseconds."""

    preprocess_ms_per_item: float        # CPU, on a processor-cache miss, before the request can be scheduled
    encoder_ms_per_1k_embeddings: float  # GPU, per step, for the items encoded in it
    prefill_ms_per_1k_tokens: float      # GPU, per step, for the prompt tokens computed in it
    decode_ms_per_step: float
    step_overhead_ms: float


@dataclass(slots=True)
class LayerCounts:
    """Lookups and hits of one cache layer."""

    lookups: int = 0   # items (processor, encoder) or blocks (prefix) looked up
    hits: int = 0


class EncoderCacheOps(Protocol):
    """The encoder-cache operations the scheduler makes, one item at a time.
    ``stream.sim.encoder.EncoderCache`` has them; so does vLLM's
    ``EncoderCacheManager`` behind the differential test's adapter."""

    def resident(self, digest: str) -> int | None:
        """The embeddings of the resident entry, or None."""

    def lookup(self, request_id: Hashable, input_id: int, digest: str) -> bool:
        """Whether the item is resident; if so the input references it."""

    def can_allocate(self, request_id: Hashable, input_id: int, embeddings: int,
                     compute_budget: int, scheduled: int = 0) -> bool:
        """Whether an input fits this step, evicting freeable entries to make it fit."""

    def allocate(self, request_id: Hashable, input_id: int, digest: str, embeddings: int) -> None:
        """Store the input (``can_allocate`` made the room)."""

    def cached_inputs(self, request_id: Hashable) -> tuple[int, ...]:
        """The request's inputs holding a reference, in the order they are freed in."""

    def free_input(self, request_id: Hashable, input_id: int) -> None:
        """Drop the input's reference."""

    def free_request(self, request_id: Hashable) -> None:
        """Drop all the request's references."""

    def take_freed(self) -> list[str]:
        """The hashes evicted in this step, reported once."""


@dataclass(frozen=True, slots=True)
class _Item:
    """A multimodal item of a request: where its placeholder tokens lie."""

    key: str
    offset: int
    tokens: int
    embeddings: int

    def embeddings_within(self, start: int, end: int) -> int:
        """Embeddings of placeholder positions ``[start, end)`` (relative to the item),
        the embedding positions being its first ``embeddings`` ones."""
        return max(0, min(end, self.embeddings) - min(start, self.embeddings))


@dataclass(slots=True)
class _Request:
    """A request as the scheduler tracks it."""

    request_id: str
    items: tuple[_Item, ...]
    runs: list[Run]
    prompt_tokens: int
    output_tokens: int
    outputs: int = 0
    computed: int = 0
    placeholders: int = 0  # tokens of steps in flight not known yet (async scheduling)
    preemptions: int = 0
    hashes: list[int] = field(default_factory=list)
    resolved: set[int] = field(default_factory=set)  # inputs counted as encoder lookups

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.outputs


def schedule_encoder_inputs(cache: EncoderCacheOps, request: _Request, computed: int,
                            new_tokens: int, compute_budget: int,
                            ) -> tuple[list[int], int, int, list[int], list[int]]:
    """The encoder inputs of ``request`` to run this step for the token window
    ``[computed, computed + new_tokens)``: returns the inputs to encode, the tokens the
    request may take, the compute budget left, the inputs that repeat an item this
    request already encodes in this step, and the inputs found resident (referenced as
    they are found, whether or not the request then runs)."""
    items = request.items
    if new_tokens == 0 or not items:
        return [], new_tokens, compute_budget, [], []
    end = computed + new_tokens
    to_encode: list[int] = []
    repeats: list[int] = []
    hits: list[int] = []
    scheduled: set[str] = set()
    scheduled_embeddings = 0
    for input_id, item in enumerate(items):
        if item.offset + item.tokens <= computed:
            continue
        if item.offset >= end:
            break
        if item.key in scheduled:
            repeats.append(input_id)
            continue
        if cache.lookup(request.request_id, input_id, item.key):
            hits.append(input_id)
            continue
        if not cache.can_allocate(request.request_id, input_id, item.embeddings,
                                  compute_budget, scheduled_embeddings):
            new_tokens = min(new_tokens, item.offset - computed) if computed < item.offset else 0
            break
        if item.embeddings_within(max(0, computed - item.offset), min(item.tokens, end - item.offset)) == 0:
            continue
        scheduled_embeddings += item.embeddings
        compute_budget -= item.embeddings
        scheduled.add(item.key)
        to_encode.append(input_id)
    return to_encode, new_tokens, compute_budget, repeats, hits


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step runs: tokens per request, the inputs encoded, the work by kind, the
    hashes the encoder cache evicted while scheduling it, the requests preempted, and
    those that sample a token in it (with how often each had been preempted then)."""

    tokens: dict[str, int]
    encoded: dict[str, list[int]]
    prefill_tokens: int
    decode_tokens: int
    embeddings: int
    freed: list[str]
    preempted: tuple[str, ...]
    samples: tuple[tuple[str, int], ...] = ()


class Scheduler:
    """vLLM v1's scheduler over one encoder cache (any ``EncoderCacheOps``) and one
    prefix cache; no time. ``add`` a request, ``schedule`` a step, ``update`` after it."""

    def __init__(self, config: EngineConfig, encoder: EncoderCacheOps,
                 prefix: PrefixCache | None = None) -> None:
        self.config = config
        self.encoder = encoder
        self.prefix = prefix if prefix is not None else PrefixCache(
            BlockPool(config.kv_blocks, config.enable_prefix_caching),
            config.block_size, config.enable_prefix_caching)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}
        self.encoder_counts = LayerCounts()
        self.prefix_counts = LayerCounts()

    def add(self, request: PromptRequest) -> None:
        """A request enters the waiting queue (its inputs already preprocessed)."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} is already in the engine")
        state = _as_request(request, self.config)
        state.hashes = chain_hashes(state.runs, self.config.block_size, state.prompt_tokens)
        self.requests[state.request_id] = state
        self.waiting.append(state)

    def schedule(self) -> StepPlan:
        """Plan one step, as ``Scheduler.schedule()`` does."""
        config, encoder, prefix = self.config, self.encoder, self.prefix
        token_budget = config.max_num_batched_tokens
        compute_budget = config.encoder_compute_budget
        tokens: dict[str, int] = {}
        encoded: dict[str, list[int]] = {}
        preempted: list[_Request] = []
        prefill = decode = embeddings = 0

        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            if (request.placeholders > 0 and request.computed + 2 - request.placeholders
                    >= request.prompt_tokens + request.output_tokens):
                index += 1  # its last token is in flight: no extra step
                continue
            new = min(request.num_tokens + request.placeholders - request.computed, token_budget)
            to_encode, new, budget_left, repeats, hits = schedule_encoder_inputs(
                encoder, request, request.computed, new, compute_budget)
            if new == 0:
                index += 1
                continue
            while True:
                fits = prefix.allocate(request.request_id, request.computed + new,
                                       min(request.computed + new, request.num_tokens), request.hashes)
                if fits:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if not fits:
                break
            tokens[request.request_id] = new
            token_budget -= new
            index += 1
            if to_encode:
                encoded[request.request_id] = to_encode
                compute_budget = budget_left
            embeddings += self._allocate_inputs(request, to_encode, repeats, hits)
            if _decoding(request, request.computed, new):
                decode += new
            else:
                prefill += new

        if not preempted:
            skipped: list[_Request] = []
            while token_budget > 0 and self.waiting:
                if len(self.running) >= config.max_num_seqs:
                    break
                request = self.waiting[0]
                hit: list[Hashable] = []
                computed = request.computed
                if computed == 0:
                    hit = prefix.longest_hit(request.hashes, request.num_tokens)
                    computed = len(hit) * config.block_size
                new = min(request.num_tokens - computed, token_budget)
                to_encode, new, budget_left, repeats, hits = schedule_encoder_inputs(
                    encoder, request, computed, new, compute_budget)
                if new == 0:
                    skipped.append(self.waiting.popleft())
                    continue
                if not prefix.allocate(request.request_id, computed + new,
                                       min(computed + new, request.num_tokens), request.hashes, hit,
                                       whole_tokens=request.num_tokens):
                    if request.items:
                        encoder.free_request(request.request_id)
                    break
                if prefix.enable_caching:
                    self.prefix_counts.lookups += (request.num_tokens - 1) // config.block_size
                    self.prefix_counts.hits += len(hit)
                self.waiting.popleft()
                self.running.append(request)
                request.computed = computed
                tokens[request.request_id] = new
                token_budget -= new
                if to_encode:
                    encoded[request.request_id] = to_encode
                    compute_budget = budget_left
                embeddings += self._allocate_inputs(request, to_encode, repeats, hits)
                if _decoding(request, computed, new):
                    decode += new
                else:
                    prefill += new
            self.waiting.extendleft(reversed(skipped))

        samples = []
        for request_id, new in tokens.items():
            request = self.requests[request_id]
            request.computed += new
            if request.computed >= request.num_tokens + request.placeholders:  # not a prefill chunk
                samples.append((request_id, request.preemptions))
                if config.async_scheduling:
                    request.placeholders += 1
        return StepPlan(tokens, encoded, prefill, decode, embeddings, encoder.take_freed(),
                        tuple(r.request_id for r in preempted), tuple(samples))

    def update(self, plan: StepPlan) -> tuple[list[str], list[str]]:
        """After the step ran, request by request in the step's order: frees the inputs
        now inside its computed tokens (less those in flight), appends the token it
        sampled, if any, and frees a request that has all its output tokens; returns the
        requests that got their first token and those that finished.

        A request preempted since the step was scheduled still gets the step's token
        (vLLM delivers such stale output) but its reset counters are left alone."""
        first: list[str] = []
        finished: list[str] = []
        encoder, block_size = self.encoder, self.config.block_size
        sampled = dict(plan.samples)
        for request_id in plan.tokens:
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished meanwhile
            stale = sampled.get(request_id, request.preemptions) != request.preemptions
            for input_id in encoder.cached_inputs(request_id):
                item = request.items[input_id]
                if item.offset + item.tokens <= request.computed - request.placeholders:
                    encoder.free_input(request_id, input_id)
            if request_id not in sampled:
                continue  # a prefill chunk: no token sampled
            request.outputs += 1
            if request.placeholders > 0 and not stale:
                request.placeholders -= 1
            if request.outputs == 1:
                first.append(request_id)
            _grow_output(request)
            if request.num_tokens % block_size == 0:
                request.hashes = chain_hashes(request.runs, block_size, request.num_tokens, request.hashes)
            if self.config.async_scheduling and not stale:
                # the blocks its known tokens now fill are cached before any later step
                self.prefix.cache(request_id, request.computed - request.placeholders, request.hashes)
            if request.outputs >= request.output_tokens:
                finished.append(request_id)
                encoder.free_request(request_id)
                self.prefix.free(request_id)
                del self.requests[request_id]
        if finished:
            done = set(finished)
            self.running = [r for r in self.running if r.request_id not in done]
            if any(r.request_id in done for r in self.waiting):
                self.waiting = deque(r for r in self.waiting if r.request_id not in done)
        return first, finished

    def _allocate_inputs(self, request: _Request, to_encode: list[int], repeats: list[int],
                         hits: list[int]) -> int:
        """Store the inputs scheduled for encoding, then reference the repeats; count the
        request's encoder lookups (each input once until it is preempted)."""
        embeddings = 0
        for input_id in to_encode:
            item = request.items[input_id]
            self.encoder.allocate(request.request_id, input_id, item.key, item.embeddings)
            embeddings += item.embeddings
        for input_id in repeats:
            self.encoder.lookup(request.request_id, input_id, request.items[input_id].key)
        counts, resolved = self.encoder_counts, request.resolved
        for hit, input_ids in ((False, to_encode), (True, repeats), (True, hits)):
            for input_id in input_ids:
                if input_id not in resolved:
                    resolved.add(input_id)
                    counts.lookups += 1
                    counts.hits += hit
        return embeddings

    def _preempt(self, request: _Request) -> None:
        self.prefix.free(request.request_id)
        self.encoder.free_request(request.request_id)
        request.computed = 0
        request.placeholders = 0
        request.preemptions += 1
        request.resolved.clear()
        self.waiting.appendleft(request)


def _decoding(request: _Request, computed: int, new: int) -> bool:
    """Whether a chunk is a decode step: the one token after a sampled (or in-flight) one."""
    ahead = request.outputs + request.placeholders
    return ahead > 0 and new == 1 and computed + 1 == request.num_tokens + request.placeholders


def _as_request(request: PromptRequest, config: EngineConfig) -> _Request:
    """The scheduler's view of a request (its block hashes still to compute); refuses
    what vLLM could never run."""
    items: list[_Item] = []
    runs: list[Run] = []
    offset = 0
    largest = min(config.encoder_compute_budget, config.encoder_cache_size)
    for segment in request.segments:
        if segment.tokens < 1:
            raise ValueError(f"{request.request_id}: segment {segment.key!r} has no tokens")
        if segment.embeddings:
            if not 0 < segment.embeddings <= segment.tokens:
                raise ValueError(f"{request.request_id}: item {segment.key!r} needs 1 to "
                                 f"{segment.tokens} embeddings (its placeholder tokens), "
                                 f"not {segment.embeddings}")
            if segment.embeddings > largest:
                raise ValueError(f"{request.request_id}: item {segment.key!r} needs "
                                 f"{segment.embeddings} embeddings, more than the encoder "
                                 f"cache and budget ({largest}); vLLM sizes both to the "
                                 "model's largest item, so raise them to at least that")
            items.append(_Item(segment.key, offset, segment.tokens, segment.embeddings))
        runs.append(Run(segment.key, segment.tokens, item=segment.embeddings > 0))
        offset += segment.tokens
    if offset == 0:
        raise ValueError(f"{request.request_id}: a request needs at least one prompt token")
    if request.output_tokens < 1:
        raise ValueError(f"{request.request_id}: output_tokens must be at least 1")
    blocks = -(-(offset + request.output_tokens) // config.block_size)
    if blocks > config.kv_blocks - 1:
        raise ValueError(f"{request.request_id}: {offset} + {request.output_tokens} tokens need "
                         f"{blocks} KV blocks, more than the {config.kv_blocks - 1} there are "
                         "(vLLM refuses a max_model_len the KV cache cannot hold)")
    runs.append(Run(f"\0out:{request.request_id}", 0))  # its generated tokens, unlike any other's
    return _Request(request.request_id, tuple(items), runs, offset, request.output_tokens)


def _grow_output(request: _Request) -> None:
    last = request.runs[-1]
    request.runs[-1] = Run(last.key, last.tokens + 1)


class Engine:
    """One model server in simulated time: the processor cache at arrival, then the
    scheduler's steps, each taking the time ``Costs`` gives its work.

    The GPU runs steps one after another. With ``async_scheduling`` (vLLM's default) the
    engine keeps two steps queued, as vLLM's batch queue does: the next step is scheduled
    while the current one runs, so it sees the results of the step before the current
    one only (a finished request's references and blocks are freed one step later).
    Without it each step is scheduled when the previous one has ended.

    ``encoder`` and ``prefix`` replace the server's own caches (the differential tests
    put vLLM's behind them).
    """

    def __init__(self, config: EngineConfig, costs: Costs, encoder: EncoderCacheOps | None = None,
                 prefix: PrefixCache | None = None) -> None:
        self.config = config
        self.costs = costs
        self.encoder_cache: EncoderCacheOps = encoder if encoder is not None else EncoderCache(
            config.encoder_cache_size, config.encoder_compute_budget)
        self.scheduler = Scheduler(config, self.encoder_cache, prefix)
        self.processor = ProcessorCache(config.processor_cache_bytes)
        self.processor_counts = LayerCounts()
        self.now = 0.0
        self.finished: list[tuple[str, float]] = []  # (request_id, finish time), appended
        self.steps = 0
        self.preemptions = 0
        self._queued: deque[tuple[StepPlan, float]] = deque()  # steps on the GPU, with their ends
        self._depth = 2 if config.async_scheduling else 1
        self._lane_free = 0.0
        self._preparing: list[tuple[float, int, PromptRequest]] = []
        self._preparing_ids: set[str] = set()
        self._arrivals = 0

    def submit(self, request: PromptRequest, now: float) -> None:
        """A request arrives: its items are looked up in the processor cache; the misses
        are preprocessed one after another on the server's lane before it can run."""
        _as_request(request, self.config)  # refuse it now, not when it is scheduled
        if request.request_id in self.scheduler.requests or request.request_id in self._preparing_ids:
            raise ValueError(f"request {request.request_id} is already in the engine")
        self._preparing_ids.add(request.request_id)
        misses = 0
        for digest, nbytes in {s.key: s.nbytes for s in request.segments if s.embeddings}.items():
            self.processor_counts.lookups += 1
            if self.processor.lookup(digest, nbytes):
                self.processor_counts.hits += 1
            else:
                misses += 1
        ready = now
        if misses:
            ready = max(now, self._lane_free) + misses * self.costs.preprocess_ms_per_item / 1000
            self._lane_free = ready
        heapq.heappush(self._preparing, (ready, self._arrivals, request))
        self._arrivals += 1

    def next_event_time(self) -> float | None:
        """When the engine next changes: the running step ends, or (idle) the next
        request is ready to be scheduled; None when there is nothing to do."""
        if self._queued:
            return self._queued[0][1]
        if self._preparing:
            return max(self._preparing[0][0], self.now)
        return None

    def advance(self, until: float) -> list[tuple[str, float]]:
        """Run every event up to ``until``; returns ``(request_id, first_token_time)`` of
        the requests whose prefill finished meanwhile."""
        first_tokens: list[tuple[str, float]] = []
        while True:
            at = self.next_event_time()
            if at is None or at > until:
                break
            self.now = at
            if self._queued and self._queued[0][1] <= at:
                plan, _ = self._queued.popleft()
                first, finished = self.scheduler.update(plan)
                first_tokens.extend((request_id, at) for request_id in first)
                self.finished.extend((request_id, at) for request_id in finished)
            self._admit_ready()
            self._fill()
        return first_tokens

    @property
    def load(self) -> int:
        """Requests waiting (preprocessing included) and running."""
        scheduler = self.scheduler
        return len(self._preparing) + len(scheduler.waiting) + len(scheduler.running)

    @property
    def layers(self) -> dict[str, LayerCounts]:
        """Lookups and hits of the processor, encoder and prefix caches so far."""
        return {"processor": self.processor_counts, "encoder": self.scheduler.encoder_counts,
                "prefix": self.scheduler.prefix_counts}

    def holds(self, item_hash: str) -> bool:
        """Whether the encoder cache holds the item now (pinned or freeable)."""
        return self.encoder_cache.resident(item_hash) is not None

    def _admit_ready(self) -> None:
        while self._preparing and self._preparing[0][0] <= self.now:
            _, _, request = heapq.heappop(self._preparing)
            self._preparing_ids.discard(request.request_id)
            self.scheduler.add(request)

    def _fill(self) -> None:
        """Schedule steps until the queue is full or nothing can run."""
        costs = self.costs
        while len(self._queued) < self._depth:
            plan = self.scheduler.schedule()
            if not plan.tokens:
                return  # nothing can run: idle until a step ends or a request is ready
            ms = (costs.step_overhead_ms
                  + costs.encoder_ms_per_1k_embeddings * plan.embeddings / 1000
                  + costs.prefill_ms_per_1k_tokens * plan.prefill_tokens / 1000
                  + (costs.decode_ms_per_step if plan.decode_tokens else 0.0))
            start = self._queued[-1][1] if self._queued else self.now
            self._queued.append((plan, start + ms / 1000))
            self.steps += 1
            self.preemptions += len(plan.preempted)
