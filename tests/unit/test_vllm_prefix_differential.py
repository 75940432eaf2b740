"""The prefix cache model against vLLM's own ``BlockPool``, op by op.

The simulator's server (``stream.sim.engine.Engine``: its scheduler and its KV cache
manager, ``stream.sim.prefix.PrefixCache``) runs the same seeded traces twice: over
``stream.sim.prefix.BlockPool`` and over vLLM's ``BlockPool`` with its free queue
(``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py``, loaded from the wheel by
``tests/vllm_wheel.py``). The manager is this repo's on both sides: what is proven is
the pool (its free-queue order, hash map and reference counts). Compared in
order: every hit lookup (the block a hash finds, or none), every block handed out with
the hash it lost (an eviction) and the free-block count before every allocation. The
traces share system prompts and items (hits), and some have a KV cache small enough that
cached blocks are evicted and requests preempted.

A second test holds the block hashes (``chain_hashes``) against vLLM's request block
hasher (``get_request_block_hasher`` in ``kv_cache_utils.py``, with its multimodal extra
keys): over prompts sharing prefixes and items, two blocks hash equal in this model
exactly when they do in vLLM.

The wheel is fetched if missing; a run that cannot get it fails, it does not skip.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from stream.sim.engine import Engine
from stream.sim.prefix import BlockPool, PrefixCache, Run, chain_hashes
from tests import vllm_wheel
from tests.unit.test_vllm_encoder_differential import COSTS, STEP_S, Trace, config, workload


def as_bytes(block_hash: int) -> bytes:
    return block_hash.to_bytes(8, "big", signed=True)


class VllmPool:
    """vLLM's ``BlockPool`` behind the pool operations the manager makes."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = vllm_wheel.block_pool().BlockPool(num_blocks, True, block_size)
        self.block_size = block_size

    def cached_block(self, block_hash: int) -> Hashable | None:
        found = self.pool.get_cached_block(as_bytes(block_hash), [0])
        return found[0] if found else None

    def is_evictable(self, block: Hashable) -> bool:
        return block.ref_cnt == 0 and not block.is_null  # what vLLM's manager counts

    def num_free(self) -> int:
        return self.pool.get_num_free_blocks()

    def new_blocks(self, count: int) -> list[Hashable]:
        return self.pool.get_new_blocks(count)

    def touch(self, blocks: Sequence[Hashable]) -> None:
        self.pool.touch(blocks)

    def cache_blocks(self, blocks: Sequence[Hashable], hashes: Sequence[int], first: int, end: int) -> None:
        request = SimpleNamespace(block_hashes=[as_bytes(h) for h in hashes])
        self.pool.cache_full_blocks(request, list(blocks), first, end, self.block_size, 0)

    def free_blocks(self, ordered: Iterable[Hashable]) -> None:
        self.pool.free_blocks(ordered)

    def hash_of(self, block: Hashable) -> int | None:
        key = block.block_hash
        return None if key is None else int.from_bytes(key[:-4], "big", signed=True)


class OurPool(BlockPool):
    """Ours, with the same ``hash_of`` the recorder reads."""

    def hash_of(self, block: Hashable) -> int | None:
        return self.block_hash[block]  # type: ignore[index]


def block_id(block: Hashable | None) -> int | None:
    return block if block is None or isinstance(block, int) else block.block_id


@dataclass
class Recorder:
    """Passes every pool operation on and writes down what came of it."""

    pool: VllmPool | OurPool
    hits: list[int | None] = field(default_factory=list)
    evictions: list[tuple[int, int | None]] = field(default_factory=list)
    free_counts: list[int] = field(default_factory=list)

    def cached_block(self, block_hash: int) -> Hashable | None:
        found = self.pool.cached_block(block_hash)
        self.hits.append(block_id(found))
        return found

    def is_evictable(self, block: Hashable) -> bool:
        return self.pool.is_evictable(block)

    def num_free(self) -> int:
        count = self.pool.num_free()
        self.free_counts.append(count)
        return count

    def new_blocks(self, count: int) -> list[Hashable]:
        before = {block_id(b): self.pool.hash_of(b) for b in self._free_head(count)}
        taken = self.pool.new_blocks(count)
        self.evictions.extend((block_id(b), before[block_id(b)]) for b in taken)
        return taken

    def _free_head(self, count: int) -> list[Hashable]:
        if isinstance(self.pool, VllmPool):
            queue = self.pool.pool.free_block_queue
            return [b for b, _ in zip(queue.iter_blocks_after(None), range(count), strict=False)]
        return list(self.pool.free_queue)[:count]

    def touch(self, blocks: Sequence[Hashable]) -> None:
        self.pool.touch(blocks)

    def cache_blocks(self, blocks: Sequence[Hashable], hashes: Sequence[int], first: int, end: int) -> None:
        self.pool.cache_blocks(blocks, hashes, first, end)

    def free_blocks(self, ordered: Iterable[Hashable]) -> None:
        self.pool.free_blocks(ordered)


TRACES = [
    Trace(200 + seed, cache, running, kv_blocks, requests=80)
    for seed, (cache, running, kv_blocks) in enumerate([
        (8192, 3, 1300), (8192, 8, 1400), (65_536, 4, 1500), (65_536, 8, 20_000), (16_384, 2, 1300),
    ])
]


def simulate(trace: Trace, pool: VllmPool | OurPool) -> tuple[Recorder, list[object]]:
    """Run the trace on an ``Engine`` whose KV cache manager works over ``pool``; returns
    the recorded operations and each request's first-token and finish times."""
    recorder = Recorder(pool)
    cfg = config(trace)
    prefix = PrefixCache(recorder, cfg.block_size)  # type: ignore[arg-type]
    engine = Engine(cfg, COSTS, prefix=prefix)
    first: list[tuple[str, float]] = []
    for step, request in workload(trace):
        first += engine.advance(step * STEP_S)
        engine.submit(request, step * STEP_S)
    while (at := engine.next_event_time()) is not None:
        first += engine.advance(at)
    assert len(engine.finished) == trace.requests, "the trace does not drain"
    return recorder, [first, engine.finished, engine.preemptions]


@functools.cache
def vllm_run(number: int) -> tuple[Recorder, list[object]]:
    """Trace ``number`` over vLLM's pool (run once per process)."""
    cfg = config(TRACES[number])
    return simulate(TRACES[number], VllmPool(cfg.kv_blocks, cfg.block_size))


def compare(pool: type[OurPool], traces: Iterable[int] = range(len(TRACES))) -> dict[str, tuple[int, int]]:
    """Per kind of operation, (agreeing, compared) over the traces numbered, ``pool``
    against vLLM's; the schedules must be the same for a pool that agrees."""
    totals = {"hits": [0, 0], "evictions": [0, 0], "free_counts": [0, 0]}
    for number in traces:
        trace, (theirs, their_steps) = TRACES[number], vllm_run(number)
        ours, our_steps = simulate(trace, pool(config(trace).kv_blocks))
        for name, total in totals.items():
            a, b = getattr(ours, name), getattr(theirs, name)
            total[0] += sum(x == y for x, y in zip(a, b, strict=False))
            total[1] += max(len(a), len(b))
        if pool is OurPool:
            assert our_steps == their_steps, f"trace {trace}: the schedules differ"
    return {name: (same, compared) for name, (same, compared) in totals.items()}


def test_the_prefix_cache_model_agrees_with_vllms_block_pool_op_by_op():
    for name, (same, compared) in compare(OurPool).items():
        print(f"{name}: {same}/{compared} agree ({same / compared:.4%})")
        assert compared > 1000
        assert same / compared >= 0.999, name
    theirs = [vllm_run(number) for number in range(len(TRACES))]
    found = sum(block is not None for recorder, _ in theirs for block in recorder.hits)
    evicted = sum(digest is not None for recorder, _ in theirs for _, digest in recorder.evictions)
    preempted = sum(outcome[2] for _, outcome in theirs)
    print(f"blocks hit {found}, cached blocks evicted {evicted}, preemptions {preempted}")
    assert found > 1000 and evicted > 100 and preempted > 0


class FreesUncachedLast(OurPool):
    """Wrong: blocks without a hash join the tail of the free queue too."""

    def free_blocks(self, ordered: Iterable[Hashable]) -> None:
        for block in ordered:
            self.refs[block] -= 1  # type: ignore[index]
            if self.refs[block] == 0:  # type: ignore[index]
                self.free_queue[block] = None  # type: ignore[index]


class FreesInGivenOrderReversed(OurPool):
    """Wrong: a request's blocks are queued first block first."""

    def free_blocks(self, ordered: Iterable[Hashable]) -> None:
        super().free_blocks(list(ordered)[::-1])


@pytest.mark.parametrize("pool", [FreesUncachedLast, FreesInGivenOrderReversed])
def test_the_comparison_catches_a_pool_that_breaks_one_rule(pool):
    agreed = compare(pool, [0, 4])
    assert any(same / compared < 0.999 for same, compared in agreed.values()), agreed


def vllm_block_hashes(runs: Sequence[Run], block_size: int) -> list[bytes]:
    """vLLM's own block hashes of a prompt made of ``runs`` (its request block hasher,
    SHA-256 over pickled tuples), with token ids standing for the runs' tokens: token
    ``j`` of text key ``k`` is one id wherever it appears, every placeholder token the
    same id, and each item a multimodal feature at its offset."""
    utils = vllm_wheel.kv_cache_utils()
    tokens: list[int] = []
    features = []
    for run in runs:
        if run.item:
            features.append(SimpleNamespace(identifier=run.key, mm_position=SimpleNamespace(
                offset=len(tokens), length=run.tokens)))
            tokens += [PLACEHOLDER] * run.tokens
        else:
            tokens += [TOKEN_IDS.setdefault((run.key, j), len(TOKEN_IDS) + 1) for j in range(run.tokens)]
    request = SimpleNamespace(all_token_ids=tokens, num_tokens=len(tokens), mm_features=features,
                              block_hashes=[], lora_request=None, cache_salt=None, prompt_embeds=None)
    return utils.get_request_block_hasher(block_size, SHA256)(request)


PLACEHOLDER = 0
TOKEN_IDS: dict[tuple[str, int], int] = {}


def SHA256(value: object) -> bytes:  # noqa: N802 - named as vLLM's hash functions are
    return hashlib.sha256(pickle.dumps(value)).digest()


def prompts(seed: int) -> list[list[Run]]:
    """Prompts that share prefixes: the same system text or not, items drawn from a few,
    at offsets that shift with the text before them, a question of their own or not."""
    rng = random.Random(seed)
    out = []
    for _ in range(60):
        runs = [Run("system", rng.choice([5, 16, 20, 32]))] if rng.random() < 0.7 else []
        for _ in range(rng.randint(0, 3)):
            runs.append(Run(rng.choice(["x", "y", "z"]), rng.choice([16, 24, 40]), item=True))
            if rng.random() < 0.6:
                runs.append(Run(rng.choice(["and", "then"]), rng.randint(1, 20)))
        runs.append(Run(rng.choice(["q1", "q2"]), rng.randint(1, 40)))
        out.append(runs)
    # the same item twice in a row against once at double length: equal tokens and
    # parents, told apart by the item's offset from the block's start only
    out += [[Run("x", 16, item=True), Run("x", 16, item=True), Run("q1", 5)],
            [Run("x", 32, item=True), Run("q1", 5)],
            [Run("x", 24, item=True), Run("x", 24, item=True), Run("q1", 5)],
            [Run("x", 48, item=True), Run("q1", 5)]]
    return out


def test_block_hashes_are_equal_exactly_where_vllms_are():
    vllm_wheel.kv_cache_utils().init_none_hash(SHA256)
    ours_of: dict[bytes, int] = {}
    theirs_of: dict[int, bytes] = {}
    blocks = 0
    for seed in range(5):
        for runs in prompts(seed):
            total = sum(run.tokens for run in runs)
            for ours, theirs in zip(chain_hashes(runs, 16, total), vllm_block_hashes(runs, 16), strict=True):
                assert ours_of.setdefault(theirs, ours) == ours
                assert theirs_of.setdefault(ours, theirs) == theirs
                blocks += 1
    print(f"{blocks} blocks, {len(ours_of)} distinct: equal hashes exactly where vLLM's are equal")
    assert blocks > 1000 and 100 < len(ours_of) < blocks  # prefixes were shared, and not all
