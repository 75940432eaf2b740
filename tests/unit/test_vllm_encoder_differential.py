"""The encoder cache model against vLLM's own ``EncoderCacheManager``, op by op.

The simulator's server (``stream.sim.engine.Engine``: arrivals in time, the processor
cache, its scheduler and step queue) runs the same seeded traces twice: once over
``stream.sim.encoder.EncoderCache`` and once over vLLM's manager, loaded from its wheel
(``tests/vllm_wheel.py``), put in as the engine's encoder cache. Every admission
(``can_allocate``), hit (``check_and_update_cache``) and step's evictions
(``get_freed_mm_hashes``) of the two runs are compared in order; the issue asks for
99.9% agreement. The traces: tight and roomy caches, 1 to 8 requests running, items
drawn with repeats from a small pool, items larger than the step's token budget, the
same item repeated in one request (turns of a conversation), prefix-cache hits that skip
or cut into items, tight KV memory (preemption), async and synchronous scheduling.

A second test shows that the older whole-request admission (``EncoderCache.admit``)
disagrees with vLLM on a real share of requests where the cache is tight.

The wheel is fetched if missing; a run that cannot get it fails, it does not skip.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import pytest

from stream.sim.encoder import EncoderCache
from stream.sim.engine import Costs, Engine, EngineConfig, PromptRequest, Scheduler, Segment
from tests import vllm_wheel

TOKEN_BUDGET = 2048


class VllmEncoderCache:
    """vLLM's ``EncoderCacheManager`` behind the operations the scheduler makes; each
    request is handed to it as a vLLM request with its items at their prompt offsets."""

    def __init__(self, size: int) -> None:
        self.manager = vllm_wheel.encoder_cache_manager().EncoderCacheManager(cache_size=size)
        self.scheduler: Scheduler | None = None
        self._requests: dict[Hashable, vllm_wheel.Request] = {}
        self.kept = 0  # entries evicted and stored again within one step

    def _request(self, request_id: Hashable) -> vllm_wheel.Request:
        found = self._requests.get(request_id)
        if found is None:
            assert self.scheduler is not None
            items = self.scheduler.requests[request_id].items
            found = self._requests[request_id] = vllm_wheel.Request(str(request_id), [
                vllm_wheel.Feature(item.key, vllm_wheel.Position(item.offset, item.tokens))
                for item in items])
        return found

    def resident(self, digest: str) -> int | None:
        return self.manager.num_embeds_by_hash.get(digest)

    def lookup(self, request_id: Hashable, input_id: int, digest: str) -> bool:
        return self.manager.check_and_update_cache(self._request(request_id), input_id)

    def can_allocate(self, request_id: Hashable, input_id: int, embeddings: int,
                     compute_budget: int, scheduled: int = 0) -> bool:
        return self.manager.can_allocate(self._request(request_id), input_id, compute_budget, scheduled)

    def allocate(self, request_id: Hashable, input_id: int, digest: str, embeddings: int) -> None:
        self.manager.allocate(self._request(request_id), input_id)

    def cached_inputs(self, request_id: Hashable) -> tuple[int, ...]:
        return tuple(self.manager.get_cached_input_ids(self._request(request_id)))

    def free_input(self, request_id: Hashable, input_id: int) -> None:
        self.manager.free_encoder_input(self._request(request_id), input_id)

    def free_request(self, request_id: Hashable) -> None:
        self.manager.free(self._request(request_id))

    def take_freed(self) -> list[str]:
        evicted = len(self.manager.freed)
        freed = self.manager.get_freed_mm_hashes()
        self.kept += evicted - len(freed)
        return freed


@dataclass
class Recorder:
    """Passes every operation to ``cache`` and writes down what it answered."""

    cache: object
    admissions: list[tuple[object, ...]] = field(default_factory=list)
    hits: list[tuple[object, ...]] = field(default_factory=list)
    evictions: list[list[str]] = field(default_factory=list)
    ops: list[tuple[str, Hashable, int, bool]] = field(default_factory=list)  # both, in order

    def __getattr__(self, name: str) -> object:
        return getattr(self.cache, name)

    def lookup(self, request_id: Hashable, input_id: int, digest: str) -> bool:
        found = self.cache.lookup(request_id, input_id, digest)
        self.hits.append((request_id, input_id, found))
        self.ops.append(("hit", request_id, input_id, found))
        return found

    def can_allocate(self, request_id: Hashable, input_id: int, embeddings: int,
                     compute_budget: int, scheduled: int = 0) -> bool:
        fits = self.cache.can_allocate(request_id, input_id, embeddings, compute_budget, scheduled)
        self.admissions.append((request_id, input_id, fits))
        self.ops.append(("fit", request_id, input_id, fits))
        return fits

    def take_freed(self) -> list[str]:
        freed = self.cache.take_freed()
        self.evictions.append(freed)
        return freed


@dataclass(frozen=True)
class Trace:
    """A seeded workload for one server."""

    seed: int
    cache: int
    running: int
    kv_blocks: int = 20_000
    requests: int = 160
    prefix_caching: bool = True
    async_scheduling: bool = True


TRACES = [
    Trace(seed, cache, running, kv_blocks, async_scheduling=seed not in (2, 7))
    for seed, (cache, running, kv_blocks) in enumerate([
        (8192, 1, 20_000), (8192, 2, 20_000), (8192, 3, 20_000), (8192, 4, 20_000),
        (8192, 6, 20_000), (8192, 8, 20_000), (8192, 3, 1300), (8192, 8, 1400),
        (65_536, 3, 20_000), (65_536, 8, 20_000), (65_536, 8, 1400), (16_384, 5, 20_000),
    ])
]
COSTS = Costs(preprocess_ms_per_item=5, encoder_ms_per_1k_embeddings=10,
              prefill_ms_per_1k_tokens=1, decode_ms_per_step=5, step_overhead_ms=1)
STEP_S = 0.005  # arrival steps are this far apart


def workload(trace: Trace) -> list[tuple[int, PromptRequest]]:
    """``(arrival step, request)`` pairs: a shared system prompt or not, 1 to 4 items
    drawn from a pool of 30 (some larger than the token budget), sometimes the same item
    again later in the request, questions of their own."""
    rng = random.Random(trace.seed)
    pool = [(f"img{i}", rng.choice([64, 256, 576, 1024, 1600, 2500, 3600]))
            for i in range(30)]
    weights = [1 / (i + 1) for i in range(len(pool))]
    out, step = [], 0
    for number in range(trace.requests):
        step += rng.choice([0, 0, 1, 1, 2, 5])
        segments = []
        if rng.random() < 0.6:
            segments.append(Segment("system", rng.choice([32, 100, 300])))
        chosen = rng.choices(pool, weights, k=rng.randint(1, 4))
        for key, size in chosen:
            segments.append(Segment(key, size, size, "image", size * 3000))
            segments.append(Segment(f"q{number}-{len(segments)}", rng.randint(1, 40)))
        if rng.random() < 0.25:  # a later turn shows an earlier item again
            key, size = rng.choice(chosen)
            segments += [Segment(key, size, size, "image"), Segment(f"t{number}", 20)]
        out.append((step, PromptRequest(f"r{number}", tuple(segments), rng.randint(1, 30))))
    return out


def config(trace: Trace) -> EngineConfig:
    return EngineConfig(max_num_batched_tokens=TOKEN_BUDGET, max_num_seqs=trace.running,
                        encoder_cache_size=trace.cache, encoder_compute_budget=max(TOKEN_BUDGET, 3600),
                        kv_blocks=trace.kv_blocks, enable_prefix_caching=trace.prefix_caching,
                        async_scheduling=trace.async_scheduling)


def simulate(trace: Trace, cache: object) -> tuple[Recorder, list[object]]:
    """Run the trace on an ``Engine`` (the simulator's server: arrivals in time, the
    processor cache, the step queue) over ``cache``; returns the recorded operations and
    each request's first-token and finish times."""
    recorder = Recorder(cache)
    engine = Engine(config(trace), COSTS, encoder=recorder)  # type: ignore[arg-type]
    if isinstance(cache, VllmEncoderCache):
        cache.scheduler = engine.scheduler
    first: list[tuple[str, float]] = []
    for step, request in workload(trace):
        first += engine.advance(step * STEP_S)
        engine.submit(request, step * STEP_S)
    while (at := engine.next_event_time()) is not None:
        first += engine.advance(at)
    assert len(engine.finished) == trace.requests, "the trace does not drain"
    return recorder, [first, engine.finished]


def run(trace: Trace, cache: object) -> tuple[Recorder, list[object]]:
    """Drive the scheduler alone over ``cache``, one step after another (no time), to the
    end of the trace; returns the recorded operations and each step's tokens per
    request, inputs encoded and finished requests."""
    recorder = Recorder(cache)
    scheduler = Scheduler(config(trace), recorder)  # type: ignore[arg-type]
    if isinstance(cache, VllmEncoderCache):
        cache.scheduler = scheduler
    arrivals = workload(trace)
    steps: list[object] = []
    step = 0
    while arrivals or scheduler.waiting or scheduler.running:
        while arrivals and arrivals[0][0] <= step:
            scheduler.add(arrivals.pop(0)[1])
        plan = scheduler.schedule()
        _, finished = scheduler.update(plan)
        steps.append((plan.tokens, plan.encoded, finished))
        step += 1
        assert step < 100_000, "the trace does not drain"
    return recorder, steps


def agreement(name: str, ours: list[object], theirs: list[object]) -> tuple[int, int]:
    """(operations that agree, operations compared), position by position; for
    evictions only the steps where either side evicted something count."""
    pairs = list(itertools.zip_longest(ours, theirs))
    if name == "evictions":
        pairs = [(a, b) for a, b in pairs if a or b]
    return sum(a == b for a, b in pairs), len(pairs)


@functools.cache
def vllm_run(number: int) -> tuple[Recorder, list[object]]:
    """Trace ``number`` over vLLM's manager (run once per process)."""
    return simulate(TRACES[number], VllmEncoderCache(TRACES[number].cache))


def compare(model: type[EncoderCache], traces: Iterable[int] = range(len(TRACES)),
            ) -> dict[str, tuple[int, int]]:
    """Per kind of operation, (agreeing, compared) over the traces numbered, ``model``
    against vLLM's manager; the schedules must be the same for a model that agrees."""
    totals = {"admissions": [0, 0], "hits": [0, 0], "evictions": [0, 0]}
    for number in traces:
        trace, (theirs, their_steps) = TRACES[number], vllm_run(number)
        ours, our_steps = simulate(trace, model(trace.cache, max(TOKEN_BUDGET, 3600)))
        for name, total in totals.items():
            same, compared = agreement(name, getattr(ours, name), getattr(theirs, name))
            total[0] += same
            total[1] += compared
        if model is EncoderCache:
            assert our_steps == their_steps, f"trace {trace}: the schedules differ"
    return {name: (same, compared) for name, (same, compared) in totals.items()}


def test_the_encoder_cache_model_agrees_with_vllms_manager_op_by_op():
    for name, (same, compared) in compare(EncoderCache).items():
        print(f"{name}: {same}/{compared} agree ({same / compared:.4%})")
        assert compared > 1000
        assert same / compared >= 0.999, name
    # the traces reach the rules the issue names
    theirs = [vllm_run(number)[0] for number in range(len(TRACES))]
    assert sum(not fits for r in theirs for _, _, fits in r.admissions) > 100
    assert sum(found for r in theirs for _, _, found in r.hits) > 1000
    assert sum(len(freed) for r in theirs for freed in r.evictions) > 500
    assert sum(r.cache.kept for r in theirs) > 0, "no entry evicted and stored again in one step"


class EvictsMostRecentlyFreed(EncoderCache):
    """Wrong: takes the most recently freed entry first."""

    def _make_room(self, need: int) -> tuple[str, ...]:
        evicted = []
        while self.free < need:
            digest = next(reversed(self.freeable))
            self.freeable_space -= self.freeable.pop(digest)
            self.free += self.sizes.pop(digest)
            del self.refs[digest]
            evicted.append(digest)
        self.freed.extend(evicted)
        return tuple(evicted)


class DropsAtFirstRepeat(EncoderCache):
    """Wrong: a request's reference drops with the first of its inputs of an item."""

    def free_input(self, request_id: Hashable, input_id: int) -> None:
        digest = self.inputs.get(request_id, {}).get(input_id)
        super().free_input(request_id, input_id)
        if digest is not None:
            self._drop_reference(request_id, digest)


class ReportsReallocated(EncoderCache):
    """Wrong: reports an entry evicted and stored again in the same step as freed."""

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed


@pytest.mark.parametrize("model", [EvictsMostRecentlyFreed, DropsAtFirstRepeat, ReportsReallocated])
def test_the_comparison_catches_a_model_that_breaks_one_rule(model):
    agreed = compare(model, [0, 4])  # tight caches, 1 and 6 running
    assert any(same / compared < 0.999 for same, compared in agreed.values()), agreed


def test_whole_request_admission_disagrees_with_vllm_on_a_tight_cache():
    """The older model admitted a request whole or made it wait. Replayed beside vLLM's
    manager (driven by the engine's scheduler, 8,192 embeddings, 3 requests running, no
    prefix caching so that every item goes through the encoder cache), admitting each
    request when vLLM first schedules it and releasing it when vLLM finishes it, it
    makes it wait or finds other hits for a real share of requests: printed, and above
    5%."""
    waited = other_hits = total = 0
    for seed in range(4):
        trace = Trace(100 + seed, 8192, 3, requests=150, prefix_caching=False)
        requests = {request.request_id: request for _, request in workload(trace)}
        recorder, steps = run(trace, VllmEncoderCache(trace.cache))
        vllm_hits = first_resolutions(recorder, requests)
        old = EncoderCache(trace.cache, max(TOKEN_BUDGET, 3600))
        started: set[str] = set()
        pinned: set[str] = set()
        for tokens, _, finished in steps:
            for request_id in tokens:
                if request_id in started:
                    continue
                started.add(request_id)
                admission = old.admit(request_id, distinct_items(requests[request_id]))
                total += 1
                old_hits = {digest for digest, _ in admission.hits}
                if admission.status != "admitted":
                    waited += 1
                elif old_hits != vllm_hits[request_id]:
                    other_hits += 1
                if admission.pinned:
                    pinned.add(request_id)
            for request_id in finished:
                if request_id in pinned:
                    old.release(request_id, [d for d, _ in distinct_items(requests[request_id])])
    differing = waited + other_hits
    print(f"whole-request admission disagrees with vLLM on {differing}/{total} requests "
          f"(1 in {total / max(differing, 1):.1f}): {waited} made to wait that vLLM started, "
          f"{other_hits} started with other hits")
    assert total == 600
    assert differing / total > 0.05


def items_of(request: PromptRequest) -> list[str]:
    """The request's item hashes by input id (prompt order)."""
    return [segment.key for segment in request.segments if segment.embeddings]


def distinct_items(request: PromptRequest) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    for segment in request.segments:
        if segment.embeddings:
            seen.setdefault(segment.key, segment.embeddings)
    return list(seen.items())


def first_resolutions(recorder: Recorder, requests: dict[str, PromptRequest]) -> dict[str, set[str]]:
    """The items each request found in vLLM's cache when it first got each of them
    (a hit), as opposed to those it had to encode (room found for them first)."""
    resolved: dict[str, dict[str, bool]] = {rid: {} for rid in requests}
    for kind, request_id, input_id, answer in recorder.ops:
        key = items_of(requests[str(request_id)])[input_id]
        seen = resolved[str(request_id)]
        if key not in seen and answer:
            seen[key] = kind == "hit"
    return {rid: {key for key, hit in seen.items() if hit} for rid, seen in resolved.items()}
