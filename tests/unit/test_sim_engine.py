"""The per-server engine model (``stream.sim.engine``) and its processor and prefix
caches, on hand-worked cases."""

from __future__ import annotations

import random

import pytest

from stream.sim.encoder import EncoderCache
from stream.sim.engine import Costs, Engine, EngineConfig, PromptRequest, Scheduler, Segment
from stream.sim.prefix import BlockPool, PrefixCache, Run, chain_hashes
from stream.sim.processor import DEFAULT_PROCESSOR_CACHE_BYTES, ProcessorCache

COSTS = Costs(preprocess_ms_per_item=100, encoder_ms_per_1k_embeddings=10,
              prefill_ms_per_1k_tokens=1, decode_ms_per_step=5, step_overhead_ms=1)


def text(key: str, tokens: int) -> Segment:
    return Segment(key, tokens)


def image(key: str, size: int, nbytes: int = 1000) -> Segment:
    return Segment(key, size, size, "image", nbytes)


def request(request_id: str, *segments: Segment, output_tokens: int = 1) -> PromptRequest:
    return PromptRequest(request_id, segments, output_tokens)


def scheduler(**settings: int) -> Scheduler:
    config = EngineConfig(**settings)
    return Scheduler(config, EncoderCache(config.encoder_cache_size, config.encoder_compute_budget))


def step(s: Scheduler) -> tuple[dict[str, int], list[str], list[str]]:
    plan = s.schedule()
    first, finished = s.update(plan)
    return plan.tokens, first, finished


def run_to_idle(engine: Engine) -> list[tuple[str, float]]:
    out = []
    while (at := engine.next_event_time()) is not None:
        out += engine.advance(at)
    return out


def test_the_defaults_are_vllms():
    config = EngineConfig()
    assert (config.max_num_batched_tokens, config.max_num_seqs) == (8192, 1024)
    assert config.encoder_cache_size == config.encoder_compute_budget == 8192
    assert config.processor_cache_bytes == DEFAULT_PROCESSOR_CACHE_BYTES == 4 * 2**30
    assert (config.block_size, config.enable_prefix_caching) == (16, True)


def test_a_long_prompt_is_prefilled_in_chunks_and_its_first_token_ends_the_last_chunk():
    engine = Engine(EngineConfig(max_num_batched_tokens=2048), COSTS)
    engine.submit(request("r", text("t", 5000)), now=0.0)
    assert engine.next_event_time() == 0.0 and engine.load == 1
    first = run_to_idle(engine)
    # chunks of 2048, 2048 and 904 tokens: 1 ms overhead + 1 ms per 1k prompt tokens each
    assert first == [("r", pytest.approx((3.048 + 3.048 + 1.904) / 1000))]
    assert engine.finished == [("r", first[0][1])] and engine.load == 0
    assert engine.next_event_time() is None


def test_decode_steps_follow_the_first_token_until_all_output_tokens_are_out():
    engine = Engine(EngineConfig(), COSTS)
    engine.submit(request("r", text("t", 1000), output_tokens=3), now=0.0)
    first = run_to_idle(engine)
    assert first == [("r", pytest.approx(0.002))]  # 1 ms + 1 ms for 1k tokens
    # then two decode steps of 1 ms overhead + 5 ms each
    assert engine.finished == [("r", pytest.approx(0.002 + 2 * 0.006))]


def test_an_item_that_does_not_fit_ends_the_step_window_at_its_start():
    s = scheduler(max_num_batched_tokens=2048, encoder_cache_size=4000, encoder_compute_budget=4000)
    s.add(request("a", image("big", 3000), text("qa", 10)))
    s.add(request("b", text("qb", 50), image("other", 1500), text("qb2", 10)))
    assert step(s)[0] == {"a": 2048}  # the whole budget: b gets nothing
    # big (3000 of 4000) is still pinned by a, so other (1500) does not fit: b runs up
    # to its start only
    assert step(s)[0] == {"a": 962, "b": 50}
    assert "big" in s.encoder and "other" not in s.encoder
    # a finished and freed big; b evicts it for other and runs on
    tokens, _, _ = step(s)
    assert tokens == {"b": 1510}
    assert "other" in s.encoder and "big" not in s.encoder


def test_a_prefix_hit_that_ends_inside_an_item_that_cannot_be_encoded_gets_no_token():
    s = scheduler(max_num_batched_tokens=64, encoder_cache_size=100, encoder_compute_budget=100,
                  kv_blocks=100)
    s.add(request("r1", text("s", 16), image("x", 70), text("t1", 4)))
    assert step(s)[0] == {"r1": 64}
    assert step(s)[0] == {"r1": 26}  # r1 finished; its first 5 blocks stay cached, x freeable
    s.add(request("r2", image("y", 100), text("u", 10)))
    assert step(s)[0] == {"r2": 64}  # y evicts x and stays pinned: r2 is inside it
    s.add(request("r3", text("s", 16), image("x", 70), text("t3", 4)))
    # r3 hits 5 blocks (80 tokens), which end inside x (16..86): x must be encoded, the
    # cache is full of the pinned y, and r3 is past x's start: no token for r3
    assert step(s)[0] == {"r2": 46}
    assert step(s)[0] == {"r3": 10}  # y freed: x encoded again, r3 computes 80..90
    assert s.prefix_counts.hits == 5


def test_a_prefix_hit_skips_the_items_it_covers():
    engine = Engine(EngineConfig(), COSTS)
    prompt = (text("sys", 32), image("x", 64), text("q", 32))
    engine.submit(PromptRequest("r1", prompt), now=0.0)
    run_to_idle(engine)
    engine.submit(PromptRequest("r2", prompt), now=1.0)
    first = run_to_idle(engine)
    # 7 of its 8 blocks hit (never the last token): x (tokens 32..96) lies inside them
    assert engine.layers["prefix"].lookups == 14 and engine.layers["prefix"].hits == 7
    assert engine.layers["encoder"].lookups == 1 and engine.layers["encoder"].hits == 0
    assert first == [("r2", pytest.approx(1.0 + (1 + 16 / 1000) / 1000))]  # 16 tokens, no encode


def test_a_repeated_item_is_encoded_once_and_hits_afterwards():
    engine = Engine(EngineConfig(enable_prefix_caching=False), COSTS)
    engine.submit(request("r1", image("x", 500), text("a", 10)), now=0.0)
    engine.submit(request("r2", image("x", 500), text("b", 10)), now=0.0)
    run_to_idle(engine)
    counts = engine.layers
    assert (counts["encoder"].lookups, counts["encoder"].hits) == (2, 1)
    assert (counts["processor"].lookups, counts["processor"].hits) == (2, 1)
    assert engine.holds("x") and not engine.holds("y")


def test_the_same_item_twice_in_one_request_is_encoded_once():
    s = scheduler(enable_prefix_caching=False)
    s.add(request("r", image("x", 300), text("turn", 20), image("x", 300), text("end", 5)))
    plan = s.schedule()
    assert plan.encoded == {"r": [0]} and plan.embeddings == 300
    assert s.encoder_counts.lookups == 2 and s.encoder_counts.hits == 1


def test_a_processor_cache_miss_delays_the_request_by_the_preprocessing_on_one_lane():
    engine = Engine(EngineConfig(), COSTS)
    engine.submit(request("r1", image("x", 64)), now=0.0)
    engine.submit(request("r2", image("x", 64)), now=0.0)  # a hit: ready at once
    engine.submit(request("r3", image("y", 64), image("z", 64)), now=0.0)  # two misses after x's
    assert engine.next_event_time() == 0.0
    assert engine.layers["processor"].lookups == 4 and engine.layers["processor"].hits == 1
    first = dict(run_to_idle(engine))
    assert first["r2"] < 0.1 <= first["r1"] < 0.3 <= first["r3"]


def test_running_requests_go_first_and_at_most_max_num_seqs_run():
    s = scheduler(max_num_batched_tokens=100, max_num_seqs=2)
    for name in ("a", "b", "c"):
        s.add(request(name, text(name, 60), output_tokens=2))
    assert step(s)[0] == {"a": 60, "b": 40}
    # a decodes first, b finishes its prefill; c waits though 79 tokens are left
    tokens, first, finished = step(s)
    assert tokens == {"a": 1, "b": 20} and first == ["b"] and finished == ["a"]
    assert step(s)[0] == {"b": 1, "c": 60}


def test_a_request_short_of_kv_blocks_preempts_the_last_running_one():
    s = scheduler(kv_blocks=9)  # 8 blocks of 16 tokens besides the null block
    s.add(request("a", text("a", 60), output_tokens=40))
    s.add(request("b", text("b", 60), output_tokens=40))
    plans = []
    firsts: list[str] = []
    for _ in range(200):
        plan = s.schedule()
        firsts += s.update(plan)[0]
        plans.append(plan)
        if not s.running and not s.waiting:
            break
    preempted = [(n, p.preempted) for n, p in enumerate(plans) if p.preempted]
    # a's 65th token needs a 5th block, none is free: b (running last) gives its 4 back
    assert preempted[0] == (5, ("b",))
    assert sorted(firsts) == ["a", "b"]  # b's first token is not reported again
    assert not s.requests


def test_the_engine_refuses_what_vllm_could_never_run():
    engine = Engine(EngineConfig(encoder_cache_size=1000, encoder_compute_budget=1000, kv_blocks=10), COSTS)
    with pytest.raises(ValueError, match="largest item"):
        engine.submit(request("r", image("x", 1001)), now=0.0)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.submit(request("r", text("t", 150)), now=0.0)
    with pytest.raises(ValueError, match="embeddings"):
        engine.submit(request("r", Segment("x", 10, 20, "image")), now=0.0)
    assert engine.load == 0 and engine.layers["processor"].lookups == 0
    engine.submit(request("r", text("t", 10)), now=0.0)
    with pytest.raises(ValueError, match="already in the engine"):
        engine.submit(request("r", text("t", 10)), now=0.0)


def test_the_processor_cache_is_an_lru_by_bytes():
    cache = ProcessorCache(100)
    assert not cache.lookup("a", 40) and not cache.lookup("b", 40)
    assert cache.lookup("a", 40)  # a is now the most recently used
    assert not cache.lookup("c", 40)  # evicts b
    assert "a" in cache and "b" not in cache and cache.used == 80
    assert not cache.lookup("huge", 101) and "huge" not in cache and cache.used == 80


def test_block_hashes_chain_and_name_the_items_in_each_block():
    runs = [Run("sys", 16), Run("x", 32, item=True), Run("q", 16)]
    hashes = chain_hashes(runs, 16, 64)
    assert len(hashes) == 4 and len(set(hashes)) == 4
    assert chain_hashes(runs, 16, 64, hashes[:2]) == hashes
    other = chain_hashes([Run("sys", 16), Run("y", 32, item=True), Run("q", 16)], 16, 64)
    assert other[0] == hashes[0] and other[1:] != hashes[1:] and other[3] != hashes[3]
    shifted = chain_hashes([Run("sys", 8), Run("x", 32, item=True), Run("q", 24)], 16, 64)
    assert shifted[0] != hashes[0]
    assert chain_hashes([Run("sys", 16), Run("x", 8)], 16, 24) == hashes[:1]  # text "x" is not item x


def test_the_prefix_cache_hits_leading_blocks_and_evicts_the_least_recently_freed():
    prefix = PrefixCache(BlockPool(7), 16)  # 6 usable blocks
    a = chain_hashes([Run("a", 48)], 16, 48)
    assert prefix.allocate("r1", 48, 48, a)
    prefix.free("r1")  # freed tail first: the queue ends with its blocks 3, 2, 1
    assert prefix.longest_hit(a, 48) == [1, 2]  # never the last token: 47 tokens = 2 blocks
    assert prefix.longest_hit(a, 49) == [1, 2, 3]
    b = chain_hashes([Run("b", 64)], 16, 64)
    assert prefix.allocate("r2", 64, 64, b)  # 3 never-used blocks, then r1's last block
    hit = prefix.longest_hit(a, 49)
    assert hit == [1, 2] and prefix.pool.evicted == [a[2]]
    # 1 new block, and the 2 hit blocks leave the free queue too: 3 > 2 free
    assert not prefix.allocate("r3", 48, 48, a, hit)
    assert prefix.pool.num_free() == 2 and "r3" not in prefix.blocks
    prefix.free("r2")
    assert prefix.allocate("r3", 48, 48, a, hit)
    assert prefix.blocks["r3"] == [1, 2, 3] and prefix.pool.evicted[-1] == b[3]


@pytest.mark.parametrize("setting", [{"max_num_batched_tokens": 0}, {"max_num_seqs": 0},
                                     {"encoder_cache_size": 0}, {"kv_blocks": 1},
                                     {"processor_cache_bytes": -1}])
def test_a_config_that_could_never_serve_is_refused(setting):
    with pytest.raises(ValueError, match=next(iter(setting))):
        EngineConfig(**setting)


@pytest.mark.parametrize(("async_scheduling", "b_first_ms"), [(False, 2.11 + 7.11), (True, 2.11 + 6 + 7.11)])
def test_with_async_scheduling_the_next_step_is_planned_before_the_last_one_is_done(
        async_scheduling, b_first_ms):
    costs = Costs(preprocess_ms_per_item=0, encoder_ms_per_1k_embeddings=10,
                  prefill_ms_per_1k_tokens=1, decode_ms_per_step=5, step_overhead_ms=1)
    engine = Engine(EngineConfig(encoder_cache_size=100, encoder_compute_budget=100,
                                 async_scheduling=async_scheduling), costs)
    engine.submit(request("a", image("x", 100), text("qa", 10), output_tokens=3), now=0.0)
    engine.submit(request("b", image("y", 100), text("qb", 10)), now=0.0)
    first = dict(run_to_idle(engine))
    # step 1 (2.11 ms): a's prefill encodes x, which fills the cache: b waits. Without
    # async scheduling, step 2 sees x freed and encodes y beside a's decode (7.11 ms);
    # with it, step 2 was planned while step 1 ran (x still pinned: a decodes alone,
    # 6 ms) and b gets y in step 3
    assert first["a"] == pytest.approx(2.11 / 1000)
    assert first["b"] == pytest.approx(b_first_ms / 1000)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_drained_engine_holds_no_reference_and_every_request_got_one_first_token(async_scheduling):
    rng = random.Random(7)
    engine = Engine(EngineConfig(max_num_batched_tokens=512, max_num_seqs=4, encoder_cache_size=2000,
                                 encoder_compute_budget=2000, kv_blocks=300,
                                 async_scheduling=async_scheduling), COSTS)
    now = 0.0
    first: list[tuple[str, float]] = []
    for number in range(150):
        now += rng.expovariate(200)
        segments = [text("sys", 40)] if rng.random() < 0.5 else []
        for _ in range(rng.randint(0, 3)):
            key = f"img{rng.randrange(12)}"
            segments += [image(key, 100 * (1 + int(key[3:]) % 7)), text(f"q{number}-{len(segments)}", 8)]
        segments.append(text(f"end{number}", rng.randint(1, 30)))
        first += engine.advance(now)
        engine.submit(request(f"r{number}", *segments, output_tokens=rng.randint(1, 40)), now)
    first += run_to_idle(engine)
    finished = dict(engine.finished)
    assert sorted(r for r, _ in first) == sorted(finished) == sorted(f"r{n}" for n in range(150))
    assert all(at <= finished[r] for r, at in first)
    cache, prefix = engine.encoder_cache, engine.scheduler.prefix
    assert all(not holders for holders in cache.refs.values()) and not cache.inputs
    assert cache.free + cache.freeable_space == cache.size
    assert prefix.pool.num_free() == 299 and not prefix.blocks
    assert engine.load == 0 and not engine.scheduler.requests


def test_a_processor_cache_of_zero_bytes_caches_nothing():
    cache = ProcessorCache(0)
    assert not cache.lookup("a", 1) and not cache.lookup("a", 1) and cache.used == 0


def test_without_prefix_caching_nothing_hits_and_freed_blocks_are_reused_first():
    prefix = PrefixCache(BlockPool(5, enable_caching=False), 16, enable_caching=False)
    a = chain_hashes([Run("a", 32)], 16, 32)
    assert prefix.allocate("r1", 32, 32, a)
    prefix.free("r1")  # hashless: back at the head of the queue, last block first
    assert prefix.longest_hit(a, 33) == []
    assert prefix.pool.free_queue and list(prefix.pool.free_queue)[:2] == [2, 1]


def test_a_waiting_request_is_admitted_only_when_its_whole_prompt_fits():
    """vLLM's ``scheduler_reserve_full_isl`` (on by default): b's first chunk would fit in
    the free blocks, its whole prompt does not, so it waits for a to finish."""
    s = scheduler(kv_blocks=9, max_num_batched_tokens=96)  # 8 blocks of 16 tokens
    s.add(request("a", text("a", 64), output_tokens=2))
    s.add(request("b", text("b", 100)))  # 7 blocks
    assert step(s)[0] == {"a": 64}  # 32 tokens of b (2 blocks) would fit in the 4 left
    assert step(s) == ({"a": 1}, [], ["a"])
    assert step(s)[0] == {"b": 96}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_finished_requests_last_full_block_is_cached_with_or_without_async_scheduling(async_scheduling):
    """The first output token completes a's second block. Without async scheduling the
    decode step caches it; with it that step was planned before the token was known, and
    vLLM's ``AsyncScheduler`` caches it when the token comes back."""
    engine = Engine(EngineConfig(kv_blocks=100, async_scheduling=async_scheduling), COSTS)
    engine.submit(request("a", text("a", 31), output_tokens=2), now=0.0)
    run_to_idle(engine)
    assert engine.finished and len(engine.scheduler.prefix.pool.cached) == 2
