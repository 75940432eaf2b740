"""One frozen settings object: flags win over ``MMCACHE_*`` variables, which win over
the YAML ``--config`` file (Go plugin parameter names), which wins over defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from stream.core.cache import Capacity

__all__ = ["KafkaSecurity", "Limits", "Settings", "load_plugin_config"]


class Limits(BaseSettings):
    """Request limits (CONTRACT defaults); a request over one gets 400 naming it.

    Why each default (README, "Security, limits and failure behaviour"): a match names
    the scheduler's candidates (a whole pool, so thousands); a placement names the pods
    a request was sent to (one, or a few for a disaggregated or mirrored request), so its
    fan-out (endpoints x items view entries) stays small; the view holds at most
    ``max_total_endpoints`` endpoints, and a placement that would add one more is refused.
    """

    model_config = SettingsConfigDict(env_prefix="MMCACHE_", frozen=True, hide_input_in_errors=True)

    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1)
    max_endpoints: int = Field(4096, ge=1)
    max_placement_endpoints: int = Field(16, ge=1)
    max_total_endpoints: int = Field(10_000, ge=1)
    max_items: int = Field(1024, ge=1)
    max_endpoint_chars: int = Field(253, ge=1, le=253)
    max_hash_chars: int = Field(256, ge=1)


class KafkaSecurity(BaseSettings):
    """How every Kafka client of mmcache connects, with Kafka's own setting names
    (``MMCACHE_KAFKA_SECURITY_PROTOCOL``, ...). The password is a ``SecretStr``: it is
    never logged nor echoed in an error."""

    model_config = SettingsConfigDict(env_prefix="MMCACHE_KAFKA_", frozen=True, hide_input_in_errors=True)

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None

    @model_validator(mode="after")
    def _complete(self) -> KafkaSecurity:
        if self.security_protocol.startswith("SASL_"):
            if self.sasl_mechanism is None or self.sasl_username is None or self.sasl_password is None:
                raise ValueError(
                    f"security_protocol {self.security_protocol} needs MMCACHE_KAFKA_SASL_MECHANISM, "
                    "MMCACHE_KAFKA_SASL_USERNAME and MMCACHE_KAFKA_SASL_PASSWORD"
                )
        return self


class Settings(BaseSettings):
    """Everything `mmcache serve` needs to run."""

    model_config = SettingsConfigDict(env_prefix="MMCACHE_", frozen=True, hide_input_in_errors=True)

    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    app_id: str = Field("mmcache", min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    data_dir: Path = Path(".mmcache")
    bootstrap_servers: str | None = None
    topic: str | None = Field(None, description="event topic; default '<app_id>-events'")
    partitions: int = Field(8, ge=1)
    # None: 3 and 2 on a cluster with at least 3 brokers, else 1 and 1 (the embedded broker)
    replication_factor: int | None = Field(None, ge=1)
    min_insync_replicas: int | None = Field(None, ge=1)
    cache_size_mb_per_server: int | None = None
    cache_size_embeddings_per_server: int | None = None
    produce_timeout_s: float = Field(2.0, gt=0)
    max_writes_in_flight: int = Field(256, ge=1)
    shutdown_timeout_s: float = Field(5.0, gt=0)
    auth_token_file: Path | None = None
    match_auth_token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    log_level: str = "info"
    limits: Limits = Field(default_factory=Limits)
    kafka: KafkaSecurity = Field(default_factory=KafkaSecurity)

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

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("set both --tls-cert and --tls-key, or neither")
        return self

    @property
    def events_topic(self) -> str:
        """The one ordered event log, partitioned by endpoint."""
        return self.topic or f"{self.app_id}-events"

    @property
    def dead_letter_topic(self) -> str:
        """Where records of the event topic that were not applied are copied."""
        return f"{self.app_id}-dead-letters"


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
