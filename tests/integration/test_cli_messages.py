"""The real `mmcache` command talks in one line (issue 10, items 3, 5, 6): every start-up
failure is one line on stderr with a non-zero exit, no traceback, and nothing changed;
--help documents every flag; a gateway's YAML is read as it is, also from MMCACHE_CONFIG;
`serve` logs its effective configuration once and is quiet otherwise."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stream.kafka.embedded import free_port

GATEWAY = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters:
    modelName: Qwen/Qwen2.5-1.5B-Instruct
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

pytestmark = pytest.mark.integration


def mmcache(*args: str, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 40) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MMCACHE_")}
    return subprocess.run([sys.executable, "-m", "stream.cli", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout, env={**clean, **(env or {})})


def one_line_failure(result: subprocess.CompletedProcess[str], needle: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    assert needle in lines[0], lines[0]
    return lines[0]


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_missing_and_a_broken_yaml_are_one_line_each(tmp_path):
    (tmp_path / "broken.yaml").write_text("plugins: [\n")
    before = listing(tmp_path)
    one_line_failure(mmcache("serve", "--config", "nope.yaml", cwd=tmp_path), "nope.yaml: no such file")
    one_line_failure(mmcache("serve", cwd=tmp_path, env={"MMCACHE_CONFIG": "gone.yaml"}),
                     "gone.yaml: no such file")
    one_line_failure(mmcache("serve", "--config", "broken.yaml", cwd=tmp_path),
                     "broken.yaml: not valid YAML at line 2")
    # from the variable, the line names the variable, not a flag that was never given
    for command in ("serve", "rebuild"):
        line = one_line_failure(mmcache(command, cwd=tmp_path, env={
            "MMCACHE_CONFIG": "broken.yaml", "MMCACHE_BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "MMCACHE_DATA_DIR": "new"}), "MMCACHE_CONFIG=broken.yaml: not valid YAML at line 2")
        assert "--config" not in line, line
    assert listing(tmp_path) == before  # no data dir, no broker files


def test_a_data_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "afile").write_text("mine")
    one_line_failure(mmcache("serve", "--data-dir", "afile", cwd=tmp_path),
                     "--data-dir afile is a file, not a directory")
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_taken_port_is_refused_before_anything_starts(tmp_path, bootstrap):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = mmcache("serve", "--host", "127.0.0.1", "--port", str(port), "--bootstrap-servers",
                         bootstrap, "--data-dir", "d", cwd=tmp_path)
    one_line_failure(result, f"--port {port}: the port is in use")
    assert not (tmp_path / "d").exists()


def test_an_unreachable_broker_is_one_line(tmp_path):
    port = free_port()
    one_line_failure(mmcache("serve", "--bootstrap-servers", f"127.0.0.1:{port}", "--data-dir", "d",
                             "--port", str(free_port()), cwd=tmp_path),
                     f"cannot reach the Kafka cluster at 127.0.0.1:{port}")
    assert not (tmp_path / "d").exists()


def test_rebuild_of_a_missing_topic_and_a_bad_until_are_one_line(tmp_path, bootstrap):
    one_line_failure(mmcache("rebuild", "--bootstrap-servers", bootstrap, "--data-dir", "new",
                             "--topic", "no-such-topic-here", cwd=tmp_path),
                     "topic no-such-topic-here does not exist")
    one_line_failure(mmcache("rebuild", "--bootstrap-servers", bootstrap, "--data-dir", "new",
                             "--until", "yesterday", cwd=tmp_path), "--until 'yesterday': give an offset")
    assert not (tmp_path / "new").exists()


def test_settings_errors_are_one_line_naming_flag_and_variable_without_the_value(tmp_path):
    one_line_failure(mmcache("serve", "--port", "99999", cwd=tmp_path), "--port / MMCACHE_PORT")
    line = one_line_failure(mmcache("serve", cwd=tmp_path, env={"MMCACHE_PARTITIONS": "s3cr3t"}),
                            "--partitions / MMCACHE_PARTITIONS")
    assert "s3cr3t" not in line
    one_line_failure(mmcache("serve", cwd=tmp_path, env={"MMCACHE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}),
                     "needs MMCACHE_KAFKA_SASL_MECHANISM")


def test_help_documents_every_flag_with_default_and_variable_and_version(tmp_path):
    top = mmcache("--help", cwd=tmp_path)
    assert top.returncode == 0 and "CONTRACT" not in top.stdout and "../shared" not in top.stdout
    version = mmcache("--version", cwd=tmp_path)
    assert version.returncode == 0 and re.fullmatch(r"mmcache \d+\.\d+\.\d+\S*\n", version.stdout)
    serve = mmcache("serve", "--help", cwd=tmp_path).stdout
    flags = set(re.findall(r"^  (--[a-z-]+)", serve, re.M)) - {"--help", "--debug"}
    assert {"--port", "--config", "--max-lag-events", "--log-level", "--auth-token-file"} <= flags
    for flag in flags:
        text = re.search(rf"^  {flag}.*?(?=^  -|\Z)", serve, re.M | re.S).group(0)
        text = " ".join(text.split()).replace("- ", "-")
        env = "MMCACHE_" + flag[2:].replace("-", "_").upper()
        assert "default:" in text and f"env {env}" in text, text
    assert "MMCACHE_MAX_ITEMS (default 1024)" in serve
    bench = mmcache("bench", "--help", cwd=tmp_path).stdout
    assert "match, freshness, ingest, replay, restart" in " ".join(bench.split())
    for command in (["rebuild"], ["broker"], ["state", "digest"]):
        text = mmcache(*command, "--help", cwd=tmp_path).stdout
        for flag in set(re.findall(r"^  (--[a-z-]+)", text, re.M)) - {"--help", "--debug"}:
            block = re.search(rf"^  {flag}.*?(?=^  -|\Z)", text, re.M | re.S).group(0)
            assert "default" in block or "required" in block, block


def test_serve_reads_a_gateway_configuration_from_mmcache_config_and_says_so_once(tmp_path, bootstrap):
    (tmp_path / "gateway.yaml").write_text(GATEWAY)
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMCACHE_")}
    env["MMCACHE_CONFIG"] = "gateway.yaml"
    with open(log_path, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "stream.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--bootstrap-servers", bootstrap, "--app-id", f"cli-{port}", "--data-dir", "d"],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        from tests.integration.conftest import eventually, http

        def ready() -> bool:
            assert process.poll() is None, log_path.read_text()
            try:
                return http("GET", f"http://127.0.0.1:{port}/readyz")[0] == 200
            except OSError:
                return False

        eventually(ready, timeout=40, interval=0.1)
        status, state = http("GET", f"http://127.0.0.1:{port}/v1/state")
        assert status == 200 and state["capacity"] == {"mode": "items", "per_endpoint": 256}
    finally:
        process.terminate()
        process.wait(30)
    text = log_path.read_text()
    assert text.count("effective configuration:") == 1
    assert "took cacheSizeInMBPerServer=512 from gateway.yaml: plugins[1]" in text
    assert "ignored plugins[0] (type token-producer)" in text and "schedulingProfiles" in text
    assert "256 entries per endpoint" in text
    # quiet at the default level: no Faust tables, no group chatter, no traceback
    for noise in ("Subscribed to topic", "+----", "Joined group", "[^Worker]", "Traceback"):
        assert noise not in text, noise
    assert len(text.splitlines()) < 25, text
