"""serve runs as the Kubernetes pod runs it (deploy/kubernetes/statefulset.yaml): every
mount read-only (readOnlyRootFilesystem) except the pod's writable volumes, its data dir
and TMPDIR. A real serve, in a mount namespace of its own where every mount of this machine
is remounted read-only and only those two directories are writable, starts, places,
matches, stops cleanly and starts again from its files."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from tests.integration.conftest import eventually
from tests.integration.test_manifests import _container, _kube

pytestmark = pytest.mark.integration

#: Remount every mount of the namespace read-only (per mount: `remount,bind` never changes
#: the filesystem others see), but /proc, /sys and /dev, which a container has as its own;
#: then each directory given as an argument up to `--` writable again; then check that the
#: root really is read-only, and run the rest of the arguments.
_READ_ONLY = r"""
set -eu
awk '{print $2}' /proc/self/mounts | sort -u | while read -r point; do
  case "$point" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) continue ;; esac
  mount -o remount,bind,ro "$point" 2>/dev/null || true
done
while [ "$1" != "--" ]; do
  mount --bind "$1" "$1" && mount -o remount,bind,rw "$1"
  shift
done
shift
if touch /usr/.mmcache-read-only-probe 2>/dev/null || touch "$HOME/.mmcache-read-only-probe" 2>/dev/null; then
  echo "the root filesystem is writable: not a read-only run" >&2
  exit 97
fi
exec "$@"
"""


def _wrapper(writable: list[Path]) -> list[str]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (util-linux) for a mount namespace: the pod's "
                    "read-only root is not reproduced here")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _READ_ONLY, "read-only",
            *map(str, writable), "--"]


def _match(service, endpoint: str, url: str) -> float:
    body = {"chat_completions": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}]}}
    status, answer = service.post("/v1/match", {"endpoints": [endpoint], "body": body})
    assert status == 200, answer
    return answer["endpoints"][0]["score"]


def test_serve_runs_with_every_path_read_only_but_the_pods_volumes(make_service, tmp_path):
    container = _container()
    config = {k: v for doc in _kube()["ConfigMap"] for k, v in doc["data"].items()}
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {config["MMCACHE_DATA_DIR"], env["TMPDIR"]}  # the two this run gives
    data, tmp = tmp_path / "data", tmp_path / "tmp"
    data.mkdir()
    tmp.mkdir()
    service = make_service(data_dir=data, env={"TMPDIR": str(tmp)}, wrapper=_wrapper([data, tmp]))

    body = {"chat_completions": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/ro.png"}}]}]}}
    status, _ = service.post("/v1/placements", {"request_id": "r-1", "endpoints": ["ns/pod-a"], "body": body})
    assert status == 202
    eventually(lambda: _match(service, "ns/pod-a", "https://x/ro.png") == 1.0)
    assert service.stop(signal.SIGTERM) == 0, service.tail()
    assert list(data.rglob("lru-*.db"))  # the state went to the writable data dir

    service.start()
    assert _match(service, "ns/pod-a", "https://x/ro.png") == 1.0
    assert service.stop(signal.SIGTERM) == 0, service.tail()
