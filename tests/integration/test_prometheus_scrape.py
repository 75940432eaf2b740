"""A real Prometheus scrapes a real serve with the target labels a Kubernetes scrape gives
it (deploy/prometheus/scrape.yaml's: namespace, pod, the pod's labels): with the shipped
``honor_labels`` the reference plugin's ``encoder_cache_hits_total{pod}`` keeps its label,
where a scrape without it renames it ``exported_pod``; and the selector of the alerts on
``up`` finds the worker."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import urllib.parse
from typing import Any

import pytest
import yaml

from stream.kafka.embedded import free_port
from tests.integration.conftest import eventually, http
from tests.integration.test_manifests import PROMETHEUS, _rule_selectors, _statefulset

pytestmark = pytest.mark.integration


def _prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.fail("prometheus is not installed: `make tools` installs it (Debian's prometheus "
                    "package, as root), or apt-get install --no-install-recommends prometheus")
    return found


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    status, answer = http("GET", f"{url}/api/v1/query?query={urllib.parse.quote(expr)}")
    assert status == 200, answer
    return answer["data"]["result"]


def test_the_shipped_scrape_keeps_the_hits_pod_label_and_the_up_alerts_find_the_worker(make_service, tmp_path):
    prometheus = _prometheus_binary()
    service = make_service()
    body = {"chat_completions": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/scrape.png"}}]}]}}
    assert service.post("/v1/placements", {"endpoints": ["default/vllm-0"], "body": body})[0] == 202
    eventually(lambda: service.post("/v1/match", {"endpoints": ["default/vllm-0"], "body": body})[1][
        "endpoints"][0]["score"] == 1.0)

    (shipped,) = yaml.safe_load((PROMETHEUS / "scrape.yaml").read_text())["scrape_configs"]
    labels = _statefulset()["spec"]["template"]["metadata"]["labels"]
    # what the shipped job's relabelling gives a worker's target on Kubernetes
    target = {"namespace": "mmcache", "pod": "mmcache-0",
              **{name.replace(".", "_").replace("/", "_").replace("-", "_"): value
                 for name, value in labels.items()}}
    jobs = [{"job_name": "shipped", "honor_labels": shipped["honor_labels"]},
            {"job_name": "without_honor_labels", "honor_labels": False}]
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{**job, "static_configs": [{"targets": [f"127.0.0.1:{service.port}"],
                                                            "labels": target}]} for job in jobs]}
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115
    process = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        def scraped() -> dict[str, dict[str, str]] | None:
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                series = {s["metric"]["job"]: s["metric"] for s in _query(url, "encoder_cache_hits_total")}
            except OSError:
                return None
            return series if len(series) == 2 else None

        series = eventually(scraped, timeout=60, interval=0.5)
        assert series["shipped"]["pod"] == "default/vllm-0"  # the plugin's label, as the plugin's
        assert "exported_pod" not in series["shipped"]
        assert series["shipped"]["instance"] == f"127.0.0.1:{service.port}"  # the worker
        assert series["without_honor_labels"]["exported_pod"] == "default/vllm-0"
        assert series["without_honor_labels"]["pod"] == "mmcache-0"
        for expr in _rule_selectors():  # e.g. up{app_kubernetes_io_name="mmcache"} == 0
            selector = re.search(r"\bup\{[^}]*\}", expr).group(0)
            assert {s["metric"]["job"] for s in _query(url, selector)} == {"shipped", "without_honor_labels"}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        log.close()
