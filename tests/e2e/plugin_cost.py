"""The plugin's cost per call inside a running vLLM, against vLLM's own class on the same
calls (tests/e2e/probe.py pairs them call by call), over rounds of seeded traffic.

``python -m tests.e2e.plugin_cost ROUNDS REQUESTS`` (in ``.venv-vllm``) starts a serve and
a vLLM as the e2e suite does, runs ROUNDS rounds of REQUESTS chats each, and prints one
JSON object: per round and hooked method, [calls, ns in the plugin's class, ns in vLLM's].
``mmcache bench --only vllm_plugin`` runs it and writes the figures.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.e2e.conftest import Serve, Vllm, eventually
from tests.e2e.traffic import traffic

__all__ = ["measure"]


def measure(rounds: int, requests: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="mmcache-plugin-cost-") as root:
        (Path(root) / "serve").mkdir()
        (Path(root) / "vllm").mkdir()
        serve = Serve(Path(root) / "serve").start()
        vllm = None
        try:
            vllm = Vllm(Path(root) / "vllm", serve.url).start()
            results = []
            before = eventually(vllm.probe, timeout=60)["costs"]
            for index in range(rounds):
                traffic(vllm, seed=100 + index, requests=requests, pool=90)
                now = vllm.probe()["costs"]
                results.append({name: [a - b for a, b in zip(now[name], before[name], strict=True)]
                                for name in now})
                before = now
            probe = vllm.probe()
            return {"rounds": results, "shadow_agrees": probe["shadow_agrees"], "counters": probe["counters"]}
        finally:
            if vllm is not None and vllm.process is not None:
                vllm.stop()
            serve.stop()


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))))
