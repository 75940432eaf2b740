"""The one place where Kafka clients get their connection security.

Every Kafka client of mmcache (publisher, Faust app, changelog follower, rebuild,
admin, bench) is built with ``client_options`` (aiokafka) or ``faust_credentials``
(Faust), so TLS and SASL settings (``KafkaSecurity``) reach all of them alike.
The password leaves its ``SecretStr`` only here, into the client's own arguments.
"""

from __future__ import annotations

import ssl
from typing import Any

from aiokafka.helpers import create_ssl_context
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from faust.auth import SASLCredentials, SSLCredentials
from faust.types.auth import CredentialsT

from stream.config import KafkaSecurity

__all__ = ["MAX_REQUEST_BYTES", "client_options", "faust_credentials", "record_bytes", "ssl_context"]

#: aiokafka's default ``max_request_size``, which mmcache's event producers keep: a record
#: over it is refused by the producer every time (``MessageSizeTooLargeError``).
MAX_REQUEST_BYTES = 1_048_576


def record_bytes(key: bytes | None, value: bytes) -> int:
    """A record's size as the producer checks it against ``MAX_REQUEST_BYTES``."""
    return int(DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, []))


def ssl_context(security: KafkaSecurity) -> ssl.SSLContext | None:
    """The TLS context of an ``SSL`` or ``SASL_SSL`` connection, else ``None``."""
    if not security.security_protocol.endswith("SSL"):
        return None
    return create_ssl_context(
        cafile=_path(security.ssl_cafile),
        certfile=_path(security.ssl_certfile),
        keyfile=_path(security.ssl_keyfile),
    )


def client_options(security: KafkaSecurity) -> dict[str, Any]:
    """Keyword arguments for any aiokafka client (producer, consumer, admin)."""
    options: dict[str, Any] = {"security_protocol": security.security_protocol}
    context = ssl_context(security)
    if context is not None:
        options["ssl_context"] = context
    if security.security_protocol.startswith("SASL_"):
        assert security.sasl_password is not None  # KafkaSecurity checks it
        options.update(
            sasl_mechanism=security.sasl_mechanism,
            sasl_plain_username=security.sasl_username,
            sasl_plain_password=security.sasl_password.get_secret_value(),
        )
    return options


def faust_credentials(security: KafkaSecurity) -> CredentialsT | None:
    """Faust's ``broker_credentials`` for the same settings (``None``: plaintext)."""
    context = ssl_context(security)
    if security.security_protocol.startswith("SASL_"):
        assert security.sasl_password is not None
        return SASLCredentials(
            username=security.sasl_username,
            password=security.sasl_password.get_secret_value(),
            ssl_context=context,
            mechanism=security.sasl_mechanism,
        )
    if context is not None:
        return SSLCredentials(context)
    return None


def _path(path: Any) -> str | None:
    return None if path is None else str(path)
