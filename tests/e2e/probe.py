"""A test-only manager loaded into real vLLM by ``--ec-manager-config``: it publishes what
vLLM's encoder cache manager holds, so that tests can hold mmcache's engine view to it, and
what each of the plugin's hooks costs against vLLM's own class on the same call.

vLLM's scheduler runs in its engine process; a daemon thread of the probe writes a JSON
file (``MMCACHE_E2E_PROBE``, replaced whole each time) every 50 ms: the entries held
(``num_embeds_by_hash``, copied in one step), every hash the workers were ever told to
drop, the resets, the plugin's counters and the costs. Nothing of the plugin is changed:
the probe only reads, after the plugin's own hook returned.

The costs are paired call by call: a shadow of vLLM's own ``EncoderCacheManager`` is given
every call the scheduler makes (so it holds the same entries), and each call of a hooked
method (``allocate``, ``get_freed_mm_hashes``, ``reset``) is timed on both, the order
alternating from one call to the next; the shadow's answers are dropped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Any

from mmcache_vllm import MmcacheEncoderCacheManager
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

__all__ = ["ProbedManager"]

PROBE_ENV = "MMCACHE_E2E_PROBE"
PROBE_INTERVAL_S = 0.05


class ProbedManager(MmcacheEncoderCacheManager):
    """The plugin's manager, published to ``$MMCACHE_E2E_PROBE``."""

    @classmethod
    def create_manager(cls, *, cache_size: int, vllm_config: Any) -> ProbedManager:
        manager = super().create_manager(cache_size=cache_size, vllm_config=vllm_config)
        threading.Thread(target=manager._publish, args=(os.environ[PROBE_ENV],), name="mmcache-e2e-probe",
                         daemon=True).start()
        return manager

    def __init__(self, cache_size: int) -> None:
        super().__init__(cache_size)
        self.shadow = EncoderCacheManager(cache_size)
        self.freed_ever: list[str] = []
        self.resets = 0
        self.passes = 0
        # method -> [calls, ns in the plugin's, ns in vLLM's own class]
        self.costs: dict[str, list[int]] = {name: [0, 0, 0] for name in ("allocate", "get_freed_mm_hashes", "reset")}

    def _paired(self, name: str, *args: Any) -> Any:
        """Calls ``name`` on the plugin's class (the answer kept) and on the shadow, timed."""
        cost = self.costs[name]
        mine, theirs = getattr(super(), name), getattr(self.shadow, name)
        clock = time.perf_counter_ns
        if cost[0] % 2:
            start = clock()
            theirs(*args)
            middle = clock()
            answer = mine(*args)
            end = clock()
            cost[1] += end - middle
            cost[2] += middle - start
        else:
            start = clock()
            answer = mine(*args)
            middle = clock()
            theirs(*args)
            end = clock()
            cost[1] += middle - start
            cost[2] += end - middle
        cost[0] += 1
        return answer

    def allocate(self, request: Any, input_id: int) -> None:
        self._paired("allocate", request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        freed = self._paired("get_freed_mm_hashes")
        self.freed_ever.extend(freed)
        self.passes += 1
        return freed

    def reset(self) -> None:
        self._paired("reset")
        self.resets += 1

    # the scheduler's other calls, given to the shadow too (it must hold what this holds);
    # ``free`` calls ``free_encoder_input`` for each input
    def check_and_update_cache(self, request: Any, input_id: int) -> bool:
        self.shadow.check_and_update_cache(request, input_id)
        return super().check_and_update_cache(request, input_id)

    def can_allocate(self, *args: Any, **kwargs: Any) -> bool:
        self.shadow.can_allocate(*args, **kwargs)
        return super().can_allocate(*args, **kwargs)

    def free_encoder_input(self, request: Any, input_id: int) -> None:
        self.shadow.free_encoder_input(request, input_id)
        super().free_encoder_input(request, input_id)

    def _publish(self, path: str) -> None:
        stop = threading.Event()
        while not stop.wait(PROBE_INTERVAL_S):
            state = {"pid": os.getpid(), "cache_size": self.cache_size, "passes": self.passes,
                     "held": dict(self.num_embeds_by_hash), "freed_ever": self.freed_ever[:],
                     "resets": self.resets, "counters": dataclasses.asdict(self.reporter.counters()),
                     "costs": {name: cost[:] for name, cost in self.costs.items()},
                     "shadow_agrees": dict(self.shadow.num_embeds_by_hash) == dict(self.num_embeds_by_hash)}
            with open(path + ".tmp", "w") as out:
                json.dump(state, out)
            os.replace(path + ".tmp", path)
