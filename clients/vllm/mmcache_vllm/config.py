"""The plugin's settings, read once from vLLM's ``manager_config`` when the scheduler starts.

A bad setting raises :class:`ConfigError` from ``create_manager``: vLLM then refuses to
start, and its log ends with one line naming the key and what it takes (after vLLM's own
traceback of the engine's start). That is the only place the plugin fails on purpose; once
running it never raises into vLLM.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "ReporterConfig", "SERVICE_ACCOUNT_NAMESPACE", "MAX_BATCH_SIZE", "read_token",
           "stamp"]

# the service's default MMCACHE_MAX_ITEMS: a POST never carries more items and hashes
MAX_BATCH_SIZE = 1024
MAX_ENDPOINT_CHARS = 253
# where Kubernetes mounts the pod's namespace, unless service-account tokens are turned off
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
EVENTS_PATH = "/v1/engine-events"
_TOKEN = re.compile(r"[!-~]+")  # visible ASCII, no spaces: a header value as is
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ConfigError(ValueError):
    """A ``manager_config`` setting the plugin cannot run with (raised at start only)."""


@dataclass(frozen=True)
class ReporterConfig:
    """The effective settings. The token is left out of ``repr``, so no log holds it."""

    events_url: str
    endpoint: str
    token: str | None = field(default=None, repr=False)
    # re-read by the sender when the file changes (a rotated Secret), see reporter.py
    token_file: str | None = None
    # the file's stamp taken before ``token`` was read: a rotation after that is seen
    # (None: unknown, the sender reads the file again before its first POST)
    token_stamp: tuple[int, int, int] | None = None
    batch_size: int = 512
    interval_s: float = 0.2
    queue_size: int = 10_000
    # above the service's produce timeout (2 s): a slow broker is answered 503, not guessed
    timeout_s: float = 3.0
    max_backoff_s: float = 5.0
    log_interval_s: float = 60.0
    ca_file: str | None = None

    @classmethod
    def from_manager_config(cls, raw: Any, environ: Mapping[str, str] | None = None,
                            namespace_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> ReporterConfig:
        """Checks every key of ``raw`` (vLLM's ``ec_manager_config.manager_config``)."""
        environ = os.environ if environ is None else environ
        if not isinstance(raw, Mapping):
            raise ConfigError(f"mmcache-vllm: manager_config must be a JSON object, not {type(raw).__name__}")
        unknown = sorted(set(raw) - KEYS)
        if unknown:
            raise ConfigError(f"mmcache-vllm: manager_config: unknown key(s) "
                              f"{', '.join(map(repr, unknown))}; known: {', '.join(sorted(KEYS))}")
        if "url" not in raw:
            raise ConfigError('mmcache-vllm: manager_config.url is required: mmcache\'s base URL, '
                              'e.g. "http://mmcache.mmcache.svc:8080"')
        defaults = cls.__dataclass_fields__
        batch_size = _integer(raw, "batch_size", defaults["batch_size"].default, 1, MAX_BATCH_SIZE)
        queue_size = _integer(raw, "queue_size", defaults["queue_size"].default, batch_size, 10_000_000)
        token_file = _readable_file(raw.get("token_file"), "token_file")
        token_stamp = stamp(token_file)  # before the token: a later rotation changes it
        return cls(
            events_url=_url(raw["url"]),
            endpoint=_endpoint(raw.get("endpoint"), environ, namespace_file),
            token=None if token_file is None else read_token(token_file),
            token_file=token_file,
            token_stamp=token_stamp,
            batch_size=batch_size,
            interval_s=_seconds(raw, "interval_s", defaults["interval_s"].default),
            queue_size=queue_size,
            timeout_s=_seconds(raw, "timeout_s", defaults["timeout_s"].default),
            max_backoff_s=_seconds(raw, "max_backoff_s", defaults["max_backoff_s"].default),
            log_interval_s=_seconds(raw, "log_interval_s", defaults["log_interval_s"].default),
            ca_file=_readable_file(raw.get("ca_file"), "ca_file"),
        )


KEYS = frozenset({"url", "endpoint", "token_file", "batch_size", "interval_s", "queue_size",
                  "timeout_s", "max_backoff_s", "log_interval_s", "ca_file"})


def _url(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError('mmcache-vllm: manager_config.url must be a string such as "http://mmcache:8080"')
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"mmcache-vllm: manager_config.url must be http:// or https:// with a host, "
                          f"not {value!r}")
    if parts.username is not None or parts.password is not None:
        raise ConfigError("mmcache-vllm: manager_config.url must not hold credentials; "
                          "give the token in manager_config.token_file")
    if parts.query or parts.fragment:
        raise ConfigError("mmcache-vllm: manager_config.url is mmcache's base URL, "
                          "without a query or fragment")
    return value.rstrip("/") + EVENTS_PATH


def _endpoint(value: Any, environ: Mapping[str, str], namespace_file: Path) -> str:
    if value is None:
        value = _pod_name(environ, namespace_file)
    elif not isinstance(value, str):
        raise ConfigError("mmcache-vllm: manager_config.endpoint must be a string (the pod's namespace/name)")
    if not 1 <= len(value) <= MAX_ENDPOINT_CHARS or _CONTROL.search(value):
        raise ConfigError(f"mmcache-vllm: endpoint must be 1 to {MAX_ENDPOINT_CHARS} characters "
                          f"without control characters: {value[:80]!r}")
    return value


def _pod_name(environ: Mapping[str, str], namespace_file: Path) -> str:
    """``namespace/name`` of the pod, as the gateway names it (its ``NamespacedName``)."""
    name = environ.get("POD_NAME") or environ.get("HOSTNAME")
    namespace = environ.get("POD_NAMESPACE")
    if not namespace:
        try:
            namespace = namespace_file.read_text().strip()
        except OSError:
            namespace = None
    if not name or not namespace:
        wanted = (("POD_NAMESPACE", namespace), ("POD_NAME (or HOSTNAME)", name))
        missing = " and ".join(what for what, have in wanted if not have)
        raise ConfigError(f"mmcache-vllm: cannot name this endpoint: {missing} not set; set them through "
                          "the downward API (metadata.namespace, metadata.name) or give "
                          'manager_config.endpoint, e.g. "default/vllm-0"')
    return f"{namespace}/{name}"


def read_token(path: str) -> str:
    """The first line of the file that is neither empty nor a ``#`` comment. No message
    below ever holds the file's content."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"mmcache-vllm: manager_config.token_file: cannot read {path}: {reason}") from None
    tokens = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not tokens:
        raise ConfigError(f"mmcache-vllm: manager_config.token_file {path} holds no token "
                          "(one per line; empty lines and # comments are skipped)")
    if not _TOKEN.fullmatch(tokens[0]):
        raise ConfigError(f"mmcache-vllm: manager_config.token_file {path}: the token must be "
                          "visible ASCII characters without spaces")
    return tokens[0]


def stamp(path: str | None) -> tuple[int, int, int] | None:
    """What tells a changed file: its inode, modification time and size (a Secret's
    volume swaps a symlink, which ``stat`` follows)."""
    if path is None:
        return None
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_ino, status.st_mtime_ns, status.st_size


def _readable_file(path: Any, key: str) -> str | None:
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ConfigError(f"mmcache-vllm: manager_config.{key} must be a file path (a string)")
    if not os.access(path, os.R_OK) or not os.path.isfile(path):
        raise ConfigError(f"mmcache-vllm: manager_config.{key}: {path} is not a readable file")
    return path


def _integer(raw: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"mmcache-vllm: manager_config.{key} must be an integer from {low} to {high}, "
                          f"not {value!r}")
    return value


def _seconds(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
        raise ConfigError(f"mmcache-vllm: manager_config.{key} must be a number of seconds above 0 "
                          f"(at most 3600), not {value!r}")
    return float(value)
