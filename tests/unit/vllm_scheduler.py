"""vLLM's scheduler as far as it calls the encoder cache manager, for the tests of the
vLLM plugin in clients/vllm (mmcache-vllm), and the plugin itself, imported from that
directory without being installed.

Importing this module loads vLLM's ``vllm.v1.core.encoder_cache_manager`` from its wheel
(tests/vllm_wheel.py) under its real name, which the plugin subclasses, and puts
clients/vllm on sys.path.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests import vllm_wheel

vllm_wheel.encoder_cache_manager()
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "vllm"))

from mmcache_vllm import LOGGER_NAME, ConfigError, MmcacheEncoderCacheManager, ReporterConfig  # noqa: E402
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager  # noqa: E402

__all__ = ["ENDPOINT", "LOGGER_NAME", "MODALITIES", "ConfigError", "MmcacheEncoderCacheManager", "ModalFeature",
           "ReporterConfig", "Scheduler", "make_request", "vllm_config"]

ENDPOINT = "default/vllm-0"
MODALITIES = ("image", "audio", "video")


@dataclass(frozen=True)
class ModalFeature(vllm_wheel.Feature):
    """vLLM's MultiModalFeatureSpec with its modality."""

    modality: str = "image"


def make_request(request_id: str, items: list[tuple[str, int, str]]) -> vllm_wheel.Request:
    features, offset = [], 0
    for identifier, size, modality in items:
        offset += 3
        features.append(ModalFeature(identifier, vllm_wheel.Position(offset, size), modality))
        offset += size
    return vllm_wheel.Request(request_id, features)


def vllm_config(**manager_config: Any) -> SimpleNamespace:
    return SimpleNamespace(
        ec_manager_config=SimpleNamespace(encoder_cache_manager_cls="mmcache_vllm.MmcacheEncoderCacheManager",
                                          manager_config=manager_config),
        model_config=SimpleNamespace(is_encoder_decoder=False),
        parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_external_lb=False))


class Scheduler:
    """Calls the manager in the order vLLM's scheduler does (``_try_schedule_encoder_inputs``
    per request, then ``_allocate_encoder_inputs``; ``free`` for a request that finished,
    was preempted or got no KV blocks; ``get_freed_mm_hashes`` at the end of every pass;
    ``reset`` when weights change). Each item hash has one size and one modality."""

    def __init__(self, manager: EncoderCacheManager, seed: int, pool: int = 120, budget: int = 1600) -> None:
        self.manager = manager
        self.random = random.Random(seed)
        self.items = [(f"h{seed}-{n}", self.random.randint(40, 400), self.random.choice(MODALITIES))
                      for n in range(pool)]
        self.budget = budget
        self.running: list[vllm_wheel.Request] = []
        self.next_id = 0
        self.durations: list[float] = []
        self.stored = 0  # allocations of an entry the manager did not hold
        self.evicted = 0
        self.resets = 0

    def call(self, method: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args)
        finally:
            self.durations.append(time.perf_counter() - started)

    def new_request(self) -> vllm_wheel.Request:
        self.next_id += 1
        count = self.random.choice((1, 1, 2, 3))
        chosen = [self.items[min(int(self.random.expovariate(0.04)), len(self.items) - 1)] for _ in range(count)]
        return make_request(f"r{self.next_id}", chosen)

    def schedule(self, request: vllm_wheel.Request, budget: int) -> tuple[list[int], int]:
        manager, to_allocate, duplicates, in_pass = self.manager, [], [], {}
        embeds = 0
        for i, feature in enumerate(request.mm_features):
            size = feature.mm_position.get_num_embeds()
            if feature.identifier in in_pass:
                duplicates.append(i)
                continue
            self.call(manager.get_cached_num_encoder_embeds, request, i)
            if self.call(manager.check_and_update_cache, request, i):
                continue
            if not self.call(manager.can_allocate, request, i, budget, embeds):
                break
            embeds += size
            budget -= size
            in_pass[feature.identifier] = size
            to_allocate.append(i)
        if self.random.random() < 0.1:  # no KV blocks for it: vLLM untouches the request
            self.call(manager.free, request)
            return [], budget
        for i in to_allocate:
            self.stored += request.mm_features[i].identifier not in manager.cached
            self.call(manager.allocate, request, i)
        for i in duplicates:
            self.call(manager.check_and_update_cache, request, i)
        return to_allocate, budget

    def step(self) -> list[str]:
        """One scheduling pass; returns what the workers are told to drop."""
        budget = self.budget
        for request in list(self.running):
            if self.random.random() < 0.4:  # finished (or preempted): its references go
                self.call(self.manager.free, request)
                self.running.remove(request)
        for _ in range(self.random.randint(0, 3)):
            request = self.new_request()
            _, budget = self.schedule(request, budget)
            self.running.append(request)
        freed = self.call(self.manager.get_freed_mm_hashes)
        self.evicted += len(freed)
        if self.random.random() < 0.01:
            self.call(self.manager.reset)
            self.running.clear()
            self.resets += 1
        return freed

    def holdings(self) -> dict[str, tuple[int, str | None]]:
        """What the manager holds, with each item's modality as the requests gave it."""
        modality = {digest: kind for digest, _, kind in self.items}
        return {digest: (size, modality[digest]) for digest, size in self.manager.num_embeds_by_hash.items()}

    def reports(self) -> int:
        """What the manager had to report: each new entry, each hash dropped, each reset."""
        return self.stored + self.evicted + self.resets

    def idle_pass(self) -> None:
        self.call(self.manager.get_freed_mm_hashes)

