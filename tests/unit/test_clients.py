"""Kafka client security reaches every client: the options each builder gets, and what
Faust makes of its ``broker_credentials`` (the embedded Tansu 0.6 broker cannot show SASL
or its own TLS end to end; see tests/integration/test_kafka_security.py)."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import faust
import pytest
from faust.auth import SASLCredentials, SSLCredentials
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from stream.config import KafkaSecurity, Settings
from stream.kafka.clients import client_options, faust_credentials
from stream.worker.app import faust_settings


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ca")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(root / "key.pem"),
                    "-out", str(root / "cert.pem")], check=True, capture_output=True)
    return root / "cert.pem"


def test_plaintext_gives_only_the_protocol_and_no_faust_credentials():
    assert client_options(KafkaSecurity()) == {"security_protocol": "PLAINTEXT"}
    assert faust_credentials(KafkaSecurity()) is None


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_settings_reach_aiokafka_and_faust(mechanism):
    security = KafkaSecurity(security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism,
                             sasl_username="svc", sasl_password="pw")
    assert client_options(security) == {
        "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": mechanism,
        "sasl_plain_username": "svc", "sasl_plain_password": "pw",
    }
    credentials = faust_credentials(security)
    assert isinstance(credentials, SASLCredentials)
    # what Faust's aiokafka driver passes to its consumer and producer
    auth = credentials_to_aiokafka_auth(credentials)
    assert auth["security_protocol"] == "SASL_PLAINTEXT"
    assert auth["sasl_mechanism"] == mechanism
    assert (auth["sasl_plain_username"], auth["sasl_plain_password"]) == ("svc", "pw")


def test_sasl_ssl_carries_a_tls_context_verifying_the_ca(ca):
    security = KafkaSecurity(security_protocol="SASL_SSL", ssl_cafile=ca,
                             sasl_mechanism="SCRAM-SHA-512", sasl_username="u", sasl_password="p")
    options = client_options(security)
    assert isinstance(options["ssl_context"], ssl.SSLContext)
    assert options["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    auth = credentials_to_aiokafka_auth(faust_credentials(security))
    assert auth["security_protocol"] == "SASL_SSL"
    assert isinstance(auth["ssl_context"], ssl.SSLContext)


def test_ssl_gives_faust_ssl_credentials(ca):
    security = KafkaSecurity(security_protocol="SSL", ssl_cafile=ca)
    credentials = faust_credentials(security)
    assert isinstance(credentials, SSLCredentials)
    assert credentials_to_aiokafka_auth(credentials)["security_protocol"] == "SSL"


def test_the_faust_app_of_serve_gets_the_credentials(monkeypatch, tmp_path):
    monkeypatch.setenv("MMCACHE_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("MMCACHE_KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
    monkeypatch.setenv("MMCACHE_KAFKA_SASL_USERNAME", "svc")
    monkeypatch.setenv("MMCACHE_KAFKA_SASL_PASSWORD", "hunter2")
    settings = Settings(app_id="sec-app", data_dir=tmp_path)
    app = faust.App("sec-app", **faust_settings(settings, "127.0.0.1:9", embedded=False))
    credentials = app.conf.broker_credentials
    assert isinstance(credentials, SASLCredentials)
    assert credentials.mechanism.value == "SCRAM-SHA-256"
    assert (credentials.username, credentials.password) == ("svc", "hunter2")


def test_the_password_is_not_in_the_settings_repr(monkeypatch):
    security = KafkaSecurity(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
                             sasl_username="svc", sasl_password="hunter2")
    assert "hunter2" not in repr(security) and "hunter2" not in str(Settings(kafka=security))
