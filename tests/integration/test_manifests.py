"""The deployment files parse and say what they must: Kubernetes (deploy/kubernetes),
Compose (docker-compose.yml), Grafana (deploy/grafana) and Prometheus rules
(deploy/prometheus), whose metric names are checked against GET /metrics of a real
``mmcache serve``."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from stream.cli import _parser, _settings
from stream.config import Settings
from stream.http.auth import refuse_open_writes
from tests.integration.conftest import Service, eventually

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
KAFKA_SECURITY = {"MMCACHE_KAFKA_SECURITY_PROTOCOL", "MMCACHE_KAFKA_SASL_MECHANISM",
                  "MMCACHE_KAFKA_SASL_USERNAME", "MMCACHE_KAFKA_SASL_PASSWORD",
                  "MMCACHE_KAFKA_SSL_CAFILE", "MMCACHE_KAFKA_SSL_CERTFILE",
                  "MMCACHE_KAFKA_SSL_KEYFILE"}
METRIC = re.compile(r"\b(?:mmcache|encoder_cache|process)_[a-z0-9_]+\b")


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kube() -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in _documents(path):
            kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


def _statefulset() -> dict[str, Any]:
    (sts,) = _kube()["StatefulSet"]
    return sts


def _container() -> dict[str, Any]:
    (container,) = _statefulset()["spec"]["template"]["spec"]["containers"]
    return container


def _memory_bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_kustomization_lists_every_manifest_but_the_secret_example():
    (kustomization,) = _documents(KUBE / "kustomization.yaml")
    listed = set(kustomization["resources"])
    present = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml", "secrets.example.yaml"}
    assert listed == present


def test_statefulset_has_a_volume_per_worker_probes_and_a_grace_above_the_shutdown_bound():
    sts = _statefulset()
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    assert spec["replicas"] == 3
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    container = _container()
    config = {k: v for doc in _kube()["ConfigMap"] for k, v in doc["data"].items()}
    data_mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}[claim["metadata"]["name"]]
    assert config["MMCACHE_DATA_DIR"] == data_mount  # the data dir is on the per-pod claim
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["terminationGracePeriodSeconds"] > float(config["MMCACHE_SHUTDOWN_TIMEOUT_S"])
    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert int(annotations["prometheus.io/port"]) == port == int(config["MMCACHE_PORT"])
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert _memory_bytes(limits["memory"]) >= _memory_bytes(requests["memory"]) >= 2**29
    assert claim["spec"]["resources"]["requests"]["storage"].endswith("Gi")


def test_kafka_security_comes_from_a_secret_and_the_tokens_from_a_secret_volume():
    container, pod = _container(), _statefulset()["spec"]["template"]["spec"]
    env = {e["name"]: e for e in container["env"]}
    for name in KAFKA_SECURITY:
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("mmcache-kafka", name)
    token_file = Path(env["MMCACHE_AUTH_TOKEN_FILE"]["value"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    auth = volumes[mounts[str(token_file.parent)]]
    assert auth["secret"]["secretName"] == "mmcache-auth"
    examples = {doc["metadata"]["name"]: doc for doc in _documents(KUBE / "secrets.example.yaml")}
    assert set(examples["mmcache-kafka"]["stringData"]) <= KAFKA_SECURITY
    assert token_file.name in examples["mmcache-auth"]["stringData"]


def test_services_and_disruption_budget_select_the_workers():
    kinds = _kube()
    labels = _statefulset()["spec"]["template"]["metadata"]["labels"]
    services = {s["metadata"]["name"]: s for s in kinds["Service"]}
    assert services[_statefulset()["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    api = [s for s in services.values() if s["spec"].get("clusterIP") != "None"]
    assert len(api) == 1 and api[0]["spec"]["ports"][0]["targetPort"] == "http"
    for service in services.values():
        assert service["spec"]["selector"].items() <= labels.items()
    (pdb,) = kinds["PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1


def test_compose_runs_kraft_kafka_and_three_workers_with_their_own_volume_and_port():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    workers = {name: s for name, s in services.items() if s.get("build") == "."}
    assert len(workers) == 3
    volumes = [s["volumes"][0].split(":")[0] for s in workers.values()]
    ports = [s["ports"][0].split(":")[0] for s in workers.values()]
    assert len(set(volumes)) == 3 and set(volumes) <= set(compose["volumes"])
    assert len(set(ports)) == 3
    for worker in workers.values():
        assert worker["volumes"][0].endswith(":/data")
        assert "/readyz" in " ".join(worker["healthcheck"]["test"])
        assert worker["depends_on"]["kafka"]["condition"] == "service_healthy"
        assert worker["environment"]["MMCACHE_APP_ID"] == "mmcache"  # one group
    # one name in front of them, listing every worker
    front = services["mmcache"]
    assert front["healthcheck"] and set(front["depends_on"]) == set(workers)
    conf = (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    assert all(f"server {name}:8080" in conf for name in workers)


def _image_env() -> dict[str, str]:
    """The MMCACHE_* variables the Dockerfile's image sets."""
    env = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ENV "):
            env.update(part.split("=", 1) for part in shlex.split(line[4:]) if "=" in part)
    return {k: v for k, v in env.items() if k.startswith("MMCACHE_")}


def _serve_settings(monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str]) -> Settings:
    """The settings the real command line resolves from ``args`` and ``env`` alone."""
    for name in [k for k in os.environ if k.startswith("MMCACHE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return _settings(_parser().parse_args(args)).settings


def _generate_tokens(script: str, volume: Path) -> Path:
    """Run the compose `tokens` service's script on ``volume`` (as the volume's root)."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(script.replace('"/auth', f'"{volume}'), "tokens", "exec"), namespace)  # noqa: S102
    return volume / "tokens"


def test_compose_generates_a_write_token_and_every_published_port_needs_it(tmp_path, monkeypatch):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    workers = {name: s for name, s in services.items() if s.get("build") == "."}
    # the one-shot token writer: a random token into a volume of its own, kept once there
    tokens = services["tokens"]
    (volume_name, at) = tokens["volumes"][0].split(":")[:2]
    assert volume_name in compose["volumes"] and at == "/auth"
    if os.geteuid() != 0:  # the service runs as root to hand the file to uid 10001
        monkeypatch.setattr(os, "fchown", lambda *a: None)
    written = _generate_tokens(tokens["command"][-1], tmp_path)
    (token,) = written.read_text().split()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert written.stat().st_mode & 0o077 == 0  # readable by its owner only
    assert _generate_tokens(tokens["command"][-1], tmp_path).read_text().split() == [token]
    image = _image_env()
    assert image["MMCACHE_HOST"] == "0.0.0.0"  # in a container: every interface
    for name, worker in workers.items():
        env = worker["environment"]
        token_file = Path(env["MMCACHE_AUTH_TOKEN_FILE"])
        mounts = {v.split(":")[1]: v.split(":")[0] for v in worker["volumes"]}
        assert mounts[str(token_file.parent)] == volume_name, name
        assert token_file.name == written.name, name
        assert worker["depends_on"]["tokens"]["condition"] == "service_completed_successfully"
        # the real start-up check, on what this worker is given
        settings = _serve_settings(monkeypatch, ["serve"], {**image, **env})
        assert settings.host == "0.0.0.0" and settings.auth_token_file == token_file
        refuse_open_writes(settings.model_copy(update={"auth_token_file": written}))
        open_env = {k: v for k, v in {**image, **env}.items() if k != "MMCACHE_AUTH_TOKEN_FILE"}
        with pytest.raises(SystemExit):
            refuse_open_writes(_serve_settings(monkeypatch, ["serve"], open_env))
    # every published port is a worker's (tokens) or the front's, which only proxies to them
    conf = (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    upstreams = set(re.findall(r"^\s*server ([a-z0-9-]+):8080", conf, re.M))
    for name, service in services.items():
        if service.get("ports"):
            assert name in workers or (name == "mmcache" and upstreams == set(workers)), name
    text = (ROOT / "docker-compose.yml").read_text()
    assert "ALLOW_UNAUTHENTICATED" not in text and "allow-unauthenticated" not in text


def test_kubernetes_listens_on_every_interface_with_tokens_from_a_required_secret(tmp_path, monkeypatch):
    container, pod = _container(), _statefulset()["spec"]["template"]["spec"]
    assert container["args"][:3] == ["serve", "--host", "0.0.0.0"]
    env = {k: v for doc in _kube()["ConfigMap"] for k, v in doc["data"].items()}
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    settings = _serve_settings(monkeypatch, container["args"], {**_image_env(), **env})
    assert settings.host == "0.0.0.0" and settings.auth_token_file is not None
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    secret = volumes[mounts[str(settings.auth_token_file.parent)]]["secret"]
    assert secret["secretName"] == "mmcache-auth" and not secret.get("optional", False)
    tokens = tmp_path / settings.auth_token_file.name
    tokens.write_text("a-token-from-the-secret\n")
    refuse_open_writes(settings.model_copy(update={"auth_token_file": tokens}))
    with pytest.raises(SystemExit):
        refuse_open_writes(settings.model_copy(update={"auth_token_file": None}))
    for path in [*KUBE.glob("*.yaml"), ROOT / "Dockerfile"]:
        text = path.read_text()
        assert "ALLOW_UNAUTHENTICATED" not in text and "allow-unauthenticated" not in text, path


def _expressions() -> dict[str, list[str]]:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "mmcache-dashboard.json").read_text())
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    return {
        "dashboard": [t["expr"] for p in dashboard["panels"] for t in p["targets"]],
        "rules": [r["expr"] for g in rules["groups"] for r in g["rules"]],
    }


def test_dashboard_and_rules_cover_what_operators_watch():
    exprs = _expressions()
    dashboard, rules = " ".join(exprs["dashboard"]), " ".join(exprs["rules"])
    for name in ("mmcache_http_request_duration_seconds_count", "encoder_cache_hit_ratio",
                 "mmcache_view_lag_events", "mmcache_view_staleness_seconds",
                 "mmcache_dead_letters_total", 'mmcache_http_requests_total{code="503"}',
                 "mmcache_write_failures_total"):
        assert name in dashboard, name
    for name in ("mmcache_view_staleness_seconds", "mmcache_view_lag_events",
                 "mmcache_dead_letters_total", "mmcache_write_failures_total"):
        assert name in rules, name


@pytest.mark.integration
def test_every_metric_the_dashboard_and_rules_use_is_exported_by_serve(service: Service):
    # staleness is exported once the worker has read the log's ends
    text = eventually(lambda: (lambda t: "mmcache_view_staleness_seconds" in t and t)(
        service.get("/metrics")[1]))
    exported = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            exported |= ({name, f"{name}_bucket", f"{name}_count", f"{name}_sum"}
                         if kind == "histogram" else {name})
        elif line and not line.startswith("#"):
            exported.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    used = {name for exprs in _expressions().values() for e in exprs for name in METRIC.findall(e)}
    assert used - exported == set()
    assert {"mmcache_dead_letters_total", "mmcache_view_lag_events",
            "process_resident_memory_bytes"} <= used
