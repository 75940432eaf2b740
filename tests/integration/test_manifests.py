"""The deployment files parse and say what they must: Kubernetes (deploy/kubernetes),
Compose (docker-compose.yml), Grafana (deploy/grafana) and Prometheus rules
(deploy/prometheus), whose metric names are checked against GET /metrics of a real
``mmcache serve``."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from stream.cli import _parser, _settings
from stream.config import Limits, Settings
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


# --- Pod Security "restricted", the policy checker, and the rendered kustomizations ---

#: Checkov's checks of what the Pod Security "restricted" level (and a read-only root)
#: asks of a pod: each must pass on the StatefulSet, not merely be absent from the failures.
RESTRICTED_CHECKS = {
    "CKV_K8S_16": "not privileged", "CKV_K8S_17": "no host PID", "CKV_K8S_18": "no host IPC",
    "CKV_K8S_19": "no host network", "CKV_K8S_20": "allowPrivilegeEscalation: false",
    "CKV_K8S_22": "read-only root filesystem", "CKV_K8S_23": "runAsNonRoot",
    "CKV_K8S_25": "no added capabilities", "CKV_K8S_26": "no host port",
    "CKV_K8S_28": "NET_RAW dropped", "CKV_K8S_29": "pod security context",
    "CKV_K8S_30": "container security context", "CKV_K8S_31": "seccomp RuntimeDefault",
    "CKV_K8S_37": "all capabilities dropped", "CKV_K8S_38": "no service account token",
    "CKV_K8S_39": "no SYS_ADMIN", "CKV_K8S_40": "a high UID",
}
#: Checks of other policies that the manifests fail on purpose, and why.
WAIVED_CHECKS = {
    "CKV_K8S_11": "no CPU limit: throttling would show as match latency (requests reserve a core)",
    "CKV_K8S_15": "IfNotPresent with a fixed tag from kustomization.yaml's images:",
    "CKV_K8S_35": "the Kafka security settings are environment variables by their contract "
                  "names (MMCACHE_KAFKA_*), from a Secret, never logged",
    "CKV_K8S_43": "the digest is the operator's, after they push the image (images: digest)",
}
#: Failures of the files as they are that kustomization.yaml resolves when it renders them.
RAW_ONLY_CHECKS = {
    "CKV_K8S_21": "kustomization.yaml's namespace: sets it",
    "CKV_K8S_14": "kustomization.yaml's images: sets the tag",
}
PROMETHEUS = ROOT / "deploy" / "prometheus"


def _checkov(target: Path) -> dict[str, Any]:
    """Checkov's Kubernetes checks on a directory or a file, as JSON."""
    binary = ROOT / ".venv-checkov" / "bin" / "checkov"
    if not binary.exists():
        pytest.fail("checkov is not installed: `make .venv-checkov/bin/checkov` (make test does it)")
    flag = "-d" if target.is_dir() else "-f"
    result = subprocess.run([str(binary), flag, str(target), "--framework", "kubernetes", "-o", "json",
                             "--skip-download"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    report = json.loads(result.stdout)
    assert report["summary"]["parsing_errors"] == 0, report["summary"]
    return report


def _policy_failures(report: dict[str, Any]) -> dict[str, set[str]]:
    failures: dict[str, set[str]] = {}
    for check in report["results"]["failed_checks"]:
        failures.setdefault(check["check_id"], set()).add(check["resource"])
    return failures


def _restricted_passed(report: dict[str, Any]) -> set[str]:
    return {check["check_id"] for check in report["results"]["passed_checks"]
            if check["resource"].startswith("StatefulSet.") and check["check_id"] in RESTRICTED_CHECKS}


def test_manifests_pass_the_restricted_level_checks_of_a_policy_checker():
    report = _checkov(KUBE)
    assert _restricted_passed(report) == set(RESTRICTED_CHECKS)
    failed = _policy_failures(report)
    assert set(failed) - set(WAIVED_CHECKS) - set(RAW_ONLY_CHECKS) == set(), failed


def _kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed: the kustomizations are not rendered here (checkov "
                    "still checks the files, test_manifests_pass_the_restricted_level_checks_...)")
    return found


def _render(kubectl: str, directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_rendered_kustomizations_pass_the_policy_checks_in_their_namespace_with_one_image(tmp_path):
    kubectl = _kubectl()
    (kustomization,) = _documents(KUBE / "kustomization.yaml")
    namespace = kustomization["namespace"]
    (image,) = kustomization["images"]
    assert _container()["image"] == image["name"]  # the file names the image only by its name
    assert image["newTag"] not in ("", "latest")
    for directory in (KUBE, PROMETHEUS / "operator"):
        docs = _render(kubectl, directory)
        for doc in docs:
            if doc["kind"] != "Namespace":
                assert doc["metadata"]["namespace"] == namespace, doc["metadata"]
        (ns,) = [doc for doc in docs if doc["kind"] == "Namespace"]
        assert ns["metadata"]["name"] == namespace
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        (sts,) = [doc for doc in docs if doc["kind"] == "StatefulSet"]
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        assert container["image"] == f"{image['newName']}:{image['newTag']}"
        rendered = tmp_path / f"{directory.name}.yaml"
        rendered.write_text(yaml.safe_dump_all(docs))
        report = _checkov(rendered)
        assert _restricted_passed(report) == set(RESTRICTED_CHECKS)
        failed = _policy_failures(report)
        assert set(failed) - set(WAIVED_CHECKS) == set(), failed
    kinds = {doc["kind"] for doc in _render(kubectl, PROMETHEUS / "operator")}
    assert {"ServiceMonitor", "PrometheusRule", "StatefulSet", "NetworkPolicy"} <= kinds


def test_every_path_the_container_writes_is_a_volume_and_the_rest_is_read_only():
    container, pod = _container(), _statefulset()["spec"]["template"]["spec"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    config = {k: v for doc in _kube()["ConfigMap"] for k, v in doc["data"].items()}
    writable = {m["mountPath"]: m["name"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert set(writable) == {config["MMCACHE_DATA_DIR"], env["TMPDIR"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[writable[env["TMPDIR"]]]


def _figures() -> dict[str, dict[str, Any]]:
    return {f["name"]: f for f in json.loads((ROOT / "bench" / "results.json").read_text())["figures"]}


def _scale3_bytes_per_entry() -> tuple[float, float]:
    """A worker's RSS per view entry at the three-worker scale run (bench/results.json):
    the largest RSS of a worker over its entries (the process's own memory included, so an
    upper bound at that size), and its start's peak over that RSS."""
    rss = _figures()["scale3_worker_rss_max"]
    assert rss["unit"] == "MiB"
    entries = int(re.search(r"([\d,]+) entries", rss["note"]).group(1).replace(",", ""))
    peaks = [float(p) for p in re.findall(r"peak ([\d.]+)", rss["note"])]
    return rss["value"] * 2**20 / entries, max(peaks) / rss["value"]


def test_memory_requests_and_limits_hold_the_view_the_config_allows(monkeypatch):
    """docs/kubernetes.md "Sizing": request >= endpoints x entries x bytes an entry; limit
    >= the start's peak over that, plus each body reader's worst body and the bodies in flight."""
    per_entry, peak = _scale3_bytes_per_entry()
    readers = max(_figures()[name]["value"] for name in ("body_reader_rss_peak_match",
                                                        "body_reader_rss_peak_write")) * 2**20
    container = _container()
    config = {k: v for doc in _kube()["ConfigMap"] for k, v in doc["data"].items()}
    settings = _serve_settings(monkeypatch, container["args"], {**_image_env(), **config})
    fields = {f"MMCACHE_{name.upper()}" for name in [*Settings.model_fields, *Limits.model_fields]}
    assert set(config) <= fields  # every key is a setting serve reads
    limits_of = settings.limits
    view = limits_of.max_total_endpoints * settings.capacity.per_endpoint * per_entry
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert settings.body_readers is not None  # not one per core of whatever node it lands on
    assert _memory_bytes(requests["memory"]) >= view
    assert (_memory_bytes(limits["memory"])
            >= peak * view + settings.body_readers * readers + limits_of.body_budget)
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    assert f"{per_entry:.0f} B an entry" in doc
    # the doc's worked example, for the shipped bound
    assert f"-> {view / 2**20:,.0f} MiB" in doc
    total = peak * view + readers + limits_of.body_budget
    assert f"R x {readers / 2**20:,.0f} MiB" in doc and f"= {total / 2**20:,.0f} MiB" in doc
    assert f"MMCACHE_MAX_TOTAL_ENDPOINTS={limits_of.max_total_endpoints:,}" in doc


def test_network_policy_lets_in_the_api_port_and_out_only_kafka_and_dns():
    (policy,) = _kube()["NetworkPolicy"]
    labels = _statefulset()["spec"]["template"]["metadata"]["labels"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    (ingress,) = spec["ingress"]
    assert [p["port"] for p in ingress["ports"]] == ["http"]  # the container's port, by name
    sources = {peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
               for peer in ingress["from"]}
    assert sources == {"gateway", "vllm", "monitoring"}
    config = {k: v for doc in _kube()["ConfigMap"] for k, v in doc["data"].items()}
    host, port = config["MMCACHE_BOOTSTRAP_SERVERS"].split(",")[0].rsplit(":", 1)
    kafka, dns = spec["egress"]
    assert host.split(".")[1] == kafka["to"][0]["namespaceSelector"]["matchLabels"][
        "kubernetes.io/metadata.name"]  # kafka-bootstrap.<namespace>.svc
    assert int(port) in {p["port"] for p in kafka["ports"]}
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}


def _rule_selectors() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"] if re.search(r"\bup\{", r["expr"])]


def test_alerts_on_up_key_on_the_pod_label_the_manifests_set_and_every_scrape_carries_it():
    labels = _statefulset()["spec"]["template"]["metadata"]["labels"]
    exprs = _rule_selectors()
    assert exprs  # a worker that is down is alerted on
    for expr in exprs:
        for name, value in re.findall(r'(\w+)="([^"]*)"', expr):
            # a pod label as Prometheus carries it: every character not [a-zA-Z0-9_] as _
            assert {re.sub(r"\W", "_", k): v for k, v in labels.items()}.get(name) == value, expr
    # the ServiceMonitor carries that pod label and honours the metrics' own `pod`
    (monitor,) = _documents(PROMETHEUS / "operator" / "servicemonitor.yaml")
    assert set(labels) & set(monitor["spec"]["podTargetLabels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True and endpoint["path"] == "/metrics"
    services = {s["metadata"]["name"]: s for s in _kube()["Service"]}
    selected = [name for name, s in services.items()
                if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert selected == [_statefulset()["spec"]["serviceName"]]  # each worker scraped once
    assert endpoint["port"] in {p["name"] for p in services[selected[0]]["spec"]["ports"]}
    # the plain scrape job: keeps the workers by that label, maps pod labels, honours `pod`
    (job,) = yaml.safe_load((PROMETHEUS / "scrape.yaml").read_text())["scrape_configs"]
    assert job["honor_labels"] is True
    relabels = job["relabel_configs"]
    keep = relabels[0]
    assert keep["action"] == "keep" and keep["regex"] == labels["app.kubernetes.io/name"]
    assert keep["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]
    assert {"action": "labelmap", "regex": "__meta_kubernetes_pod_label_(.+)"} in relabels


def test_prometheus_rule_object_holds_the_rule_files_groups_in_the_base_namespace():
    (rule,) = _documents(PROMETHEUS / "operator" / "prometheusrule.yaml")
    assert rule["spec"]["groups"] == yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text())["groups"]
    (overlay,) = _documents(PROMETHEUS / "operator" / "kustomization.yaml")
    (base,) = _documents(KUBE / "kustomization.yaml")
    assert overlay["namespace"] == base["namespace"]


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not installed: `make tools` installs it (Debian's prometheus "
                    "package, as root), or apt-get install --no-install-recommends prometheus")
    return found


def test_every_alert_rule_fires_in_its_promtool_unit_test():
    promtool = _promtool()
    for args in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts.test.yaml"]):
        result = subprocess.run([promtool, *args], cwd=PROMETHEUS, capture_output=True, text=True,
                                timeout=120, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
    rules = yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((PROMETHEUS / "alerts.test.yaml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert fired == names  # each rule is shown firing, not only parsed
