"""One frozen settings object: flags win over ``MMCACHE_*`` variables, which win over
the YAML ``--config`` file (Go plugin parameter names), which wins over defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from stream.core.cache import Capacity

__all__ = ["Limits", "Settings", "load_plugin_config"]


class Limits(BaseSettings):
    """Request limits (CONTRACT defaults); a request over one gets 400 naming it."""

    model_config = SettingsConfigDict(env_prefix="MMCACHE_", frozen=True)

    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1)
    max_endpoints: int = Field(4096, ge=1)
    max_items: int = Field(1024, ge=1)
    max_endpoint_chars: int = Field(253, ge=1, le=253)
    max_hash_chars: int = Field(256, ge=1)


class Settings(BaseSettings):
    """Everything `mmcache serve` needs to run."""

    model_config = SettingsConfigDict(env_prefix="MMCACHE_", frozen=True)

    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    app_id: str = Field("mmcache", min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    data_dir: Path = Path(".mmcache")
    bootstrap_servers: str | None = None
    topic: str | None = Field(None, description="event topic; default '<app_id>-events'")
    partitions: int = Field(8, ge=1)
    replication_factor: int = Field(1, ge=1)
    cache_size_mb_per_server: int | None = None
    cache_size_embeddings_per_server: int | None = None
    produce_timeout_s: float = Field(10.0, gt=0)
    log_level: str = "info"
    limits: Limits = Field(default_factory=Limits)

    @model_validator(mode="after")
    def _one_capacity_mode(self) -> Settings:
        self.capacity  # noqa: B018 - raises on a conflicting configuration
        return self

    @property
    def capacity(self) -> Capacity:
        """Per-endpoint LRU capacity from the Go plugin's parameters."""
        return Capacity.from_params(
            self.cache_size_mb_per_server, self.cache_size_embeddings_per_server
        )

    @property
    def events_topic(self) -> str:
        """The one ordered event log, partitioned by endpoint."""
        return self.topic or f"{self.app_id}-events"


_PLUGIN_KEYS = {
    "cacheSizeInMBPerServer": "cache_size_mb_per_server",
    "cacheSizeInEmbeddingsPerServer": "cache_size_embeddings_per_server",
}


def load_plugin_config(path: Path) -> dict[str, Any]:
    """Read the Go plugin's YAML parameters (top level or under ``parameters:``)."""
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a YAML mapping")
    params = raw.get("parameters", raw)
    unknown = set(params) - set(_PLUGIN_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown parameter(s) {sorted(unknown)}")
    return {_PLUGIN_KEYS[key]: value for key, value in params.items()}
