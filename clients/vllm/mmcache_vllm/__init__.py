"""mmcache-vllm: a vLLM encoder cache manager that reports what the cache holds to mmcache.

Loaded by vLLM through ``--ec-manager-config`` (see README.md); vLLM imports this package
in its scheduler's process, which is why it needs vLLM to import.
"""

from .config import ConfigError, ReporterConfig
from .manager import MmcacheEncoderCacheManager
from .reporter import LOGGER_NAME, Counters, EngineEventReporter

__all__ = ["ConfigError", "Counters", "EngineEventReporter", "LOGGER_NAME", "MmcacheEncoderCacheManager",
           "ReporterConfig"]
