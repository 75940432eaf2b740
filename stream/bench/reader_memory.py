"""How much memory one body reader process takes for the worst body within the limits:
the most of the smallest JSON values (the most Python objects a byte) within
``MMCACHE_MAX_BODY_BYTES`` and ``MMCACHE_MAX_BODY_VALUES``, read by each route's reader in
a fresh process. Each reader holds one body at a time, so
a pod's memory holds ``MMCACHE_BODY_READERS`` of these (docs/kubernetes.md, "Sizing").

``python -m stream.bench.reader_memory ROUTE`` prints the peak RSS in KiB of reading one
such body (accepted or refused alike: the parse is the cost)."""

from __future__ import annotations

import resource
import subprocess
import sys

from stream.bench.figures import Figure
from stream.config import Limits
from stream.http.bodies import READERS

__all__ = ["reader_memory_figures"]

#: Where each route's body puts the small values (its one unbounded list).
_SHAPES = {
    "match_query": (b'{"endpoints":["default/pod-a"],"body":{"messages":[],"padding":[', b"]}}"),
    "placement": (b'{"endpoints":["default/pod-a"],"body":{"messages":[],"padding":[', b"]}}"),
    "endpoint_event": (b'{"type":"sync","padding":[', b'],"live":["default/pod-a"]}'),
    "engine_events": (b'{"endpoint":"default/pod-a","engine":"vllm","events":[', b"]}"),
}
_VALUE = {"engine_events": b'{"type":"cleared"}'}


def _values(raw: bytes) -> int:
    return raw.count(b",") + raw.count(b":") + raw.count(b"[") + raw.count(b"{")


def _body(route: str, limits: Limits) -> bytes:
    """The route's body of the most small values within both ``max_body_bytes`` and
    ``max_body_values``: the worst a reader parses."""
    head, tail = _SHAPES[route]
    value = _VALUE.get(route, b'{"a":1}')
    by_bytes = (limits.max_body_bytes - len(head) - len(tail) + 1) // (len(value) + 1)
    by_values = (limits.max_body_values - _values(head + tail)) // (_values(value) + 1)
    return head + b",".join([value] * min(by_bytes, by_values)) + tail


def _peak_kib(route: str) -> int:
    limits = Limits()
    raw = _body(route, limits)
    try:
        READERS[route](raw, limits)
    except Exception:  # noqa: BLE001, S110 - a refusal costs the parse too
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reader_memory_figures() -> list[Figure]:
    """The peak RSS of a reader process for the open route (match) and the write routes."""
    peaks = {}
    for route in _SHAPES:
        out = subprocess.run([sys.executable, "-m", "stream.bench.reader_memory", route],
                             capture_output=True, text=True, check=True, timeout=600).stdout
        peaks[route] = int(out.split()[-1]) / 1024
    writes = {route: mib for route, mib in peaks.items() if route != "match_query"}
    worst = max(writes, key=writes.__getitem__)
    limits = Limits()
    limit_mib = limits.max_body_bytes / 2**20
    within = (f"the most small JSON values within both body limits ({limit_mib:g} MiB, "
              f"{limits.max_body_values:,} values)")
    return [
        Figure("body_reader_rss_peak_match", round(peaks["match_query"], 1), "MiB", "reported", True,
               note=f"one reader process, a match body of {within}; a match needs no token "
                    f"unless --match-auth-token-file"),
        Figure("body_reader_rss_peak_write", round(writes[worst], 1), "MiB", "reported", True,
               note=f"the worst write route ({worst}) of " + ", ".join(
                   f"{route} {mib:.1f}" for route, mib in writes.items())
               + f" MiB, bodies of {within}; writes need the write token"),
    ]


if __name__ == "__main__":
    print(_peak_kib(sys.argv[1]))
