"""Multimodal items and their extraction from a request body.

The extraction rules mirror the Go plugin byte for byte (CONTRACT, "Extracting
items from a request body") so that a mixed fleet agrees on every hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

__all__ = ["MAX_ITEM_SIZE", "InvalidField", "Item", "extract_items", "media_hash", "unique_items"]

MAX_ITEM_SIZE = 2**31 - 1


class InvalidField(ValueError):
    """A request names a field whose value breaks a rule; nothing was changed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class Item:
    """One unique multimodal input of a request."""

    hash: Annotated[str, Field(min_length=1)]
    size: Annotated[int, Field(ge=1, le=MAX_ITEM_SIZE)]
    modality: str


def media_hash(block_type: str, reference: str) -> str:
    """Hash a chat-completions media reference as the Go plugin does."""
    return hashlib.sha256(f"{block_type}\x00{reference}".encode()).hexdigest()


def extract_items(body: Any, path: str = "body", *, max_items: int | None = None,
                  max_references: int | None = None, items_field: str = "body items") -> list[Item]:
    """Return the request's unique items, in order of first occurrence.

    The first source that yields at least one item wins: ``tokenized``, then
    ``generate``, then ``chat_completions``. A malformed source raises
    :class:`InvalidField` naming the field, even when an earlier source wins,
    so that bad input is never half-accepted. A body with none of the three keys but a
    top-level ``messages`` list is a plain OpenAI request, read as ``chat_completions``.

    Reading stops at the first problem, so its cost follows the limits, not the body:
    at the item past ``max_items`` unique ones in a source (``items_field`` names it),
    and at the media reference past ``max_references`` in the whole body (every
    ``mm_features`` and ``mm_hashes`` entry and media block counts, repeats included).
    A chat reference seen before in the body is not hashed again.
    """
    if not isinstance(body, dict):
        raise InvalidField(path, "must be a JSON object")
    budget = _Budget(path, max_references)
    if isinstance(body.get("messages"), list) and not _SOURCE_KEYS & body.keys():
        return unique_items(_from_chat(body, lambda: path, budget), max_items, items_field)
    found: list[list[Item]] = []
    for key, source in _SOURCES:
        value = body.get(key)
        if value is not None:
            found.append(unique_items(source(value, lambda: f"{path}.{key}", budget),
                                      max_items, items_field))
    for items in found:
        if items:
            return items
    return []


def unique_items(items: Iterable[Item], max_items: int | None = None,
                 field: str = "items") -> list[Item]:
    """Drop repeated hashes; the first occurrence wins and keeps its place. Past
    ``max_items`` unique ones, raise :class:`InvalidField` naming ``field`` (the rest of
    ``items`` is not read)."""
    seen: dict[str, Item] = {}
    if max_items is None:
        for item in items:
            seen.setdefault(item.hash, item)
    else:
        for item in items:
            if seen.setdefault(item.hash, item) is item and len(seen) > max_items:
                raise InvalidField(field, f"at most {max_items} items (max_items)")
    return list(seen.values())


class _Budget:
    """Media references read from one body so far, against ``max_references``."""

    __slots__ = ("path", "limit", "count")

    def __init__(self, path: str, limit: int | None) -> None:
        self.path = path
        self.limit = limit
        self.count = 0

    def take(self) -> None:
        """Count one more reference; raise once there are more than the limit."""
        self.count += 1
        if self.limit is not None and self.count > self.limit:
            raise InvalidField(self.path, f"at most {self.limit} media references (image, video "
                                          "and audio blocks, mm_features, mm_hashes entries) in one "
                                          "request (max_references)")


# A field path, formatted only when an error names it (valid bodies pay nothing).
Path = Callable[[], str]


def _expect(value: Any, kind: type | tuple[type, ...], path: Path, what: str) -> Any:
    """Return ``value`` if it is of ``kind``; the path is only formatted for an error."""
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidField(path(), f"must be {what}")
    return value


def _or(value: Any, default: Any) -> Any:
    """JSON null counts as absent; any other value must have the right type."""
    return default if value is None else value


def _from_tokenized(value: Any, path: Path, budget: _Budget) -> Iterator[Item]:
    _expect(value, dict, path, "an object")
    prompts = _expect(_or(value.get("prompts"), []), list, lambda: f"{path()}.prompts", "an array")
    for p, prompt in enumerate(prompts):
        ppath: Path = lambda: f"{path()}.prompts[{p}]"
        _expect(prompt, dict, ppath, "an object")
        features = _expect(_or(prompt.get("mm_features"), []), list,
                           lambda: f"{ppath()}.mm_features", "an array")
        for f, feature in enumerate(features):
            budget.take()
            if isinstance(feature, dict):  # the common, valid case, checked inline
                digest, modality = feature.get("hash", ""), feature.get("modality", "")
                length = feature.get("length")
                if (type(digest) is str and type(modality) is str
                        and (length is None or (type(length) is int and length <= MAX_ITEM_SIZE))):
                    if digest:
                        yield Item(digest, length if length is not None and length >= 1 else 1,
                                   modality)
                    continue
            _reject_feature(feature, lambda: f"{ppath()}.mm_features[{f}]")


def _reject_feature(feature: Any, path: Path) -> None:
    """Raise the error that names what is wrong with a malformed feature."""
    _expect(feature, dict, path, "an object")
    _expect(feature.get("hash", ""), str, lambda: f"{path()}.hash", "a string")
    _expect(feature.get("modality", ""), str, lambda: f"{path()}.modality", "a string")
    _expect(feature.get("length"), int, lambda: f"{path()}.length", "an integer")
    raise InvalidField(f"{path()}.length", f"must be at most {MAX_ITEM_SIZE}")


def _from_generate(value: Any, path: Path, budget: _Budget) -> Iterator[Item]:
    _expect(value, dict, path, "an object")
    features = _expect(_or(value.get("features"), {}), dict, lambda: f"{path()}.features",
                       "an object")
    mm_hashes = _expect(_or(features.get("mm_hashes"), {}), dict,
                        lambda: f"{path()}.features.mm_hashes", "an object")
    for modality, hashes in mm_hashes.items():
        hpath: Path = lambda: f"{path()}.features.mm_hashes.{modality}"
        for i, digest in enumerate(_expect(_or(hashes, []), list, hpath, "an array of strings")):
            budget.take()
            _expect(digest, str, lambda: f"{hpath()}[{i}]", "a string")
            if digest:
                yield Item(digest, 1, modality)


_URL_BLOCKS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
_HASHED_BLOCKS = (*_URL_BLOCKS, "input_audio")


def _from_chat(value: Any, path: Path, budget: _Budget) -> Iterator[Item]:
    _expect(value, dict, path, "an object")
    messages = _expect(_or(value.get("messages"), []), list, lambda: f"{path()}.messages", "an array")
    # references already hashed, by block type: a repeat names the same item, which
    # ``unique_items`` would drop, so it is counted but neither hashed nor yielded
    seen: dict[str, set[str]] = {kind: set() for kind in _HASHED_BLOCKS}
    for m, message in enumerate(messages):
        mpath: Path = lambda: f"{path()}.messages[{m}]"
        _expect(message, dict, mpath, "an object")
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for b, block in enumerate(content):
            bpath: Path = lambda: f"{mpath()}.content[{b}]"
            _expect(block, dict, bpath, "an object")
            kind = block.get("type")
            if kind is not None:  # a list or an object is no type (and not hashable)
                _expect(kind, str, lambda: f"{bpath()}.type", "a string")
            if kind in _URL_BLOCKS:
                budget.take()
                reference = _block_url(block.get(kind), lambda: f"{bpath()}.{kind}",
                                       bare_string=kind == "image_url")
                modality = _URL_BLOCKS[kind]
            elif kind == "input_audio":
                budget.take()
                apath: Path = lambda: f"{bpath()}.input_audio"
                audio = _expect(block.get(kind), dict, apath, "an object")
                data = _expect(audio.get("data"), str, lambda: f"{apath()}.data", "a string")
                fmt = _expect(audio.get("format"), str, lambda: f"{apath()}.format", "a string")
                reference, modality = f"{fmt}:{data}", "audio"
            else:
                continue
            hashed = seen[kind]
            if reference not in hashed:
                hashed.add(reference)
                yield Item(media_hash(kind, reference), 1, modality)


def _block_url(value: Any, path: Path, *, bare_string: bool) -> str:
    if bare_string and isinstance(value, str):
        return value
    _expect(value, dict, path, "an object with a url")
    return str(_expect(value.get("url"), str, lambda: f"{path()}.url", "a string"))


_SOURCES: tuple[tuple[str, Callable[[Any, Path, _Budget], Iterator[Item]]], ...] = (
    ("tokenized", _from_tokenized),
    ("generate", _from_generate),
    ("chat_completions", _from_chat),
)
_SOURCE_KEYS = frozenset(key for key, _ in _SOURCES)
