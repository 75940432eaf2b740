"""Queries of the LRUs through the inverted index: which requested endpoints hold which
request items, their scores, the per-endpoint counts, and the index itself, read-only."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import NamedTuple, TypedDict

from stream.core.holders import HolderSets
from stream.core.items import Item
from stream.core.lru import Lrus

__all__ = ["EndpointMatch", "EndpointSummary", "Index"]


class EndpointMatch(TypedDict):
    """The match data attached to one candidate endpoint (EncoderCacheMatchInfo).

    A plain dict at run time: the match answer is built for every candidate of every
    request, and dicts are the cheapest objects to build and to serialize.
    """

    endpoint: str
    matched_items: list[Item]
    matched_weight: int
    total_weight: int
    score: float


class EndpointSummary(NamedTuple):
    """Counts for one endpoint, without its hashes."""

    endpoint: str
    items: int
    weight: int


class Index:
    """Read-only questions to ``lrus``; nothing here changes them."""

    __slots__ = ("lrus",)

    def __init__(self, lrus: Lrus) -> None:
        self.lrus = lrus

    @property
    def holders(self) -> HolderSets:
        """The inverted index: hash -> endpoints holding it, read-only, each value a
        frozenset (``lrus.holders`` itself keeps the compact forms of ``stream.core.holders``)."""
        return HolderSets(self.lrus.holders)

    def hits(
        self, items: Sequence[Item], endpoints: Iterable[str]
    ) -> tuple[list[str], dict[str, list[Item]]]:
        """The distinct endpoints in request order, and the request items each one holds
        (only endpoints that hold at least one, items in request order).

        Walks the inverted index from the request's few items to the endpoints holding
        them, so the cost follows the hits, not endpoints x items.
        """
        requested = dict.fromkeys(endpoints)
        found: dict[str, list[Item]] = {}
        index = self.lrus.holders
        for item in items:
            held = index.get(item.hash)
            if held is None:
                continue
            if type(held) is str:  # one holder (stream.core.holders' compact forms)
                if held in requested:
                    found.setdefault(held, []).append(item)
            elif type(held) is tuple or len(held) < len(requested):
                for name in held:
                    if name in requested:
                        found.setdefault(name, []).append(item)
            else:
                for name in requested:
                    if name in held:
                        found.setdefault(name, []).append(item)
        return list(requested), found

    def match(self, items: Sequence[Item], endpoints: Iterable[str]) -> list[EndpointMatch]:
        """Score each distinct endpoint, in request order, by the items it holds."""
        if not items:
            return []
        requested, found = self.hits(items, endpoints)
        return self.scores(items, requested, found)

    @staticmethod
    def scores(items: Sequence[Item], requested: list[str],
               found: dict[str, list[Item]]) -> list[EndpointMatch]:
        """Score each endpoint of ``requested``, in order, by the items ``found`` it holds."""
        if not items:
            return []
        total = sum(item.size for item in items)
        results: list[EndpointMatch] = []
        for name in requested:
            matched = found.get(name, [])
            weight = sum(item.size for item in matched)
            results.append({"endpoint": name, "matched_items": matched, "matched_weight": weight,
                            "total_weight": total, "score": weight / total})
        return results

    def summary(self, limit: int) -> list[EndpointSummary]:
        """Endpoints with most items first, then by name.

        Ranks plain (count, name) tuples, compared in C, and picks the first ``limit``
        with a heap when that is a small share (the default 100 of up to 10,000).
        """
        endpoints = self.lrus.endpoints
        keys = [(-len(cache.entries), name) for name, cache in endpoints.items()]
        top = heapq.nsmallest(limit, keys) if limit * 8 < len(keys) else sorted(keys)[:limit]
        return [EndpointSummary(name, -count, endpoints[name].weight) for count, name in top]
