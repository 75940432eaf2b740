"""The /v1/match answer, written as JSON bytes by hand for speed.

Pure (no aiohttp, no state): ``stream.http.api`` serves what ``render_match`` returns,
and it is compiled with the rest of the match path (``setup.py``). A wide match (many
endpoint x item pairs) is built in slices instead (``held_by``, ``gather``, then
``match_entries``), so that the loop turns between them; both give the same bytes.

Every endpoint entry ends with its ``source``: ``engine`` for the endpoints in ``engine``
(answered from their engine views), ``estimate`` for the others (their LRUs).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence, Set
from operator import attrgetter
from typing import Any

import orjson

from stream.core.holders import HolderSets
from stream.core.items import Item

__all__ = ["answer_ends", "gather", "held_by", "match_entries", "render_match"]

_SIZE = attrgetter("size")
_EMPTY = b'{"request_items":[],"endpoints":[]}'
_NONE: frozenset[str] = frozenset()


def render_match(items: list[Item], requested: list[str], found: dict[str, list[Item]],
                 engine: Set[str] = _NONE) -> bytes:
    """The /v1/match answer as JSON bytes, equal to serializing ``Index.match`` with
    each entry's ``source`` (``engine`` for the names in ``engine``, else ``estimate``).

    Most candidates hold none of the request's items and their entries differ only in
    the name, so each run of them is one ``str.join`` (``_unmatched``); only endpoints
    that hold items are built one by one (bench answer: ~13 us, against ~24 us when every
    entry was concatenated on its own).
    """
    if not items:
        return _EMPTY
    return b'{"request_items":%b,"endpoints":[%b]}' % (
        _items_json(items), b",".join(match_entries(items, requested, found, engine)))


def answer_ends(items: list[Item]) -> tuple[bytes, bytes]:
    """What comes before and after the comma-joined entries of a match with ``items``
    (at least one): ``render_match`` is ``head + b",".join(entries) + tail``."""
    return b'{"request_items":%b,"endpoints":[' % _items_json(items), b"]}"


def match_entries(items: list[Item], requested: list[str], found: Mapping[str, list[Item]],
                  engine: Set[str] = _NONE) -> Iterator[bytes]:
    """The answer's endpoint entries in request order, to be joined by commas: one part
    for each endpoint that holds items (its cost follows its matched items), and one for
    each run of the others between them (one ``str.join``). ``engine`` holds requested
    names only; each run of one source is written as a whole answer's entries would be."""
    total = sum(map(_SIZE, items))
    if not engine or len(engine) == len(requested):
        if len(found) < 8:  # a few holders: finding each is cheaper than a pass over all
            indexes = sorted(map(requested.index, found))
        else:  # one pass, not one scan of ``requested`` per holder (4,096 x 4,096: 260 ms)
            indexes = [index for index, name in enumerate(requested) if name in found]
        return _entries(requested, found, total, "engine" if engine else "estimate", indexes)
    return _mixed(requested, found, total, engine)


def _mixed(requested: list[str], found: Mapping[str, list[Item]], total: int,
           engine: Set[str]) -> Iterator[bytes]:
    """``match_entries`` of endpoints of both sources, in one pass: the entries of each run
    of endpoints that hold nothing are joined into one part.

    When no name needs escaping (one ``orjson`` pass over all of them tells), an entry
    of an endpoint without hits is the name between quotes and its source's tail, as in
    ``_unmatched``; otherwise each is written by ``_unmatched`` on its own.
    """
    tails = {source: f',"matched_items":[],"matched_weight":0,"total_weight":{total},"score":0.0,'
                     f'"source":"{source}"}}' for source in ("engine", "estimate")}
    plain = b"\\" not in orjson.dumps(requested)
    run: list[str] = []  # entries of the endpoints without hits since the last with some
    for name in requested:
        source = "engine" if name in engine else "estimate"
        matched = found.get(name)
        if matched is None:
            run.append('{"endpoint":"' + name + '"' + tails[source] if plain
                       else _unmatched([name], tails[source]).decode())
            continue
        if run:
            yield ",".join(run).encode()
            run = []
        weight = sum(map(_SIZE, matched))
        yield (b'{"endpoint":%b,"matched_items":%b,"matched_weight":%d,'
               b'"total_weight":%d,"score":%b,"source":"%b"}' % (
                   orjson.dumps(name), _items_json(matched), weight, total,
                   orjson.dumps(weight / total), source.encode()))
    if run:
        yield ",".join(run).encode()


def _entries(names: list[str], found: Mapping[str, list[Item]], total: int, source: str,
             indexes: list[int]) -> Iterator[bytes]:
    """Entries of ``names``, all of one ``source``; ``indexes`` are those in ``found``."""
    tail = f',"matched_items":[],"matched_weight":0,"total_weight":{total},"score":0.0,"source":"{source}"}}'
    raw_source = source.encode()
    start = 0
    for index in indexes:
        if index > start:
            yield _unmatched(names[start:index], tail)
        name = names[index]
        matched = found[name]
        weight = sum(map(_SIZE, matched))
        yield (b'{"endpoint":%b,"matched_items":%b,"matched_weight":%d,'
               b'"total_weight":%d,"score":%b,"source":"%b"}' % (
                   orjson.dumps(name), _items_json(matched), weight, total,
                   orjson.dumps(weight / total), raw_source))
        start = index + 1
    if start < len(names):
        yield _unmatched(names[start:], tail)


def held_by(holders: Mapping[str, Any], items: Sequence[Item],
            requested: list[str]) -> list[set[str]]:
    """For each item, the requested endpoints that hold it, read at one moment: each is a
    set intersection in C, so this costs ~40 ns a held pair; the rest of a wide match
    works on these copies while the view goes on changing.

    ``holders`` is an index of compact holders (``stream.core.holders``: a name, a tuple
    or a set), or a ``HolderSets`` view of one, read through to its index."""
    index = holders.raw if isinstance(holders, HolderSets) else holders
    wanted = set(requested)
    empty: set[str] = set()
    held_sets: list[set[str]] = []
    for item in items:
        held = index.get(item.hash)
        if held is None:
            held_sets.append(empty)
        elif type(held) is str:
            held_sets.append({held} if held in wanted else empty)
        else:
            held_sets.append(wanted.intersection(held))
    return held_sets


def gather(items: Sequence[Item], held: list[set[str]], found: dict[str, list[Item]],
           start: int, pairs: int) -> int:
    """Add to ``found`` the items from ``start`` on, each to the endpoints that hold it,
    until about ``pairs`` pairs were added; return where the next slice starts
    (``len(items)`` when done). Items are taken in request order, so each endpoint's
    list is in request order too, as ``Index.hits`` gives it."""
    added, index, end = 0, start, len(items)
    while index < end and added < pairs:
        item, holding = items[index], held[index]
        for name in holding:
            matched = found.get(name)
            if matched is None:
                found[name] = [item]
            else:
                matched.append(item)
        added += len(holding) + 1
        index += 1
    return index


def _items_json(items: list[Item]) -> bytes:
    """Items as a JSON array (orjson's own dataclass path was measured 4x slower)."""
    return orjson.dumps([{"hash": item.hash, "size": item.size, "modality": item.modality}
                         for item in items])


def _unmatched(names: list[str], tail: str) -> bytes:
    """Entries of endpoints that hold nothing, comma-separated.

    When orjson writes no backslash, no name needed escaping and each is its own JSON
    string between quotes (orjson leaves non-ASCII as UTF-8), so one ``str.join`` puts
    the tail between them; otherwise each name is written on its own.
    """
    if b"\\" in orjson.dumps(names):
        end = tail.encode()
        return b",".join(b'{"endpoint":%b%b' % (orjson.dumps(name), end) for name in names)
    between = '"' + tail + ',{"endpoint":"'
    return ('{"endpoint":"' + between.join(names) + '"' + tail).encode()
