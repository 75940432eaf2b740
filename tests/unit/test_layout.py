"""The package's import graph reads as the design: no circles, arrows that point down
from one room to the rooms below it, and a core that imports nothing from the outside.
Every import counts, also those inside a function (a lazy import hides a circle from
Python, not from the reader)."""

from __future__ import annotations

import ast
from pathlib import Path

STREAM = Path(__file__).resolve().parents[2] / "stream"


# The rooms, lowest first: each may import only the rooms before it. Loose modules
# (config, metrics, logs, event_loop, allocator, compiled, internals, percentiles) serve every room and import
# only the core.
ROOMS = ["core", "kafka", "state", "http", "worker", "sim", "gateway", "bench", "serve", "cli"]
# What the pure core must never import (nor any module of theirs).
OUTSIDE = ("aiokafka", "faust", "mode", "rocksdict", "aiohttp", "asyncio", "socket", "subprocess",
           "threading", "prometheus_client", "uvicorn", "granian", "httptools")


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "stream"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in STREAM.rglob("*.py"):
        parts = path.relative_to(STREAM.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_stream_imports_itself_through_others():
    assert _circles(_graph()) == []


def test_arrows_point_down_from_room_to_room():
    wrong = []
    for module, targets in _graph().items():
        room = _room(module)
        for target in targets:
            other = _room(target)
            if other == room or other == "stream":
                continue
            if room in ROOMS and other in ROOMS:
                if ROOMS.index(other) > ROOMS.index(room):
                    wrong.append(f"{module} -> {target}")
            elif room not in ROOMS and room != "stream" and other != "core" and other in ROOMS:
                wrong.append(f"{module} (loose) -> {target}")
    assert wrong == []


def test_every_module_is_in_a_room_or_one_of_the_loose_ones():
    loose = {"config", "metrics", "logs", "event_loop", "allocator", "compiled", "internals", "percentiles", "stream"}
    assert {_room(module) for module in _graph()} == set(ROOMS) | loose


def test_the_core_imports_nothing_from_outside():
    found = {f"{path.name}: {name}" for path in (STREAM / "core").glob("*.py")
             for name in _imports(path) if name.split(".")[0] in OUTSIDE}
    assert found == set()
