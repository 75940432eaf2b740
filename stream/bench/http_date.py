"""What the ``Date`` header costs an answer (RFC 9110 section 6.6.1): ``Response.head`` as
the server writes it (``date_header``: a clock read and a comparison, formatted once a
second) against the same head with a constant ``Date`` line (the control: the head's
formatting alone), in alternating runs in one process."""

from __future__ import annotations

import statistics
import timeit
from unittest import mock

from stream.bench.figures import Figure, span
from stream.http import server

__all__ = ["http_date_figures"]

#: What an answer may pay for its Date, at most: ~0.5% of a match's ~93 us (10,705 req/s).
TARGET_NS = 500


def http_date_figures(runs: int, number: int) -> list[Figure]:
    """One figure: the ns Date adds to an answer's head, the head without it as control."""
    answer = server.Response(b"x" * 300)
    constant = server.date_header()
    with_date, without = [], []
    for _ in range(runs):
        with_date.append(min(timeit.repeat(lambda: answer.head(False), number=number, repeat=3))
                         / number * 1e9)
        with mock.patch.object(server, "date_header", lambda: constant):
            without.append(min(timeit.repeat(lambda: answer.head(False), number=number, repeat=3))
                           / number * 1e9)
    added = statistics.median(a - b for a, b in zip(with_date, without, strict=True))
    control = statistics.median(without)
    return [Figure("http_date_header_ns_per_answer", round(added), "ns/answer", f"<= {TARGET_NS} ns",
                   added <= TARGET_NS, round(control), round(added / control, 3),
                   f"what the Date header adds to Response.head (a 300-byte JSON answer); control: the "
                   f"same head with a constant Date line; median over {runs} alternating runs of "
                   f"{number:,} heads (with Date {span(with_date)} ns, without {span(without)} ns)")]
