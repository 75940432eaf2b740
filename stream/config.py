"""One frozen settings object: flags win over ``MMCACHE_*`` variables, which win over
the YAML ``--config`` file (Go plugin parameter names), which wins over defaults. The
order is pydantic-settings' own (``Settings.settings_customise_sources``): the flags are
the init values, the variables are read as pydantic-settings reads them (their case
aside), and the file is a source of its own.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from stream.core.cache import Capacity
from stream.core.engine import ENGINE_VIEW_ENTRIES

__all__ = [
    "CAPACITY_KEYS",
    "FLAGS",
    "PLUGIN_TYPE",
    "ConfigError",
    "KafkaSecurity",
    "Limits",
    "PluginConfig",
    "Resolved",
    "Settings",
    "describe_validation_error",
    "environment",
    "load_plugin_config",
    "read_yaml",
    "resolve",
    "setting_names",
]

#: The two keys of the capacity: one choice, taken whole from the highest source naming either.
CAPACITY_KEYS = ("cache_size_mb_per_server", "cache_size_embeddings_per_server")
# the --config file's values while ``resolve`` builds a ``Settings`` (its source reads them)
_PLUGIN_VALUES: ContextVar[dict[str, Any] | None] = ContextVar("plugin_values", default=None)


def environment(name: str) -> str | None:
    """The variable ``name`` as pydantic-settings reads the settings' own: its case aside
    (``MMCACHE_X`` or ``mmcache_x``; the exact name first)."""
    if name in os.environ:
        return os.environ[name]
    wanted = name.lower()
    return next((value for key, value in os.environ.items() if key.lower() == wanted), None)


def _environment_name(name: str) -> str:
    """The name under which ``name`` is set in the environment (its case as given)."""
    wanted = name.lower()
    return name if name in os.environ else next(
        (key for key in os.environ if key.lower() == wanted), name)


class _PluginFileSource(PydanticBaseSettingsSource):
    """The --config file's values (``load_plugin_config``), below the environment."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_PLUGIN_VALUES.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_PLUGIN_VALUES.get() or {})


class _CapacityBelow(PydanticBaseSettingsSource):
    """A source whose capacity keys count only when no source above it names either: the
    two modes are one choice, never one key from each of two sources."""

    def __init__(self, settings_cls: type[BaseSettings], source: PydanticBaseSettingsSource,
                 above: tuple[PydanticBaseSettingsSource, ...]) -> None:
        super().__init__(settings_cls)
        self.source, self.above = source, above

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.source.get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        values = self.source()
        if any(key in higher() for higher in self.above for key in CAPACITY_KEYS):
            values = {key: value for key, value in values.items() if key not in CAPACITY_KEYS}
        return values


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
    max_modality_chars: int = Field(64, ge=1)
    # media references (image/video/audio blocks, mm_features, mm_hashes entries) read from
    # one body, repeats included: extraction stops at the first one over
    max_references: int = Field(4096, ge=1)
    # endpoints x request items of one match: bounds its answer (and the work to build it)
    max_match_pairs: int = Field(16_384, ge=1)
    # facts (stored, removed, cleared) in one POST /v1/engine-events; its stored items and its
    # removed hashes are each bounded by max_items too
    max_engine_events: int = Field(1024, ge=1)
    # JSON values in one body at most, counted from its bytes before it is parsed (the
    # separators ``,`` ``:`` ``[`` ``{``, so an upper bound): a parse costs up to ~80 B a
    # value, so this, not the bytes, is what bounds a body reader's memory (16 MiB of tiny
    # objects took a reader to ~1 GiB; bench reader_memory)
    max_body_values: int = Field(262_144, ge=1)
    # open HTTP connections at most; a new one over it is closed at once (Redis' maxclients,
    # nginx's worker_connections: see docs/http-api.md, "What all clients together hold")
    max_connections: int = Field(4096, ge=1)
    # bytes the request bodies in flight hold at most, over all connections; a body that
    # would go over gets 503 server_busy (None: four bodies of max_body_bytes, 64 MiB)
    body_budget_bytes: int | None = Field(None, ge=1)

    @property
    def body_budget(self) -> int:
        """``body_budget_bytes``, or four bodies of ``max_body_bytes``."""
        return 4 * self.max_body_bytes if self.body_budget_bytes is None else self.body_budget_bytes

    @model_validator(mode="after")
    def _budget_holds_a_body(self) -> Limits:
        if self.body_budget < self.max_body_bytes:
            raise ValueError(f"MMCACHE_BODY_BUDGET_BYTES ({self.body_budget}) must be at least "
                             f"MMCACHE_MAX_BODY_BYTES ({self.max_body_bytes}): else a body within the "
                             "limit could never be read")
        return self

    @model_validator(mode="after")
    def _references_cover_items(self) -> Limits:
        if self.max_references < self.max_items:
            raise ValueError(f"MMCACHE_MAX_REFERENCES ({self.max_references}) must be at least "
                             f"MMCACHE_MAX_ITEMS ({self.max_items}): each item is one reference; "
                             "raise it with max_items")
        return self


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

    # loopback unless told otherwise; any other address needs write tokens (stream.http.auth)
    host: str = "127.0.0.1"
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
    # child processes that read big request bodies at most (None: one per usable core)
    body_readers: int | None = Field(None, ge=1, le=1024)
    # seconds a big body may wait for a body reader, and again its reader may take to
    # answer (a new reader's start not counted), before its request is answered 503 (a
    # stuck reader is replaced)
    body_read_timeout_s: float = Field(4.0, gt=0, le=60)
    shutdown_timeout_s: float = Field(5.0, gt=0)
    # what the embedded broker's kept log holds of the event and dead-letter topics, as
    # Kafka's retention.ms and retention.bytes (per partition; -1 keeps everything); the
    # changelog is compacted whatever these say (stream.kafka.log_cleaner)
    embedded_retention_ms: int = Field(7 * 24 * 3600 * 1000, ge=-1)
    embedded_retention_bytes: int = Field(32 * 1024 * 1024, ge=-1)
    # the embedded broker (whose memory Tansu never frees) is started again on the
    # compacted log once this much was written to the kept log since its start (-1: never;
    # stream.kafka.rebase)
    embedded_rebase_bytes: int = Field(64 * 1024 * 1024, ge=-1)
    # on serve's own embedded broker: how often an idle consumer looks for writes that did
    # not pass through this process (its own writes wake it at once; stream.kafka.fetch_gate)
    idle_poll_s: float = Field(0.5, gt=0, le=600)
    # /readyz answers 503 while the view lags the log by more than this (None: never)
    max_lag_events: int | None = Field(None, ge=0)
    # what /v1/match answers each endpoint from: auto (its engine view where it reported
    # one, else its LRU), estimate (always the LRU), engine (always the engine view; an
    # endpoint that never reported holds nothing)
    match_source: Literal["auto", "estimate", "engine"] = "auto"
    # rebuild: the changelog holding the checkpoint a partition whose oldest events were
    # trimmed starts from (None: '<app_id>-lru-changelog'), and whether every partition
    # starts from its checkpoint, trimmed or not
    checkpoint_topic: str | None = None
    from_checkpoint: bool = False
    # entries one engine view holds at most (a bound of the fold: give rebuild the same)
    engine_view_max_entries: int = Field(ENGINE_VIEW_ENTRIES, ge=1)
    auth_token_file: Path | None = None
    match_auth_token_file: Path | None = None
    allow_unauthenticated_writes: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    limits: Limits = Field(default_factory=Limits)
    kafka: KafkaSecurity = Field(default_factory=KafkaSecurity)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (the init values), then the environment, then the --config file, then the
        defaults; the capacity taken whole from the highest that names it."""
        plugin = _PluginFileSource(settings_cls)
        return (init_settings, _CapacityBelow(settings_cls, env_settings, (init_settings,)),
                _CapacityBelow(settings_cls, plugin, (init_settings, env_settings)))

    @field_validator("embedded_retention_ms", "embedded_retention_bytes", "embedded_rebase_bytes")
    @classmethod
    def _retention(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (keep everything) or positive")
        return value

    @field_validator("log_level", "match_source", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

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


PLUGIN_TYPE = "mm-embeddings-cache-producer"

_PLUGIN_KEYS = {
    "cacheSizeInMBPerServer": "cache_size_mb_per_server",
    "cacheSizeInEmbeddingsPerServer": "cache_size_embeddings_per_server",
}

# Where each setting comes from on the command line and in the environment, for help
# texts and for errors that name the thing to change.
_MODEL_ENV = {"Settings": "MMCACHE_", "Limits": "MMCACHE_", "KafkaSecurity": "MMCACHE_KAFKA_"}


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is one line naming the setting
    and what to do."""


@dataclass(frozen=True)
class PluginConfig:
    """What ``--config`` gave: settings values (``Settings`` names), where in the file
    they were found, and what of the file was not read."""

    values: dict[str, Any]
    source: str
    ignored: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for the log: what was taken from where, and what was ignored."""
        taken = ", ".join(f"{_GO_NAME[key]}={value}" for key, value in self.values.items())
        text = f"took {taken or 'no parameters (defaults)'} from {self.source}"
        if self.ignored:
            text += f"; ignored {', '.join(self.ignored)}"
        return text


_GO_NAME = {value: key for key, value in _PLUGIN_KEYS.items()}


def read_yaml(path: Path) -> Any:
    """The YAML document of ``path``; a missing, unreadable or broken file raises
    ``ConfigError`` naming it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file (check the path or MMCACHE_CONFIG)") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path}: is a directory, not a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: cannot read it ({type(exc).__name__}: "
                          f"{getattr(exc, 'strerror', None) or exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"--config {path}: not valid YAML{where} ({problem}): fix the file") from None


def load_plugin_config(path: Path) -> PluginConfig:
    """Read the Go plugin's parameters from a YAML file, in any of three forms.

    - the parameters at top level (``cacheSizeInMBPerServer: 2048``);
    - one plugin entry (``parameters:`` and optionally ``type:``/``name:``);
    - a whole gateway configuration (``plugins:`` with one entry of ``type:
      mm-embeddings-cache-producer``): its ``parameters:`` are taken and everything
      else (other plugins, ``schedulingProfiles:``, ``apiVersion:``...) is ignored.

    Parameter names are checked (a mistyped one would silently mean the default) and
    values must be integers, as the plugin's JSON decoding requires.
    """
    raw = read_yaml(path)
    if raw is None:
        return PluginConfig({}, f"{path} (empty)")
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: must be a YAML mapping, not a {_kind(raw)}")
    if "plugins" in raw:
        return _from_gateway(path, raw)
    if "parameters" in raw:
        kind = raw.get("type")
        if kind is not None and kind != PLUGIN_TYPE:
            raise ConfigError(f"--config {path}: type is {kind!r}, expected {PLUGIN_TYPE!r}")
        extra = sorted(set(raw) - {"parameters", "type", "name"})
        if extra:
            raise ConfigError(f"--config {path}: unknown key(s) {', '.join(map(str, extra))} beside "
                              "parameters (expected type, name, parameters)")
        return PluginConfig(_parameters(path, "parameters", raw["parameters"]), f"{path}: parameters")
    return PluginConfig(_parameters(path, "top level", raw), f"{path}: top level")


def _from_gateway(path: Path, raw: dict[str, Any]) -> PluginConfig:
    plugins = raw["plugins"]
    if not isinstance(plugins, list):
        raise ConfigError(f"--config {path}: plugins must be a list, not a {_kind(plugins)}")
    ours = [i for i, entry in enumerate(plugins)
            if isinstance(entry, dict) and entry.get("type") == PLUGIN_TYPE]
    if not ours:
        found = sorted({str(entry.get("type")) for entry in plugins if isinstance(entry, dict)})
        raise ConfigError(f"--config {path}: plugins has no entry of type {PLUGIN_TYPE} "
                          f"(found: {', '.join(found) or 'none'}): add one, or give the "
                          "parameters with --cache-size-mb-per-server")
    if len(ours) > 1:
        raise ConfigError(f"--config {path}: plugins has {len(ours)} entries of type {PLUGIN_TYPE} "
                          f"(plugins[{'], plugins['.join(map(str, ours))}]): mmcache serves one "
                          "cache, keep one of them")
    index = ours[0]
    entry = plugins[index]
    where = f"plugins[{index}]"
    ignored = [f"plugins[{i}] (type {entry.get('type') if isinstance(entry, dict) else '?'})"
               for i, entry in enumerate(plugins) if i != index]
    ignored += [str(key) for key in raw if key != "plugins"]
    values = _parameters(path, f"{where}.parameters", entry.get("parameters"))
    name = f" name {entry['name']}" if entry.get("name") else ""
    return PluginConfig(values, f"{path}: {where} (type {PLUGIN_TYPE}{name})", ignored)


def _parameters(path: Path, where: str, params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ConfigError(f"--config {path}: {where} must be a mapping, not a {_kind(params)}")
    unknown = sorted(str(key) for key in params if key not in _PLUGIN_KEYS)
    if unknown:
        raise ConfigError(f"--config {path}: {where}: unknown parameter(s) {', '.join(unknown)} "
                          f"(known: {', '.join(_PLUGIN_KEYS)})")
    values = {}
    for key, value in params.items():
        if value is None:
            continue
        if type(value) is not int:
            raise ConfigError(f"--config {path}: {where}.{key} must be an integer, not a {_kind(value)}")
        values[_PLUGIN_KEYS[key]] = value
    if len(values) > 1:
        raise ConfigError(f"--config {path}: {where}: set either cacheSizeInMBPerServer or "
                          "cacheSizeInEmbeddingsPerServer, not both")
    return values


def _kind(value: Any) -> str:
    return {dict: "mapping", list: "list", str: "string", bool: "boolean", float: "number",
            int: "integer"}.get(type(value), type(value).__name__)


def setting_names(model: str, field_name: str) -> str:
    """How a user sets one field: its flag (when ``serve`` has one) and its variable."""
    env = f"{_MODEL_ENV.get(model, 'MMCACHE_')}{field_name.upper()}"
    if model == "Settings" and field_name in FLAGS:
        return f"--{field_name.replace('_', '-')} / {env}"
    return env


# Settings that `serve` (or, for the last two, `rebuild`) takes as flags (the rest are
# environment variables only).
FLAGS = frozenset({
    "host", "port", "app_id", "data_dir", "bootstrap_servers", "topic", "partitions",
    "cache_size_mb_per_server", "cache_size_embeddings_per_server", "auth_token_file",
    "match_auth_token_file", "allow_unauthenticated_writes", "tls_cert", "tls_key",
    "produce_timeout_s", "shutdown_timeout_s", "idle_poll_s", "max_lag_events", "match_source",
    "log_level", "checkpoint_topic", "from_checkpoint",
})


def describe_validation_error(exc: ValidationError) -> str:
    """A settings error as one line: the setting (flag and variable) and what is wrong
    with it, never its value (it may be a password)."""
    parts = []
    for error in exc.errors(include_url=False, include_input=False):
        loc = [str(part) for part in error["loc"]]
        message = error["msg"].removeprefix("Value error, ")
        if not loc:
            parts.append(message)
            continue
        model = exc.title
        if loc[0] in ("limits", "kafka") and len(loc) > 1:
            model, loc = ("Limits" if loc[0] == "limits" else "KafkaSecurity"), loc[1:]
        parts.append(f"{setting_names(model, loc[0])}: {message}")
    return "; ".join(parts)


class Resolved(NamedTuple):
    """Settings and where the capacity came from (for the effective-configuration line)."""

    settings: Settings
    capacity_source: str
    plugin: PluginConfig | None


def resolve(flags: dict[str, Any], plugin: PluginConfig | None) -> Resolved:
    """The settings from the flags given (``None``-free), the environment and the --config
    file's ``plugin``, in ``Settings``' order; raises ``ValidationError`` (or ``ValueError``)."""
    values = plugin.values if plugin is not None else {}
    token = _PLUGIN_VALUES.set(values)
    try:
        settings = Settings(**flags)
    finally:
        _PLUGIN_VALUES.reset(token)
    source = "default"
    if any(key in flags for key in CAPACITY_KEYS):
        source = "flag --" + next(k for k in CAPACITY_KEYS if k in flags).replace("_", "-")
    elif any(environment(f"MMCACHE_{key.upper()}") is not None for key in CAPACITY_KEYS):
        source = "environment " + next(_environment_name(f"MMCACHE_{k.upper()}") for k in CAPACITY_KEYS
                                       if environment(f"MMCACHE_{k.upper()}") is not None)
    elif plugin is not None and values:
        source = f"--config {plugin.source}"
    return Resolved(settings, source, plugin)
