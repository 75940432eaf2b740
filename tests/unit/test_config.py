"""--config reads the Go plugin's YAML in the forms users have (issue 10, item 3), and
settings errors are one line naming the flag and the variable, never the value."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from stream.config import (
    ConfigError,
    KafkaSecurity,
    Resolved,
    Settings,
    describe_validation_error,
    load_plugin_config,
)
from stream.serve import effective_configuration

# The gateway configuration as the plugin's documentation writes it, with the other
# plugins and the scheduling profiles around it.
GATEWAY = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters:
    modelName: Qwen/Qwen2.5-1.5B-Instruct
    vllm:
      http: http://localhost:8000
- type: mm-embeddings-cache-producer
  parameters:
    cacheSizeInMBPerServer: 512
- type: mm-embeddings-cache-scorer
schedulingProfiles:
- name: decode
  plugins:
  - pluginRef: mm-embeddings-cache-scorer
    weight: 4
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_a_whole_gateway_configuration_gives_the_producers_parameters(tmp_path):
    config = load_plugin_config(_write(tmp_path, GATEWAY))
    assert config.values == {"cache_size_mb_per_server": 512}
    assert "plugins[1]" in config.source
    line = config.describe()
    assert "took cacheSizeInMBPerServer=512" in line
    for ignored in ("plugins[0] (type token-producer)", "plugins[2] (type mm-embeddings-cache-scorer)",
                    "schedulingProfiles", "apiVersion", "kind"):
        assert ignored in line
    assert Settings(**config.values).capacity.per_endpoint == 256


@pytest.mark.parametrize("text", [
    "cacheSizeInMBPerServer: 512\n",
    "parameters:\n  cacheSizeInMBPerServer: 512\n",
    "type: mm-embeddings-cache-producer\nname: mm\nparameters:\n  cacheSizeInMBPerServer: 512\n",
])
def test_top_level_and_single_entry_forms(tmp_path, text):
    assert load_plugin_config(_write(tmp_path, text)).values == {"cache_size_mb_per_server": 512}


def test_a_producer_entry_without_parameters_means_the_defaults(tmp_path):
    config = load_plugin_config(_write(tmp_path, "plugins:\n- type: mm-embeddings-cache-producer\n"))
    assert config.values == {}
    assert "no parameters (defaults)" in config.describe()


@pytest.mark.parametrize(("text", "needle"), [
    ("plugins:\n- type: queue-scorer\n", "no entry of type mm-embeddings-cache-producer (found: queue-scorer)"),
    ("plugins:\n- type: mm-embeddings-cache-producer\n- type: mm-embeddings-cache-producer\n",
     "2 entries of type mm-embeddings-cache-producer (plugins[0], plugins[1])"),
    ("plugins:\n- type: mm-embeddings-cache-producer\n  parameters:\n    cacheSizeInMbPerServer: 1\n",
     "plugins[0].parameters: unknown parameter(s) cacheSizeInMbPerServer"),
    ("cacheSizeInMBPerServer: '512'\n", "top level.cacheSizeInMBPerServer must be an integer, not a string"),
    ("cacheSizeInMBPerServer: true\n", "must be an integer, not a boolean"),
    ("cacheSizeInMBPerServer: 1\ncacheSizeInEmbeddingsPerServer: 2\n", "not both"),
    ("- 1\n", "must be a YAML mapping, not a list"),
    ("plugins: 3\n", "plugins must be a list"),
    ("type: queue-scorer\nparameters: {}\n", "type is 'queue-scorer'"),
    ("a: [\n", "not valid YAML at line 2, column 1"),
])
def test_a_config_that_cannot_be_used_is_one_line_naming_the_problem(tmp_path, text, needle):
    with pytest.raises(ConfigError) as caught:
        load_plugin_config(_write(tmp_path, text))
    message = str(caught.value)
    assert needle in message
    assert "\n" not in message and str(tmp_path) in message


def test_a_missing_file_and_a_directory_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_plugin_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_plugin_config(tmp_path)


def test_settings_errors_name_the_flag_and_the_variable_and_never_the_value(monkeypatch):
    with pytest.raises(ValidationError) as caught:
        Settings(port=70000)
    assert describe_validation_error(caught.value) == (
        "--port / MMCACHE_PORT: Input should be less than or equal to 65535")
    monkeypatch.setenv("MMCACHE_MAX_ITEMS", "lots")
    with pytest.raises(ValidationError) as caught:
        Settings()
    line = describe_validation_error(caught.value)
    assert line.startswith("MMCACHE_MAX_ITEMS: ") and "lots" not in line
    monkeypatch.delenv("MMCACHE_MAX_ITEMS")
    monkeypatch.setenv("MMCACHE_KAFKA_SECURITY_PROTOCOL", "hunter2-protocol")
    with pytest.raises(ValidationError) as caught:
        Settings()
    line = describe_validation_error(caught.value)
    assert line.startswith("MMCACHE_KAFKA_SECURITY_PROTOCOL: ") and "hunter2" not in line


def test_the_effective_configuration_masks_the_password_and_says_where_capacity_came_from():
    kafka = KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="PLAIN", sasl_username="gw",
                          sasl_password=SecretStr("hunter2"))
    settings = Settings(app_id="a1", cache_size_mb_per_server=512, kafka=kafka,
                        auth_token_file=Path("/etc/mmcache/tokens"))
    line = effective_configuration(Resolved(settings, "--config g.yaml: plugins[1]", None),
                                   "kafka:9092", False, 8, "a1-lru-changelog")
    assert "hunter2" not in line and "password ****" in line
    assert "app id a1" in line and "a1-events (8 partitions)" in line and "a1-dead-letters" in line
    assert "256 entries per endpoint (cacheSizeInMBPerServer 512 MiB / 2 MiB an item) from --config" in line
    assert "auth for writes and /v1/state on (tokens from /etc/mmcache/tokens)" in line
    assert "auth for /v1/match off" in line and "broker kafka:9092" in line
    assert "\n" not in line


def test_a_config_error_names_the_variable_when_the_file_came_from_it(tmp_path, monkeypatch):
    from stream.cli import _parser, _settings

    broken = _write(tmp_path, "plugins: [\n")
    monkeypatch.setenv("MMCACHE_CONFIG", str(broken))
    with pytest.raises(SystemExit) as refused:
        _settings(_parser().parse_args(["serve"]))
    assert str(refused.value.code).startswith(f"configuration error: MMCACHE_CONFIG={broken}: not valid YAML")
    with pytest.raises(SystemExit) as refused:
        _settings(_parser().parse_args(["serve", "--config", str(broken)]))
    assert str(refused.value.code).startswith(f"configuration error: --config {broken}: not valid YAML")
