"""The deployment files parse and say what they must: Kubernetes (deploy/kubernetes),
Compose (docker-compose.yml), Grafana (deploy/grafana) and Prometheus rules
(deploy/prometheus), whose metric names are checked against GET /metrics of a real
``mmcache serve``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

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
