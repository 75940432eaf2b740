"""vLLM's own encoder cache manager, reporting to mmcache what it holds.

What the service's engine view must equal is what the manager holds:
``self.num_embeds_by_hash`` (the keys of ``self.cached``, with their sizes). It changes in
exactly three places, and each is reported right after vLLM's own code ran, on the
scheduler thread:

- ``allocate`` adds an entry that was not there: ``stored`` (its embeddings as size,
  its feature's modality).
- ``can_allocate`` evicts entries, but the scheduler tells its workers only at the end of
  the pass, through ``get_freed_mm_hashes``, which leaves out an entry allocated again in
  the same pass (its tensor is kept). ``removed`` is what that call returns, when it
  returns it: exactly what the workers drop. An entry evicted and allocated again has
  been ``stored`` again by then (same hash, maybe a new size), so the view never loses it.
- ``reset`` empties everything: ``cleared``.

Between an eviction and the end of its pass the view still lists the evicted entry, as
the workers still hold it; after every pass the view equals the manager. Checking for
hits (``check_and_update_cache``) and freeing references (``free``,
``free_encoder_input``) only change reference counts, never what is held.
"""

from __future__ import annotations

from multiprocessing.util import Finalize
from typing import Any

from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from .config import ConfigError, ReporterConfig
from .reporter import EngineEventReporter, Item

__all__ = ["MmcacheEncoderCacheManager"]


class MmcacheEncoderCacheManager(EncoderCacheManager):
    """``--ec-manager-config '{"encoder_cache_manager_cls":
    "mmcache_vllm.MmcacheEncoderCacheManager", "manager_config": {"url": ...}}'``.

    Everything reported is caught: a failure in the plugin is counted
    (``reporter.counters().errors``) and resynced, never raised into the scheduler.
    vLLM's own errors (its asserts) pass through unchanged.
    """

    reporter: EngineEventReporter

    @classmethod
    def create_manager(cls, *, cache_size: int, vllm_config: Any) -> MmcacheEncoderCacheManager:
        """Reads ``vllm_config.ec_manager_config.manager_config`` and starts the sender;
        a bad setting raises :class:`ConfigError` here, so vLLM does not start."""
        _check_served_alone(vllm_config)
        config = ReporterConfig.from_manager_config(_manager_config(vllm_config))
        manager = cls(cache_size=cache_size)
        _check_base(manager)
        manager.reporter = EngineEventReporter(config, manager._holdings)
        manager.reporter.start()
        # run at the process's clean exit, also in vLLM's engine process, which
        # multiprocessing ends without atexit when it was forked
        Finalize(None, manager.reporter.close, exitpriority=10)
        return manager

    def __init__(self, cache_size: int) -> None:
        super().__init__(cache_size)
        # the modality of each entry held (vLLM keeps only hash and size); same keys as
        # num_embeds_by_hash, plus evicted entries until the end of their pass
        self._modalities: dict[str, str | None] = {}

    def allocate(self, request: Any, input_id: int) -> None:
        """Reports ``stored`` when the entry is new to the cache."""
        reporter = self.reporter
        reporter.enter()
        try:
            try:
                feature = request.mm_features[input_id]
                added = feature.identifier not in self.cached
            except Exception as exc:
                reporter.failed(exc)
                added = False
            super().allocate(request, input_id)
            if added:
                try:
                    mm_hash = feature.identifier
                    modality = getattr(feature, "modality", None)
                    self._modalities[mm_hash] = modality
                    reporter.stored(mm_hash, self.num_embeds_by_hash[mm_hash], modality)
                except Exception as exc:
                    reporter.failed(exc)
        finally:
            reporter.leave()

    def get_freed_mm_hashes(self) -> list[str]:
        """Reports ``removed`` for exactly the entries the workers are told to drop."""
        reporter = self.reporter
        reporter.enter()
        try:
            freed = super().get_freed_mm_hashes()
            try:
                for mm_hash in freed:
                    self._modalities.pop(mm_hash, None)
                reporter.removed(freed)
            except Exception as exc:
                reporter.failed(exc)
            return freed
        finally:
            reporter.leave()

    def reset(self) -> None:
        """Reports ``cleared`` (vLLM resets when model weights change)."""
        reporter = self.reporter
        reporter.enter()
        try:
            super().reset()
            try:
                self._modalities.clear()
                reporter.cleared()
            except Exception as exc:
                reporter.failed(exc)
        finally:
            reporter.leave()

    def _holdings(self) -> list[Item]:
        """Every entry held now, for a resync: on the scheduler thread within a hook, or
        on the sender's while the scheduler is idle. Each dict is copied first, in one
        C-level call that no other thread interleaves with (the GIL)."""
        sizes = dict(self.num_embeds_by_hash)
        modalities = dict(self._modalities)
        return [(mm_hash, size, modalities.get(mm_hash)) for mm_hash, size in sizes.items()]


def _check_base(manager: EncoderCacheManager) -> None:
    """What the plugin relies on in vLLM's class (public in its docstring): refused at
    start if this vLLM's class differs, rather than failing inside the scheduler."""
    missing = [name for name in ("allocate", "get_freed_mm_hashes", "reset")
               if not callable(getattr(EncoderCacheManager, name, None))]
    missing += [name for name in ("cached", "num_embeds_by_hash")
                if not isinstance(getattr(manager, name, None), dict)]
    if missing:
        raise ConfigError(f"mmcache-vllm: this vLLM's EncoderCacheManager has no {', '.join(missing)}; "
                          "mmcache-vllm needs vLLM 0.31.0 or later")


def _manager_config(vllm_config: Any) -> Any:
    ec_manager_config = getattr(vllm_config, "ec_manager_config", None)
    return getattr(ec_manager_config, "manager_config", None) or {}


def _check_served_alone(vllm_config: Any) -> None:
    """One endpoint, one scheduler: the service folds one event stream per endpoint."""
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "is_encoder_decoder", False):
        raise ConfigError("mmcache-vllm: this is an encoder-decoder model, whose encoder outputs vLLM does "
                          "not cache (EncoderDecoderCacheManager); leave --ec-manager-config out")
    parallel = getattr(vllm_config, "parallel_config", None)
    if (getattr(parallel, "data_parallel_size", 1) > 1
            and not getattr(parallel, "data_parallel_external_lb", False)):
        raise ConfigError("mmcache-vllm: several data-parallel ranks share this server's endpoint, each "
                          "with its own encoder cache; run one rank per pod (--data-parallel-external-lb) "
                          "or leave --ec-manager-config out")
