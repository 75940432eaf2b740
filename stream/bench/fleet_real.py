"""A real fleet against the simulator's prediction (docs/simulation.md, "Against a real
engine"): ``tests/e2e/fleet.py`` runs two real vLLM servers, `mmcache serve` and the
reference gateway on the trace of ``stream.bench.fleet_trace`` in the e2e environment
(``make e2e`` builds ``.venv-vllm``), each gateway policy in turn; this runs it as a child
process, then the simulator as ``mmcache simulate`` with the arguments of
``fleet_trace.simulate_argv`` (the same requests: their digests are checked equal; the
fleet's shape; CPU costs), and writes both: the rows, and the whole document in
``bench/fleet_real.json``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from stream.bench.figures import Figure
from stream.bench.fleet_trace import FleetTrace, requests_of, simulate_argv, trace_digest
from stream.sim.fleet import PolicyResult
from stream.sim.workload import Request

__all__ = ["figures_of", "fleet_real_figures", "predicted", "prediction"]

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
POLICIES = ("round-robin", "index", "index-bounded")


def predicted(argv: Sequence[str]) -> tuple[dict[str, PolicyResult], list[Request]]:
    """The simulator's results for ``mmcache simulate`` arguments, and its requests."""
    import argparse

    from stream.sim.commands import add_commands, run_simulation

    parser = argparse.ArgumentParser(prog="mmcache")
    add_commands(parser.add_subparsers(dest="command", required=True))
    placed: list[tuple[str, Request]] = []
    run = run_simulation(parser.parse_args(list(argv)), placed=placed)
    return run.results, sorted((request for _, request in placed), key=lambda r: r.id)


def prediction(real: Mapping[str, Any], trace: FleetTrace) -> dict[str, Any]:
    """The document: the real run's figures with the simulator's beside them, on the same
    requests and the fleet's KV shape as the servers reported it."""
    shape = real["trace"]
    policies = list(real["real"])
    argv = simulate_argv(trace, shape["kv_blocks"], shape["block_size"], policies)
    results, requests = predicted(argv)
    if trace_digest(requests) != shape["digest"] or requests != requests_of(trace):
        raise RuntimeError("the simulator drew other requests than the real run")
    return {"command": "mmcache " + " ".join(argv), "trace": shape, "real": real["real"],
            "simulated": {policy: {**result.summary(),
                                   "layers": _layers(result, requests, shape["block_size"])}
                          for policy, result in results.items()}}


def _layers(result: PolicyResult, requests: Sequence[Request], block_size: int) -> dict[str, float]:
    """The simulator's hit ratios in the real run's terms. Its encoder layer counts only
    the items whose tokens were computed (an item inside a prefix hit is never looked up),
    the real one every item of every request (1 - encodings / items). Its prefix layer
    counts whole blocks (a prompt's last, partial block is never looked up), vLLM's
    counters tokens of the whole prompt (hit blocks x block size / prompt tokens here)."""
    ratios = {name: layer.hit_ratio for name, layer in result.layers.items()}
    items = sum(len(r.items) for r in requests)
    encoder = result.layers["encoder"]
    ratios["encoder"] = 1 - (encoder.lookups - encoder.hits) / items if items else 0.0
    ratios["encoder_computed_only"] = encoder.hit_ratio
    prompt = sum(r.prompt_tokens for r in requests)
    ratios["prefix"] = result.layers["prefix"].hits * block_size / prompt if prompt else 0.0
    ratios["prefix_blocks"] = result.layers["prefix"].hit_ratio
    return ratios


def fleet_real_figures(quick: bool, scale: float | None) -> list[Figure]:
    """The bench rows: per policy and layer the real hit ratio with the simulator's
    prediction as its control, TTFT relative to round-robin's, the estimate's precision
    and recall beside the simulator's."""
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: `make e2e` builds it (fleet_real runs there)")
    trace = FleetTrace(requests=40 if scale else 80 if quick else 150)
    done = subprocess.run([str(VLLM_PYTHON), "-m", "tests.e2e.fleet", "--requests", str(trace.requests),
                           "--policies", ",".join(POLICIES)],
                          cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"tests.e2e.fleet failed: {done.stderr[-3000:]}")
    doc = prediction(orjson.loads(done.stdout.strip().splitlines()[-1]), trace)
    if scale is None:  # the whole document beside the rows: docs/simulation.md's tables
        out = REPO / "bench" / ("fleet_real_quick.json" if quick else "fleet_real.json")
        out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return figures_of(doc, trace)


def figures_of(doc: Mapping[str, Any], trace: FleetTrace) -> list[Figure]:
    """Rows of a :func:`prediction` document."""
    shape = doc["trace"]
    note = (f"{shape['requests']} requests ({shape['items']} items, {shape['distinct_items']} distinct, "
            f"{shape['conversations']} conversations) at {trace.rate:g}/s, seed {trace.seed}, "
            f"{trace.servers} vLLM CPU servers (tiny Qwen2-VL, max_num_seqs {trace.max_num_seqs}, "
            f"encoder cache {trace.max_num_batched_tokens} embeddings); control: the simulator on the same "
            "requests (bench/fleet_real.json has the command)")
    rows: list[Figure] = []
    base_real = doc["real"].get("round-robin", {})
    base_sim = doc["simulated"].get("round-robin", {})
    for policy, real in doc["real"].items():
        sim = doc["simulated"][policy]
        slug = policy.replace("-", "_")
        for layer in ("encoder", "processor", "prefix"):
            value, control = real["layers"][layer], sim["layers"][layer]
            rows.append(Figure(f"fleet_real_{layer}_hit_ratio_{slug}", round(value, 3), "ratio",
                               "reported beside the simulator's prediction", True, round(control, 3),
                               round(value / control, 2) if control else None, note))
        for key in ("ttft_p50_s", "ttft_p90_s"):
            if base_real.get(key) and policy != "round-robin":
                rel = real[key] / base_real[key]
                sim_rel = sim[key] / base_sim[key] if base_sim.get(key) else None
                name = f"fleet_real_{key.removesuffix('_s')}_vs_round_robin_{slug}"
                rows.append(Figure(name, round(rel, 2), "x", "relative only (CPU)", True,
                                   None if sim_rel is None else round(sim_rel, 2), None,
                                   note + f"; real {real[key]:.3f} s vs round-robin {base_real[key]:.3f} s"))
        for key in ("precision", "recall"):
            if real[key] is not None:
                rows.append(Figure(f"fleet_real_estimate_{key}_{slug}", round(real[key], 3), "ratio",
                                   "beside the simulator's", True,
                                   None if sim[key] is None else round(sim[key], 3), None,
                                   note + f"; checks {real['checks']}"))
    return rows


def tables(doc: Mapping[str, Any]) -> str:
    """The real figures and the simulator's, one Markdown table each (docs/simulation.md);
    the real one says how many requests the gateway sent to each server."""
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    out = []
    for key in ("real", "simulated"):
        head = f"| {key} | encoder | processor | prefix | TTFT p50 s | TTFT p90 s | precision | recall |"
        lines = [head + (" requests per server |" if key == "real" else ""),
                 "|---" * (9 if key == "real" else 8) + "|"]
        for policy, figures in doc[key].items():
            layers = figures["layers"]
            cells = [f"{layers[layer]:.3f}" for layer in ("encoder", "processor", "prefix")]
            cells += [f"{figures['ttft_p50_s']:.3f}", f"{figures['ttft_p90_s']:.3f}",
                      ratio(figures["precision"]), ratio(figures["recall"])]
            row = f"| {policy} | " + " | ".join(cells) + " |"
            if key == "real":
                row += " " + " / ".join(str(n) for n in figures["routed"].values()) + " |"
            lines.append(row)
        out.append("\n".join(lines))
    return "\n\n".join(out)


if __name__ == "__main__":  # python -m stream.bench.fleet_real [bench/fleet_real.json]: the tables
    import sys

    path = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "bench" / "fleet_real.json"
    print(tables(orjson.loads(path.read_bytes())))
